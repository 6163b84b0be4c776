// The front doors under attack (issue 11): real `kvferry serve` P and D processes and a
// `kvferry proxy` process on 127.0.0.1, and every HTTP server among them — P's completions
// endpoint, P's bootstrap service, D's completions endpoint and the proxy — fed what an attacker
// on the network would send: malformed, oversized, deep, mistyped, negative-length, truncated and
// slow requests, and 10,000 idle or half-sent connections. After each attack every server still
// answers, a real request still completes through the proxy, and P's and D's block pools are
// back to idle. Bounded: each test starts its own processes and kills them at the end.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <cstdio>
#include <future>

#include "serve_process.h"
#include "support/raw_socket.h"
#include "support/spawn.h"

namespace {

using namespace kvferry::serve_test;
using namespace std::chrono_literals;

using kvferry::testing::FreePort;
using kvferry::testing::RawSocket;
using kvferry::testing::StatusOf;

std::string BodyOf(const std::string& raw) {
  const auto at = raw.find("\r\n\r\n");
  return at == std::string::npos ? std::string() : raw.substr(at + 4);
}

// One raw request; the status line's code (0: closed without an answer) and the raw answer.
std::pair<int, std::string> RawExchange(int port, std::string_view request,
                                        std::chrono::milliseconds timeout = 3000ms) {
  RawSocket s(port);
  if (!s.ok() || !s.Send(request)) return {0, ""};
  std::string raw = s.ReadAll(timeout);
  return {StatusOf(raw), raw};
}

std::string PostRequest(const std::string& path, const std::string& body) {
  return "POST " + path + " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" +
         "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

std::uint64_t RssKiB(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6));
  }
  return 0;
}

std::chrono::microseconds TimedHealth(int port, const std::string& path) {
  const auto start = Clock::now();
  httplib::Client cli("127.0.0.1", port);
  cli.set_connection_timeout(5);
  cli.set_read_timeout(5);
  auto res = cli.Get(path.c_str());
  if (!res || res->status != 200) return std::chrono::microseconds(-1);
  return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start);
}

// `kvferry proxy` in front of `p` and `d` in kvferry's own form: with P's engine id given, it is
// ready as soon as it listens.
std::unique_ptr<ProxyProcess> StartProxy(const fs::path& dir, const ServeProcess& p,
                                         const ServeProcess& d) {
  return std::make_unique<ProxyProcess>(
      dir, "proxy", FreePort(),
      std::vector<std::string>{"--prefill", "http://127.0.0.1:" + std::to_string(p.port()),
                               "--prefill-bootstrap", p.bootstrap_addr(), "--prefill-engine-id",
                               p.engine_id(), "--decode",
                               "http://127.0.0.1:" + std::to_string(d.port()), "--threads", "32"});
}

struct Target {
  std::string name;
  int port;
  pid_t pid;
  std::string post_path;  // where JSON bodies go
};

class FrontDoorAttack : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("kvferry_attack_test_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    p_ = std::make_unique<ServeProcess>(
        dir_, "prefill",
        std::vector<std::string>{
            "--role", "prefill", "--kv-transfer-config",
            R"({"kv_role":"kv_producer","kv_connector_extra_config":{"bootstrap_port":0,"kv_lease_duration":5}})",
            "--num-blocks", "256", "--decode-us-per-step", "500"});
    d_ = std::make_unique<ServeProcess>(
        dir_, "decode",
        std::vector<std::string>{
            "--role", "decode", "--kv-transfer-config",
            R"({"kv_role":"kv_consumer","kv_connector_extra_config":{"kv_lease_duration":5}})",
            "--num-blocks", "256", "--decode-us-per-step", "500"});
    ASSERT_TRUE(p_->WaitReady()) << p_->Log();
    ASSERT_TRUE(d_->WaitReady()) << d_->Log();
    proxy_ = StartProxy(dir_, *p_, *d_);
    ASSERT_TRUE(proxy_->WaitHealth(200, 10s)) << proxy_->Log();
    const std::string boot = p_->bootstrap_addr();
    const int boot_port = std::stoi(boot.substr(boot.rfind(':') + 1));
    targets_ = {{"P", p_->port(), p_->pid(), "/v1/completions"},
                {"P bootstrap", boot_port, p_->pid(), "/register"},
                {"D", d_->port(), d_->pid(), "/v1/completions"},
                {"proxy", proxy_->port(), proxy_->pid(), "/v1/completions"}};
  }

  void TearDown() override {
    if (HasFailure()) {
      std::fprintf(stderr, "---- P log ----\n%s\n---- D log ----\n%s\n", p_->Log().c_str(),
                   d_->Log().c_str());
    }
    proxy_.reset();
    d_.reset();
    p_.reset();
    fs::remove_all(dir_);
  }

  // Every server answers, a real request completes through the proxy, and both pools are idle.
  void ExpectStillServingAndNothingLeaked() {
    for (const Target& t : targets_) {
      EXPECT_GT(TimedHealth(t.port, "/health").count(), 0) << t.name << " stopped answering";
    }
    HttpResult r = Post(proxy_->port(), {{"model", "m"},
                                         {"prompt", Prompt(40)},
                                         {"max_tokens", 4},
                                         {"ignore_eos", true}});
    EXPECT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(WaitMetric(p_->port(), "kvferry_kv_blocks_used", 0), 0);
    EXPECT_EQ(WaitMetric(p_->port(), "kvferry_hold_entries", 0), 0);
    EXPECT_EQ(WaitMetric(d_->port(), "kvferry_kv_blocks_used", 0), 0);
    EXPECT_EQ(WaitMetric(d_->port(), "kvferry_corrupt_blocks_total", 0), 0);
  }

  fs::path dir_;
  std::unique_ptr<ServeProcess> p_;
  std::unique_ptr<ServeProcess> d_;
  std::unique_ptr<ProxyProcess> proxy_;
  std::vector<Target> targets_;
};

TEST_F(FrontDoorAttack, MalformedRequestLinesAndHeadersAreRefusedAndChangeNothing) {
  const std::vector<std::string> garbage = {
      std::string("\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 11) + "\r\n\r\n",  // TLS hello
      "GET\r\n\r\n",
      "GET /health HTTP/9.9\r\nHost: x\r\n\r\n",
      "GET /health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 9\r\n\r\n",
  };
  for (const Target& t : targets_) {
    for (const std::string& request : garbage) {
      auto [status, raw] = RawExchange(t.port, request);
      // A 4xx/5xx with a reason, or the connection closed: never a 2xx, never a hang (within
      // RawExchange's 3 s: each case is answered or closed at once).
      EXPECT_TRUE(status == 0 || (status >= 400 && status < 600))
          << t.name << ": " << status << " for " << testing::PrintToString(request);
    }
  }
  ExpectStillServingAndNothingLeaked();
}

TEST_F(FrontDoorAttack, OversizedHeadersAndBodiesAreRefusedWithoutGrowingMemory) {
  for (const Target& t : targets_) {
    auto [header_status, header_raw] =
        RawExchange(t.port, "GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " +
                                std::string(64 << 10, 'a') + "\r\n\r\n");
    EXPECT_TRUE(header_status == 431 || header_status == 0) << t.name << ": " << header_raw;

    // 50 MB declared and sent: refused at once, never held (it used to cost the proxy +78 MB).
    const std::uint64_t rss_before = RssKiB(t.pid);
    RawSocket s(t.port);
    ASSERT_TRUE(s.Send("POST " + t.post_path +
                       " HTTP/1.1\r\nHost: x\r\nContent-Length: 50000000\r\n\r\n"));
    const std::string chunk(1 << 20, 'x');
    for (int i = 0; i < 50 && s.Send(chunk); ++i) {
    }
    const std::string raw = s.ReadAll(3000ms);
    EXPECT_EQ(StatusOf(raw), 413) << t.name << ": " << raw;
    const std::uint64_t rss_after = RssKiB(t.pid);
    EXPECT_LT(rss_after, rss_before + 16 * 1024)
        << t.name << " grew from " << rss_before << " KiB to " << rss_after << " KiB";
  }
  ExpectStillServingAndNothingLeaked();
}

TEST_F(FrontDoorAttack, NegativeMalformedAndChunkedLengthsGetA4xx) {
  for (const Target& t : targets_) {
    const std::string start = "POST " + t.post_path + " HTTP/1.1\r\nHost: x\r\n";
    EXPECT_EQ(RawExchange(t.port, start + "Content-Length: -1\r\n\r\n").first, 400) << t.name;
    EXPECT_EQ(RawExchange(t.port, start + "Content-Length: abc\r\n\r\n").first, 400) << t.name;
    // A length no server could take: the library calls it too large.
    EXPECT_EQ(RawExchange(t.port, start + "Content-Length: 99999999999999999999999\r\n\r\n").first,
              413)
        << t.name;
    EXPECT_EQ(RawExchange(t.port, start + "Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
                  .first,
              411)
        << t.name;
    EXPECT_EQ(RawExchange(t.port, start + "\r\n").first, 411) << t.name;
  }
  // Refusals are counted where operators look: P's /metrics lists its bootstrap service too.
  const std::string p_metrics = Get(p_->port(), "/metrics");
  EXPECT_GE(Metric(p_metrics, R"(kvferry_http_refusals_total{server="serve",reason="limits"})"), 2);
  EXPECT_GE(Metric(p_metrics, R"(kvferry_http_refusals_total{server="bootstrap",reason="limits"})"),
            2);
  EXPECT_GE(Metric(Get(proxy_->port(), "/metrics"),
                   R"(kvferry_http_refusals_total{server="proxy",reason="limits"})"),
            2);
  ExpectStillServingAndNothingLeaked();
}

TEST_F(FrontDoorAttack, DeepAndMistypedJsonGetsA400NamingTheProblem) {
  // 60 KB: under every server's body limit (the bootstrap's is 64 KiB), so the parser meets it.
  const std::string deep = "{\"prompt\":" + std::string(30000, '[') + std::string(30000, ']') + "}";
  for (const Target& t : targets_) {
    auto [status, raw] = RawExchange(t.port, PostRequest(t.post_path, deep));
    EXPECT_EQ(status, 400) << t.name << ": " << raw.substr(0, 300);
    EXPECT_NE(BodyOf(raw).find("deeper than"), std::string::npos) << t.name << ": " << BodyOf(raw);
  }
  // Too many values (1.5 M token ids in 3 MB, under the 8 MiB body cap): refused on the raw
  // text, before a parser holds ~24 MB for them.
  std::string wide = "{\"prompt\":[";
  for (int i = 0; i < 1500000; ++i) wide += "1,";
  wide += "1],\"max_tokens\":1}";
  for (const Target& t : targets_) {
    if (t.post_path != "/v1/completions") continue;
    auto [status, raw] = RawExchange(t.port, PostRequest(t.post_path, wide));
    EXPECT_EQ(status, 400) << t.name << ": " << raw.substr(0, 300);
    EXPECT_NE(BodyOf(raw).find("more than 1048576"), std::string::npos) << t.name << ": "
                                                                           << BodyOf(raw);
  }
  // A wrong type in a field gets a 400 that names the field.
  const std::vector<std::pair<std::string, std::string>> completions = {
      {R"({"prompt":[1,2],"max_tokens":"8"})", "max_tokens"},
      {R"({"prompt":[1,2],"max_tokens":2,"stream":"yes"})", "stream"},
      {R"({"prompt":{"a":1},"max_tokens":2})", "prompt"},
  };
  for (const Target& t : targets_) {
    if (t.post_path != "/v1/completions") continue;
    for (const auto& [body, field] : completions) {
      auto [status, raw] = RawExchange(t.port, PostRequest(t.post_path, body));
      EXPECT_EQ(status, 400) << t.name << ": " << body << " -> " << raw;
      EXPECT_NE(BodyOf(raw).find(field), std::string::npos) << t.name << ": " << BodyOf(raw);
    }
  }
  // Through the proxy, what only D would refuse never reaches P: P's copy carries
  // max_tokens: 1, so P would prefill it and hold its KV for a D that refused it.
  const double p_before = Metric(Get(p_->port(), "/metrics"), "kvferry_requests_finished_total");
  for (const auto& [body, field] : completions) {
    EXPECT_EQ(RawExchange(proxy_->port(), PostRequest("/v1/completions", body)).first, 400);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // a P copy would be done by now
  const std::string p_after = Get(p_->port(), "/metrics");
  EXPECT_EQ(Metric(p_after, "kvferry_requests_finished_total"), p_before);
  EXPECT_EQ(Metric(p_after, "kvferry_hold_entries"), 0);
  auto [status, raw] =
      RawExchange(targets_[1].port, PostRequest("/register", R"({"engine_id":5})"));
  EXPECT_EQ(status, 400) << raw;
  EXPECT_NE(BodyOf(raw).find("engine_id"), std::string::npos) << BodyOf(raw);
  ExpectStillServingAndNothingLeaked();
}

TEST_F(FrontDoorAttack, TruncatedRequestsAreDroppedWithoutAnAnswerOrALeak) {
  for (const Target& t : targets_) {
    for (int i = 0; i < 20; ++i) {
      RawSocket s(t.port);
      ASSERT_TRUE(s.Send("POST " + t.post_path +
                         " HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\":"));
    }  // closed mid-body
    RawSocket s(t.port);
    ASSERT_TRUE(s.Send("GET /health HTTP/1.1\r\nHo"));
  }
  ExpectStillServingAndNothingLeaked();
}

// Slow-loris: 200 clients each dribbling a header byte every 20 ms hold their connections, yet
// others are served at once (they hold no thread).
TEST_F(FrontDoorAttack, SlowClientsDoNotDelayOthers) {
  for (const Target& t : targets_) {
    std::vector<RawSocket> slow;
    for (int i = 0; i < 200; ++i) slow.emplace_back(t.port);
    const std::string request = "GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + std::string(8, 'a');
    std::chrono::microseconds worst{0};
    for (std::size_t byte = 0; byte < request.size(); ++byte) {
      for (RawSocket& s : slow) (void)s.Send(request.substr(byte, 1));
      if (byte % 4 == 0) {
        const auto latency = TimedHealth(t.port, "/health");
        ASSERT_GT(latency.count(), 0) << t.name;
        worst = std::max(worst, latency);
      }
      std::this_thread::sleep_for(20ms);
    }
    std::printf("[ measured ] %s: /health worst %.2f ms beside 200 slow-loris clients\n",
                t.name.c_str(), static_cast<double>(worst.count()) / 1000.0);
    EXPECT_LT(worst, std::chrono::microseconds(2000000)) << t.name;
  }
  ExpectStillServingAndNothingLeaked();
}

// The attack of issue 11: 600 idle connections froze D and the proxy for 30-35 s. Each server
// now holds 10,000 (half idle, half stuck mid-header) and answers /health throughout. The bound
// asserted is loose (not a timing test); the measured worst case is printed.
TEST_F(FrontDoorAttack, TenThousandIdleConnectionsLeaveEveryServerAnswering) {
  rlimit limit{};
  getrlimit(RLIMIT_NOFILE, &limit);
  limit.rlim_cur = limit.rlim_max;
  setrlimit(RLIMIT_NOFILE, &limit);
  constexpr int kConnections = 10000;
  if (limit.rlim_cur < kConnections + 1024) {
    GTEST_SKIP() << "RLIMIT_NOFILE " << limit.rlim_cur << " cannot hold " << kConnections;
  }
  for (const Target& t : targets_) {
    std::vector<RawSocket> sockets;
    sockets.reserve(kConnections);
    std::chrono::microseconds worst{0};
    for (int i = 0; i < kConnections; ++i) {
      sockets.emplace_back(t.port);
      ASSERT_TRUE(sockets.back().ok()) << t.name << " connection " << i;
      if (i % 2 == 1) {
        ASSERT_TRUE(sockets.back().Send("POST " + t.post_path + " HTTP/1.1\r\nContent-Le"));
      }
      if (i % 2500 == 2499) {
        const auto latency = TimedHealth(t.port, "/health");
        ASSERT_GT(latency.count(), 0) << t.name << " with " << i + 1 << " connections";
        worst = std::max(worst, latency);
      }
    }
    for (int i = 0; i < 10; ++i) {
      const auto latency = TimedHealth(t.port, "/health");
      ASSERT_GT(latency.count(), 0) << t.name;
      worst = std::max(worst, latency);
    }
    std::printf("[ measured ] %s: /health worst %.2f ms with %d connections open\n",
                t.name.c_str(), static_cast<double>(worst.count()) / 1000.0, kConnections);
    EXPECT_LT(worst, std::chrono::microseconds(2000000)) << t.name;
  }
  ExpectStillServingAndNothingLeaked();
}


// The takeover of issue 11: one unauthenticated POST /register with a new incarnation for P's
// engine id replaced P's entry, and every D that looked P up afterwards hung. P's embedded
// bootstrap now knows its own engine's incarnation and refuses any other (409) while it runs.
TEST_F(FrontDoorAttack, AForgedRegistrationCannotTakeOverPsEngine) {
  const int boot_port = targets_[1].port;
  httplib::Client cli("127.0.0.1", boot_port);
  auto before = cli.Get(("/query?engine_id=" + p_->engine_id()).c_str());
  ASSERT_TRUE(before);
  ASSERT_EQ(before->status, 200) << before->body;
  const json info = json::parse(before->body);
  json forged = {{"engine_id", p_->engine_id()},
                 {"dp_rank", info["dp_rank"]},
                 {"tp_rank", 0},
                 {"pp_rank", 0},
                 {"tp_size", info["tp_size"]},
                 {"pp_size", info["pp_size"]},
                 {"side_channel", "tcp://127.0.0.1:9"},
                 {"data_plane", "attacker"},
                 {"kv_lease_duration", info["kv_lease_duration"]},
                 {"protocol_version", info["protocol_version"]},
                 {"incarnation", "f0f0f0f0f0f0f0f0"}};
  auto res = cli.Post("/register", forged.dump(), "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 409) << res->body;
  EXPECT_NE(res->body.find("served by this process"), std::string::npos) << res->body;
  auto after = cli.Get(("/query?engine_id=" + p_->engine_id()).c_str());
  ASSERT_TRUE(after);
  EXPECT_EQ(after->body, before->body);  // P's entry is untouched
  ExpectStillServingAndNothingLeaked();  // and a D that looks P up now still gets P
}

}  // namespace
