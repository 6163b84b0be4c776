// proxy, load and probe against a tiny fake OpenAI server on 127.0.0.1 (OS-chosen ports).
#include <arpa/inet.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "client_http.h"
#include "client_load.h"
#include "client_probe.h"
#include "client_proxy.h"
#include "control/load_failure_service.h"
#include "control/bootstrap_client.h"
#include "control/bootstrap_server.h"
#include "control/cluster_auth.h"
#include "demo_process.h"

namespace kvferry::harness {
namespace {

using nlohmann::json;

// Debian's compiled cpp-httplib 0.11.4 listens with a backlog of 5 (CPPHTTPLIB_LISTEN_BACKLOG
// is baked into libcpp-httplib.so), so a burst of concurrent connects (the seed's 128 requests
// "sent at once") overflows the accept queue and connects stall for seconds in SYN
// retransmission. Call after Server::bind_to_port / bind_to_any_port: it finds this process's
// listening socket on 127.0.0.1:`port` and listen()s again with `backlog` (Linux updates the
// backlog of a listening socket). Returns false when no such socket was found.
bool RaiseListenBacklog(int port, int backlog = 4096) {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return false;
  bool raised = false;
  while (const dirent* e = ::readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == ::dirfd(dir)) continue;
    sockaddr_storage addr{};
    socklen_t len = sizeof addr;
    if (::getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      continue;
    }
    int local_port = -1;
    if (addr.ss_family == AF_INET) {
      local_port = ntohs(reinterpret_cast<const sockaddr_in*>(&addr)->sin_port);
    } else if (addr.ss_family == AF_INET6) {
      local_port = ntohs(reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_port);
    }
    int listening = 0;
    socklen_t optlen = sizeof listening;
    if (local_port != port ||
        ::getsockopt(static_cast<int>(fd), SOL_SOCKET, SO_ACCEPTCONN, &listening, &optlen) != 0 ||
        listening == 0) {
      continue;
    }
    raised = ::listen(static_cast<int>(fd), backlog) == 0 || raised;
  }
  ::closedir(dir);
  return raised;
}


// A fake completions server: streams `max_tokens` SSE events (or answers JSON), records every
// request body, and fails or delays requests when told to.
class FakeServer {
 public:
  std::function<int(const json&)> fail_status = [](const json&) { return 0; };
  std::function<double(const json&, int)> delay_s = [](const json&, int) { return 0.0; };
  // Streams: the 200 and its headers go out at once, the events only after this long.
  double stream_delay_s = 0;
  // Streams end with an error event after the first token (as vLLM ends one whose KV load
  // failed).
  bool stream_error = false;

  // What /health answers (the proxy polls a P's before learning its engine ids).
  std::atomic<int> health_status{200};

  // One request as received.
  struct Seen {
    std::string path;
    json body;
    httplib::Headers headers;
  };

  FakeServer() {
    svr_.new_task_queue = [] { return new httplib::ThreadPool(64); };
    auto completion = [this](const httplib::Request& req, httplib::Response& res) {
      const json body = json::parse(req.body);
      int n = 0;
      {
        std::lock_guard<std::mutex> lock(mu_);
        n = static_cast<int>(bodies_.size());
        bodies_.push_back(body);
        seen_.push_back({req.path, body, req.headers});
      }
      const double d = delay_s(body, n);
      if (d > 0) std::this_thread::sleep_for(std::chrono::duration<double>(d));
      if (const int st = fail_status(body); st != 0) {
        res.status = st;
        res.set_content(
            json{{"error",
                  {{"message", "kv transfer failed for xfer-" + std::to_string(1000 + n)},
                   {"type", "kv_transfer"}}}}
                .dump(),
            "application/json");
        return;
      }
      const int tokens = body.contains("max_tokens") ? body.value("max_tokens", 1)
                                                     : body.value("max_completion_tokens", 1);
      if (!body.value("stream", false)) {
        res.set_content(json{{"choices", {{{"text", "x"}, {"index", 0}}}}}.dump(),
                        "application/json");
        return;
      }
      res.set_chunked_content_provider(
          "text/event-stream", [this, tokens](std::size_t, httplib::DataSink& sink) {
            if (stream_delay_s > 0) {
              std::this_thread::sleep_for(std::chrono::duration<double>(stream_delay_s));
            }
            for (int i = 0; i < tokens; ++i) {
              if (stream_error && i == 1) {
                const std::string err =
                    "data: " +
                    json{{"error", {{"message", "Internal server error"}, {"code", 500}}}}.dump() +
                    "\n\n";
                sink.write(err.data(), 7);
                sink.write(err.data() + 7, err.size() - 7);
                break;
              }
              const std::string ev =
                  "data: " + json{{"choices", {{{"text", "t" + std::to_string(i)}}}}}.dump() +
                  "\n\n";
              // Split each event over two writes to exercise the SSE parser.
              sink.write(ev.data(), 7);
              sink.write(ev.data() + 7, ev.size() - 7);
            }
            sink.write("data: [DONE]\n\n", 14);
            sink.done();
            return true;
          });
    };
    svr_.Post("/v1/completions", completion);
    svr_.Post("/v1/chat/completions", completion);
    svr_.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
      res.status = health_status.load();
      res.set_content("{}", "application/json");
    });
    svr_.Get("/metrics", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(
          "# HELP kvferry_kv_blocks_total x\nkvferry_kv_blocks_total 100\n"
          "kvferry_kv_blocks_used{rank=\"0\"} 30\nkvferry_kv_blocks_used{rank=\"1\"} 12\n",
          "text/plain");
    });
    port_ = svr_.bind_to_any_port("127.0.0.1");
    RaiseListenBacklog(port_);
    thread_ = std::thread([this] { svr_.listen_after_bind(); });
    WaitFor([this] { return svr_.is_running(); }, 5);
  }
  ~FakeServer() {
    svr_.stop();
    thread_.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  std::vector<json> bodies() {
    std::lock_guard<std::mutex> lock(mu_);
    return bodies_;
  }
  std::vector<Seen> seen() {
    std::lock_guard<std::mutex> lock(mu_);
    return seen_;
  }

 private:
  httplib::Server svr_;
  int port_ = 0;
  std::thread thread_;
  std::mutex mu_;
  std::vector<json> bodies_;
  std::vector<Seen> seen_;
};

TEST(ClientHttp, ParseUrl) {
  auto hp = ParseUrl("http://127.0.0.1:8000");
  ASSERT_TRUE(hp);
  EXPECT_EQ(hp->host, "127.0.0.1");
  EXPECT_EQ(hp->port, 8000);
  EXPECT_TRUE(ParseUrl("127.0.0.1:80/"));
  EXPECT_FALSE(ParseUrl("http://127.0.0.1"));
  EXPECT_FALSE(ParseUrl("http://127.0.0.1:99999"));
  EXPECT_FALSE(ParseUrl("http://127.0.0.1:80/v1"));
}

TEST(ClientHttp, SseParserHandlesSplitsAndCrLf) {
  std::vector<std::string> got;
  SseParser p([&](const std::string& d) { got.push_back(d); });
  const std::string s = "data: {\"a\":1}\r\n\r\nevent: x\ndata:[DONE]\n\n";
  for (char c : s) p.Feed(&c, 1);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0], "{\"a\":1}");
  EXPECT_EQ(got[1], "[DONE]");
}

TEST(ClientHttp, NormalizeReasonGroupsIds) {
  EXPECT_EQ(NormalizeReason("transfer xfer-3f2a9c1e-1b2c-4d5e-8f90-123456789abc failed after 20 s"),
            NormalizeReason("transfer xfer-00000000-1111-4222-8333-444444444444 failed after 3 s"));
  EXPECT_EQ(NormalizeReason("HTTP 500: TOMBSTONED"), "HTTP N: TOMBSTONED");
}

TEST(ClientHttp, PrometheusSumsSeriesAndPercentiles) {
  const auto m = ParsePrometheus("# x\na 1\nb{r=\"0\"} 2.5\nb{r=\"1\"} 1.5\nbad{ 3\nc NaN\n");
  EXPECT_EQ(m.at("a"), 1);
  EXPECT_EQ(m.at("b"), 4);
  EXPECT_EQ(Percentile({3, 1, 2, 4}, 50), 2);
  EXPECT_EQ(Percentile({3, 1, 2, 4}, 100), 4);
  EXPECT_EQ(Percentile({}, 50), -1);
  EXPECT_NE(RandomUuid(), RandomUuid());
  EXPECT_EQ(RandomUuid().size(), 36u);
}

// A proxy in front of one fake P and one fake D.
ProxyOptions PairOptions(const FakeServer& p, const FakeServer& d) {
  ProxyOptions o;
  o.prefills = {{p.url(), "127.0.0.1:1", "p"}};
  o.decodes = {d.url()};
  return o;
}
std::string UrlOf(const Proxy& proxy) { return "http://127.0.0.1:" + std::to_string(proxy.port()); }

TEST(Proxy, SendsPrefillAndDecodeCopiesAndStreamsDecode) {
  FakeServer p, d;
  ProxyOptions o;
  o.prefills = {{p.url(), "127.0.0.1:8998", "engine-p0"}};
  o.decodes = {d.url()};
  Proxy proxy(o);
  std::string err;
  ASSERT_TRUE(proxy.Start(&err)) << err;
  const std::string url = "http://127.0.0.1:" + std::to_string(proxy.port());
  ASSERT_TRUE(WaitFor([&] { return HttpGet(url, "/health", 1).has_value(); }, 5));

  const CompletionOutcome r =
      PostCompletion({url, CompletionBody({1, 2, 3}, 5, true, true), true, 10, nullptr});
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_EQ(r.tokens, 5);
  EXPECT_TRUE(r.saw_done);
  EXPECT_GE(r.ttft_s, 0);

  ASSERT_TRUE(WaitFor([&] { return p.bodies().size() == 1; }, 5));
  const json pb = p.bodies()[0];
  const json db = d.bodies().at(0);
  EXPECT_EQ(pb["max_tokens"], 1);
  EXPECT_EQ(pb["stream"], true) << "P's copy is streamed so that P notices a drop";
  EXPECT_EQ(pb["prompt"], json({1, 2, 3}));
  EXPECT_EQ(pb["kv_transfer_params"]["do_remote_decode"], true);
  EXPECT_EQ(pb["kv_transfer_params"]["do_remote_prefill"], false);
  const std::string tid = pb["kv_transfer_params"]["transfer_id"];
  EXPECT_EQ(tid.rfind("xfer-", 0), 0u);
  EXPECT_EQ(tid.size(), 5u + 36u);
  EXPECT_EQ(db["max_tokens"], 5);
  EXPECT_EQ(db["stream"], true);
  EXPECT_EQ(db["kv_transfer_params"]["transfer_id"], tid);
  EXPECT_EQ(db["kv_transfer_params"]["do_remote_prefill"], true);
  EXPECT_EQ(db["kv_transfer_params"]["do_remote_decode"], false);
  EXPECT_EQ(db["kv_transfer_params"]["remote_engine_id"], "engine-p0");
  EXPECT_EQ(db["kv_transfer_params"]["remote_bootstrap_addr"], "http://127.0.0.1:8998");
  proxy.Stop();
  EXPECT_EQ(proxy.stats().requests, 1u);
}

TEST(Proxy, SendsDecodeAtOnceEvenWhilePrefillIsSlow) {
  FakeServer p, d;
  p.delay_s = [](const json&, int) { return 1.5; };
  Proxy proxy(PairOptions(p, d));
  ASSERT_TRUE(proxy.Start(nullptr));
  const std::string url = UrlOf(proxy);
  const CompletionOutcome r =
      PostCompletion({url, CompletionBody({1}, 2, true, true), true, 10, nullptr});
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_LT(r.latency_s, 1.0);  // D's answer did not wait for P's
  proxy.Stop();                 // cancels P's background request; joins promptly
}

TEST(Proxy, ForwardsDecodeErrorsAndRoundRobins) {
  FakeServer p, d0, d1;
  d1.fail_status = [](const json&) { return 503; };
  ProxyOptions o;
  o.prefills = {{p.url(), "127.0.0.1:1", "p"}};
  o.decodes = {d0.url(), d1.url()};
  Proxy proxy(o);
  ASSERT_TRUE(proxy.Start(nullptr));
  const std::string url = "http://127.0.0.1:" + std::to_string(proxy.port());
  int ok = 0, failed = 0;
  for (int i = 0; i < 4; ++i) {
    const auto r = PostCompletion({url, CompletionBody({1}, 2, true, true), true, 10, nullptr});
    if (r.ok) {
      ++ok;
    } else {
      ++failed;
      EXPECT_EQ(r.http_status, 503);
      EXPECT_NE(r.error.find("kv transfer failed"), std::string::npos) << r.error;
    }
  }
  EXPECT_EQ(ok, 2);
  EXPECT_EQ(failed, 2);
  EXPECT_EQ(d0.bodies().size(), 2u);
  EXPECT_EQ(d1.bodies().size(), 2u);
  // A dead decode instance: a 502 with a reason, not a hang.
  ProxyOptions dead = o;
  dead.decodes = {"http://127.0.0.1:" + std::to_string(FreePort())};
  Proxy proxy2(dead);
  ASSERT_TRUE(proxy2.Start(nullptr));
  const auto r = PostCompletion({"http://127.0.0.1:" + std::to_string(proxy2.port()),
                                 CompletionBody({1}, 2, true, true), true, 10, nullptr});
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(r.http_status, 502);
}

// Hostile bodies get a 400 naming what is wrong (or 413 for size), reach neither P nor D, and
// the proxy keeps serving: a body nested 70,000 deep used to crash it (SIGSEGV re-serializing
// it), and "stream": "yes" got an empty 500.
TEST(Proxy, HostileBodiesAreRefusedAndTheProxyKeepsServing) {
  FakeServer p, d;
  ProxyOptions o = PairOptions(p, d);
  o.max_body_bytes = 1 << 20;
  Proxy proxy(o);
  ASSERT_TRUE(proxy.Start(nullptr));
  httplib::Client cli("127.0.0.1", proxy.port());
  cli.set_read_timeout(std::chrono::seconds(10));
  auto post = [&](const std::string& body) {
    auto res = cli.Post("/v1/completions", body, "application/json");
    return res ? std::make_pair(res->status, res->body) : std::make_pair(0, std::string());
  };
  const std::string deep = "{\"prompt\":" + std::string(70000, '[') + std::string(70000, ']') + "}";
  auto [deep_status, deep_body] = post(deep);
  EXPECT_EQ(deep_status, 400);
  EXPECT_NE(deep_body.find("deeper than 32 levels"), std::string::npos) << deep_body;
  auto [stream_status, stream_body] = post(R"({"prompt":[1],"max_tokens":2,"stream":"yes"})");
  EXPECT_EQ(stream_status, 400);
  EXPECT_NE(stream_body.find("'stream'"), std::string::npos) << stream_body;
  auto [big_status, big_body] = post("{\"prompt\":\"" + std::string(2 << 20, 'a') + "\"}");
  EXPECT_EQ(big_status, 413) << big_body;
  // A chunked body would dodge the size cap (cpp-httplib checks Content-Length only): refused
  // before it is read (a large one just has its connection closed under it).
  auto chunked_post = [&](std::size_t parts) {
    httplib::Client c("127.0.0.1", proxy.port());
    return c.Post(
        "/v1/completions",
        [parts](std::size_t, httplib::DataSink& sink) {
          const std::string part(64 << 10, 'a');
          for (std::size_t i = 0; i < parts; ++i) {
            if (!sink.write(part.data(), part.size())) return false;
          }
          sink.done();
          return true;
        },
        "application/json");
  };
  auto small_chunked = chunked_post(0);
  ASSERT_TRUE(small_chunked);
  EXPECT_EQ(small_chunked->status, 411) << small_chunked->body;
  auto big_chunked = chunked_post(256);  // 16 MiB offered
  EXPECT_TRUE(!big_chunked || big_chunked->status == 411);
  auto [garbage_status, garbage_body] = post("not json");
  EXPECT_EQ(garbage_status, 400) << garbage_body;
  EXPECT_TRUE(p.bodies().empty());
  EXPECT_TRUE(d.bodies().empty());
  // Still serving.
  auto health = cli.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  const std::string url = "http://127.0.0.1:" + std::to_string(proxy.port());
  EXPECT_TRUE(PostCompletion({url, CompletionBody({1}, 2, true, true), true, 10, nullptr}).ok);
}

// P refuses its half: the client hears P's reason at once (not after D's copy gave up), and
// D's copy is dropped.
TEST(Proxy, PrefillFailureEndsTheRequestAtOnce) {
  FakeServer p, d;
  p.fail_status = [](const json&) { return 503; };
  d.delay_s = [](const json&, int) { return 3.0; };
  Proxy proxy(PairOptions(p, d));
  ASSERT_TRUE(proxy.Start(nullptr));
  const std::string url = UrlOf(proxy);
  const auto start = std::chrono::steady_clock::now();
  const auto r = PostCompletion({url, CompletionBody({1}, 2, false, true), false, 10, nullptr});
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(r.http_status, 503);
  EXPECT_NE(r.error.find("prefill " + p.url() + " failed"), std::string::npos) << r.error;
  EXPECT_LT(took, 2.0) << "the client waited for D's copy";
  EXPECT_EQ(proxy.stats().twins_aborted, 1u);
}

// A streaming client whose D has already answered 200 (kvferry serve streams at once): P's
// failure still ends the request at once, as the stream's error event, and drops D's copy.
TEST(Proxy, PrefillFailureEndsAStreamDecodeHasBegun) {
  FakeServer p, d;
  p.fail_status = [](const json&) { return 503; };
  d.stream_delay_s = 3;
  Proxy proxy(PairOptions(p, d));
  ASSERT_TRUE(proxy.Start(nullptr));
  const std::string url = UrlOf(proxy);
  const auto start = std::chrono::steady_clock::now();
  const auto r = PostCompletion({url, CompletionBody({1}, 2, true, true), true, 10, nullptr});
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_FALSE(r.ok);
  EXPECT_TRUE(r.saw_done);
  EXPECT_NE(r.error.find("prefill " + p.url() + " failed"), std::string::npos) << r.error;
  EXPECT_LT(took, 2.0) << "the client waited for D's stream";
  EXPECT_EQ(proxy.stats().twins_aborted, 1u);
}

// D refuses its half: the client gets D's error, and P's copy is cancelled at once instead of
// prefilling (and holding KV) for nobody.
TEST(Proxy, DecodeRefusalCancelsThePrefillCopy) {
  FakeServer p, d;
  d.fail_status = [](const json&) { return 400; };
  p.delay_s = [](const json&, int) { return 3.0; };
  Proxy proxy(PairOptions(p, d));
  ASSERT_TRUE(proxy.Start(nullptr));
  const std::string url = UrlOf(proxy);
  const auto r = PostCompletion({url, CompletionBody({1}, 2, false, true), false, 10, nullptr});
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(r.http_status, 400);
  EXPECT_EQ(proxy.stats().twins_aborted, 1u);
  // P's copy ends long before P would have answered (3 s): the proxy closed it.
  EXPECT_TRUE(WaitFor([&] { return proxy.stats().prefill_cancelled == 1; }, 1.5));
  EXPECT_EQ(proxy.stats().prefill_failed, 0u) << "a cancelled copy is not P's failure";
}

// vLLM answers a request whose KV load failed with a bare "Internal server error"; with D's
// load-failure service known (--decode URL PORT), the proxy asks it why and tells the client —
// as the body of a failed answer and as the error event of a stream D had begun.
TEST(Proxy, AFailedLoadReachesTheClientWithItsReasonFromDsLoadFailureService) {
  control::LoadFailureService failures;
  auto failure_port = failures.Start("127.0.0.1", 0);
  ASSERT_TRUE(failure_port.has_value());
  FakeServer p, d;
  d.fail_status = [&](const json& body) {
    if (body.value("stream", false)) return 0;
    failures.Record(body["kv_transfer_params"]["transfer_id"].get<std::string>(),
                    "TOMBSTONED: transfer was already released on P (late pull)");
    return 500;
  };
  d.stream_error = true;
  ProxyOptions o = PairOptions(p, d);
  o.load_failure_ports[d.url()] = *failure_port;
  Proxy proxy(o);
  ASSERT_TRUE(proxy.Start(nullptr));
  const std::string url = UrlOf(proxy);
  auto r = PostCompletion({url, CompletionBody({1}, 2, false, true), false, 10, nullptr});
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(r.http_status, 500);
  EXPECT_NE(r.error.find("TOMBSTONED"), std::string::npos) << r.error;
  // Streamed: D records the reason when its stream fails (as the connector does).
  d.delay_s = [&](const json& body, int) {
    if (body.value("stream", false)) {
      failures.Record(body["kv_transfer_params"]["transfer_id"].get<std::string>(),
                      "LEASE_MISMATCH: decoder has 4s, prefiller has off");
    }
    return 0.0;
  };
  r = PostCompletion({url, CompletionBody({1}, 3, true, true), true, 10, nullptr});
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.error.find("decoder has 4s, prefiller has off"), std::string::npos) << r.error;
  // Without the service (or for a transfer it does not know), D's own answer passes.
  ProxyOptions plain = PairOptions(p, d);
  Proxy bare(plain);
  ASSERT_TRUE(bare.Start(nullptr));
  r = PostCompletion({UrlOf(bare), CompletionBody({1}, 2, false, true), false, 10, nullptr});
  EXPECT_EQ(r.http_status, 500);
  EXPECT_EQ(r.error.find("TOMBSTONED"), std::string::npos) << r.error;
}

TEST(Proxy, BurstOfConnectionsDoesNotStall) {
  // 64 connects at once: with httplib's backlog of 5 some would sit in SYN retransmission
  // (1 s, 3 s, ...); the proxy listens with a backlog of 4,096, and this fake server raises its.
  FakeServer p, d;
  ProxyOptions o;
  o.prefills = {{p.url(), "127.0.0.1:1", "p"}};
  o.decodes = {d.url()};
  Proxy proxy(o);
  ASSERT_TRUE(proxy.Start(nullptr));
  LoadOptions lo;
  lo.url = "http://127.0.0.1:" + std::to_string(proxy.port());
  lo.requests = 64;
  lo.prompt_tokens = 4;
  lo.max_tokens = 2;
  lo.timeout_s = 20;
  lo.progress_every_s = 0;
  const LoadResult r = RunLoad(lo);
  EXPECT_EQ(r.summary.succeeded, 64);
  EXPECT_LT(r.summary.latency_max, 0.9) << "a connect waited for a SYN retransmission";
}

// ---- vLLM's Mooncake proxy's command line, and engine ids learned from P's bootstrap.

// A header of a request a fake server received ("" when absent; names are case-insensitive).
std::string HeaderOf(const httplib::Headers& headers, const char* name) {
  const auto it = headers.find(name);
  return it == headers.end() ? std::string() : it->second;
}

ProxyPrefillFlags Flags(std::vector<std::vector<std::string>> prefill,
                        std::vector<std::string> bootstrap = {},
                        std::vector<std::string> engine_id = {}) {
  return {std::move(prefill), std::move(bootstrap), std::move(engine_id)};
}

TEST(ProxyFlags, MooncakeAndKvferryFormsResolveAsDocumented) {
  struct Case {
    const char* name;
    ProxyPrefillFlags flags;
    std::vector<std::pair<std::string, std::string>> want;  // bootstrap, engine id per P
  };
  const std::vector<Case> cases = {
      {"URL alone: bootstrap on the URL's host at 8998, engine learned",
       Flags({{"http://10.0.0.1:8010"}}),
       {{"10.0.0.1:8998", ""}}},
      {"URL and port", Flags({{"http://10.0.0.1:8010", "9000"}}), {{"10.0.0.1:9000", ""}}},
      {"none, with the engine id",
       Flags({{"http://10.0.0.1:8010", "NONE"}}, {}, {"e"}),
       {{"", "e"}}},
      {"kvferry's form",
       Flags({{"http://127.0.0.1:8010"}, {"http://127.0.0.1:8011"}},
             {"127.0.0.1:8998", "http://127.0.0.1:8999"}, {"p0", "p1"}),
       {{"127.0.0.1:8998", "p0"}, {"127.0.0.1:8999", "p1"}}},
      {"Mooncake's form with engine ids",
       Flags({{"http://a:1", "9000"}, {"http://b:2"}}, {}, {"x", "y"}),
       {{"a:9000", "x"}, {"b:8998", "y"}}},
      {"IPv6", Flags({{"http://[::1]:8010"}}), {{"[::1]:8998", ""}}},
  };
  for (const Case& c : cases) {
    auto targets = PrefillTargetsFromFlags(c.flags);
    ASSERT_TRUE(targets) << c.name << ": " << targets.error().ToString();
    ASSERT_EQ(targets->size(), c.want.size()) << c.name;
    for (std::size_t i = 0; i < c.want.size(); ++i) {
      EXPECT_EQ((*targets)[i].url, c.flags.prefill[i][0]) << c.name;
      EXPECT_EQ((*targets)[i].bootstrap, c.want[i].first) << c.name;
      EXPECT_EQ((*targets)[i].engine_id, c.want[i].second) << c.name;
    }
  }
}

TEST(ProxyFlags, AmbiguousOrMalformedCommandLinesAreRefusedNamingTheRule) {
  const struct Case {
    const char* name;
    ProxyPrefillFlags flags;
    const char* reason;
  } cases[] = {
      {"no prefill", Flags({}), "at least one --prefill"},
      {"a port and --prefill-bootstrap", Flags({{"http://a:1", "9000"}}, {"a:9001"}, {"e"}),
       "both name this P's bootstrap"},
      {"none and --prefill-bootstrap", Flags({{"http://a:1", "none"}}, {"a:9001"}),
       "both name this P's bootstrap"},
      {"fewer bootstraps than Ps", Flags({{"http://a:1"}, {"http://b:1"}}, {"a:9000"}),
       "1 --prefill-bootstrap for 2 --prefill"},
      {"fewer engine ids than Ps", Flags({{"http://a:1"}, {"http://b:1"}}, {}, {"e"}),
       "1 --prefill-engine-id for 2 --prefill"},
      {"more engine ids than Ps", Flags({{"http://a:1"}}, {}, {"e", "f"}),
       "2 --prefill-engine-id for 1 --prefill"},
      {"none without an engine id", Flags({{"http://a:1", "none"}}),
       "no bootstrap to learn its engine id from"},
      {"two values after the URL", Flags({{"http://a:1", "9000", "9001"}}),
       "has 2 values after the URL"},
      {"a port out of range", Flags({{"http://a:1", "70000"}}),
       "is not a bootstrap port (1..65535) or 'none'"},
      {"a port that is a word", Flags({{"http://a:1", "auto"}}),
       "is not a bootstrap port (1..65535) or 'none'"},
      {"a URL without a port", Flags({{"http://a"}}), "not a URL of the form"},
      {"an https URL", Flags({{"https://a:1"}}), "not a URL of the form"},
      {"an empty engine id", Flags({{"http://a:1"}}, {}, {""}), "an engine id is 1 to 256"},
      {"an engine id too long", Flags({{"http://a:1"}}, {}, {std::string(300, 'e')}),
       "an engine id is 1 to 256"},
      {"a bootstrap that is no address", Flags({{"http://a:1"}}, {"a"}, {"e"}),
       "bootstrap address 'a'"},
  };
  for (const Case& c : cases) {
    auto targets = PrefillTargetsFromFlags(c.flags);
    ASSERT_FALSE(targets) << c.name;
    EXPECT_EQ(targets.error().code(), ErrorCode::kInvalidArgument) << c.name;
    EXPECT_NE(targets.error().message().find(c.reason), std::string::npos)
        << c.name << ": " << targets.error().message();
  }
}

// A bootstrap service whose GET /query answer the test chooses (a hostile one, say).
class FakeBootstrap {
 public:
  FakeBootstrap() {
    svr_.Get("/query", [this](const httplib::Request&, httplib::Response& res) {
      std::lock_guard<std::mutex> lock(mu_);
      res.status = status_;
      res.set_content(body_, "application/json");
    });
    port_ = svr_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { svr_.listen_after_bind(); });
    WaitFor([this] { return svr_.is_running(); }, 5);
  }
  ~FakeBootstrap() {
    svr_.stop();
    thread_.join();
  }
  void Answer(int status, std::string body) {
    std::lock_guard<std::mutex> lock(mu_);
    status_ = status;
    body_ = std::move(body);
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }

 private:
  httplib::Server svr_;
  int port_ = 0;
  std::thread thread_;
  std::mutex mu_;
  int status_ = 200;
  std::string body_ = "{}";
};

// Lines a proxy logged (ProxyOptions::log), for tests that check what it says.
class LogLines {
 public:
  std::function<void(std::string_view)> sink() {
    return [this](std::string_view line) {
      std::lock_guard<std::mutex> lock(mu_);
      text_ += std::string(line) + "\n";
    };
  }
  std::string text() {
    std::lock_guard<std::mutex> lock(mu_);
    return text_;
  }

 private:
  std::mutex mu_;
  std::string text_;
};

// A proxy in front of one fake P, whose engine ids it learns from `bootstrap`, and one fake D.
ProxyOptions LearningOptions(const FakeServer& p, const std::string& bootstrap,
                             const FakeServer& d) {
  ProxyOptions o;
  o.prefills = {{p.url(), bootstrap, ""}};
  o.decodes = {d.url()};
  o.ready_attempt_timeout_s = 2;
  o.ready_retry_interval_s = 0.05;
  o.ready_log_interval_s = 0.2;
  return o;
}

struct Answer {
  int status = 0;
  std::string body;
};
Answer Get(const Proxy& proxy, const std::string& path) {
  httplib::Client cli("127.0.0.1", proxy.port());
  cli.set_read_timeout(std::chrono::seconds(5));
  auto res = cli.Get(path.c_str());
  return res ? Answer{res->status, res->body} : Answer{};
}
Answer PostJson(const Proxy& proxy, const std::string& path, const json& body) {
  httplib::Client cli("127.0.0.1", proxy.port());
  cli.set_read_timeout(std::chrono::seconds(10));
  auto res = cli.Post(path.c_str(), body.dump(), "application/json");
  return res ? Answer{res->status, res->body} : Answer{};
}

// Until P answers /health with 200 the proxy does not ask its bootstrap: completions get 503
// naming P and why, /health answers 503 with every P's state, the log names P. Once P is
// healthy the proxy learns its engine and serves.
TEST(Proxy, IsNotReadyUntilItsPrefillIsHealthyAndItsEngineKnown) {
  FakeServer p, d;
  p.health_status = 503;
  control::BootstrapServer bootstrap;
  auto bport = bootstrap.Start("127.0.0.1", 0);
  ASSERT_TRUE(bport) << bport.error().ToString();
  const std::string baddr = "127.0.0.1:" + std::to_string(*bport);
  control::WorkerRegistration r;
  r.engine_id = "engine-a";
  r.side_channel = "tcp://127.0.0.1:5555";
  r.protocol_version = 1;
  r.incarnation = "i1";
  ASSERT_TRUE(control::BootstrapClient::Create(baddr)->Register(r, control::Timeout{5000}).ok());
  LogLines log;
  ProxyOptions o = LearningOptions(p, baddr, d);
  o.log = log.sink();
  Proxy proxy(o);
  std::string err;
  ASSERT_TRUE(proxy.Start(&err)) << err;
  ASSERT_TRUE(WaitFor(
      [&] { return proxy.readiness().reason.find("answered HTTP 503") != std::string::npos; }, 5))
      << proxy.readiness().reason;
  EXPECT_FALSE(proxy.readiness().ready);
  EXPECT_NE(proxy.readiness().reason.find("prefill " + p.url() + " is not ready"),
            std::string::npos)
      << proxy.readiness().reason;
  const Answer refused =
      PostJson(proxy, "/v1/completions", {{"prompt", {1, 2}}, {"max_tokens", 2}});
  EXPECT_EQ(refused.status, 503);
  EXPECT_NE(refused.body.find("proxy is not ready: prefill " + p.url()), std::string::npos)
      << refused.body;
  const Answer health = Get(proxy, "/health");
  EXPECT_EQ(health.status, 503);
  const json h = json::parse(health.body, nullptr, false);
  ASSERT_TRUE(h.is_object()) << health.body;
  EXPECT_EQ(h["prefills"][0]["url"], p.url());
  EXPECT_EQ(h["prefills"][0]["ready"], false);
  EXPECT_TRUE(WaitFor(
      [&] { return log.text().find("prefill " + p.url() + " is not ready") != std::string::npos; },
      5))
      << log.text();
  EXPECT_TRUE(p.bodies().empty());
  EXPECT_TRUE(d.bodies().empty());
  EXPECT_EQ(proxy.stats().not_ready, 1u);

  p.health_status = 200;
  ASSERT_TRUE(WaitFor([&] { return proxy.readiness().ready; }, 5)) << proxy.readiness().reason;
  EXPECT_EQ(Get(proxy, "/health").status, 200);
  EXPECT_NE(log.text().find("prefill " + p.url() + " is ready: engine-a (dp rank 0)"),
            std::string::npos)
      << log.text();
  const std::string url = UrlOf(proxy);
  const CompletionOutcome ok =
      PostCompletion({url, CompletionBody({1, 2}, 3, true, true), true, 10, nullptr});
  ASSERT_TRUE(ok.ok) << ok.error;
  EXPECT_EQ(d.bodies().at(0)["kv_transfer_params"]["remote_engine_id"], "engine-a");
  EXPECT_EQ(d.bodies().at(0)["kv_transfer_params"]["remote_bootstrap_addr"], "http://" + baddr);
}

// A P with several dp ranks (a vLLM DP deployment registers one engine per rank): the proxy
// learns each, and requests go round-robin over them, P told its rank in X-data-parallel-rank
// and D the rank's engine id, as vLLM's Mooncake proxy does.
TEST(Proxy, LearnsEveryDpRankOfItsPrefillAndRoundRobinsOverThem) {
  FakeServer p, d;
  control::BootstrapServer bootstrap;
  auto bport = bootstrap.Start("127.0.0.1", 0);
  ASSERT_TRUE(bport) << bport.error().ToString();
  const std::string baddr = "127.0.0.1:" + std::to_string(*bport);
  auto client = control::BootstrapClient::Create(baddr);
  for (std::uint32_t dp : {1u, 0u}) {
    control::WorkerRegistration r;
    r.engine_id = "engine-dp" + std::to_string(dp);
    r.dp_rank = dp;
    r.side_channel = "tcp://127.0.0.1:" + std::to_string(5555 + dp);
    r.protocol_version = 1;
    r.incarnation = "i1";
    ASSERT_TRUE(client->Register(r, control::Timeout{5000}).ok());
  }
  Proxy proxy(LearningOptions(p, baddr, d));
  ASSERT_TRUE(proxy.Start(nullptr));
  ASSERT_TRUE(WaitFor([&] { return proxy.readiness().ready; }, 5)) << proxy.readiness().reason;
  const std::string url = UrlOf(proxy);
  for (int i = 0; i < 4; ++i) {
    const auto r = PostCompletion({url, CompletionBody({1}, 2, false, true), false, 10, nullptr});
    ASSERT_TRUE(r.ok) << r.error;
  }
  ASSERT_TRUE(WaitFor([&] { return p.seen().size() == 4; }, 5));
  const auto d_seen = d.seen();
  const auto p_seen = p.seen();
  ASSERT_EQ(d_seen.size(), 4u);
  for (std::size_t i = 0; i < d_seen.size(); ++i) {
    const json& params = d_seen[i].body["kv_transfer_params"];
    const std::string dp = std::to_string(i % 2);
    EXPECT_EQ(params["remote_engine_id"], "engine-dp" + dp) << i;
    const std::string tid = params["transfer_id"];
    const auto p_copy = std::find_if(p_seen.begin(), p_seen.end(), [&](const FakeServer::Seen& s) {
      return s.body["kv_transfer_params"]["transfer_id"] == tid;
    });
    ASSERT_NE(p_copy, p_seen.end()) << tid;
    EXPECT_EQ(HeaderOf(p_copy->headers, "X-data-parallel-rank"), dp) << tid;
    EXPECT_EQ("xfer-" + HeaderOf(p_copy->headers, "X-Request-Id"), tid);
    EXPECT_EQ("xfer-" + HeaderOf(d_seen[i].headers, "X-Request-Id"), tid);
    EXPECT_FALSE(d_seen[i].headers.count("X-data-parallel-rank")) << "D is not told P's rank";
  }
}

// POST /v1/chat/completions goes to the same path on P and D; P's copy has
// max_completion_tokens (chat's name) cut to 1 as well as max_tokens, D's keeps the client's.
TEST(Proxy, ChatCompletionsGoToTheSamePathOnPAndD) {
  FakeServer p, d;
  Proxy proxy(PairOptions(p, d));
  ASSERT_TRUE(proxy.Start(nullptr));
  const json body = {{"model", "m"},
                     {"messages", {{{"role", "user"}, {"content", "hello"}}}},
                     {"max_completion_tokens", 4},
                     {"stream", true},
                     {"stream_options", {{"include_usage", true}}}};
  CompletionCall call{UrlOf(proxy), body.dump(), true, 10, nullptr};
  call.path = "/v1/chat/completions";
  call.headers = {{"Authorization", "Bearer client-key"}};
  const CompletionOutcome r = PostCompletion(call);
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_EQ(r.tokens, 4);
  ASSERT_TRUE(WaitFor([&] { return p.seen().size() == 1; }, 5));
  const FakeServer::Seen pc = p.seen()[0];
  const FakeServer::Seen dc = d.seen().at(0);
  EXPECT_EQ(pc.path, "/v1/chat/completions");
  EXPECT_EQ(dc.path, "/v1/chat/completions");
  EXPECT_EQ(pc.body["max_completion_tokens"], 1);
  EXPECT_EQ(pc.body["max_tokens"], 1);
  EXPECT_FALSE(pc.body.contains("stream_options"));
  EXPECT_EQ(pc.body["messages"], body["messages"]);
  EXPECT_EQ(dc.body["max_completion_tokens"], 4);
  EXPECT_EQ(dc.body["kv_transfer_params"]["do_remote_prefill"], true);
  EXPECT_EQ(HeaderOf(pc.headers, "Authorization"), "Bearer client-key");
  EXPECT_EQ(HeaderOf(dc.headers, "Authorization"), "Bearer client-key");
  // What only D would refuse never reaches P.
  EXPECT_EQ(PostJson(proxy, "/v1/chat/completions", {{"messages", "hello"}}).status, 400);
  EXPECT_EQ(PostJson(proxy, "/v1/chat/completions",
                     {{"messages", json::array({{{"role", "user"}, {"content", "x"}}})},
                      {"max_completion_tokens", 0}})
                .status,
            400);
  EXPECT_EQ(p.seen().size(), 1u);
  EXPECT_EQ(d.seen().size(), 1u);
}

// A P with no bootstrap (`--prefill URL none`): its engine id is given, and D is sent no
// remote_bootstrap_addr (it finds P another way, e.g. through etcd).
TEST(Proxy, APrefillWithoutABootstrapSendsDNoBootstrapAddress) {
  FakeServer p, d;
  ProxyOptions o;
  o.prefills = {{p.url(), "", "engine-n"}};
  o.decodes = {d.url()};
  Proxy proxy(o);
  ASSERT_TRUE(proxy.Start(nullptr));
  EXPECT_TRUE(proxy.readiness().ready);
  const auto r =
      PostCompletion({UrlOf(proxy), CompletionBody({1}, 2, true, true), true, 10, nullptr});
  ASSERT_TRUE(r.ok) << r.error;
  const json params = d.bodies().at(0)["kv_transfer_params"];
  EXPECT_EQ(params["remote_engine_id"], "engine-n");
  EXPECT_FALSE(params.contains("remote_bootstrap_addr")) << params.dump();
}

// Whatever P's bootstrap answers (huge, deep, mistyped, bad ids, inconsistent, an error), the
// proxy stays up at 503 with the reason, and serves once the answer is good.
TEST(Proxy, HostileBootstrapAnswersKeepItAt503WithTheReasonAndItRecovers) {
  FakeServer p, d;
  FakeBootstrap bootstrap;
  LogLines log;
  ProxyOptions o = LearningOptions(p, bootstrap.address(), d);
  o.log = log.sink();
  Proxy proxy(o);
  ASSERT_TRUE(proxy.Start(nullptr));
  const struct Case {
    const char* name;
    int status;
    std::string body;
    const char* reason;
  } cases[] = {
      {"huge", 200, "{\"0\":{\"engine_id\":\"e\",\"pad\":\"" + std::string(20 << 20, 'x') + "\"}}",
       "answer exceeds 16777216 bytes"},
      {"deep", 200, "{\"0\":" + std::string(200000, '[') + std::string(200000, ']') + "}",
       "deeper than 32 levels"},
      {"not JSON", 200, "<html>", "not valid JSON"},
      {"an array", 200, "[1,2]", "keyed by dp rank"},
      {"an engine_id of the wrong type", 200, R"({"0":{"engine_id":["e"]}})",
       "engine_id must be a string"},
      {"an empty engine_id", 200, R"({"0":{"engine_id":""}})", "printable ASCII"},
      {"an engine_id with control bytes", 200, R"({"0":{"engine_id":"e\u0007"}})",
       "printable ASCII"},
      {"a key that is no dp rank", 200, R"({"dp0":{"engine_id":"e"}})", "key 'dp0'"},
      {"one engine on two ranks", 200, R"({"0":{"engine_id":"e"},"1":{"engine_id":"e"}})",
       "listed on two dp ranks"},
      {"complete of the wrong type", 200, R"({"0":{"engine_id":"e","complete":1}})",
       "complete must be a boolean"},
      {"an incomplete engine", 200, R"({"0":{"engine_id":"e","complete":false}})",
       "waits for some of its ranks"},
      {"no engine yet", 200, "{}", "lists no engine yet"},
      {"an error", 500, R"({"error":"boom"})", "boom (HTTP 500)"},
  };
  const std::string url = UrlOf(proxy);
  for (const Case& c : cases) {
    bootstrap.Answer(c.status, c.body);
    EXPECT_TRUE(
        WaitFor([&] { return proxy.readiness().reason.find(c.reason) != std::string::npos; }, 10))
        << c.name << ": " << proxy.readiness().reason;
    EXPECT_FALSE(proxy.readiness().ready) << c.name;
    const Answer refused = PostJson(proxy, "/v1/completions", {{"prompt", {1}}});
    EXPECT_EQ(refused.status, 503) << c.name;
    EXPECT_NE(refused.body.find("proxy is not ready"), std::string::npos) << refused.body;
  }
  EXPECT_EQ(Get(proxy, "/health").status, 503);
  EXPECT_NE(log.text().find("not valid JSON"), std::string::npos) << log.text();
  EXPECT_TRUE(p.bodies().empty());
  EXPECT_TRUE(d.bodies().empty());

  bootstrap.Answer(200, R"({"0":{"engine_id":"good","worker_addr":{"0":{"0":"tcp://x:1"}}}})");
  ASSERT_TRUE(WaitFor([&] { return proxy.readiness().ready; }, 5)) << proxy.readiness().reason;
  const auto r = PostCompletion({url, CompletionBody({1}, 2, true, true), true, 10, nullptr});
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_EQ(d.bodies().at(0)["kv_transfer_params"]["remote_engine_id"], "good");
}

// With a cluster secret the proxy believes only a listing signed with it, as D believes only
// signed engine answers; with the cluster's secret it is ready.
TEST(Proxy, WithAClusterSecretOnlyAListingSignedWithItIsBelieved) {
  const std::string dir = ::testing::TempDir() + "kvferry_proxy_secret_" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  auto write_secret = [&](const std::string& name, char fill) {
    const std::string path = dir + "/" + name;
    std::ofstream(path) << std::string(48, fill) << "\n";
    std::filesystem::permissions(
        path, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write,
        std::filesystem::perm_options::replace);
    return path;
  };
  const std::string cluster = write_secret("cluster", 'a');
  const std::string other = write_secret("other", 'b');
  auto secret = control::LoadClusterSecret(cluster);
  ASSERT_TRUE(secret) << secret.error().ToString();
  auto shared = std::make_shared<const control::ClusterSecret>(std::move(*secret));
  control::BootstrapServerOptions bo;
  bo.cluster_secret = shared;
  control::BootstrapServer bootstrap(bo);
  auto bport = bootstrap.Start("127.0.0.1", 0);
  ASSERT_TRUE(bport) << bport.error().ToString();
  const std::string baddr = "127.0.0.1:" + std::to_string(*bport);
  control::WorkerRegistration r;
  r.engine_id = "engine-s";
  r.side_channel = "tcp://127.0.0.1:5555";
  r.protocol_version = 1;
  r.incarnation = "i1";
  ASSERT_TRUE(
      control::BootstrapClient::Create(baddr, shared)->Register(r, control::Timeout{5000}).ok());

  FakeServer p, d;
  ProxyOptions wrong = LearningOptions(p, baddr, d);
  wrong.cluster_secret_file = other;
  Proxy outsider(wrong);
  ASSERT_TRUE(outsider.Start(nullptr));
  ProxyOptions right = LearningOptions(p, baddr, d);
  right.cluster_secret_file = cluster;
  Proxy member(right);
  ASSERT_TRUE(member.Start(nullptr));
  EXPECT_TRUE(WaitFor([&] { return member.readiness().ready; }, 5)) << member.readiness().reason;
  EXPECT_TRUE(WaitFor(
      [&] { return outsider.readiness().reason.find("does not match") != std::string::npos; }, 5))
      << outsider.readiness().reason;
  EXPECT_FALSE(outsider.readiness().ready);
  // A secret file that is refused stops the proxy from starting, with the reason.
  ProxyOptions missing = LearningOptions(p, baddr, d);
  missing.cluster_secret_file = dir + "/absent";
  Proxy unstarted(missing);
  std::string err;
  EXPECT_FALSE(unstarted.Start(&err));
  EXPECT_NE(err.find("absent"), std::string::npos) << err;
  std::filesystem::remove_all(dir);
}

TEST(Load, CountsSuccessesAndFailureReasons) {
  FakeServer s;
  std::atomic<int> n{0};
  s.fail_status = [&](const json&) { return n.fetch_add(1) % 5 == 4 ? 500 : 0; };
  LoadOptions o;
  o.url = s.url();
  o.requests = 20;
  o.prompt_tokens = 16;
  o.max_tokens = 3;
  o.timeout_s = 10;
  o.progress_every_s = 0;
  const LoadResult r = RunLoad(o);
  EXPECT_EQ(r.summary.total, 20);
  EXPECT_EQ(r.summary.succeeded, 16);
  EXPECT_EQ(r.summary.failed, 4);
  ASSERT_EQ(r.summary.failure_reasons.size(), 1u);  // ids normalized away
  EXPECT_EQ(r.summary.failure_reasons.begin()->second, 4);
  EXPECT_GT(r.summary.latency_p50, 0);
  EXPECT_GE(r.summary.ttft_p50, 0);
  EXPECT_EQ(s.bodies().size(), 20u);
  EXPECT_EQ(s.bodies()[0]["prompt"].size(), 16u);
  EXPECT_EQ(s.bodies()[0]["ignore_eos"], true);
  const json j = json::parse(LoadResultJson(o, r));
  EXPECT_EQ(j["summary"]["failed"], 4);
  EXPECT_EQ(j["requests"].size(), 20u);
}

TEST(Load, TimesOutAndCancels) {
  FakeServer s;
  s.delay_s = [](const json&, int) { return 3.0; };
  LoadOptions o;
  o.url = s.url();
  o.requests = 3;
  o.prompt_tokens = 4;
  o.max_tokens = 1;
  o.timeout_s = 0.5;
  o.progress_every_s = 0;
  auto t0 = SteadyClock::now();
  LoadResult r = RunLoad(o);
  EXPECT_EQ(r.summary.failed, 3);
  EXPECT_LT(SecondsSince(t0), 2.5);
  EXPECT_NE(r.summary.failure_reasons.begin()->first.find("timeout"), std::string::npos)
      << r.summary.failure_reasons.begin()->first;

  CancelGroup cancel;
  o.timeout_s = 30;
  t0 = SteadyClock::now();
  std::thread canceller([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    cancel.CancelAll();
  });
  r = RunLoad(o, &cancel);
  canceller.join();
  EXPECT_EQ(r.summary.failed, 3);
  EXPECT_LT(SecondsSince(t0), 2.5);
}

TEST(Probe, StuckProbeDoesNotDelayTheNext) {
  FakeServer s;
  s.delay_s = [](const json&, int n) { return n == 0 ? 1.0 : 0.0; };
  ProbeOptions o;
  o.url = s.url();
  o.every_s = 0.2;
  o.duration_s = 0.5;
  o.prompt_tokens = 8;
  o.timeout_s = 5;
  Prober prober(o);
  prober.Start();
  prober.Wait();
  const auto recs = prober.Records();
  ASSERT_EQ(recs.size(), 3u);  // t = 0, 0.2, 0.4
  for (std::size_t i = 0; i < recs.size(); ++i) {
    EXPECT_TRUE(recs[i].finished);
    EXPECT_TRUE(recs[i].outcome.ok) << recs[i].outcome.error;
    EXPECT_NEAR(recs[i].sent_s, 0.2 * static_cast<double>(i), 0.1);
  }
  EXPECT_GT(recs[0].outcome.latency_s, 0.9);
  EXPECT_LT(recs[1].outcome.latency_s, 0.5);
  const json b = s.bodies()[0];
  EXPECT_EQ(b["max_tokens"], 1);
  EXPECT_EQ(b["stream"], false);
  EXPECT_FALSE(b.contains("kv_transfer_params"));
  EXPECT_EQ(b["prompt"].size(), 8u);
}

TEST(Probe, StopCancelsOutstandingProbes) {
  FakeServer s;
  s.delay_s = [](const json&, int) { return 5.0; };
  ProbeOptions o;
  o.url = s.url();
  o.every_s = 10;
  o.duration_s = 100;
  o.timeout_s = 60;
  Prober prober(o);
  prober.Start();
  ASSERT_TRUE(WaitFor([&] { return s.bodies().size() == 1; }, 5));
  const auto t0 = SteadyClock::now();
  prober.Stop(0.1);
  EXPECT_LT(SecondsSince(t0), 2.0);
  const auto recs = prober.Records();
  ASSERT_EQ(recs.size(), 1u);
  EXPECT_FALSE(recs[0].outcome.ok);
}

TEST(ChildProcess, StopKillsTheWholeGroup) {
  std::string err;
  auto child =
      ChildProcess::Spawn({"/bin/sh", "-c", "sleep 100 & sleep 100 & wait"}, "/dev/null", {}, &err);
  ASSERT_TRUE(child) << err;
  const pid_t pgid = child->pid();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_TRUE(child->Running());
  EXPECT_EQ(::kill(-pgid, 0), 0);
  child->Stop(1.0);
  EXPECT_FALSE(child->Running());
  // The grandchildren (sleep) were in the group and are gone too (possibly zombies of init
  // for a moment, so poll).
  EXPECT_TRUE(WaitFor([&] { return ::kill(-pgid, 0) != 0; }, 3));
}

TEST(ChildProcess, KillIsImmediate) {
  auto child = ChildProcess::Spawn({"/bin/sleep", "100"}, "/dev/null", {}, nullptr);
  ASSERT_TRUE(child);
  const auto t0 = SteadyClock::now();
  child->Kill();
  EXPECT_FALSE(child->Running());
  EXPECT_LT(SecondsSince(t0), 1.0);
  EXPECT_FALSE(ChildProcess::Spawn({}, "/dev/null", {}, nullptr));
}

}  // namespace
}  // namespace kvferry::harness
