// HttpServer (control/http_server.h): routes, limits, blocking and streamed answers, and the
// attacks it exists for — thousands of idle or half-sent connections, oversized and malformed
// requests — against a real server on 127.0.0.1.
#include "control/http_server.h"
#include "support/raw_socket.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <future>
#include <string>
#include <thread>
#include <vector>

namespace kvferry::control {
namespace {

using namespace std::chrono_literals;

using kvferry::testing::RawSocket;
using kvferry::testing::StatusOf;

HttpServerOptions TestOptions() {
  HttpServerOptions o;
  o.name = "test";
  o.max_body_bytes = 1024;
  o.handler_threads = 4;
  o.max_queued = 4;
  o.drain_timeout = 500ms;
  return o;
}

class HttpServerTest : public ::testing::Test {
 protected:
  void StartServer(HttpServerOptions options = TestOptions()) {
    server_ = std::make_unique<HttpServer>(std::move(options));
    server_->Route("GET", "/health", InlineHandler([](const HttpRequest&) {
                     HttpResponse r;
                     r.body = "{\"status\":\"ok\"}";
                     return r;
                   }));
    server_->Route("POST", "/echo", BlockingHandler([](const HttpRequest& req, HttpExchange& ex) {
                     HttpResponse r;
                     r.body = req.body;
                     r.content_type = "text/plain";
                     const std::string* who = req.Param("who");
                     r.headers.emplace_back("X-Who", who != nullptr ? *who : "-");
                     ex.Reply(std::move(r));
                   }));
    server_->Route("GET", "/stream", BlockingHandler([](const HttpRequest&, HttpExchange& ex) {
                     HttpResponse head;
                     head.content_type = "text/event-stream";
                     ASSERT_TRUE(ex.BeginStream(head));
                     for (int i = 0; i < 5; ++i) {
                       if (!ex.Write("data: " + std::to_string(i) + "\n\n")) return;
                       std::this_thread::sleep_for(5ms);
                     }
                     ex.EndStream();
                   }));
    server_->Route("GET", "/silent", BlockingHandler([](const HttpRequest&, HttpExchange&) {}));
    server_->Route("GET", "/block", BlockingHandler([this](const HttpRequest&, HttpExchange& ex) {
                     ++blocked_;
                     while (!release_ && !ex.client_gone()) std::this_thread::sleep_for(2ms);
                     HttpResponse r;
                     r.body = "{}";
                     ex.Reply(r);
                   }));
    auto port = server_->Start("127.0.0.1", 0);
    ASSERT_TRUE(port.has_value()) << port.error().ToString();
    port_ = *port;
  }

  void TearDown() override {
    release_ = true;
    if (server_) server_->Stop();
  }

  // One GET /health on a fresh connection; its latency, or a negative duration on failure.
  std::chrono::microseconds TimedHealth() {
    const auto start = std::chrono::steady_clock::now();
    httplib::Client cli("127.0.0.1", port_);
    cli.set_connection_timeout(5);
    cli.set_read_timeout(5);
    auto res = cli.Get("/health");
    if (!res || res->status != 200) return std::chrono::microseconds(-1);
    return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() -
                                                                 start);
  }

  std::unique_ptr<HttpServer> server_;
  int port_ = 0;
  std::atomic<bool> release_{false};
  std::atomic<int> blocked_{0};
};

TEST_F(HttpServerTest, InlineAndBlockingRoutesAnswerWithTheirHeadersAndParams) {
  StartServer();
  httplib::Client cli("127.0.0.1", port_);
  auto health = cli.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  EXPECT_EQ(health->body, "{\"status\":\"ok\"}");
  EXPECT_EQ(health->get_header_value("Content-Type"), "application/json");

  auto echo = cli.Post("/echo?who=d%201", "hello", "text/plain");
  ASSERT_TRUE(echo);
  EXPECT_EQ(echo->status, 200);
  EXPECT_EQ(echo->body, "hello");
  EXPECT_EQ(echo->get_header_value("X-Who"), "d 1");
}

TEST_F(HttpServerTest, UnknownPathsAndMethodsGetAReasonInTheErrorShape) {
  StartServer();
  httplib::Client cli("127.0.0.1", port_);
  auto missing = cli.Get("/nope");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);
  EXPECT_NE(missing->body.find("no endpoint GET /nope"), std::string::npos) << missing->body;
  auto wrong = cli.Post("/health", "x", "text/plain");
  ASSERT_TRUE(wrong);
  EXPECT_EQ(wrong->status, 405);
}

TEST_F(HttpServerTest, AStreamArrivesChunkByChunkAndEnds) {
  StartServer();
  httplib::Client cli("127.0.0.1", port_);
  std::string body;
  auto res = cli.Get("/stream", [&](const char* data, std::size_t n) {
    body.append(data, n);
    return true;
  });
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(body, "data: 0\n\ndata: 1\n\ndata: 2\n\ndata: 3\n\ndata: 4\n\n");
}

TEST_F(HttpServerTest, AHandlerThatDoesNotAnswerGetsA500AndIsCounted) {
  StartServer();
  httplib::Client cli("127.0.0.1", port_);
  auto res = cli.Get("/silent");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 500);
  EXPECT_EQ(server_->stats().handler_errors, 1u);
}

TEST_F(HttpServerTest, OversizedChunkedAndMalformedBodiesAreRefusedBeforeBeingRead) {
  StartServer();
  {
    RawSocket s(port_);
    // Somewhat over the limit: read, dropped, and answered once it is in.
    ASSERT_TRUE(s.Send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2000\r\n\r\n" +
                       std::string(2000, 'x')));
    const std::string raw = s.ReadAll(2000ms);
    EXPECT_EQ(StatusOf(raw), 413) << raw;
    EXPECT_NE(raw.find("over the limit of 1024 bytes"), std::string::npos) << raw;
  }
  {
    // Far over it: answered at once, nothing read.
    RawSocket s(port_);
    ASSERT_TRUE(s.Send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n"));
    EXPECT_EQ(StatusOf(s.ReadAll(2000ms)), 413);
  }
  {
    RawSocket s(port_);
    ASSERT_TRUE(s.Send("POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                       "5\r\nhello\r\n"));
    EXPECT_EQ(StatusOf(s.ReadAll(2000ms)), 411);
  }
  {
    RawSocket s(port_);
    ASSERT_TRUE(s.Send("POST /echo HTTP/1.1\r\nHost: x\r\n\r\n"));
    EXPECT_EQ(StatusOf(s.ReadAll(2000ms)), 411);
  }
  {
    RawSocket s(port_);
    ASSERT_TRUE(s.Send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n"));
    EXPECT_EQ(StatusOf(s.ReadAll(2000ms)), 400);
  }
  {
    RawSocket s(port_);
    ASSERT_TRUE(s.Send("GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(40000, 'a') +
                       "\r\n\r\n"));
    EXPECT_EQ(StatusOf(s.ReadAll(2000ms)), 431);
  }
  EXPECT_GT(TimedHealth().count(), 0);
  EXPECT_EQ(server_->stats().refused_limits, 4u);  // 413, 413, 411, 411 (400, 431: the library)
}

TEST_F(HttpServerTest, RequestsBeyondTheHandlerThreadsAndQueueGetA503AtOnce) {
  HttpServerOptions options = TestOptions();
  options.handler_threads = 1;
  options.max_queued = 0;
  StartServer(options);
  auto blocked = std::async(std::launch::async, [this] {
    httplib::Client cli("127.0.0.1", port_);
    return cli.Get("/block");
  });
  while (blocked_ == 0) std::this_thread::sleep_for(1ms);
  httplib::Client cli("127.0.0.1", port_);
  auto refused = cli.Get("/block");
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 503);
  EXPECT_NE(refused->body.find("server busy"), std::string::npos);
  EXPECT_GT(TimedHealth().count(), 0);  // inline routes never wait for handler threads
  release_ = true;
  auto first = blocked.get();
  ASSERT_TRUE(first);
  EXPECT_EQ(first->status, 200);
  EXPECT_EQ(server_->stats().refused_busy, 1u);
}

TEST_F(HttpServerTest, AnIdleOrHalfSentConnectionIsClosedAfterTheIdleTimeout) {
  HttpServerOptions options = TestOptions();
  options.idle_timeout = 1s;
  StartServer(options);
  RawSocket idle(port_);
  RawSocket half(port_);
  ASSERT_TRUE(half.Send("GET /health HTTP/1.1\r\nHost:"));
  EXPECT_TRUE(idle.ClosedWithin(4000ms));
  EXPECT_TRUE(half.ClosedWithin(4000ms));
}

// Issue 20 item 12: over the cap, a connection is closed at accept, and the server keeps
// answering the others (before: the library stopped accepting at its limit, and connections
// over it waited unanswered in the backlog until an idle one timed out).
TEST_F(HttpServerTest, ConnectionsOverTheCapAreClosedAtAcceptAndTheServerKeepsAnswering) {
  HttpServerOptions options = TestOptions();
  options.max_connections = 32;
  StartServer(options);
  std::vector<RawSocket> idle;
  for (int i = 0; i < 32; ++i) idle.emplace_back(port_);
  for (int i = 0; i < 100 && server_->stats().connections_open < 32; ++i) {
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_EQ(server_->stats().connections_open, 32u);
  std::vector<RawSocket> over;
  for (int i = 0; i < 8; ++i) over.emplace_back(port_);
  for (RawSocket& s : over) EXPECT_TRUE(s.ClosedWithin(2000ms)) << "closed at accept, not held";
  EXPECT_EQ(server_->stats().refused_connections, 8u);
  EXPECT_NE(RenderHttpMetrics({{"test", server_->stats()}})
                .find("kvferry_http_refusals_total{server=\"test\",reason=\"connections\"} 8"),
            std::string::npos);
  // Once some idle ones leave, a new connection is served at once.
  while (idle.size() > 24) idle.pop_back();
  for (int i = 0; i < 100 && server_->stats().connections_open > 24; ++i) {
    std::this_thread::sleep_for(10ms);
  }
  const auto latency = TimedHealth();
  EXPECT_GE(latency.count(), 0);
  EXPECT_LT(latency, std::chrono::microseconds(1000000));
}

TEST_F(HttpServerTest, StopAnswersAHandlerThatOutlivesTheDrainTimeoutWith503) {
  StartServer();
  auto blocked = std::async(std::launch::async, [this] {
    httplib::Client cli("127.0.0.1", port_);
    cli.set_read_timeout(10);
    return cli.Get("/block");
  });
  while (blocked_ == 0) std::this_thread::sleep_for(1ms);
  const auto start = std::chrono::steady_clock::now();
  server_->Stop();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  auto res = blocked.get();
  // Either the 503 reached the client before the socket closed, or the connection was cut.
  if (res) {
    EXPECT_EQ(res->status, 503);
  }
}

TEST_F(HttpServerTest, BodiesInProgressTogetherAreBoundedWith503) {
  HttpServerOptions options = TestOptions();
  options.max_total_body_bytes = 1500;  // room for one 1,000-byte body, not two
  StartServer(options);
  RawSocket first(port_);
  ASSERT_TRUE(first.Send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nabc"));
  std::this_thread::sleep_for(50ms);  // its headers are in: its 1,000 bytes are counted
  RawSocket second(port_);
  ASSERT_TRUE(second.Send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"));
  const std::string raw = second.ReadAll(2000ms);
  EXPECT_EQ(StatusOf(raw), 503) << raw;
  EXPECT_NE(raw.find("bytes of request bodies are in progress"), std::string::npos) << raw;
  // The first one completes; its bytes are given back and a new body fits again.
  ASSERT_TRUE(first.Send(std::string(997, 'x')));
  EXPECT_EQ(StatusOf(first.ReadAll(2000ms)), 200);
  httplib::Client cli("127.0.0.1", port_);
  auto res = cli.Post("/echo", std::string(1000, 'y'), "text/plain");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
}

TEST_F(HttpServerTest, AStreamCutShortByStopEndsBrokenNotComplete) {
  HttpServerOptions options = TestOptions();
  options.drain_timeout = 100ms;
  server_ = std::make_unique<HttpServer>(options);
  std::atomic<bool> began{false};
  server_->Route("GET", "/endless", BlockingHandler([&](const HttpRequest&, HttpExchange& ex) {
                   HttpResponse head;
                   head.content_type = "text/event-stream";
                   ex.BeginStream(head);
                   while (ex.Write("data: x\n\n")) {
                     began = true;
                     std::this_thread::sleep_for(5ms);
                   }
                 }));
  auto port = server_->Start("127.0.0.1", 0);
  ASSERT_TRUE(port);
  RawSocket s(*port);
  ASSERT_TRUE(s.Send("GET /endless HTTP/1.1\r\nHost: x\r\n\r\n"));
  while (!began) std::this_thread::sleep_for(1ms);
  std::thread stopper([&] { server_->Stop(); });
  const std::string raw = s.ReadAll(3000ms);
  stopper.join();
  EXPECT_NE(raw.find("data: x"), std::string::npos);
  // A complete chunked body ends with the zero-length chunk; a broken one must not.
  EXPECT_EQ(raw.find("\r\n0\r\n\r\n"), std::string::npos) << "the stream looked complete";
}

// Stop() racing requests that are just being dispatched: every connection is answered or cut,
// none is left suspended (libmicrohttpd aborts the process if one is), nothing crashes. The
// review that found the race reproduced it 6 times in 3,000 runs; this keeps it fixed.
TEST(HttpServerStop, StopRacingNewRequestsNeverLeavesOneSuspended) {
  for (int i = 0; i < 300; ++i) {
    HttpServerOptions options = TestOptions();
    options.drain_timeout = 0ms;
    HttpServer server(options);
    server.Route("POST", "/slow", BlockingHandler([](const HttpRequest&, HttpExchange& ex) {
                   std::this_thread::sleep_for(1ms);
                   ex.Reply(HttpResponse{});
                 }));
    auto port = server.Start("127.0.0.1", 0);
    ASSERT_TRUE(port);
    RawSocket s(*port);
    ASSERT_TRUE(s.Send("POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"));
    std::this_thread::sleep_for(std::chrono::microseconds((i * 37) % 400));
    server.Stop();
  }
}

// A server in a child process (10,000 client sockets and 10,000 server sockets do not fit in one
// process's descriptor limit). Serves /health and /stats ({"connections_open": N}) until the
// parent closes the pipe.
class ForkedServer {
 public:
  ForkedServer() {
    int to_child[2];
    int from_child[2];
    if (::pipe(to_child) != 0 || ::pipe(from_child) != 0) return;
    pid_ = ::fork();
    if (pid_ == 0) {
      ::close(to_child[1]);
      ::close(from_child[0]);
      RaiseOpenFileLimit();
      HttpServerOptions options = TestOptions();
      HttpServer server(options);
      server.Route("GET", "/health", InlineHandler([](const HttpRequest&) {
                     HttpResponse r;
                     r.body = "{\"status\":\"ok\"}";
                     return r;
                   }));
      server.Route("GET", "/stats", InlineHandler([&server](const HttpRequest&) {
                     HttpResponse r;
                     r.body = std::to_string(server.stats().connections_open);
                     return r;
                   }));
      auto port = server.Start("127.0.0.1", 0);
      const int value = port ? *port : -1;
      if (::write(from_child[1], &value, sizeof(value)) != sizeof(value)) ::_exit(1);
      char byte;
      while (::read(to_child[0], &byte, 1) > 0) {
      }
      server.Stop();
      ::_exit(0);
    }
    ::close(to_child[0]);
    ::close(from_child[1]);
    control_ = to_child[1];
    if (::read(from_child[0], &port_, sizeof(port_)) != sizeof(port_)) port_ = -1;
    ::close(from_child[0]);
  }
  ~ForkedServer() {
    if (control_ >= 0) ::close(control_);
    if (pid_ > 0) ::waitpid(pid_, nullptr, 0);
  }
  int port() const { return port_; }

 private:
  pid_t pid_ = -1;
  int control_ = -1;
  int port_ = -1;
};

std::chrono::microseconds TimedGet(int port, const char* path, std::string* body = nullptr) {
  const auto start = std::chrono::steady_clock::now();
  httplib::Client cli("127.0.0.1", port);
  cli.set_connection_timeout(5);
  cli.set_read_timeout(5);
  auto res = cli.Get(path);
  if (!res || res->status != 200) return std::chrono::microseconds(-1);
  if (body != nullptr) *body = res->body;
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() -
                                                               start);
}

// The attack the server exists for (issue 11): with cpp-httplib, 600 idle connections froze
// `kvferry serve` for 30 s. Here 10,000 connections — half idle, half stuck mid-header — are held
// open while fresh /health requests keep being answered. The latency bound asserted is loose
// (this is not a timing test: 2 s would only be exceeded by a server blocked on those
// connections); the measured worst case is printed, and docs/performance.md records it.
TEST(HttpServerAttack, TenThousandIdleAndHalfSentConnectionsDoNotStopHealth) {
  const std::uint64_t fd_limit = RaiseOpenFileLimit();
  constexpr int kConnections = 10000;
  if (fd_limit < kConnections + 512) {
    GTEST_SKIP() << "RLIMIT_NOFILE is " << fd_limit << ": too low to hold " << kConnections
                 << " client sockets";
  }
  ForkedServer server;
  ASSERT_GT(server.port(), 0);
  std::vector<RawSocket> sockets;
  sockets.reserve(kConnections);
  std::chrono::microseconds worst{0};
  for (int i = 0; i < kConnections; ++i) {
    RawSocket s(server.port());
    ASSERT_TRUE(s.ok()) << "connection " << i;
    if (i % 2 == 1) {
      ASSERT_TRUE(s.Send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Le"));
    }
    sockets.push_back(std::move(s));
    if (i % 1000 == 999) {
      const auto latency = TimedGet(server.port(), "/health");
      ASSERT_GT(latency.count(), 0) << "health failed with " << i + 1 << " connections open";
      worst = std::max(worst, latency);
    }
  }
  // Every connection is held (none refused at the limit), and health still answers.
  std::string open;
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (TimedGet(server.port(), "/stats", &open).count() > 0 && std::stoull(open) < kConnections &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_GE(std::stoull(open), static_cast<std::uint64_t>(kConnections));
  for (int i = 0; i < 20; ++i) {
    const auto latency = TimedGet(server.port(), "/health");
    ASSERT_GT(latency.count(), 0);
    worst = std::max(worst, latency);
  }
  std::printf("[ measured ] /health worst latency with %d connections open: %.2f ms\n",
              kConnections, static_cast<double>(worst.count()) / 1000.0);
  EXPECT_LT(worst, std::chrono::microseconds(2000000));
}

}  // namespace
}  // namespace kvferry::control
