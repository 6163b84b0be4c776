// The seed experiments at full scale: assertions on their outcomes (who wins and by how much
// structurally), not on canned numbers.
#include "scenarios.h"

#include <gtest/gtest.h>

namespace kvferry::sim {
namespace {

void ExpectNoViolations(const SimResult& r) {
  for (const std::string& v : r.violations) ADD_FAILURE() << v;
  for (std::size_t i = 0; i < r.requests.size(); ++i) EXPECT_EQ(r.requests[i].ends, 1) << i;
}

TEST(ScenarioA, LeaseFreesDeadDecodersKvTimeoutHoldsIt) {
  const ScenarioA a = RunScenarioA(1);
  ExpectNoViolations(a.timeout);
  ExpectNoViolations(a.lease);
  const FiguresA t = ComputeFiguresA(a.timeout);
  const FiguresA l = ComputeFiguresA(a.lease);
  // P is near-full while D is dead, in both runs, until the lease acts (calibration).
  EXPECT_GE(PctAt(a.timeout, 40), 95.0);
  EXPECT_GE(PctAt(a.lease, 40), 95.0);
  // Lease: what D renewed is gone one lease (+ a pass) after D's last renewal (t <= 23 s)...
  EXPECT_LT(PctAt(a.lease, 23 + 30 + 2), 50.0);
  // ...and what P prefilled after D died is held one lease more: < 5% by crash + 2 leases + slack.
  ASSERT_GE(l.kv_below_5_s, 0);
  EXPECT_LT(l.kv_below_5_s, 23 + 2 * 30 + 15);
  // Timeout: P still holds it all at that time, and until ~480 s after the prefills.
  EXPECT_GE(PctAt(a.timeout, l.kv_below_5_s), 95.0);
  EXPECT_GE(PctAt(a.timeout, 450), 95.0);
  EXPECT_GT(t.kv_left_full_s, 480);
  // The probe sent at t=10 s waits out the hold: ~480 s vs about one lease.
  EXPECT_GT(t.probe10_s, 400);
  EXPECT_LT(l.probe10_s, 23 + 30 + 30);
  // Once P's KV is free a probe is a lone 512-token prefill again (tens of ms).
  EXPECT_GT(l.later_probe_min_s, 0);
  EXPECT_LT(l.later_probe_max_s, 0.1);
}

TEST(ScenarioB, LeaseKeepsQueuedRequestsTimeoutFailsThem) {
  const ScenarioB b = RunScenarioB(1);
  ExpectNoViolations(b.timeout);
  ExpectNoViolations(b.lease);
  const FiguresB t = ComputeFiguresB(b.timeout);
  const FiguresB l = ComputeFiguresB(b.lease);
  EXPECT_EQ(l.ok, 128u);
  EXPECT_EQ(l.expired_on_p, 0u);
  // Requests really waited on D longer than the 20 s hold; the timeout fails a large share.
  EXPECT_GT(l.max_wait_on_d_s, 40);
  EXPECT_GE(t.failed, 128u / 4);
  EXPECT_EQ(t.failed + t.ok, 128u);
  EXPECT_GT(t.expired_on_p, 0u);
  for (const RequestResult& r : b.timeout.requests) {
    if (r.outcome == Outcome::kFailed) {
      EXPECT_FALSE(r.error.message().empty());
    }
  }
}

TEST(ScenarioC, FixedLedgerNeverWritesAfterFreeOldLogicDoes) {
  const ScenarioC c = RunScenarioC(1);
  const FiguresC o = ComputeFiguresC(c.old_logic);
  const FiguresC f = ComputeFiguresC(c.fixed);
  EXPECT_EQ(f.requests, 791u);
  EXPECT_GT(o.p0_failures, 10u);
  EXPECT_GT(f.p0_failures, 10u);
  EXPECT_EQ(f.written_by_both, 791u);
  EXPECT_EQ(f.p1_after_free, 0u);
  EXPECT_EQ(f.p1_after_realloc, 0u);
  ExpectNoViolations(c.fixed);
  // The seed's buggy baseline: P1's delayed WRITEs hit freed and reallocated blocks.
  EXPECT_GT(o.p1_after_free, 0u);
  EXPECT_GT(o.p1_after_realloc, 0u);
  EXPECT_FALSE(c.old_logic.violations.empty());
}

TEST(ScenarioD, LatePullFailsAtOnceWithAndWithoutLease) {
  const ScenarioD d = RunScenarioD(1);
  for (const SimResult* r : {&d.timeout, &d.lease}) {
    ExpectNoViolations(*r);
    const FiguresD f = ComputeFiguresD(*r);
    EXPECT_TRUE(f.failed);
    EXPECT_GT(f.pull_sent_s, 25);  // the pull really was late (after P's 20 s hold)
    EXPECT_LT(f.pull_sent_s, 38);  // and within the tombstone's 20 s after the free
    EXPECT_GE(f.time_to_fail_s, 0);
    EXPECT_LT(f.time_to_fail_s, 0.010);
    EXPECT_EQ(r->requests[1].error.code(), ErrorCode::kTombstoned);
    EXPECT_EQ(r->requests[0].outcome, Outcome::kOk);
  }
  // Without tombstones the same pull waits out P's abort_request_timeout.
  const FiguresD n = ComputeFiguresD(d.no_tombstones);
  EXPECT_TRUE(n.failed);
  EXPECT_GE(n.time_to_fail_s, 20);
}

// E: the release frees cancelled requests' KV at once; the lease only after a lease; the
// timeout only after 480 s. The same cancellations in all three runs.
TEST(ScenarioE, ReleaseFreesCancelledKvSoonerThanLeaseAndTimeout) {
  const ScenarioE e = RunScenarioE(1);
  ExpectNoViolations(e.timeout);
  ExpectNoViolations(e.lease);
  ExpectNoViolations(e.release);
  // Cancelled requests' KV: the timeout keeps it to the end of its 480 s, the lease frees it.
  EXPECT_GT(PctAt(e.timeout, 120), 5.0);
  EXPECT_LT(PctAt(e.lease, 120), 1.0);
  EXPECT_LT(PctAt(e.release, 120), 1.0);
  // While cancellations still come (t <= 40 s) the release holds less than the lease alone.
  EXPECT_LT(PctAt(e.release, 45), PctAt(e.lease, 45) - 5.0);
  EXPECT_LT(PctAt(e.release, 20), PctAt(e.lease, 20) - 5.0);
  // Clients did cancel, and the others still succeeded.
  EXPECT_GE(e.release.Count(Outcome::kAborted), 30u);
  EXPECT_GE(e.release.Count(Outcome::kOk), 80u);
  EXPECT_EQ(e.release.Count(Outcome::kFailed), 0u);
}

}  // namespace
}  // namespace kvferry::sim
