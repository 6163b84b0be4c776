// BootstrapRegistry: the registration rules, without sockets.
#include "control/bootstrap_registry.h"

#include <gtest/gtest.h>

#include "bootstrap_test_util.h"

namespace kvferry::control {
namespace {

using testing::MakeWorker;
using Outcome = BootstrapRegistry::Outcome;

TEST(BootstrapRegistry, RegistersWorkersAndReportsCompleteness) {
  BootstrapRegistry reg;
  ASSERT_EQ(reg.Register(MakeWorker("p0", 1)), Outcome::kAdded);
  auto info = reg.Query("p0");
  ASSERT_TRUE(info);
  EXPECT_FALSE(info->complete);
  EXPECT_EQ(info->tp_size, 2u);
  EXPECT_EQ(info->incarnation, "inc-a");
  ASSERT_EQ(reg.Register(MakeWorker("p0", 0)), Outcome::kAdded);
  info = reg.Query("p0");
  ASSERT_TRUE(info);
  EXPECT_TRUE(info->complete);
  ASSERT_EQ(info->workers.size(), 2u);
  EXPECT_EQ(info->workers[0].tp_rank, 0u);  // sorted
  EXPECT_EQ(info->workers[1].side_channel, "tcp://127.0.0.1:5551");
  ASSERT_NE(info->Find(1, 0), nullptr);
  EXPECT_EQ(info->Find(2, 0), nullptr);
  EXPECT_TRUE(ValidateEngineInfo(*info).ok());
  EXPECT_EQ(reg.worker_count(), 2u);
}

TEST(BootstrapRegistry, IdenticalReRegistrationIsUnchanged) {
  BootstrapRegistry reg;
  ASSERT_EQ(reg.Register(MakeWorker("p0", 0)), Outcome::kAdded);
  EXPECT_EQ(reg.Register(MakeWorker("p0", 0)), Outcome::kUnchanged);
  EXPECT_EQ(reg.worker_count(), 1u);
}

TEST(BootstrapRegistry, ConflictsInTheSameIncarnationAreRejectedWithAReason) {
  BootstrapRegistry reg;
  ASSERT_TRUE(reg.Register(MakeWorker("p0", 0)));
  const auto before = reg.Query("p0");

  auto moved = MakeWorker("p0", 0);
  moved.side_channel = "tcp://127.0.0.1:9999";
  auto r = reg.Register(moved);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kAlreadyExists);
  EXPECT_NE(r.error().message().find("tcp://127.0.0.1:5550"), std::string::npos);
  EXPECT_NE(r.error().message().find("tcp://127.0.0.1:9999"), std::string::npos);

  auto data_plane = MakeWorker("p0", 0);
  data_plane.data_plane = "elsewhere";
  EXPECT_EQ(reg.Register(data_plane).error().code(), ErrorCode::kAlreadyExists);

  auto tp = MakeWorker("p0", 1, /*tp_size=*/4);
  r = reg.Register(tp);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message().find("tp_size 4 (registered 2)"), std::string::npos);

  auto lease = MakeWorker("p0", 1);
  lease.kv_lease_duration = 30;
  r = reg.Register(lease);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message().find("kv_lease_duration 30s (registered off)"), std::string::npos);

  auto version = MakeWorker("p0", 1);
  version.protocol_version = 2;
  EXPECT_EQ(reg.Register(version).error().code(), ErrorCode::kAlreadyExists);

  auto dp = MakeWorker("p0", 1, 2, "inc-a", /*dp_rank=*/3);
  EXPECT_EQ(reg.Register(dp).error().code(), ErrorCode::kAlreadyExists);

  EXPECT_EQ(reg.Query("p0"), before);
}

TEST(BootstrapRegistry, AnotherEngineOnTheSameDpRankIsRejected) {
  BootstrapRegistry reg;
  ASSERT_TRUE(reg.Register(MakeWorker("p0", 0)));
  auto r = reg.Register(MakeWorker("p1", 0, 2, "inc-x", /*dp_rank=*/0));
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kAlreadyExists);
  EXPECT_NE(r.error().message().find("dp_rank 0 belongs to engine p0"), std::string::npos);
  EXPECT_EQ(reg.Query("p1").error().code(), ErrorCode::kNotFound);
  // Another dp_rank is another engine's to take.
  EXPECT_EQ(reg.Register(MakeWorker("p1", 0, 2, "inc-x", /*dp_rank=*/1)), Outcome::kAdded);
  EXPECT_EQ(reg.engine_count(), 2u);
}

TEST(BootstrapRegistry, NewIncarnationReplacesTheOldWorkers) {
  BootstrapRegistry reg;
  ASSERT_TRUE(reg.Register(MakeWorker("p0", 0)));
  ASSERT_TRUE(reg.Register(MakeWorker("p0", 1)));

  // P restarted with TP 4 on new ports.
  auto fresh = MakeWorker("p0", 2, /*tp_size=*/4, "inc-b");
  fresh.side_channel = "tcp://127.0.0.1:7000";
  fresh.kv_lease_duration = 30;
  ASSERT_EQ(reg.Register(fresh), Outcome::kNewIncarnation);
  auto info = reg.Query("p0");
  ASSERT_TRUE(info);
  EXPECT_EQ(info->incarnation, "inc-b");
  EXPECT_EQ(info->tp_size, 4u);
  EXPECT_EQ(info->kv_lease_duration, 30);
  EXPECT_FALSE(info->complete);
  ASSERT_EQ(info->workers.size(), 1u);
  EXPECT_EQ(info->workers[0].side_channel, "tcp://127.0.0.1:7000");
  EXPECT_EQ(reg.worker_count(), 1u);

  // A late retry from the old process must not bring it back.
  auto r = reg.Register(MakeWorker("p0", 0));
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kAlreadyExists);
  EXPECT_NE(r.error().message().find("replaced"), std::string::npos);
  EXPECT_EQ(reg.Query("p0")->incarnation, "inc-b");
}

TEST(BootstrapRegistry, NewIncarnationMayMoveToAFreeDpRank) {
  BootstrapRegistry reg;
  ASSERT_TRUE(reg.Register(MakeWorker("p0", 0, 1, "inc-a", 0)));
  ASSERT_TRUE(reg.Register(MakeWorker("p1", 0, 1, "inc-x", 1)));
  EXPECT_EQ(reg.Register(MakeWorker("p0", 0, 1, "inc-b", 1)).error().code(),
            ErrorCode::kAlreadyExists);  // dp 1 is p1's
  ASSERT_EQ(reg.Register(MakeWorker("p0", 0, 1, "inc-b", 2)), Outcome::kNewIncarnation);
  // dp 0 is free again.
  EXPECT_EQ(reg.Register(MakeWorker("p2", 0, 1, "inc-y", 0)), Outcome::kAdded);
}

TEST(BootstrapRegistry, AnotherIncarnationOfTheEmbeddingEngineIsRefusedWhileItRuns) {
  BootstrapRegistry reg(16384, EngineIncarnation{"p0", "inc-a"});
  ASSERT_EQ(reg.Register(MakeWorker("p0", 0)), Outcome::kAdded);
  // Before and after its own registration: nothing else may speak for the embedding engine.
  for (const char* incarnation : {"inc-b", "inc-z"}) {
    auto r = reg.Register(MakeWorker("p0", 1, 2, incarnation));
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error().code(), ErrorCode::kAlreadyExists);
    EXPECT_NE(r.error().message().find(
                  "engine p0 is served by this process, incarnation inc-a; a new incarnation "
                  "cannot register while it runs"),
              std::string::npos)
        << r.error().message();
  }
  BootstrapRegistry fresh(16384, EngineIncarnation{"p0", "inc-a"});
  EXPECT_EQ(fresh.Register(MakeWorker("p0", 0, 2, "inc-b")).error().code(),
            ErrorCode::kAlreadyExists);
  EXPECT_EQ(fresh.engine_count(), 0u);
  // The embedding engine's own ranks and other engines register as usual.
  auto info = reg.Query("p0");
  ASSERT_TRUE(info);
  EXPECT_EQ(info->incarnation, "inc-a");
  EXPECT_EQ(info->workers.size(), 1u);
  EXPECT_EQ(reg.Register(MakeWorker("p0", 1)), Outcome::kAdded);
  EXPECT_EQ(reg.Register(MakeWorker("p1", 0, 1, "inc-x", 1)), Outcome::kAdded);
  EXPECT_EQ(reg.Register(MakeWorker("p1", 0, 1, "inc-y", 1)), Outcome::kNewIncarnation);
}

TEST(BootstrapRegistry, InvalidRegistrationChangesNothing) {
  BootstrapRegistry reg;
  auto bad = MakeWorker("p0", 2);  // tp_rank 2 of tp_size 2
  auto r = reg.Register(bad);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(reg.engine_count(), 0u);
  // The dp_rank was not claimed either.
  EXPECT_TRUE(reg.Register(MakeWorker("p1", 0)));
}

TEST(BootstrapRegistry, CapacityIsBounded) {
  BootstrapRegistry reg(/*max_workers=*/2);
  ASSERT_TRUE(reg.Register(MakeWorker("p0", 0)));
  ASSERT_TRUE(reg.Register(MakeWorker("p0", 1)));
  auto r = reg.Register(MakeWorker("p1", 0, 2, "inc-x", 1));
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kResourceExhausted);
  // A restart frees the old incarnation's workers first.
  EXPECT_EQ(reg.Register(MakeWorker("p0", 0, 2, "inc-b")), Outcome::kNewIncarnation);
  EXPECT_TRUE(reg.Register(MakeWorker("p1", 0, 2, "inc-x", 1)));
}

TEST(BootstrapRegistry, QueryAllIsSortedByEngine) {
  BootstrapRegistry reg;
  ASSERT_TRUE(reg.Register(MakeWorker("pb", 0, 1, "i", 1)));
  ASSERT_TRUE(reg.Register(MakeWorker("pa", 0, 1, "i", 0)));
  auto all = reg.QueryAll();
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].engine_id, "pa");
  EXPECT_TRUE(all[0].complete);
  EXPECT_EQ(all[1].engine_id, "pb");
}

}  // namespace
}  // namespace kvferry::control
