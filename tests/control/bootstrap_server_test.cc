// BootstrapServer over real sockets on 127.0.0.1 (OS-chosen ports), driven by BootstrapClient
// and, for bodies the client would never send, by a raw httplib client.
#include "control/bootstrap_server.h"

#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <vector>

#include "bootstrap_test_util.h"
#include "control/bootstrap_client.h"
#include "control/bootstrap_json.h"

namespace kvferry::control {
namespace {

using namespace std::chrono_literals;
using testing::ElapsedSince;
using testing::MakeWorker;

constexpr Timeout kTimeout{5000};

class BootstrapServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto port = server_.Start("127.0.0.1", 0);
    ASSERT_TRUE(port) << port.error().ToString();
    port_ = *port;
    ASSERT_GT(port_, 0);
    client_ = std::make_unique<BootstrapClient>(BootstrapAddress{"127.0.0.1", port_});
  }
  void TearDown() override { server_.Stop(); }

  std::string Address() const { return "127.0.0.1:" + std::to_string(port_); }

  httplib::Result RawPost(const std::string& body) {
    httplib::Client raw("127.0.0.1", port_);
    raw.set_connection_timeout(2s);
    raw.set_read_timeout(2s);
    return raw.Post("/register", body, "application/json");
  }
  httplib::Result RawGet(const std::string& path) {
    httplib::Client raw("127.0.0.1", port_);
    raw.set_connection_timeout(2s);
    raw.set_read_timeout(2s);
    return raw.Get(path);
  }

  std::string Snapshot() {
    auto all = client_->QueryAll(kTimeout);
    EXPECT_TRUE(all) << all.error().ToString();
    return all ? EncodeEngines(*all) : "";
  }

  BootstrapServer server_;
  int port_ = 0;
  std::unique_ptr<BootstrapClient> client_;
};

TEST_F(BootstrapServerTest, HealthRegisterAndQuery) {
  EXPECT_TRUE(client_->Health(kTimeout).ok());
  auto health = RawGet("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  EXPECT_EQ(health->body, "{\"status\":\"ok\"}");

  auto w0 = MakeWorker("p0", 0);
  auto w1 = MakeWorker("p0", 1);
  w0.kv_lease_duration = w1.kv_lease_duration = 30;
  ASSERT_TRUE(client_->Register(w0, kTimeout).ok());

  auto info = client_->Query("p0", kTimeout);
  ASSERT_TRUE(info) << info.error().ToString();
  EXPECT_FALSE(info->complete);
  ASSERT_TRUE(client_->Register(w1, kTimeout).ok());

  info = client_->Query("p0", kTimeout);
  ASSERT_TRUE(info) << info.error().ToString();
  EXPECT_EQ(info->engine_id, "p0");
  EXPECT_EQ(info->incarnation, "inc-a");
  EXPECT_EQ(info->tp_size, 2u);
  EXPECT_EQ(info->pp_size, 1u);
  EXPECT_EQ(info->kv_lease_duration, 30);
  EXPECT_EQ(info->protocol_version, 1u);
  EXPECT_TRUE(info->complete);
  ASSERT_EQ(info->workers.size(), 2u);
  EXPECT_EQ(info->workers[1].side_channel, w1.side_channel);
  EXPECT_EQ(info->workers[1].data_plane, w1.data_plane);

  auto all = client_->QueryAll(kTimeout);
  ASSERT_TRUE(all);
  ASSERT_EQ(all->size(), 1u);
  EXPECT_EQ((*all)[0], *info);
  ASSERT_EQ(server_.Engines().size(), 1u);
}

TEST_F(BootstrapServerTest, IdenticalReRegistrationIs200) {
  const auto w = MakeWorker("p0", 0);
  ASSERT_TRUE(client_->Register(w, kTimeout).ok());
  ASSERT_TRUE(client_->Register(w, kTimeout).ok());
  auto res = RawPost(EncodeRegistration(w));
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_NE(res->body.find("unchanged"), std::string::npos);
  EXPECT_EQ(client_->Query("p0", kTimeout)->workers.size(), 1u);
}

TEST_F(BootstrapServerTest, ConflictIs409WithAReason) {
  ASSERT_TRUE(client_->Register(MakeWorker("p0", 0), kTimeout).ok());
  const std::string before = Snapshot();

  auto moved = MakeWorker("p0", 0);
  moved.side_channel = "tcp://127.0.0.1:9999";
  auto res = RawPost(EncodeRegistration(moved));
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 409);
  EXPECT_NE(DecodeError(res->body).find("tcp://127.0.0.1:9999"), std::string::npos) << res->body;

  // The client reports it at once: a conflict is final, not retried.
  const auto start = std::chrono::steady_clock::now();
  Status s = client_->Register(moved, kTimeout);
  EXPECT_EQ(s.code(), ErrorCode::kAlreadyExists);
  EXPECT_NE(s.message().find("is registered at"), std::string::npos) << s.message();
  EXPECT_LT(ElapsedSince(start), 1000ms);

  auto other_engine = MakeWorker("p1", 0, 2, "inc-z", /*dp_rank=*/0);
  s = client_->Register(other_engine, kTimeout);
  EXPECT_EQ(s.code(), ErrorCode::kAlreadyExists);
  EXPECT_NE(s.message().find("dp_rank 0 belongs to engine p0"), std::string::npos);

  auto lease = MakeWorker("p0", 1);
  lease.kv_lease_duration = 10;
  EXPECT_EQ(client_->Register(lease, kTimeout).code(), ErrorCode::kAlreadyExists);

  EXPECT_EQ(Snapshot(), before);
}

TEST_F(BootstrapServerTest, RestartWithNewIncarnationReplacesWorkersAndDirectoryNotices) {
  ASSERT_TRUE(client_->Register(MakeWorker("p0", 0), kTimeout).ok());
  ASSERT_TRUE(client_->Register(MakeWorker("p0", 1), kTimeout).ok());

  EngineDirectory directory;
  auto first = directory.Lookup("p0", Address(), kTimeout);
  ASSERT_TRUE(first) << first.error().ToString();
  EXPECT_FALSE(first->incarnation_changed);
  EXPECT_EQ(first->info->incarnation, "inc-a");

  // P restarts: a new incarnation on new ports; rank 0 re-registers first.
  auto new0 = MakeWorker("p0", 0, 2, "inc-b");
  auto new1 = MakeWorker("p0", 1, 2, "inc-b");
  new0.side_channel = "tcp://127.0.0.1:6000";
  new1.side_channel = "tcp://127.0.0.1:6001";
  ASSERT_TRUE(client_->Register(new0, kTimeout).ok());
  auto info = client_->Query("p0", kTimeout);
  ASSERT_TRUE(info);
  EXPECT_EQ(info->incarnation, "inc-b");
  EXPECT_FALSE(info->complete);
  ASSERT_EQ(info->workers.size(), 1u);  // the old incarnation's workers are gone
  EXPECT_EQ(info->workers[0].side_channel, "tcp://127.0.0.1:6000");

  // A retry from the old process is refused.
  EXPECT_EQ(client_->Register(MakeWorker("p0", 1), kTimeout).code(), ErrorCode::kAlreadyExists);

  // D still uses its cached view until a side channel fails.
  auto cached = directory.Lookup("p0", Address(), kTimeout);
  ASSERT_TRUE(cached);
  EXPECT_EQ(cached->info->incarnation, "inc-a");
  directory.Invalidate("p0");
  EXPECT_EQ(directory.Cached("p0"), nullptr);

  // Incomplete: not returned, not cached.
  auto partial = directory.Lookup("p0", Address(), kTimeout);
  ASSERT_FALSE(partial);
  EXPECT_EQ(partial.error().code(), ErrorCode::kUnavailable);
  EXPECT_NE(partial.error().message().find("1 of 2 workers"), std::string::npos);

  ASSERT_TRUE(client_->Register(new1, kTimeout).ok());
  auto second = directory.Lookup("p0", Address(), kTimeout);
  ASSERT_TRUE(second) << second.error().ToString();
  EXPECT_TRUE(second->incarnation_changed);
  EXPECT_EQ(second->previous_incarnation, "inc-a");
  EXPECT_EQ(second->info->incarnation, "inc-b");
  EXPECT_EQ(second->info->Find(1, 0)->side_channel, "tcp://127.0.0.1:6001");

  auto third = directory.Lookup("p0", Address(), kTimeout);
  ASSERT_TRUE(third);
  EXPECT_FALSE(third->incarnation_changed);
  EXPECT_EQ(third->info, second->info);  // served from the cache
  EXPECT_EQ(directory.queries_sent(), 3u);
}

TEST_F(BootstrapServerTest, MalformedBodiesAre400OversizedOnes413AndNeitherChangesAnything) {
  ASSERT_TRUE(client_->Register(MakeWorker("p0", 0), kTimeout).ok());
  const std::string before = Snapshot();

  auto valid = EncodeRegistration(MakeWorker("p0", 1));
  auto wrong_type = valid;
  wrong_type.replace(wrong_type.find("\"tp_rank\":1"), 11, "\"tp_rank\":\"1\"");
  auto missing = valid;
  missing.replace(missing.find("\"incarnation\""), 13, "\"incarnation_\"");
  auto long_string = MakeWorker("p0", 1);
  long_string.data_plane = std::string(300, 'd');
  auto big_rank = valid;
  big_rank.replace(big_rank.find("\"dp_rank\":0"), 11, "\"dp_rank\":1024");
  std::string oversized = valid;
  oversized.insert(1, "\"pad\":\"" + std::string(kMaxBodyBytes, 'x') + "\",");

  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{", "not valid JSON"},
      {"[]", "JSON object"},
      {"", "not valid JSON"},
      {wrong_type, "tp_rank must be a non-negative integer"},
      {missing, "missing field incarnation"},
      {EncodeRegistration(long_string), "data_plane"},
      {big_rank, "not below 1024"},
  };
  for (const auto& [body, reason] : cases) {
    auto res = RawPost(body);
    ASSERT_TRUE(res) << reason << ": " << httplib::to_string(res.error());
    EXPECT_EQ(res->status, 400) << reason;
    EXPECT_NE(DecodeError(res->body).find(reason), std::string::npos)
        << reason << " / " << res->body;
  }
  // A body over the limit is refused before it is read: 413, naming the limit.
  auto too_big = RawPost(oversized);
  ASSERT_TRUE(too_big);
  EXPECT_EQ(too_big->status, 413);
  EXPECT_NE(DecodeError(too_big->body).find("65536"), std::string::npos) << too_big->body;
  // The client refuses an invalid registration before sending it.
  EXPECT_EQ(client_->Register(long_string, kTimeout).code(), ErrorCode::kInvalidArgument);

  EXPECT_EQ(Snapshot(), before);
  // Still serving after all that.
  EXPECT_TRUE(client_->Register(MakeWorker("p0", 1), kTimeout).ok());
}

TEST_F(BootstrapServerTest, QueryErrors) {
  auto unknown = client_->Query("nobody", kTimeout);
  ASSERT_FALSE(unknown);
  EXPECT_EQ(unknown.error().code(), ErrorCode::kNotFound);
  EXPECT_NE(unknown.error().message().find("unknown engine_id nobody"), std::string::npos);

  auto res = RawGet("/query?engine_id=nobody");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404);
  EXPECT_FALSE(DecodeError(res->body).empty());

  res = RawGet("/query?engine_id=");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  res = RawGet("/query?engine_id=a%01b");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  res = RawGet("/nowhere");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404);
  EXPECT_NE(DecodeError(res->body).find("/nowhere"), std::string::npos);

  // An empty registry lists no engines.
  auto all = client_->QueryAll(kTimeout);
  ASSERT_TRUE(all);
  EXPECT_TRUE(all->empty());

  // Ids needing URL encoding work.
  auto odd = MakeWorker("p 0&x=1", 0, 1);
  ASSERT_TRUE(client_->Register(odd, kTimeout).ok());
  auto info = client_->Query("p 0&x=1", kTimeout);
  ASSERT_TRUE(info) << info.error().ToString();
  EXPECT_TRUE(info->complete);
}

// GET /query without a parameter lists every engine by dp rank, in the shape of vLLM's
// Mooncake bootstrap ({"<dp>": {"engine_id", "worker_addr": {tp: {pp: addr}}}}) with
// kvferry's fields beside; a router reads it with QueryDpEngines.
TEST_F(BootstrapServerTest, ListingAnswersEveryEngineByDpRankInMooncakesShape) {
  ASSERT_TRUE(client_->Register(MakeWorker("p-a", 0, 2, "inc-a", 1), kTimeout).ok());
  ASSERT_TRUE(client_->Register(MakeWorker("p-a", 1, 2, "inc-a", 1), kTimeout).ok());
  ASSERT_TRUE(client_->Register(MakeWorker("p-b", 0, 2, "inc-b", 0), kTimeout).ok());
  auto res = RawGet("/query");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  const nlohmann::json j = nlohmann::json::parse(res->body, nullptr, false);
  ASSERT_TRUE(j.is_object()) << res->body;
  EXPECT_EQ(j.size(), 2u) << res->body;
  EXPECT_EQ(j["1"]["engine_id"], "p-a");
  EXPECT_EQ(j["1"]["worker_addr"]["1"]["0"], "tcp://127.0.0.1:5551");
  EXPECT_EQ(j["0"]["engine_id"], "p-b");
  EXPECT_EQ(j["0"]["complete"], false);

  auto routes = client_->QueryDpEngines(kTimeout);
  ASSERT_TRUE(routes) << routes.error().ToString();
  EXPECT_EQ(*routes, (std::vector<DpEngine>{{0, "p-b", false}, {1, "p-a", true}}));
  auto all = client_->QueryAll(kTimeout);
  ASSERT_TRUE(all) << all.error().ToString();
  ASSERT_EQ(all->size(), 2u);
  EXPECT_EQ((*all)[0].engine_id, "p-b");
  EXPECT_EQ((*all)[1].engine_id, "p-a");
}

TEST_F(BootstrapServerTest, SecondServerOnTheSamePortFailsToStart) {
  BootstrapServer other;
  auto r = other.Start("127.0.0.1", port_);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kUnavailable);
  EXPECT_NE(r.error().message().find(std::to_string(port_)), std::string::npos);
}

TEST(BootstrapServer, StartStopRestartAndDestructor) {
  BootstrapServer server;
  auto port = server.Start("127.0.0.1", 0);
  ASSERT_TRUE(port);
  EXPECT_TRUE(server.running());
  EXPECT_EQ(server.Start("127.0.0.1", 0).error().code(), ErrorCode::kAlreadyExists);
  BootstrapClient client({"127.0.0.1", *port});
  ASSERT_TRUE(client.Register(MakeWorker("p0", 0, 1), kTimeout).ok());

  auto start = std::chrono::steady_clock::now();
  server.Stop();
  EXPECT_LT(ElapsedSince(start), 3000ms);
  EXPECT_FALSE(server.running());
  EXPECT_EQ(server.port(), 0);
  server.Stop();  // idempotent
  EXPECT_NE(client.Health(500ms).code(), ErrorCode::kOk);

  // Start again: same registry, new port.
  port = server.Start("127.0.0.1", 0);
  ASSERT_TRUE(port);
  BootstrapClient again({"127.0.0.1", *port});
  EXPECT_TRUE(again.Query("p0", kTimeout));
  EXPECT_EQ(BootstrapServer().Start("127.0.0.1", 70000).error().code(),
            ErrorCode::kInvalidArgument);
  // ~BootstrapServer stops it.
}

TEST(BootstrapServer, LogsStateChanges) {
  std::mutex mu;
  std::vector<std::string> lines;
  BootstrapServerOptions options;
  options.log = [&](std::string_view line) {
    std::lock_guard<std::mutex> lock(mu);
    lines.emplace_back(line);
  };
  BootstrapServer server(options);
  auto port = server.Start("127.0.0.1", 0);
  ASSERT_TRUE(port);
  BootstrapClient client({"127.0.0.1", *port});
  ASSERT_TRUE(client.Register(MakeWorker("p0", 0, 1), kTimeout).ok());
  ASSERT_TRUE(client.Register(MakeWorker("p0", 0, 1, "inc-b"), kTimeout).ok());
  server.Stop();
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_NE(lines[0].find("(added)"), std::string::npos) << lines[0];
  EXPECT_NE(lines[1].find("inc-b (new_incarnation)"), std::string::npos) << lines[1];
}

// RunBootstrapServer in a child process: it serves until SIGTERM, then exits 0.
TEST(BootstrapServer, StandaloneRunsUntilSigterm) {
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::dup2(pipe_fds[1], STDERR_FILENO);
    ::close(pipe_fds[0]);
    ::close(pipe_fds[1]);
    ::_exit(RunBootstrapServer("127.0.0.1", 0));
  }
  ::close(pipe_fds[1]);
  FILE* child_err = ::fdopen(pipe_fds[0], "r");
  ASSERT_NE(child_err, nullptr);
  int port = 0;
  char line[512];
  // The first line names the bound port; the child writes it within milliseconds.
  if (std::fgets(line, sizeof(line), child_err) != nullptr) {
    std::sscanf(line, "kvferry bootstrap: listening on http://127.0.0.1:%d", &port);
  }
  EXPECT_GT(port, 0) << line;
  if (port > 0) {
    BootstrapClient client({"127.0.0.1", port});
    EXPECT_TRUE(client.Health(kTimeout).ok());
    EXPECT_TRUE(client.Register(MakeWorker("p0", 0, 1), kTimeout).ok());
  }
  ::kill(child, SIGTERM);
  int status = 0;
  pid_t done = 0;
  const auto start = std::chrono::steady_clock::now();
  while ((done = ::waitpid(child, &status, WNOHANG)) == 0 && ElapsedSince(start) < 10s) {
    std::this_thread::sleep_for(10ms);
  }
  if (done == 0) {
    ::kill(child, SIGKILL);
    ::waitpid(child, &status, 0);
    FAIL() << "RunBootstrapServer did not stop on SIGTERM";
  }
  std::fclose(child_err);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// ---- Cluster authentication (docs/security.md) ----

std::shared_ptr<const ClusterSecret> TestSecret(char fill) {
  auto secret = ClusterSecret::FromBytes(std::string(48, fill));
  EXPECT_TRUE(secret.has_value());
  return std::make_shared<const ClusterSecret>(std::move(*secret));
}

class AuthenticatedBootstrapTest : public ::testing::Test {
 protected:
  void StartServer(std::optional<EngineIncarnation> own_engine = std::nullopt) {
    BootstrapServerOptions options;
    options.cluster_secret = secret_;
    options.own_engine = std::move(own_engine);
    server_ = std::make_unique<BootstrapServer>(options);
    auto port = server_->Start("127.0.0.1", 0);
    ASSERT_TRUE(port) << port.error().ToString();
    port_ = *port;
  }
  void TearDown() override {
    if (server_) server_->Stop();
  }

  BootstrapClient Client(std::shared_ptr<const ClusterSecret> secret) const {
    return BootstrapClient({"127.0.0.1", port_}, std::move(secret));
  }
  httplib::Result RawPost(const std::string& body, const std::string& authorization) {
    httplib::Client raw("127.0.0.1", port_);
    raw.set_connection_timeout(2s);
    raw.set_read_timeout(2s);
    httplib::Headers headers;
    if (!authorization.empty()) headers.emplace("Authorization", authorization);
    return raw.Post("/register", headers, body, "application/json");
  }

  std::shared_ptr<const ClusterSecret> secret_ = TestSecret('a');
  std::unique_ptr<BootstrapServer> server_;
  int port_ = 0;
};

TEST_F(AuthenticatedBootstrapTest, UnsignedOrForgedRegistrationIs401AndChangesNothing) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  ASSERT_TRUE(Client(secret_).Register(MakeWorker("p0", 0), kTimeout).ok());
  const std::vector<EngineInfo> before = server_->Engines();
  ASSERT_EQ(before.size(), 1u);

  const std::string body = EncodeRegistration(MakeWorker("p0", 1, 2, "inc-forged"));
  const std::int64_t now = UnixNowSeconds();
  struct Case {
    std::string name;
    std::string authorization;
    std::string reason;  // part of the 401's {"error"}
  };
  const std::vector<Case> cases = {
      {"unsigned", "", "not signed"},
      {"another secret", SignRequest(*TestSecret('b'), "POST", "/register", body, now),
       "does not match"},
      {"signature of another body",
       SignRequest(*secret_, "POST", "/register", EncodeRegistration(MakeWorker("p0", 1)), now),
       "does not match"},
      {"replayed after the window", SignRequest(*secret_, "POST", "/register", body, now - 120),
       "a replay"},
      {"malformed", "kvferry-hmac t=1,sig=zz", "malformed"},
  };
  for (const Case& c : cases) {
    auto res = RawPost(body, c.authorization);
    ASSERT_TRUE(res) << c.name;
    EXPECT_EQ(res->status, 401) << c.name;
    EXPECT_NE(DecodeError(res->body).find(c.reason), std::string::npos)
        << c.name << ": " << res->body;
  }
  // BootstrapClient reports a 401 at once, as kUnauthenticated, without retrying.
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(Client(nullptr).Register(MakeWorker("p0", 1), kTimeout).code(),
            ErrorCode::kUnauthenticated);
  EXPECT_EQ(Client(TestSecret('b')).Register(MakeWorker("p0", 1), kTimeout).code(),
            ErrorCode::kUnauthenticated);
  EXPECT_LT(ElapsedSince(start), 1000ms);

  EXPECT_EQ(server_->Engines(), before);
  EXPECT_EQ(server_->auth_refusals(), cases.size() + 2);
}

// A signature covers the path alone: a correctly signed body sent to /register?anything is not
// what was signed, and is refused before the signature is even looked at.
TEST_F(AuthenticatedBootstrapTest, RegistrationWithAQueryStringIsRefusedAndChangesNothing) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  const std::string body = EncodeRegistration(MakeWorker("p0", 0, 1));
  httplib::Client raw("127.0.0.1", port_);
  httplib::Headers headers = {
      {"Authorization", SignRequest(*secret_, "POST", "/register", body, UnixNowSeconds())}};
  auto res = raw.Post("/register?engine_id=p9", headers, body, "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  EXPECT_NE(DecodeError(res->body).find("no query string"), std::string::npos) << res->body;
  EXPECT_TRUE(server_->Engines().empty());
}

TEST_F(AuthenticatedBootstrapTest, QueryAnswersAreSignedAndOnlyTheClusterBelievesThem) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  ASSERT_TRUE(Client(secret_).Register(MakeWorker("p0", 0, 1), kTimeout).ok());

  auto info = Client(secret_).Query("p0", kTimeout);
  ASSERT_TRUE(info) << info.error().ToString();
  EXPECT_EQ(info->engine_id, "p0");
  ASSERT_TRUE(Client(secret_).QueryAll(kTimeout));
  // Errors are signed too: an unknown engine is kNotFound, not an authentication failure.
  EXPECT_EQ(Client(secret_).Query("nobody", kTimeout).error().code(), ErrorCode::kNotFound);

  // The raw answer carries a signature over its status, path and body.
  httplib::Client raw("127.0.0.1", port_);
  auto res = raw.Get("/query?engine_id=p0");
  ASSERT_TRUE(res);
  const std::string signature = res->get_header_value(std::string(kSignatureHeader));
  EXPECT_TRUE(VerifyResponse(*secret_, signature, 200, "/query", res->body, UnixNowSeconds()).ok());
  EXPECT_FALSE(
      VerifyResponse(*secret_, signature, 200, "/query", res->body + " ", UnixNowSeconds()).ok());

  // Another secret cannot verify it; a process without a secret refuses a signed answer
  // rather than pair with a cluster whose side channels would refuse it.
  auto other = Client(TestSecret('b')).Query("p0", kTimeout);
  ASSERT_FALSE(other);
  EXPECT_EQ(other.error().code(), ErrorCode::kUnauthenticated);
  EXPECT_NE(other.error().message().find("does not match"), std::string::npos);
  auto open = Client(nullptr).Query("p0", kTimeout);
  ASSERT_FALSE(open);
  EXPECT_EQ(open.error().code(), ErrorCode::kUnauthenticated);
  EXPECT_NE(open.error().message().find("has no cluster secret"), std::string::npos);
}

// A router verifies the listing as D verifies an engine's answer: with the secret only a
// signed answer is believed; without one, a signed answer is still read (a router takes no
// part in the side channels that would shut it out).
TEST_F(AuthenticatedBootstrapTest, TheListingIsSignedAndARouterWithTheSecretBelievesNothingElse) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  ASSERT_TRUE(Client(secret_).Register(MakeWorker("p0", 0, 1), kTimeout).ok());
  auto member = Client(secret_).QueryDpEngines(kTimeout);
  ASSERT_TRUE(member) << member.error().ToString();
  EXPECT_EQ(*member, (std::vector<DpEngine>{{0, "p0", true}}));
  auto other = Client(TestSecret('b')).QueryDpEngines(kTimeout);
  ASSERT_FALSE(other);
  EXPECT_EQ(other.error().code(), ErrorCode::kUnauthenticated);
  EXPECT_NE(other.error().message().find("does not match"), std::string::npos)
      << other.error().message();
  auto open = Client(nullptr).QueryDpEngines(kTimeout);
  ASSERT_TRUE(open) << open.error().ToString();

  // An open service's unsigned listing is not believed by a router with the secret.
  BootstrapServer open_server;
  auto port = open_server.Start("127.0.0.1", 0);
  ASSERT_TRUE(port);
  BootstrapClient router({"127.0.0.1", *port}, secret_);
  auto unsigned_listing = router.QueryDpEngines(kTimeout);
  ASSERT_FALSE(unsigned_listing);
  EXPECT_EQ(unsigned_listing.error().code(), ErrorCode::kUnauthenticated);
  EXPECT_NE(unsigned_listing.error().message().find("not signed"), std::string::npos)
      << unsigned_listing.error().message();
}

TEST_F(AuthenticatedBootstrapTest, UnsignedAnswerOfAnOpenServiceIsRefusedByAMember) {
  BootstrapServer open_server;
  auto port = open_server.Start("127.0.0.1", 0);
  ASSERT_TRUE(port);
  BootstrapClient member({"127.0.0.1", *port}, secret_);
  // An open service ignores the signature, but its answers prove nothing.
  ASSERT_TRUE(member.Register(MakeWorker("p0", 0, 1), kTimeout).ok());
  auto info = member.Query("p0", kTimeout);
  ASSERT_FALSE(info);
  EXPECT_EQ(info.error().code(), ErrorCode::kUnauthenticated);
  EXPECT_NE(info.error().message().find("not signed"), std::string::npos);
  EngineDirectory directory(secret_);
  auto lookup = directory.Lookup("p0", "127.0.0.1:" + std::to_string(*port), kTimeout);
  ASSERT_FALSE(lookup);
  EXPECT_EQ(lookup.error().code(), ErrorCode::kUnauthenticated);
}

TEST_F(AuthenticatedBootstrapTest, ForgedIncarnationOfTheEmbeddingEngineIs409) {
  ASSERT_NO_FATAL_FAILURE(StartServer(EngineIncarnation{"p0", "inc-a"}));
  BootstrapClient member = Client(secret_);
  ASSERT_TRUE(member.Register(MakeWorker("p0", 0), kTimeout).ok());
  const std::vector<EngineInfo> before = server_->Engines();
  // Even correctly signed (a cluster member misconfigured, or one whose key leaked): while
  // this process serves p0 as inc-a, no other incarnation of p0 can take its place.
  Status s = member.Register(MakeWorker("p0", 0, 2, "inc-b"), kTimeout);
  EXPECT_EQ(s.code(), ErrorCode::kAlreadyExists);
  EXPECT_NE(s.message().find("engine p0 is served by this process, incarnation inc-a"),
            std::string::npos)
      << s.message();
  EXPECT_NE(s.message().find("(HTTP 409)"), std::string::npos) << s.message();
  EXPECT_EQ(server_->Engines(), before);
  EXPECT_EQ(member.Query("p0", kTimeout)->incarnation, "inc-a");
}

}  // namespace
}  // namespace kvferry::control
