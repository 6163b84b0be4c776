// RenewalScheduler: D's renewal rules (SPEC §2 rules 1–3).
#include "kvferry/core/renewal_scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>

namespace kvferry::core {
namespace {

using std::chrono::seconds;
const TimePoint t0 = TimePoint{} + seconds(100);

std::size_t CountIds(const std::vector<RenewalBatch>& batches) {
  std::size_t n = 0;
  for (const auto& b : batches) n += b.ids.size();
  return n;
}

TEST(RenewalSchedulerRules, OffWithoutLease) {
  RenewalScheduler s(Duration{0});
  s.Track("x", "p");
  EXPECT_EQ(s.tracked(), 0u);
  EXPECT_TRUE(s.Poll(t0).empty());
  EXPECT_EQ(s.NextDue(), kNever);
}

TEST(RenewalSchedulerRules, RenewsEveryLeaseOverSix) {
  RenewalScheduler s(seconds(30));
  s.Track("x", "p");
  EXPECT_EQ(CountIds(s.Poll(t0)), 1u);
  EXPECT_EQ(s.NextDue(), t0 + seconds(5));
  EXPECT_TRUE(s.Poll(t0 + seconds(4)).empty()) << "throttled to lease/6";
  EXPECT_EQ(CountIds(s.Poll(t0 + seconds(5))), 1u);
}

TEST(RenewalSchedulerRules, TracksFromNewRequestUntilSettledOrFinished) {
  RenewalScheduler s(seconds(30));
  s.Track("queued", "p");  // on_new_request: still waiting for D blocks
  s.Track("done", "p");
  auto b = s.Poll(t0);
  ASSERT_EQ(b.size(), 1u);
  EXPECT_EQ(b[0].ids.size(), 2u);
  s.Untrack("done");  // finished_recving
  b = s.Poll(t0 + seconds(5));
  ASSERT_EQ(b.size(), 1u);
  EXPECT_EQ(b[0].ids, std::vector<Fingerprint>{FingerprintOf("queued")});
  s.Untrack("queued");  // request_finished / abort
  EXPECT_TRUE(s.Poll(t0 + seconds(10)).empty());
  s.Untrack("never-tracked");  // harmless
}

TEST(RenewalSchedulerRules, GroupsByEngineInBatchesOfAtMost128) {
  RenewalScheduler s(seconds(30), 128);
  for (int i = 0; i < 300; ++i) s.Track("a" + std::to_string(i), "engine-a");
  for (int i = 0; i < 5; ++i) s.Track("b" + std::to_string(i), "engine-b");
  auto batches = s.Poll(t0);
  std::map<EngineId, std::size_t> per_engine;
  for (const auto& b : batches) {
    EXPECT_LE(b.ids.size(), 128u);
    per_engine[b.engine] += b.ids.size();
  }
  EXPECT_EQ(per_engine["engine-a"], 300u);
  EXPECT_EQ(per_engine["engine-b"], 5u);
  EXPECT_EQ(batches.size(), 4u);  // 128 + 128 + 44, and 5
}

TEST(RenewalSchedulerRules, RejectionWarnsOncePerEngineAndStopsRenewingIt) {
  RenewalScheduler s(seconds(30));
  s.Track("x", "old-p");
  s.Track("y", "new-p");
  EXPECT_TRUE(s.NoteRejected("old-p"));
  EXPECT_FALSE(s.NoteRejected("old-p")) << "one warning per P engine";
  auto b = s.Poll(t0);
  ASSERT_EQ(b.size(), 1u);
  EXPECT_EQ(b[0].engine, "new-p");
  s.ResetEngine("old-p");  // P restarted (new incarnation): try again
  EXPECT_EQ(s.Poll(t0 + seconds(5)).size(), 2u);
}

}  // namespace
}  // namespace kvferry::core
