// The etcd registry (control/etcd_registry.h) against a real etcd (Debian's etcd-server, one
// member on 127.0.0.1 with a data directory of its own, started and killed by each test).
#include "control/etcd_registry.h"

#include <gtest/gtest.h>
#include <httplib.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "bootstrap_test_util.h"
#include "control/bootstrap_json.h"
#include "support/etcd_process.h"

namespace kvferry::control {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::MakeWorker;
using kvferry::testing::EtcdProcess;
namespace fs = std::filesystem;

class EtcdRegistryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!EtcdProcess::Available()) {
      GTEST_SKIP() << EtcdProcess::kBinary << " is missing (scripts/install-deps.sh)";
    }
    dir_ = fs::temp_directory_path() / ("kvferry_etcd_test_" + std::to_string(getpid()));
    etcd_ = std::make_unique<EtcdProcess>(dir_);
    ASSERT_TRUE(etcd_->ok()) << "etcd did not come up";
    options_.endpoints = {etcd_->url()};
    options_.request_timeout = 500ms;
  }
  void TearDown() override {
    etcd_.reset();
    fs::remove_all(dir_);
  }

  struct Down {
    std::mutex mu;
    std::vector<std::string> engines;
    std::vector<std::string> reasons;
    Clock::time_point first;
  };
  EtcdWatcher::DownCallback Recorder(Down& down) {
    return [&down](const std::string& engine, const std::string&, const std::string& successor,
                   const Status& why) {
      if (!successor.empty()) return;  // a replacement, not a down (counted in stats)
      std::lock_guard<std::mutex> lock(down.mu);
      if (down.engines.empty()) down.first = Clock::now();
      down.engines.push_back(engine);
      down.reasons.push_back(why.message());
    };
  }
  static std::size_t Count(Down& down) {
    std::lock_guard<std::mutex> lock(down.mu);
    return down.engines.size();
  }

  // What etcd does to the leases of a P cut off for longer than their TTL.
  void RevokeEveryLease() {
    httplib::Client cli("127.0.0.1", etcd_->client_port());
    auto res = cli.Post("/v3/lease/leases", "{}", "application/json");
    ASSERT_TRUE(res);
    const auto j = nlohmann::json::parse(res->body);
    EtcdClient client(options_);
    for (const auto& lease : j.value("leases", nlohmann::json::array())) {
      ASSERT_TRUE(client.Revoke(std::stoll(lease["ID"].get<std::string>())).ok());
    }
  }

  fs::path dir_;
  std::unique_ptr<EtcdProcess> etcd_;
  EtcdOptions options_;
};

TEST(EtcdOptionsTest, BadEndpointsAndPrefixesAreRefusedWithTheReason) {
  EtcdOptions o;
  EXPECT_NE(Validate(o).message().find("no endpoint"), std::string::npos);
  o.endpoints = {"http://127.0.0.1"};
  EXPECT_NE(Validate(o).message().find("is not [http://]host:port"), std::string::npos);
  o.endpoints = {"127.0.0.1:99999"};
  EXPECT_NE(Validate(o).message().find("no valid port"), std::string::npos);
  o.endpoints = {"127.0.0.1:2379"};
  o.prefix = "kvferry";
  EXPECT_NE(Validate(o).message().find("must start with '/'"), std::string::npos);
  o.prefix = "/kvferry";
  EXPECT_TRUE(Validate(o).ok());
}

TEST_F(EtcdRegistryTest, APublishedEngineIsFoundCompleteOnceEveryRankIsThere) {
  auto registrar = EtcdRegistrar::Start(
      options_, {MakeWorker("p0", 0, 2, "inc-1"), MakeWorker("p0", 1, 2, "inc-1")}, 5s, nullptr);
  ASSERT_TRUE(registrar) << registrar.error().ToString();
  auto watcher = EtcdWatcher::Start(options_, 50ms, nullptr, nullptr);
  ASSERT_TRUE(watcher);
  auto info = (*watcher)->Lookup("p0");
  ASSERT_TRUE(info) << info.error().ToString();
  EXPECT_TRUE(info->complete);
  EXPECT_EQ(info->incarnation, "inc-1");
  EXPECT_EQ(info->workers.size(), 2u);
  EXPECT_EQ((*watcher)->Lookup("p9").error().code(), ErrorCode::kNotFound);

  // One rank only: known, but not usable yet.
  EtcdOptions other = options_;
  other.prefix = "/other";
  auto half = EtcdRegistrar::Start(other, {MakeWorker("p1", 0, 2, "inc-2")}, 5s, nullptr);
  ASSERT_TRUE(half);
  auto half_watcher = EtcdWatcher::Start(other, 50ms, nullptr, nullptr);
  ASSERT_TRUE(half_watcher);
  auto partial = (*half_watcher)->Lookup("p1");
  ASSERT_FALSE(partial);
  EXPECT_EQ(partial.error().code(), ErrorCode::kUnavailable);
  EXPECT_NE(partial.error().message().find("1 of 2 workers"), std::string::npos);
}

// Engines that each run their own bootstrap may all be dp_rank 0; in the shared registry they
// are still distinct engines (found by the xPyD test on test hosts).
TEST_F(EtcdRegistryTest, EnginesSharingADpRankAreAllFound) {
  std::vector<std::unique_ptr<EtcdRegistrar>> registrars;
  for (const char* id : {"p1", "p2", "p3"}) {
    auto r = EtcdRegistrar::Start(options_, {MakeWorker(id, 0, 1, std::string("inc-") + id)}, 5s,
                                  nullptr);
    ASSERT_TRUE(r) << r.error().ToString();
    registrars.push_back(std::move(*r));
  }
  Down down;
  auto watcher = EtcdWatcher::Start(options_, 50ms, Recorder(down), nullptr);
  ASSERT_TRUE(watcher);
  for (const char* id : {"p1", "p2", "p3"}) {
    auto info = (*watcher)->Lookup(id);
    ASSERT_TRUE(info) << id << ": " << info.error().ToString();
    EXPECT_EQ(info->incarnation, std::string("inc-") + id);
  }
  std::this_thread::sleep_for(300ms);  // several polls: nobody flips in and out
  EXPECT_EQ(Count(down), 0u);
}

// An engine that registered after the last poll is found by the lookup itself: D would
// otherwise believe "not registered" (and fail loads for lookup_failure_ttl) for a poll interval.
TEST_F(EtcdRegistryTest, AnEngineRegisteredSinceTheLastPollIsFoundAtOnce) {
  auto watcher = EtcdWatcher::Start(options_, 1h, nullptr, nullptr);  // no poll of its own
  ASSERT_TRUE(watcher);
  auto registrar = EtcdRegistrar::Start(options_, {MakeWorker("late", 0, 1, "inc-1")}, 5s, nullptr);
  ASSERT_TRUE(registrar);
  auto info = (*watcher)->Lookup("late");
  ASSERT_TRUE(info) << info.error().ToString();
  EXPECT_EQ(info->incarnation, "inc-1");
}

TEST_F(EtcdRegistryTest, AnEngineThatStopsRenewingIsReportedDownSoonAfterItsTtl) {
  // A P that died: its lease is granted and its keys put, then nobody renews.
  EtcdClient client(options_);
  auto lease = client.Grant(1s);
  ASSERT_TRUE(lease);
  const WorkerRegistration reg = MakeWorker("p0", 0, 1, "inc-1");
  ASSERT_TRUE(client.Put("/kvferry/engines/p0/0-0", EncodeRegistration(reg), *lease).ok());
  Down down;
  auto watcher = EtcdWatcher::Start(options_, 100ms, Recorder(down), nullptr);
  ASSERT_TRUE(watcher);
  ASSERT_TRUE((*watcher)->Lookup("p0"));
  const auto granted = Clock::now();
  const auto deadline = granted + 5s;
  while (Count(down) == 0 && Clock::now() < deadline) std::this_thread::sleep_for(10ms);
  ASSERT_EQ(Count(down), 1u);
  const double after = std::chrono::duration<double>(down.first - granted).count();
  std::printf("[ measured ] engine reported down %.2f s after its 1 s lease was granted\n", after);
  // etcd grants at least 2 s (its minimum TTL); + its 0.5 s expiry check + a poll, loosely.
  EXPECT_LT(after, 6.0);
  EXPECT_NE(down.reasons[0].find("left etcd"), std::string::npos);
  EXPECT_EQ((*watcher)->Lookup("p0").error().code(), ErrorCode::kNotFound);
}

TEST_F(EtcdRegistryTest, AKeptAliveEngineOutlivesItsTtlAndStopRevokesItAtOnce) {
  auto registrar = EtcdRegistrar::Start(options_, {MakeWorker("p0", 0, 1, "inc-1")}, 1s, nullptr);
  ASSERT_TRUE(registrar);
  Down down;
  auto watcher = EtcdWatcher::Start(options_, 50ms, Recorder(down), nullptr);
  ASSERT_TRUE(watcher);
  std::this_thread::sleep_for(5000ms);  // 2.5 of the 2 s etcd grants for a 1 s TTL
  EXPECT_EQ(Count(down), 0u);
  EXPECT_GE((*registrar)->stats().keepalives, 6u);
  const auto stop = Clock::now();
  (*registrar)->Stop();
  while (Count(down) == 0 && Clock::now() < stop + 3s) std::this_thread::sleep_for(5ms);
  ASSERT_EQ(Count(down), 1u);
  EXPECT_LT(down.first - stop, 1500ms);  // revoked, not left to expire (2 s + later)
}

// A P that crashes and restarts within its TTL replaces its keys instead of letting them expire:
// the watcher reports the old process gone, naming its successor, and never reports the engine
// down (it is there).
TEST_F(EtcdRegistryTest, AnEngineRestartedWithinItsTtlIsReportedAsReplacedNotDown) {
  auto first = EtcdRegistrar::Start(options_, {MakeWorker("p0", 0, 1, "inc-1")}, 30s, nullptr);
  ASSERT_TRUE(first);
  struct Replaced {
    std::mutex mu;
    std::vector<std::string> lines;
  } seen;
  auto watcher = EtcdWatcher::Start(
      options_, 50ms,
      [&seen](const std::string& engine, const std::string& incarnation,
              const std::string& successor, const Status&) {
        std::lock_guard<std::mutex> lock(seen.mu);
        seen.lines.push_back(engine + " " + incarnation + " -> " + successor);
      },
      nullptr);
  ASSERT_TRUE(watcher);
  ASSERT_TRUE((*watcher)->Lookup("p0"));
  // The crashed process's lease is still alive (30 s TTL); the new one publishes over it.
  auto second = EtcdRegistrar::Start(options_, {MakeWorker("p0", 0, 1, "inc-2")}, 30s, nullptr);
  ASSERT_TRUE(second);
  const auto deadline = Clock::now() + 5s;
  while ((*watcher)->stats().engines_replaced == 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(20ms);
  }
  std::this_thread::sleep_for(200ms);  // more polls: nothing else may be reported
  std::lock_guard<std::mutex> lock(seen.mu);
  EXPECT_EQ(seen.lines, std::vector<std::string>{"p0 inc-1 -> inc-2"});
  EXPECT_EQ((*watcher)->stats().engines_down, 0u);
  auto info = (*watcher)->Lookup("p0");
  ASSERT_TRUE(info);
  EXPECT_EQ(info->incarnation, "inc-2");
}

// The attacker's test for the registry: with a cluster secret, D believes only records P signed
// with it. A record written by anyone else who reaches etcd — unsigned, signed with another
// secret, or a member's signed record copied under another engine's key — is ignored and
// counted; the member's own engine is found.
TEST_F(EtcdRegistryTest, WithASecretOnlyRecordsSignedWithItAreBelievedAndForgeriesAreCounted) {
  auto secret = std::make_shared<const ClusterSecret>(
      ClusterSecret::FromBytes(std::string(32, 'k')).value());
  auto other = std::make_shared<const ClusterSecret>(
      ClusterSecret::FromBytes(std::string(32, 'x')).value());
  EtcdOptions member = options_;
  member.cluster_secret = secret;
  auto registrar = EtcdRegistrar::Start(member, {MakeWorker("good", 0, 1, "inc-1")}, 30s, nullptr);
  ASSERT_TRUE(registrar);
  EtcdClient client(options_);
  auto lease = client.Grant(30s);
  ASSERT_TRUE(lease);
  // Unsigned.
  ASSERT_TRUE(client.Put("/kvferry/engines/plain/0-0",
                         EncodeRegistration(MakeWorker("plain", 0, 1, "inc-9")), *lease)
                  .ok());
  // Signed with another secret.
  EtcdOptions outsider = options_;
  outsider.cluster_secret = other;
  auto foreign = EtcdRegistrar::Start(outsider, {MakeWorker("foreign", 0, 1, "inc-8")}, 30s, nullptr);
  ASSERT_TRUE(foreign);
  // The member's signed record, copied under another engine's key.
  auto kvs = client.Range("/kvferry/engines/good/");
  ASSERT_TRUE(kvs);
  ASSERT_EQ(kvs->size(), 1u);
  ASSERT_TRUE(client.Put("/kvferry/engines/copied/0-0", (*kvs)[0].value, *lease).ok());

  auto watcher = EtcdWatcher::Start(member, 50ms, nullptr, nullptr);
  ASSERT_TRUE(watcher);
  auto good = (*watcher)->Lookup("good");
  ASSERT_TRUE(good) << good.error().ToString();
  EXPECT_EQ(good->incarnation, "inc-1");
  EXPECT_FALSE((*watcher)->Lookup("plain"));
  EXPECT_FALSE((*watcher)->Lookup("foreign"));
  // The copy names engine "good" inside, under "copied"'s key: refused, so "good" is not
  // overwritten by it either.
  EXPECT_GE((*watcher)->stats().records_refused, 3u);

  // A D without the secret (an open cluster) reads signed records too.
  auto open = EtcdWatcher::Start(options_, 50ms, nullptr, nullptr);
  ASSERT_TRUE(open);
  EXPECT_TRUE((*open)->Lookup("good"));
  EXPECT_EQ((*open)->stats().records_refused, 0u);
}

// Found by review: a lookup of an engine the watcher does not know refreshes it at once, and
// that refresh took a known engine's new incarnation without reporting it, so the next poll
// saw no change and the restart was never reported. A refresh now leaves that to the poll.
TEST_F(EtcdRegistryTest, ALookupsRefreshDoesNotHideARestart) {
  auto first = EtcdRegistrar::Start(options_, {MakeWorker("p0", 0, 1, "inc-1")}, 30s, nullptr);
  ASSERT_TRUE(first);
  auto watcher = EtcdWatcher::Start(options_, 1s, nullptr, nullptr);
  ASSERT_TRUE(watcher);
  ASSERT_TRUE((*watcher)->Lookup("p0"));
  auto second = EtcdRegistrar::Start(options_, {MakeWorker("p0", 0, 1, "inc-2")}, 30s, nullptr);
  ASSERT_TRUE(second);
  EXPECT_FALSE((*watcher)->Lookup("never-registered"));  // refreshes before the next poll
  const auto deadline = Clock::now() + 4s;
  while ((*watcher)->stats().engines_replaced == 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_EQ((*watcher)->stats().engines_replaced, 1u);
}

// Whoever can write under the prefix decides how large a record is: one above 64 KiB is skipped
// before it is parsed, and the engines beside it are still found.
TEST_F(EtcdRegistryTest, AnOversizedRecordIsSkippedAndTheOthersAreFound) {
  auto registrar = EtcdRegistrar::Start(options_, {MakeWorker("good", 0, 1, "inc-1")}, 30s, nullptr);
  ASSERT_TRUE(registrar);
  EtcdClient client(options_);
  auto lease = client.Grant(30s);
  ASSERT_TRUE(lease);
  std::string huge = EncodeRegistration(MakeWorker("huge", 0, 1, "inc-2"));
  huge.insert(huge.size() - 1, ",\"pad\":\"" + std::string(100 * 1024, 'x') + "\"");
  ASSERT_TRUE(client.Put("/kvferry/engines/huge/0-0", huge, *lease).ok());
  auto watcher = EtcdWatcher::Start(options_, 50ms, nullptr, nullptr);
  ASSERT_TRUE(watcher);
  EXPECT_TRUE((*watcher)->Lookup("good"));
  EXPECT_FALSE((*watcher)->Lookup("huge"));
}

TEST_F(EtcdRegistryTest, ALostLeaseIsPublishedAgainUnderTheSameIncarnation) {
  auto registrar = EtcdRegistrar::Start(options_, {MakeWorker("p0", 0, 1, "inc-1")}, 2s, nullptr);
  ASSERT_TRUE(registrar);
  // What a partition longer than the TTL does: etcd drops the lease.
  EtcdClient client(options_);
  auto kvs = client.Range("/kvferry/engines/");
  ASSERT_TRUE(kvs);
  ASSERT_EQ(kvs->size(), 1u);
  RevokeEveryLease();
  const auto deadline = Clock::now() + 5s;
  while ((*registrar)->stats().republished == 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_EQ((*registrar)->stats().republished, 1u);
  auto watcher = EtcdWatcher::Start(options_, 50ms, nullptr, nullptr);
  ASSERT_TRUE(watcher);
  auto info = (*watcher)->Lookup("p0");
  ASSERT_TRUE(info) << info.error().ToString();
  EXPECT_EQ(info->incarnation, "inc-1");
}

TEST_F(EtcdRegistryTest, WhileEtcdIsAwayKnownEnginesStayAndUnknownOnesFailWithTheReason) {
  auto registrar = EtcdRegistrar::Start(options_, {MakeWorker("p0", 0, 1, "inc-1")}, 30s, nullptr);
  ASSERT_TRUE(registrar);
  Down down;
  auto watcher = EtcdWatcher::Start(options_, 50ms, Recorder(down), nullptr);
  ASSERT_TRUE(watcher);
  ASSERT_TRUE((*watcher)->Lookup("p0"));
  etcd_->Freeze();  // every call times out
  const auto deadline = Clock::now() + 5s;
  while ((*watcher)->stats().healthy && Clock::now() < deadline) std::this_thread::sleep_for(20ms);
  EXPECT_FALSE((*watcher)->stats().healthy);
  EXPECT_TRUE((*watcher)->Lookup("p0")) << "a known engine is kept while etcd is away";
  auto unknown = (*watcher)->Lookup("p9");
  ASSERT_FALSE(unknown);
  EXPECT_EQ(unknown.error().code(), ErrorCode::kUnavailable);
  EXPECT_NE(unknown.error().message().find("etcd is unreachable"), std::string::npos)
      << unknown.error().message();
  EXPECT_EQ(Count(down), 0u) << "an unreachable etcd declares nobody dead";
  etcd_->Thaw();
  const auto back = Clock::now() + 5s;
  while (!(*watcher)->stats().healthy && Clock::now() < back) std::this_thread::sleep_for(20ms);
  EXPECT_TRUE((*watcher)->stats().healthy);
  EXPECT_EQ(Count(down), 0u);
}

}  // namespace
}  // namespace kvferry::control
