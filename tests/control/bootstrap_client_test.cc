// BootstrapClient and EngineDirectory: addresses, deadlines against servers that misbehave, and
// the directory's caching and deduplication.
#include "control/bootstrap_client.h"

#include <gtest/gtest.h>
#include <httplib.h>
#include <sys/socket.h>

#include <atomic>
#include <thread>

#include "bootstrap_test_util.h"
#include "control/bootstrap_json.h"
#include "control/bootstrap_server.h"
#include "support/raw_socket.h"

namespace kvferry::control {
namespace {

using namespace std::chrono_literals;
using kvferry::testing::FreePort;
using kvferry::testing::SilentListener;
using testing::ElapsedSince;
using testing::MakeWorker;

TEST(BootstrapAddress, Parses) {
  auto a = ParseBootstrapAddress("10.0.0.1:8998");
  ASSERT_TRUE(a);
  EXPECT_EQ(a->host, "10.0.0.1");
  EXPECT_EQ(a->port, 8998);
  a = ParseBootstrapAddress("http://prefill-0.svc:80/");
  ASSERT_TRUE(a);
  EXPECT_EQ(a->host, "prefill-0.svc");
  EXPECT_EQ(a->port, 80);
  a = ParseBootstrapAddress("http://[::1]:8998");
  ASSERT_TRUE(a);
  EXPECT_EQ(a->host, "::1");
  EXPECT_EQ(a->ToString(), "[::1]:8998");
  for (const char* bad : {"", "host", "host:", "host:0", "host:65536", "host:12x", ":80",
                          "https://host:443", "::1:80", "[::1]80", "ho st:80", "a/b:80"}) {
    auto r = ParseBootstrapAddress(bad);
    ASSERT_FALSE(r) << bad;
    EXPECT_EQ(r.error().code(), ErrorCode::kInvalidArgument) << bad;
  }
  EXPECT_FALSE(BootstrapClient::Create("nope"));
}

// A server that accepts but never answers: every call ends with kTimeout near its deadline.
TEST(BootstrapClientTimeouts, SilentServer) {
  SilentListener silent;
  BootstrapClient client({"127.0.0.1", silent.port()});

  auto start = std::chrono::steady_clock::now();
  auto q = client.Query("p0", 300ms);
  auto took = ElapsedSince(start);
  ASSERT_FALSE(q);
  EXPECT_EQ(q.error().code(), ErrorCode::kTimeout) << q.error().ToString();
  EXPECT_GE(took, 250ms);
  EXPECT_LT(took, 1500ms);

  start = std::chrono::steady_clock::now();
  Status health = client.Health(200ms);
  EXPECT_EQ(health.code(), ErrorCode::kTimeout) << health.ToString();
  EXPECT_LT(ElapsedSince(start), 1500ms);

  // Register retries within its budget: attempts of 150 ms inside 600 ms.
  RetryPolicy retry;
  retry.attempt_timeout = 150ms;
  retry.initial_backoff = 10ms;
  start = std::chrono::steady_clock::now();
  Status s = client.Register(MakeWorker("p0", 0), 600ms, retry);
  took = ElapsedSince(start);
  EXPECT_EQ(s.code(), ErrorCode::kTimeout) << s.ToString();
  EXPECT_NE(s.message().find("attempt"), std::string::npos);
  EXPECT_EQ(s.message().find("after 1 attempt"), std::string::npos) << s.message();
  EXPECT_GE(took, 400ms);
  EXPECT_LT(took, 2000ms);

  EngineDirectory directory;
  start = std::chrono::steady_clock::now();
  auto l = directory.Lookup("p0", "127.0.0.1:" + std::to_string(silent.port()), 300ms);
  ASSERT_FALSE(l);
  EXPECT_EQ(l.error().code(), ErrorCode::kTimeout);
  EXPECT_LT(ElapsedSince(start), 1500ms);
}

TEST(BootstrapClientTimeouts, NothingListening) {
  BootstrapClient client({"127.0.0.1", FreePort()});
  auto q = client.Query("p0", 1000ms);
  ASSERT_FALSE(q);
  EXPECT_EQ(q.error().code(), ErrorCode::kUnavailable) << q.error().ToString();

  RetryPolicy retry;
  retry.initial_backoff = 20ms;
  retry.max_backoff = 40ms;
  auto start = std::chrono::steady_clock::now();
  Status s = client.Register(MakeWorker("p0", 0), 400ms, retry);
  EXPECT_EQ(s.code(), ErrorCode::kUnavailable) << s.ToString();
  EXPECT_EQ(s.message().find("after 1 attempt"), std::string::npos) << s.message();
  EXPECT_LT(ElapsedSince(start), 1500ms);
}

// A server that sends its answer one byte per 50 ms: each read succeeds, so only the call's
// overall deadline can stop it.
TEST(BootstrapClientTimeouts, TricklingServerCannotStretchTheDeadline) {
  SilentListener listener;
  std::atomic<bool> stop{false};
  std::thread trickler([&] {
    const int conn = ::accept(listener.fd(), nullptr, nullptr);
    if (conn < 0) return;
    const std::string answer = "HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n";
    for (std::size_t i = 0; !stop && i < 200; ++i) {
      const char c = i < answer.size() ? answer[i] : ' ';
      if (::send(conn, &c, 1, MSG_NOSIGNAL) != 1) break;
      std::this_thread::sleep_for(50ms);
    }
    ::close(conn);
  });
  BootstrapClient client({"127.0.0.1", listener.port()});
  const auto start = std::chrono::steady_clock::now();
  auto q = client.Query("p0", 400ms);
  const auto took = ElapsedSince(start);
  stop = true;
  ::shutdown(listener.fd(), SHUT_RDWR);
  trickler.join();
  ASSERT_FALSE(q);
  EXPECT_EQ(q.error().code(), ErrorCode::kTimeout) << q.error().ToString();
  EXPECT_LT(took, 1200ms);
}

// A fake bootstrap whose /query answers slowly and counts its hits.
class SlowBootstrap {
 public:
  explicit SlowBootstrap(std::chrono::milliseconds delay) {
    server_.Get("/query", [this, delay](const httplib::Request& req, httplib::Response& res) {
      ++hits_;
      std::this_thread::sleep_for(delay);
      EngineInfo info;
      info.engine_id = req.get_param_value("engine_id");
      info.incarnation = "inc-" + std::to_string(generation_.load());
      info.tp_size = 1;
      info.complete = true;
      info.workers = {{0, 0, 0, "tcp://127.0.0.1:1", ""}};
      res.set_content(EncodeEngine(info), "application/json");
    });
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    while (!server_.is_running()) std::this_thread::sleep_for(1ms);
  }
  ~SlowBootstrap() {
    server_.stop();
    thread_.join();
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  int hits() const { return hits_; }
  void Restart() { ++generation_; }

 private:
  httplib::Server server_;
  std::thread thread_;
  int port_ = 0;
  std::atomic<int> hits_{0};
  std::atomic<int> generation_{0};
};

TEST(EngineDirectory, ConcurrentLookupsShareOneQuery) {
  SlowBootstrap slow(300ms);
  EngineDirectory directory;
  constexpr int kThreads = 8;
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&] {
      auto r = directory.Lookup("p0", slow.address(), 5000ms);
      if (r && r->info->incarnation == "inc-0") ++ok;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok, kThreads);
  EXPECT_EQ(slow.hits(), 1);
  EXPECT_EQ(directory.queries_sent(), 1u);
}

TEST(EngineDirectory, WaiterGivesUpAtItsOwnDeadline) {
  SlowBootstrap slow(600ms);
  EngineDirectory directory;
  std::thread leader([&] { EXPECT_TRUE(directory.Lookup("p0", slow.address(), 5000ms)); });
  std::this_thread::sleep_for(100ms);  // let the leader's query start
  const auto start = std::chrono::steady_clock::now();
  auto r = directory.Lookup("p0", slow.address(), 100ms);
  const auto took = ElapsedSince(start);
  leader.join();
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kTimeout);
  EXPECT_LT(took, 450ms);
  EXPECT_NE(directory.Cached("p0"), nullptr);
}

TEST(EngineDirectory, InvalidateDuringAQueryDoesNotCacheItsAnswer) {
  SlowBootstrap slow(300ms);
  EngineDirectory directory;
  std::thread leader([&] { EXPECT_TRUE(directory.Lookup("p0", slow.address(), 5000ms)); });
  std::this_thread::sleep_for(100ms);
  directory.Invalidate("p0");
  leader.join();
  EXPECT_EQ(directory.Cached("p0"), nullptr);
}

TEST(EngineDirectory, ReportsARestartOnceAndRequeriesAnotherAddress) {
  SlowBootstrap a(0ms);
  SlowBootstrap b(0ms);
  EngineDirectory directory;
  auto r = directory.Lookup("p0", a.address(), 2000ms);
  ASSERT_TRUE(r);
  EXPECT_FALSE(r->incarnation_changed);
  // Another bootstrap address for the same engine: asked again, not served from the cache.
  b.Restart();
  r = directory.Lookup("p0", b.address(), 2000ms);
  ASSERT_TRUE(r);
  EXPECT_TRUE(r->incarnation_changed);
  EXPECT_EQ(r->previous_incarnation, "inc-0");
  EXPECT_EQ(r->info->incarnation, "inc-1");
  r = directory.Lookup("p0", b.address(), 2000ms);
  ASSERT_TRUE(r);
  EXPECT_FALSE(r->incarnation_changed);
  EXPECT_EQ(b.hits(), 1);
  // Same incarnation after Invalidate: no change reported.
  directory.Invalidate("p0");
  r = directory.Lookup("p0", b.address(), 2000ms);
  ASSERT_TRUE(r);
  EXPECT_FALSE(r->incarnation_changed);
  EXPECT_EQ(b.hits(), 2);
}

TEST(EngineDirectory, FailuresAreNotCached) {
  BootstrapServer server;
  auto port = server.Start("127.0.0.1", 0);
  ASSERT_TRUE(port);
  const std::string addr = "127.0.0.1:" + std::to_string(*port);
  EngineDirectory directory;
  auto r = directory.Lookup("p0", addr, 2000ms);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kNotFound);
  EXPECT_EQ(directory.Lookup("p0", "not an address", 2000ms).error().code(),
            ErrorCode::kInvalidArgument);

  BootstrapClient client({"127.0.0.1", *port});
  ASSERT_TRUE(client.Register(MakeWorker("p0", 0, 1), 2000ms).ok());
  r = directory.Lookup("p0", addr, 2000ms);
  ASSERT_TRUE(r) << r.error().ToString();
  EXPECT_FALSE(r->incarnation_changed);  // first sight is not a change
  EXPECT_TRUE(CheckLease(0, *r->info).ok());
  EXPECT_EQ(CheckLease(30, *r->info).code(), ErrorCode::kLeaseMismatch);
  server.Stop();
}

// Many threads looking up, invalidating and reading at once (run under TSan to check races).
TEST(EngineDirectory, ConcurrentUseIsSafe) {
  SlowBootstrap slow(1ms);
  EngineDirectory directory;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 30; ++i) {
        const std::string engine = "p" + std::to_string(i % 3);
        if (t % 3 == 0 && i % 5 == 0) directory.Invalidate(engine);
        auto r = directory.Lookup(engine, slow.address(), 5000ms);
        if (!r || r->info->engine_id != engine) ++failures;
        (void)directory.Cached(engine);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures, 0);
  EXPECT_LE(directory.queries_sent(), 6u * 30u);
}

}  // namespace
}  // namespace kvferry::control
