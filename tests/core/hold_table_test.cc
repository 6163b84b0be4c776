// HoldTable: one test per lease rule (SPEC §2, §4). docs/design.md maps each rule to its test.
#include "kvferry/core/hold_table.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace kvferry::core {
namespace {

using std::chrono::seconds;
using Kind = HoldEvent::Kind;
using Verdict = PullAdmission::Verdict;

const TimePoint t0 = TimePoint{} + seconds(1000);

HoldConfig LeaseConfig(int lease_s = 30, int abort_s = 480) {
  HoldConfig c;
  c.lease = seconds(lease_s);
  c.abort_request_timeout = seconds(abort_s);
  return c;
}
HoldConfig NoLeaseConfig(int abort_s = 480) { return LeaseConfig(0, abort_s); }

Fingerprint Fp(const TransferId& id) { return FingerprintOf(id); }

// Admits `id` and finishes its prefill at `at`.
void MakeReady(HoldTable& t, const TransferId& id, TimePoint at, std::uint32_t blocks = 4) {
  ASSERT_TRUE(t.Admit(id, 7, at).ok());
  ASSERT_TRUE(t.PrefillDone(id, blocks, at).ok());
}

bool HasEvent(const std::vector<HoldEvent>& events, Kind kind, const TransferId& id,
              ReleaseReason reason) {
  return std::any_of(events.begin(), events.end(), [&](const HoldEvent& e) {
    return e.kind == kind && e.id == id && e.reason == reason;
  });
}

// --- Without a lease: today's behaviour, unchanged. ---

TEST(HoldTableRules, NoLeaseHoldsUntilAbortRequestTimeout) {
  HoldTable t(NoLeaseConfig(480));
  MakeReady(t, "x", t0);
  t.Expire(t0 + seconds(479));
  EXPECT_TRUE(t.Contains("x"));
  EXPECT_TRUE(t.TakeEvents().empty());
  t.Expire(t0 + seconds(480));
  EXPECT_FALSE(t.Contains("x"));
  EXPECT_TRUE(HasEvent(t.TakeEvents(), Kind::kFreeBlocks, "x", ReleaseReason::kExpired));
}

TEST(HoldTableRules, FreedOnceEveryPairedDecoderRankPulled) {
  HoldTable t(NoLeaseConfig());
  MakeReady(t, "x", t0);
  // P TP1 → D TP2: both D ranks pull; need_send = 2.
  ASSERT_EQ(t.AdmitPull("x", 0, 2, std::nullopt, t0).verdict, Verdict::kReady);
  ASSERT_TRUE(t.BeginSend("x", 0, t0).ok());
  ASSERT_TRUE(t.EndSend("x", 0, true, t0).ok());
  EXPECT_TRUE(t.Contains("x")) << "one of two ranks pulled";
  ASSERT_EQ(t.AdmitPull("x", 1, 2, std::nullopt, t0).verdict, Verdict::kReady);
  ASSERT_TRUE(t.BeginSend("x", 1, t0).ok());
  ASSERT_TRUE(t.EndSend("x", 1, true, t0).ok());
  EXPECT_FALSE(t.Contains("x"));
  EXPECT_TRUE(HasEvent(t.TakeEvents(), Kind::kFreeBlocks, "x", ReleaseReason::kSent));
  EXPECT_EQ(t.stats().blocks_ready, 0u);
}

TEST(HoldTableRules, FailedSendDoesNotCountAsSent) {
  HoldTable t(NoLeaseConfig());
  MakeReady(t, "x", t0);
  ASSERT_EQ(t.AdmitPull("x", 0, 1, std::nullopt, t0).verdict, Verdict::kReady);
  ASSERT_TRUE(t.BeginSend("x", 0, t0).ok());
  ASSERT_TRUE(t.EndSend("x", 0, false, t0).ok());
  EXPECT_TRUE(t.Contains("x"));
  // D may retry; this time it lands.
  ASSERT_TRUE(t.BeginSend("x", 0, t0).ok());
  ASSERT_TRUE(t.EndSend("x", 0, true, t0).ok());
  EXPECT_FALSE(t.Contains("x"));
}

TEST(HoldTableRules, DuplicatePullFromSameRankIsRejected) {
  HoldTable t(NoLeaseConfig());
  MakeReady(t, "x", t0);
  ASSERT_EQ(t.AdmitPull("x", 0, 2, std::nullopt, t0).verdict, Verdict::kReady);
  ASSERT_TRUE(t.BeginSend("x", 0, t0).ok());
  ASSERT_TRUE(t.EndSend("x", 0, true, t0).ok());
  PullAdmission again = t.AdmitPull("x", 0, 2, std::nullopt, t0);
  EXPECT_EQ(again.verdict, Verdict::kFail);
  EXPECT_EQ(again.error.code(), ErrorCode::kAlreadyExists);
  EXPECT_TRUE(t.Contains("x")) << "the other rank has not pulled yet";
}

TEST(HoldTableRules, SendInFlightDefersExpiry) {
  HoldTable t(LeaseConfig(30));
  MakeReady(t, "x", t0);
  ASSERT_EQ(t.AdmitPull("x", 0, 1, std::nullopt, t0 + seconds(29)).verdict, Verdict::kReady);
  ASSERT_TRUE(t.BeginSend("x", 0, t0 + seconds(29)).ok());
  t.Expire(t0 + seconds(40));
  EXPECT_TRUE(t.Contains("x")) << "never free blocks a write is reading";
  ASSERT_TRUE(t.EndSend("x", 0, false, t0 + seconds(41)).ok());
  t.Expire(t0 + seconds(41));
  EXPECT_FALSE(t.Contains("x")) << "the deferred expiry applies once the send ends";
}

// --- With a lease. ---

TEST(HoldTableRules, LeaseStartsWhenPrefillEnds) {
  HoldTable t(LeaseConfig(30));
  ASSERT_TRUE(t.Admit("x", 1, t0).ok());
  ASSERT_TRUE(t.PrefillDone("x", 4, t0 + seconds(100)).ok());
  EXPECT_EQ(t.DeadlineOf("x"), t0 + seconds(130));
  t.Expire(t0 + seconds(129));
  EXPECT_TRUE(t.Contains("x"));
  t.Expire(t0 + seconds(130));
  EXPECT_FALSE(t.Contains("x"));
  EXPECT_TRUE(HasEvent(t.TakeEvents(), Kind::kFreeBlocks, "x", ReleaseReason::kExpired));
}

TEST(HoldTableRules, RenewalExtendsToTwoThirdsOfLease) {
  HoldTable t(LeaseConfig(30));
  MakeReady(t, "x", t0);
  auto r = t.Renew(std::vector<Fingerprint>{Fp("x")}, t0 + seconds(25));
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->extended, 1u);
  EXPECT_EQ(t.DeadlineOf("x"), t0 + seconds(45));  // max(30, 25 + 20)
}

TEST(HoldTableRules, RenewalNeverShortensDeadline) {
  HoldTable t(LeaseConfig(30));
  MakeReady(t, "x", t0);
  ASSERT_TRUE(t.Renew(std::vector<Fingerprint>{Fp("x")}, t0 + seconds(1)).has_value());
  EXPECT_EQ(t.DeadlineOf("x"), t0 + seconds(30)) << "1 + 20 < 30 must not shorten";
}

TEST(HoldTableRules, RenewalExtendsOnlyKnownTransfers) {
  HoldTable t(LeaseConfig(30));
  MakeReady(t, "x", t0);
  auto r = t.Renew(std::vector<Fingerprint>{Fp("x"), Fp("never-seen")}, t0 + seconds(20));
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->extended, 1u);
  EXPECT_EQ(r->unknown, 1u);
  EXPECT_FALSE(t.Contains("never-seen")) << "a renewal must not create an entry";
  EXPECT_EQ(t.size(), 1u);
}

TEST(HoldTableRules, PrefillerWithoutLeaseRejectsRenewals) {
  HoldTable t(NoLeaseConfig());
  MakeReady(t, "x", t0);
  const TimePoint before = *t.DeadlineOf("x");
  auto r = t.Renew(std::vector<Fingerprint>{Fp("x")}, t0 + seconds(1));
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), ErrorCode::kRejected);
  EXPECT_EQ(t.DeadlineOf("x"), before);
}

TEST(HoldTableRules, UnrenewedEntryFreedAtNextPassAndTombstoned) {
  HoldTable t(LeaseConfig(30));
  MakeReady(t, "x", t0);
  t.Expire(t0 + seconds(31));
  EXPECT_FALSE(t.Contains("x"));
  EXPECT_TRUE(t.IsTombstoned("x"));
  EXPECT_EQ(t.stats().released[ReleaseReason::kExpired], 1u);
}

TEST(HoldTableRules, LatePullFailsAtOnceWithLease) {
  HoldTable t(LeaseConfig(30));
  MakeReady(t, "x", t0);
  t.Expire(t0 + seconds(31));
  PullAdmission a = t.AdmitPull("x", 0, 1, seconds(30), t0 + seconds(32));
  EXPECT_EQ(a.verdict, Verdict::kFail);
  EXPECT_EQ(a.error.code(), ErrorCode::kTombstoned);
  EXPECT_FALSE(t.Contains("x")) << "a late pull must not create a placeholder that waits";
  EXPECT_EQ(t.stats().late_pulls_rejected, 1u);
}

TEST(HoldTableRules, LatePullFailsAtOnceWithoutLease) {
  HoldTable t(NoLeaseConfig(480));
  MakeReady(t, "x", t0);
  ASSERT_EQ(t.AdmitPull("x", 0, 1, std::nullopt, t0).verdict, Verdict::kReady);
  ASSERT_TRUE(t.BeginSend("x", 0, t0).ok());
  ASSERT_TRUE(t.EndSend("x", 0, true, t0).ok());
  PullAdmission a = t.AdmitPull("x", 0, 1, std::nullopt, t0 + seconds(1));
  EXPECT_EQ(a.verdict, Verdict::kFail);
  EXPECT_EQ(a.error.code(), ErrorCode::kTombstoned);
}

TEST(HoldTableRules, TombstonesKeptForAbortRequestTimeout) {
  HoldTable t(LeaseConfig(30, 480));
  MakeReady(t, "x", t0);
  t.Expire(t0 + seconds(30));
  ASSERT_TRUE(t.IsTombstoned("x"));
  t.Expire(t0 + seconds(30 + 479));
  EXPECT_TRUE(t.IsTombstoned("x"));
  t.Expire(t0 + seconds(30 + 480));
  EXPECT_FALSE(t.IsTombstoned("x"));
  EXPECT_EQ(t.stats().tombstones, 0u);
}

TEST(HoldTableRules, TombstonesAreBoundedInMemory) {
  HoldConfig c = LeaseConfig(30);
  c.max_tombstones = 3;
  HoldTable t(c);
  for (int i = 0; i < 5; ++i) MakeReady(t, "x" + std::to_string(i), t0 + seconds(i));
  for (int i = 0; i < 5; ++i) t.Expire(t0 + seconds(30 + i));
  EXPECT_EQ(t.stats().tombstones, 3u);
  EXPECT_EQ(t.stats().tombstones_evicted, 2u);
  EXPECT_FALSE(t.IsTombstoned("x0")) << "oldest evicted first";
  EXPECT_TRUE(t.IsTombstoned("x4"));
}

TEST(HoldTableRules, ExpiryNeverStrandsEntryBehindRenewedOne) {
  // vLLM #58222: an ordered reaper stopped at the first unexpired head. Here the oldest entry
  // keeps being renewed while the ones behind it must still expire on time.
  HoldTable t(LeaseConfig(30));
  MakeReady(t, "head", t0);
  MakeReady(t, "behind1", t0 + seconds(1));
  MakeReady(t, "behind2", t0 + seconds(2));
  for (int s = 5; s <= 60; s += 5) {
    ASSERT_TRUE(t.Renew(std::vector<Fingerprint>{Fp("head")}, t0 + seconds(s)).has_value());
    t.Expire(t0 + seconds(s));
  }
  EXPECT_TRUE(t.Contains("head"));
  EXPECT_FALSE(t.Contains("behind1"));
  EXPECT_FALSE(t.Contains("behind2"));
}

TEST(HoldTableRules, MixedTimeoutsExpireIndependently) {
  // Entries with different remaining deadlines (renewed vs not) must each leave at their own.
  HoldTable t(LeaseConfig(30));
  MakeReady(t, "a", t0);
  MakeReady(t, "b", t0);
  ASSERT_TRUE(t.Renew(std::vector<Fingerprint>{Fp("a")}, t0 + seconds(29)).has_value());
  t.Expire(t0 + seconds(30));
  EXPECT_TRUE(t.Contains("a"));
  EXPECT_FALSE(t.Contains("b"));
  t.Expire(t0 + seconds(49));
  EXPECT_FALSE(t.Contains("a"));
}

TEST(HoldTableRules, AbortRequestTimeoutBoundsWaitForUnfinishedPrefill) {
  HoldTable t(LeaseConfig(30, 480));
  ASSERT_TRUE(t.Admit("x", 9, t0).ok());
  PullAdmission a = t.AdmitPull("x", 0, 1, seconds(30), t0 + seconds(1));
  ASSERT_EQ(a.verdict, Verdict::kWait);
  EXPECT_EQ(a.wait_until, t0 + seconds(481));
  t.Expire(t0 + seconds(480));
  EXPECT_TRUE(t.Contains("x"));
  t.Expire(t0 + seconds(481));
  EXPECT_FALSE(t.Contains("x"));
  auto events = t.TakeEvents();
  EXPECT_TRUE(HasEvent(events, Kind::kPullsFailed, "x", ReleaseReason::kWaitTimeout));
  EXPECT_TRUE(HasEvent(events, Kind::kAbortPrefill, "x", ReleaseReason::kWaitTimeout));
}

TEST(HoldTableRules, PullBeforeAdmitWaitsThenSendsWhenPrefillDone) {
  HoldTable t(LeaseConfig(30));
  PullAdmission a = t.AdmitPull("x", 0, 1, seconds(30), t0);
  ASSERT_EQ(a.verdict, Verdict::kWait);
  EXPECT_EQ(t.PhaseOf("x"), HoldPhase::kPlaceholder);
  ASSERT_TRUE(t.Admit("x", 5, t0 + seconds(1)).ok());
  EXPECT_EQ(t.PhaseOf("x"), HoldPhase::kPrefilling);
  ASSERT_TRUE(t.PrefillDone("x", 2, t0 + seconds(2)).ok());
  auto events = t.TakeEvents();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, Kind::kPullsReady);
  EXPECT_EQ(events[0].handle, 5u);
}

// One wait per D rank and transfer: a D rank repeating its pull cannot grow anything, and no
// counter can wrap (a 16-bit count once wrapped after 65,536 waits and dropped the deadline).
TEST(HoldTableRules, SecondWaitOfOneDecoderRankIsRefusedAndKeepsTheDeadline) {
  HoldTable t(LeaseConfig(30));
  ASSERT_EQ(t.AdmitPull("x", 0, 2, seconds(30), t0).verdict, Verdict::kWait);
  for (int i = 0; i < 70000; ++i) {
    PullAdmission again = t.AdmitPull("x", 0, 2, seconds(30), t0 + seconds(1));
    ASSERT_EQ(again.verdict, Verdict::kFail);
    ASSERT_EQ(again.error.code(), ErrorCode::kAlreadyExists);
  }
  EXPECT_EQ(t.DeadlineOf("x"), t0 + seconds(480));
  // Another rank of the same transfer still waits.
  EXPECT_EQ(t.AdmitPull("x", 1, 2, seconds(30), t0).verdict, Verdict::kWait);
  MakeReady(t, "x", t0 + seconds(2));
  auto events = t.TakeEvents();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, Kind::kPullsReady);
}

TEST(HoldTableRules, UnadmittedPlaceholderFailsAfterAbortRequestTimeout) {
  HoldTable t(NoLeaseConfig(480));
  ASSERT_EQ(t.AdmitPull("x", 0, 1, std::nullopt, t0).verdict, Verdict::kWait);
  t.Expire(t0 + seconds(480));
  EXPECT_FALSE(t.Contains("x"));
  EXPECT_TRUE(t.IsTombstoned("x"));
  auto events = t.TakeEvents();
  EXPECT_TRUE(HasEvent(events, Kind::kPullsFailed, "x", ReleaseReason::kWaitTimeout));
  // P admits it later: the engine is told not to spend compute on it.
  EXPECT_EQ(t.Admit("x", 1, t0 + seconds(481)).code(), ErrorCode::kTombstoned);
}

TEST(HoldTableRules, EveryRejectedPullCarriesAReason) {
  HoldTable t(LeaseConfig(30));
  MakeReady(t, "gone", t0);
  t.Expire(t0 + seconds(31));
  const PullAdmission rejected[] = {
      t.AdmitPull("gone", 0, 1, seconds(30), t0 + seconds(32)),
      t.AdmitPull("y", 70, 1, seconds(30), t0 + seconds(32)),
      t.AdmitPull("z", 0, 1, seconds(10), t0 + seconds(32)),
  };
  for (const PullAdmission& a : rejected) {
    EXPECT_EQ(a.verdict, Verdict::kFail);
    EXPECT_FALSE(a.error.ok());
    EXPECT_FALSE(a.error.message().empty());
  }
}

// --- Beyond the seeds (SPEC §4). ---

TEST(HoldTableRules, DeadDecoderAbortsUnfinishedPrefill) {
  HoldTable t(LeaseConfig(30));
  ASSERT_TRUE(t.Admit("x", 3, t0).ok());
  ASSERT_TRUE(t.Renew(std::vector<Fingerprint>{Fp("x")}, t0 + seconds(5)).has_value());
  ASSERT_TRUE(t.Renew(std::vector<Fingerprint>{Fp("x")}, t0 + seconds(10)).has_value());
  t.Expire(t0 + seconds(39));
  EXPECT_TRUE(t.Contains("x")) << "renewed 29 s ago: still alive";
  t.Expire(t0 + seconds(40));
  EXPECT_FALSE(t.Contains("x"));
  auto events = t.TakeEvents();
  EXPECT_TRUE(HasEvent(events, Kind::kAbortPrefill, "x", ReleaseReason::kDeadDecoder));
  EXPECT_EQ(events[0].handle, 3u);
}

TEST(HoldTableRules, NeverRenewedPrefillIsNotAbortedAsDeadDecoder) {
  // An old decoder that does not renew must not lose requests that queue on P.
  HoldTable t(LeaseConfig(30));
  ASSERT_TRUE(t.Admit("x", 3, t0).ok());
  t.Expire(t0 + seconds(1000));
  EXPECT_TRUE(t.Contains("x"));
}

TEST(HoldTableRules, LeaseMismatchFailsPullNamingBothValues) {
  HoldTable t(LeaseConfig(30));
  MakeReady(t, "x", t0);
  PullAdmission a = t.AdmitPull("x", 0, 1, seconds(20), t0);
  ASSERT_EQ(a.verdict, Verdict::kFail);
  EXPECT_EQ(a.error.code(), ErrorCode::kLeaseMismatch);
  EXPECT_NE(a.error.message().find("20s"), std::string::npos) << a.error.message();
  EXPECT_NE(a.error.message().find("30s"), std::string::npos) << a.error.message();
  EXPECT_FALSE(t.Contains("x")) << "D fails the request, so P frees it now";
  EXPECT_TRUE(HasEvent(t.TakeEvents(), Kind::kFreeBlocks, "x", ReleaseReason::kLeaseMismatch));
}

TEST(HoldTableRules, LeaseMismatchDecoderOnPrefillerOff) {
  HoldTable t(NoLeaseConfig());
  MakeReady(t, "x", t0);
  PullAdmission a = t.AdmitPull("x", 0, 1, seconds(30), t0);
  ASSERT_EQ(a.verdict, Verdict::kFail);
  EXPECT_NE(a.error.message().find("off"), std::string::npos) << a.error.message();
  // A decoder that does not declare its lease (an older build) is accepted.
  MakeReady(t, "y", t0);
  EXPECT_EQ(t.AdmitPull("y", 0, 1, std::nullopt, t0).verdict, Verdict::kReady);
}

TEST(HoldTableRules, EngineAbortBeforePrefillLeavesCleanupToEngine) {
  HoldTable t(LeaseConfig(30));
  ASSERT_TRUE(t.Admit("x", 1, t0).ok());
  ASSERT_EQ(t.AdmitPull("x", 0, 1, seconds(30), t0).verdict, Verdict::kWait);
  t.EngineFinished("x", t0 + seconds(1));
  EXPECT_FALSE(t.Contains("x"));
  auto events = t.TakeEvents();
  ASSERT_EQ(events.size(), 2u) << "only the waiting pull is answered; the engine owns the blocks";
  EXPECT_EQ(events[0].kind, Kind::kPullsFailed);
  EXPECT_EQ(events[1].kind, Kind::kReleased);
  EXPECT_EQ(events[1].reason, ReleaseReason::kAbortedByEngine);
  t.Expire(t0 + seconds(100));
  EXPECT_TRUE(t.TakeEvents().empty()) << "terminal exactly once";
  EXPECT_TRUE(t.IsTombstoned("x"));
}

TEST(HoldTableRules, EngineAbortOfReadyEntryFreesOnlyAfterSendEnds) {
  HoldTable t(LeaseConfig(30));
  MakeReady(t, "x", t0);
  ASSERT_EQ(t.AdmitPull("x", 0, 2, std::nullopt, t0).verdict, Verdict::kReady);
  ASSERT_TRUE(t.BeginSend("x", 0, t0).ok());
  t.EngineFinished("x", t0 + seconds(1));
  EXPECT_TRUE(t.TakeEvents().empty()) << "a write is reading the blocks";
  EXPECT_EQ(t.AdmitPull("x", 1, 2, std::nullopt, t0 + seconds(1)).verdict, Verdict::kFail);
  ASSERT_TRUE(t.EndSend("x", 0, true, t0 + seconds(2)).ok());
  EXPECT_TRUE(HasEvent(t.TakeEvents(), Kind::kFreeBlocks, "x", ReleaseReason::kAbortedByEngine));
  EXPECT_FALSE(t.Contains("x"));
}

TEST(HoldTableRules, LeaseMismatchDuringSendDefersTheFree) {
  HoldTable t(LeaseConfig(30));
  MakeReady(t, "x", t0);
  ASSERT_EQ(t.AdmitPull("x", 0, 2, seconds(30), t0).verdict, Verdict::kReady);
  ASSERT_TRUE(t.BeginSend("x", 0, t0).ok());
  EXPECT_EQ(t.AdmitPull("x", 1, 2, seconds(5), t0).error.code(), ErrorCode::kLeaseMismatch);
  EXPECT_TRUE(t.TakeEvents().empty());
  ASSERT_TRUE(t.EndSend("x", 0, true, t0).ok());
  EXPECT_TRUE(HasEvent(t.TakeEvents(), Kind::kFreeBlocks, "x", ReleaseReason::kLeaseMismatch));
}

TEST(HoldTableRules, OneSendPerDecoderRankAtATime) {
  HoldTable t(LeaseConfig(30));
  MakeReady(t, "x", t0);
  ASSERT_EQ(t.AdmitPull("x", 0, 1, std::nullopt, t0).verdict, Verdict::kReady);
  ASSERT_TRUE(t.BeginSend("x", 0, t0).ok());
  EXPECT_EQ(t.BeginSend("x", 0, t0).code(), ErrorCode::kAlreadyExists);
  EXPECT_EQ(t.AdmitPull("x", 0, 1, std::nullopt, t0).verdict, Verdict::kFail);
  EXPECT_EQ(t.EndSend("x", 1, true, t0).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(t.stats().sending, 1u);
}

TEST(HoldTableRules, FractionalLeaseMatchesAtMillisecondGranularity) {
  // 4.1 s in nanoseconds and 4100 ms on the wire are the same lease.
  HoldConfig c;
  c.lease = Seconds(4.1);
  HoldTable t(c);
  MakeReady(t, "x", t0);
  EXPECT_EQ(t.AdmitPull("x", 0, 1, std::chrono::milliseconds(4100), t0).verdict, Verdict::kReady);
}

TEST(HoldTableRules, LeaseMismatchBeforeAdmitTombstonesTheId) {
  HoldTable t(LeaseConfig(30));
  EXPECT_EQ(t.AdmitPull("x", 0, 1, seconds(10), t0).error.code(), ErrorCode::kLeaseMismatch);
  EXPECT_EQ(t.Admit("x", 1, t0 + seconds(1)).code(), ErrorCode::kTombstoned)
      << "P must not prefill and hold KV that D already failed";
}

TEST(HoldTableRules, InconsistentNeedSendIsRejected) {
  HoldTable t(LeaseConfig(30));
  MakeReady(t, "x", t0);
  ASSERT_EQ(t.AdmitPull("x", 0, 1, std::nullopt, t0).verdict, Verdict::kReady);
  EXPECT_EQ(t.AdmitPull("x", 1, 2, std::nullopt, t0).error.code(), ErrorCode::kInvalidArgument);
}

TEST(HoldTableRules, SentEntryIsFreedOnlyAfterEveryWriteEnded) {
  HoldTable t(LeaseConfig(30));
  MakeReady(t, "x", t0);
  ASSERT_EQ(t.AdmitPull("x", 0, 2, std::nullopt, t0).verdict, Verdict::kReady);
  ASSERT_EQ(t.AdmitPull("x", 1, 2, std::nullopt, t0).verdict, Verdict::kReady);
  ASSERT_TRUE(t.BeginSend("x", 0, t0).ok());
  ASSERT_TRUE(t.BeginSend("x", 1, t0).ok());
  ASSERT_TRUE(t.EndSend("x", 0, true, t0).ok());
  EXPECT_TRUE(t.TakeEvents().empty());
  ASSERT_TRUE(t.EndSend("x", 1, true, t0).ok());
  EXPECT_TRUE(HasEvent(t.TakeEvents(), Kind::kFreeBlocks, "x", ReleaseReason::kSent));
}

TEST(HoldTableRules, PlaceholdersAreBounded) {
  HoldConfig c = LeaseConfig(30);
  c.max_placeholders = 2;
  HoldTable t(c);
  EXPECT_EQ(t.AdmitPull("a", 0, 1, std::nullopt, t0).verdict, Verdict::kWait);
  EXPECT_EQ(t.AdmitPull("b", 0, 1, std::nullopt, t0).verdict, Verdict::kWait);
  PullAdmission third = t.AdmitPull("c", 0, 1, std::nullopt, t0);
  EXPECT_EQ(third.error.code(), ErrorCode::kResourceExhausted);
  EXPECT_FALSE(t.Contains("c"));
  // An admitted transfer is not a placeholder: its pulls still wait.
  ASSERT_TRUE(t.Admit("d", 1, t0).ok());
  EXPECT_EQ(t.AdmitPull("d", 0, 1, std::nullopt, t0).verdict, Verdict::kWait);
}

TEST(HoldTableRules, DeadDecoderKvIsFreedWithinALeaseOfItsLastRenewal) {
  // D renewed while P was still prefilling, then died; the prefill ends later. Its KV must not
  // get a fresh full lease from the prefill's end: nobody renewed it for a whole lease.
  HoldTable t(LeaseConfig(30));
  ASSERT_TRUE(t.Admit("x", 1, t0).ok());
  ASSERT_TRUE(t.Renew(std::vector<Fingerprint>{Fp("x")}, t0 + seconds(5)).has_value());
  ASSERT_TRUE(t.PrefillDone("x", 4, t0 + seconds(20)).ok());
  EXPECT_EQ(t.DeadlineOf("x"), t0 + seconds(35)) << "last renewal + lease, not 20 + 30";
  t.Expire(t0 + seconds(35));
  EXPECT_TRUE(HasEvent(t.TakeEvents(), Kind::kFreeBlocks, "x", ReleaseReason::kExpired));
}

TEST(HoldTableRules, LiveDecoderRenewalsKeepReadyKvPastItsFirstLease) {
  HoldTable t(LeaseConfig(30));
  ASSERT_TRUE(t.Admit("x", 1, t0).ok());
  ASSERT_TRUE(t.PrefillDone("x", 4, t0).ok());
  for (int s = 5; s <= 120; s += 5) {
    ASSERT_TRUE(t.Renew(std::vector<Fingerprint>{Fp("x")}, t0 + seconds(s)).has_value());
    t.Expire(t0 + seconds(s));
  }
  EXPECT_TRUE(t.Contains("x"));
  EXPECT_EQ(t.DeadlineOf("x"), t0 + seconds(140));
}

TEST(HoldTableRules, NextDeadlineIsALowerBound) {
  HoldTable t(LeaseConfig(30));
  EXPECT_EQ(t.NextDeadline(), kNever);
  MakeReady(t, "x", t0);
  EXPECT_EQ(t.NextDeadline(), t0 + seconds(30));
  ASSERT_TRUE(t.Renew(std::vector<Fingerprint>{Fp("x")}, t0 + seconds(20)).has_value());
  EXPECT_LE(t.NextDeadline(), *t.DeadlineOf("x"));
  t.Expire(t0 + seconds(30));  // pops the stale key and re-arms at the real deadline
  EXPECT_EQ(t.NextDeadline(), t0 + seconds(40));
}

// --- Releases by the decoder (wire::Release, HoldTable::ReleaseByDecoder). ---

using RV = HoldTable::ReleaseOutcome::Verdict;

// The events of `id`, in order.
std::vector<HoldEvent> EventsOf(const std::vector<HoldEvent>& events, const TransferId& id) {
  std::vector<HoldEvent> out;
  for (const HoldEvent& e : events) {
    if (e.id == id) out.push_back(e);
  }
  return out;
}

std::size_t CountKind(const std::vector<HoldEvent>& events, Kind kind) {
  return static_cast<std::size_t>(std::count_if(
      events.begin(), events.end(), [&](const HoldEvent& e) { return e.kind == kind; }));
}

TEST(HoldTableReleases, ReleaseByTheOnlyPairedRankFreesAReadyEntryAtOnce) {
  HoldTable t(LeaseConfig(30));
  MakeReady(t, "x", t0, 4);
  const auto out = t.ReleaseByDecoder(Fp("x"), 0, 1, t0 + seconds(1));
  EXPECT_EQ(out.verdict, RV::kReleased);
  EXPECT_TRUE(out.error.ok());
  EXPECT_FALSE(t.Contains("x"));
  EXPECT_FALSE(t.ContainsFingerprint(Fp("x")));
  EXPECT_TRUE(t.IsTombstoned("x"));
  auto events = t.TakeEvents();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].kind, Kind::kFreeBlocks);
  EXPECT_EQ(events[0].reason, ReleaseReason::kReleasedByDecoder);
  EXPECT_EQ(events[0].handle, 7u);
  EXPECT_EQ(events[1].kind, Kind::kReleased);
  EXPECT_EQ(events[1].reason, ReleaseReason::kReleasedByDecoder);
  EXPECT_EQ(events[1].id, "x");
  EXPECT_EQ(t.stats().released[ReleaseReason::kReleasedByDecoder], 1u);
  EXPECT_EQ(t.stats().decoder_releases, 1u);
  EXPECT_EQ(t.stats().decoder_releases_ignored, 0u);
  EXPECT_EQ(t.stats().blocks_ready, 0u);
  EXPECT_EQ(t.stats().entries[HoldPhase::kReady], 0u);
  // A later pull of any rank fails at once.
  PullAdmission late = t.AdmitPull("x", 0, 1, std::nullopt, t0 + seconds(2));
  EXPECT_EQ(late.verdict, Verdict::kFail);
  EXPECT_EQ(late.error.code(), ErrorCode::kTombstoned);
}

TEST(HoldTableReleases, ReleaseWhileASendReadsTheBlocksDefersTheFreeUntilEndSend) {
  HoldTable t(LeaseConfig(30));
  MakeReady(t, "x", t0);
  ASSERT_EQ(t.AdmitPull("x", 0, 1, std::nullopt, t0).verdict, Verdict::kReady);
  ASSERT_TRUE(t.BeginSend("x", 0, t0).ok());
  // D gave up on the request while P writes it (e.g. aborted mid-load).
  EXPECT_EQ(t.ReleaseByDecoder(Fp("x"), 0, 1, t0 + seconds(1)).verdict, RV::kReleased);
  EXPECT_TRUE(t.TakeEvents().empty()) << "a write is reading the blocks";
  EXPECT_TRUE(t.Contains("x"));
  t.Expire(t0 + seconds(1000));
  EXPECT_TRUE(t.Contains("x")) << "not even expiry frees under a write";
  EXPECT_TRUE(t.TakeEvents().empty());
  EXPECT_EQ(t.AdmitPull("x", 0, 1, std::nullopt, t0 + seconds(2)).verdict, Verdict::kFail);
  ASSERT_TRUE(t.EndSend("x", 0, false, t0 + seconds(1001)).ok());
  EXPECT_FALSE(t.Contains("x"));
  auto events = t.TakeEvents();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].kind, Kind::kFreeBlocks);
  EXPECT_EQ(events[0].reason, ReleaseReason::kReleasedByDecoder);
  EXPECT_EQ(events[1].kind, Kind::kReleased);
  EXPECT_EQ(events[1].reason, ReleaseReason::kReleasedByDecoder);
  EXPECT_EQ(t.stats().sending, 0u);
  EXPECT_EQ(t.stats().blocks_ready, 0u);
}

TEST(HoldTableReleases, ReleaseOfTheOtherRankDuringASendFreesWhenTheSendEnds) {
  HoldTable t(LeaseConfig(30));
  MakeReady(t, "x", t0);
  ASSERT_EQ(t.AdmitPull("x", 0, 2, std::nullopt, t0).verdict, Verdict::kReady);
  ASSERT_TRUE(t.BeginSend("x", 0, t0).ok());
  EXPECT_EQ(t.ReleaseByDecoder(Fp("x"), 1, 2, t0).verdict, RV::kKept);
  EXPECT_TRUE(t.TakeEvents().empty());
  ASSERT_TRUE(t.EndSend("x", 0, true, t0 + seconds(1)).ok());
  EXPECT_FALSE(t.Contains("x"));
  auto events = t.TakeEvents();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].kind, Kind::kFreeBlocks);
  EXPECT_EQ(events[0].reason, ReleaseReason::kReleasedByDecoder);
  EXPECT_EQ(events[1].kind, Kind::kReleased);
  EXPECT_EQ(t.stats().released[ReleaseReason::kSent], 0u);
}

TEST(HoldTableReleases, WithTwoPairedRanksOneReleaseKeepsTheEntryUntilTheOtherRankPulls) {
  HoldTable t(LeaseConfig(30));
  MakeReady(t, "x", t0, 4);
  const auto out = t.ReleaseByDecoder(Fp("x"), 0, 2, t0 + seconds(1));
  EXPECT_EQ(out.verdict, RV::kKept);
  EXPECT_TRUE(out.error.ok());
  EXPECT_TRUE(t.Contains("x")) << "rank 1 may still pull it";
  EXPECT_TRUE(t.TakeEvents().empty());
  EXPECT_EQ(t.stats().decoder_releases, 1u);
  EXPECT_EQ(t.DeadlineOf("x"), t0 + seconds(30)) << "a release does not shorten the hold";
  // Rank 1's first try fails: still not freed.
  ASSERT_EQ(t.AdmitPull("x", 1, 2, std::nullopt, t0 + seconds(2)).verdict, Verdict::kReady);
  ASSERT_TRUE(t.BeginSend("x", 1, t0 + seconds(2)).ok());
  ASSERT_TRUE(t.EndSend("x", 1, false, t0 + seconds(3)).ok());
  EXPECT_TRUE(t.Contains("x"));
  EXPECT_TRUE(t.TakeEvents().empty());
  // Its retry lands: every paired rank pulled or released it.
  ASSERT_TRUE(t.BeginSend("x", 1, t0 + seconds(4)).ok());
  ASSERT_TRUE(t.EndSend("x", 1, true, t0 + seconds(5)).ok());
  EXPECT_FALSE(t.Contains("x"));
  auto events = t.TakeEvents();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].kind, Kind::kFreeBlocks);
  EXPECT_EQ(events[0].reason, ReleaseReason::kReleasedByDecoder);
  EXPECT_EQ(events[1].kind, Kind::kReleased);
  EXPECT_EQ(events[1].reason, ReleaseReason::kReleasedByDecoder);
  EXPECT_EQ(t.stats().released[ReleaseReason::kReleasedByDecoder], 1u);
  EXPECT_EQ(t.stats().released[ReleaseReason::kSent], 0u);
}

TEST(HoldTableReleases, ReleaseByTheRankThatDidNotPullFreesAnEntryTheOtherPulled) {
  HoldTable t(NoLeaseConfig());
  MakeReady(t, "x", t0);
  ASSERT_EQ(t.AdmitPull("x", 1, 2, std::nullopt, t0).verdict, Verdict::kReady);
  ASSERT_TRUE(t.BeginSend("x", 1, t0).ok());
  ASSERT_TRUE(t.EndSend("x", 1, true, t0).ok());
  ASSERT_TRUE(t.Contains("x"));
  EXPECT_EQ(t.ReleaseByDecoder(Fp("x"), 0, 2, t0).verdict, RV::kReleased);
  EXPECT_FALSE(t.Contains("x"));
  EXPECT_TRUE(HasEvent(t.TakeEvents(), Kind::kFreeBlocks, "x", ReleaseReason::kReleasedByDecoder));
}

TEST(HoldTableReleases, ReleasesNeverFreeWhileAnotherPairedRankMayStillPull) {
  // Four paired ranks: three release, the fourth has neither pulled nor released.
  HoldTable t(LeaseConfig(30));
  MakeReady(t, "x", t0);
  for (std::uint32_t rank : {0u, 2u, 3u}) {
    EXPECT_EQ(t.ReleaseByDecoder(Fp("x"), rank, 4, t0).verdict, RV::kKept) << "rank " << rank;
    EXPECT_TRUE(t.Contains("x"));
  }
  EXPECT_TRUE(t.TakeEvents().empty());
  ASSERT_EQ(t.AdmitPull("x", 1, 4, std::nullopt, t0).verdict, Verdict::kReady);
  ASSERT_TRUE(t.BeginSend("x", 1, t0).ok());
  ASSERT_TRUE(t.EndSend("x", 1, true, t0).ok());
  EXPECT_FALSE(t.Contains("x"));
}

TEST(HoldTableReleases, ReleaseOfAPrefillingEntryAbortsThePrefill) {
  HoldTable t(LeaseConfig(30));
  ASSERT_TRUE(t.Admit("x", 3, t0).ok());
  EXPECT_EQ(t.ReleaseByDecoder(Fp("x"), 0, 1, t0 + seconds(1)).verdict, RV::kReleased);
  EXPECT_FALSE(t.Contains("x"));
  auto events = t.TakeEvents();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].kind, Kind::kAbortPrefill);
  EXPECT_EQ(events[0].reason, ReleaseReason::kReleasedByDecoder);
  EXPECT_EQ(events[0].handle, 3u);
  EXPECT_EQ(events[1].kind, Kind::kReleased);
  EXPECT_EQ(events[1].reason, ReleaseReason::kReleasedByDecoder);
  EXPECT_EQ(t.stats().entries[HoldPhase::kPrefilling], 0u);
  // The engine finishes the (aborted) prefill: nobody will pull it, the caller frees at once.
  EXPECT_EQ(t.PrefillDone("x", 4, t0 + seconds(2)).code(), ErrorCode::kTombstoned);
  EXPECT_TRUE(t.TakeEvents().empty());
}

TEST(HoldTableReleases, ReleaseFailsOnlyTheReleasingRanksWaitingPull) {
  HoldTable t(LeaseConfig(30));
  ASSERT_TRUE(t.Admit("x", 5, t0).ok());
  ASSERT_EQ(t.AdmitPull("x", 0, 2, std::nullopt, t0).verdict, Verdict::kWait);
  ASSERT_EQ(t.AdmitPull("x", 1, 2, std::nullopt, t0).verdict, Verdict::kWait);
  EXPECT_EQ(t.ReleaseByDecoder(Fp("x"), 0, 2, t0 + seconds(1)).verdict, RV::kKept);
  auto events = t.TakeEvents();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, Kind::kPullsFailed);
  EXPECT_EQ(events[0].ranks, std::uint64_t{1}) << "only rank 0's pull fails";
  EXPECT_EQ(events[0].status.code(), ErrorCode::kCancelled);
  EXPECT_EQ(events[0].handle, 5u);
  EXPECT_EQ(t.PhaseOf("x"), HoldPhase::kPrefilling) << "rank 1 still waits for it";
  // Rank 1's pull goes on waiting and is served once the prefill ends.
  ASSERT_TRUE(t.PrefillDone("x", 2, t0 + seconds(2)).ok());
  events = t.TakeEvents();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, Kind::kPullsReady);
  ASSERT_TRUE(t.BeginSend("x", 1, t0 + seconds(2)).ok());
  ASSERT_TRUE(t.EndSend("x", 1, true, t0 + seconds(2)).ok());
  EXPECT_TRUE(HasEvent(t.TakeEvents(), Kind::kFreeBlocks, "x", ReleaseReason::kReleasedByDecoder));
}

TEST(HoldTableReleases, ReleaseOfTheLastWaitingRankFailsItsPullAndFreesThePlaceholder) {
  HoldTable t(LeaseConfig(30));
  ASSERT_EQ(t.AdmitPull("x", 0, 1, std::nullopt, t0).verdict, Verdict::kWait);
  EXPECT_EQ(t.ReleaseByDecoder(Fp("x"), 0, 1, t0).verdict, RV::kReleased);
  auto events = t.TakeEvents();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].kind, Kind::kPullsFailed);
  EXPECT_EQ(events[0].ranks, std::uint64_t{1});
  EXPECT_EQ(events[1].kind, Kind::kReleased);
  EXPECT_EQ(CountKind(events, Kind::kAbortPrefill), 0u) << "a placeholder has no prefill";
  EXPECT_EQ(t.stats().entries[HoldPhase::kPlaceholder], 0u);
  EXPECT_EQ(t.Admit("x", 1, t0 + seconds(1)).code(), ErrorCode::kTombstoned);
}

TEST(HoldTableReleases, UnknownIdWithOnePairedRankIsTombstonedSoItIsNeverPrefilled) {
  HoldTable t(LeaseConfig(30));
  const auto out = t.ReleaseByDecoder(Fp("x"), 0, 1, t0);
  EXPECT_EQ(out.verdict, RV::kTombstoned);
  EXPECT_FALSE(t.Contains("x"));
  EXPECT_TRUE(t.IsTombstoned("x"));
  EXPECT_EQ(t.size(), 0u);
  EXPECT_TRUE(t.TakeEvents().empty()) << "no entry left the table";
  EXPECT_EQ(t.stats().decoder_releases, 1u);
  EXPECT_EQ(t.Admit("x", 1, t0 + seconds(1)).code(), ErrorCode::kTombstoned);
  EXPECT_EQ(t.AdmitPull("x", 0, 1, std::nullopt, t0 + seconds(1)).error.code(),
            ErrorCode::kTombstoned);
  // The tombstone lives abort_request_timeout like any other.
  t.Expire(t0 + seconds(480));
  EXPECT_FALSE(t.IsTombstoned("x"));
}

TEST(HoldTableReleases, UnknownIdWithSeveralPairedRanksIsIgnored) {
  HoldTable t(LeaseConfig(30));
  const auto out = t.ReleaseByDecoder(Fp("x"), 0, 2, t0);
  EXPECT_EQ(out.verdict, RV::kIgnored);
  EXPECT_TRUE(out.error.ok()) << "plainly unknown, not an error";
  EXPECT_FALSE(t.IsTombstoned("x"));
  EXPECT_FALSE(t.Contains("x"));
  EXPECT_EQ(t.size(), 0u) << "a release must not create an entry";
  EXPECT_EQ(t.stats().decoder_releases, 0u);
  EXPECT_EQ(t.stats().decoder_releases_ignored, 1u);
  EXPECT_TRUE(t.Admit("x", 1, t0 + seconds(1)).ok()) << "the other rank may still pull it";
}

TEST(HoldTableReleases, RepeatedAndLateReleasesAreIgnoredAndChangeNothing) {
  HoldTable t(LeaseConfig(30));
  MakeReady(t, "x", t0);
  ASSERT_EQ(t.ReleaseByDecoder(Fp("x"), 0, 2, t0).verdict, RV::kKept);
  const TimePoint deadline = *t.DeadlineOf("x");
  const auto again = t.ReleaseByDecoder(Fp("x"), 0, 2, t0 + seconds(1));
  EXPECT_EQ(again.verdict, RV::kIgnored);
  EXPECT_TRUE(again.error.ok());
  EXPECT_TRUE(t.Contains("x")) << "a repeated release must not count as the other rank's";
  EXPECT_EQ(t.DeadlineOf("x"), deadline);
  EXPECT_TRUE(t.TakeEvents().empty());
  EXPECT_EQ(t.stats().decoder_releases, 1u);
  EXPECT_EQ(t.stats().decoder_releases_ignored, 1u);
  // Rank 1 pulled it: the entry goes. A release after that is late.
  ASSERT_EQ(t.AdmitPull("x", 1, 2, std::nullopt, t0).verdict, Verdict::kReady);
  ASSERT_TRUE(t.BeginSend("x", 1, t0).ok());
  ASSERT_TRUE(t.EndSend("x", 1, true, t0).ok());
  ASSERT_FALSE(t.Contains("x"));
  ASSERT_EQ(CountKind(t.TakeEvents(), Kind::kReleased), 1u);
  for (std::uint32_t rank : {0u, 1u}) {
    const auto late = t.ReleaseByDecoder(Fp("x"), rank, 2, t0 + seconds(2));
    EXPECT_EQ(late.verdict, RV::kIgnored);
    EXPECT_TRUE(late.error.ok());
  }
  // Also with need_send 1: a tombstoned id is never "released" twice.
  EXPECT_EQ(t.ReleaseByDecoder(Fp("x"), 0, 1, t0 + seconds(2)).verdict, RV::kIgnored);
  EXPECT_TRUE(t.TakeEvents().empty());
  EXPECT_EQ(t.stats().released[ReleaseReason::kReleasedByDecoder], 1u);
  EXPECT_EQ(t.stats().decoder_releases_ignored, 4u);
}

TEST(HoldTableReleases, ReleaseByARankThatAlreadyPulledIsIgnored) {
  HoldTable t(LeaseConfig(30));
  MakeReady(t, "x", t0);
  ASSERT_EQ(t.AdmitPull("x", 0, 2, std::nullopt, t0).verdict, Verdict::kReady);
  ASSERT_TRUE(t.BeginSend("x", 0, t0).ok());
  ASSERT_TRUE(t.EndSend("x", 0, true, t0).ok());
  EXPECT_EQ(t.ReleaseByDecoder(Fp("x"), 0, 2, t0).verdict, RV::kIgnored);
  EXPECT_TRUE(t.Contains("x")) << "rank 1 has neither pulled nor released it";
  EXPECT_TRUE(t.TakeEvents().empty());
}

TEST(HoldTableReleases, NeedSendMismatchIsIgnoredWithAnError) {
  HoldTable t(LeaseConfig(30));
  MakeReady(t, "x", t0);
  ASSERT_EQ(t.AdmitPull("x", 0, 2, std::nullopt, t0).verdict, Verdict::kReady);
  const auto out = t.ReleaseByDecoder(Fp("x"), 1, 1, t0);
  EXPECT_EQ(out.verdict, RV::kIgnored);
  EXPECT_EQ(out.error.code(), ErrorCode::kInvalidArgument);
  EXPECT_FALSE(out.error.message().empty());
  EXPECT_TRUE(t.Contains("x")) << "with need_send 1 it would have been freed under rank 0";
  EXPECT_TRUE(t.TakeEvents().empty());
  EXPECT_EQ(t.stats().decoder_releases_ignored, 1u);
  // Rank 1 was not marked done: it may still pull.
  EXPECT_EQ(t.AdmitPull("x", 1, 2, std::nullopt, t0).verdict, Verdict::kReady);
}

TEST(HoldTableReleases, FirstReleaseFixesNeedSendForLaterPulls) {
  HoldTable t(LeaseConfig(30));
  ASSERT_TRUE(t.Admit("x", 1, t0).ok());
  ASSERT_EQ(t.ReleaseByDecoder(Fp("x"), 0, 2, t0).verdict, RV::kKept);
  EXPECT_EQ(t.AdmitPull("x", 1, 1, std::nullopt, t0).error.code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(t.AdmitPull("x", 1, 2, std::nullopt, t0).verdict, Verdict::kWait);
}

TEST(HoldTableReleases, OutOfRangeRankOrNeedSendIsIgnoredWithAnError) {
  HoldTable t(LeaseConfig(30));
  MakeReady(t, "x", t0);
  EXPECT_EQ(t.ReleaseByDecoder(Fp("x"), 64, 1, t0).error.code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(t.ReleaseByDecoder(Fp("x"), 0, 0, t0).error.code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(t.ReleaseByDecoder(Fp("x"), 0, 65, t0).error.code(), ErrorCode::kOutOfRange);
  EXPECT_TRUE(t.Contains("x"));
  EXPECT_EQ(t.stats().decoder_releases_ignored, 3u);
}

TEST(HoldTableReleases, TheReleasedRanksLaterPullsAndSendsFail) {
  HoldTable t(LeaseConfig(30));
  MakeReady(t, "x", t0);
  ASSERT_EQ(t.ReleaseByDecoder(Fp("x"), 0, 2, t0).verdict, RV::kKept);
  PullAdmission pull = t.AdmitPull("x", 0, 2, std::nullopt, t0 + seconds(1));
  EXPECT_EQ(pull.verdict, Verdict::kFail);
  EXPECT_EQ(pull.error.code(), ErrorCode::kCancelled);
  EXPECT_FALSE(t.BeginSend("x", 0, t0 + seconds(1)).ok());
  EXPECT_EQ(t.stats().sending, 0u);
  EXPECT_TRUE(t.Contains("x"));
  // The other rank is unaffected.
  EXPECT_EQ(t.AdmitPull("x", 1, 2, std::nullopt, t0 + seconds(1)).verdict, Verdict::kReady);
  EXPECT_TRUE(t.BeginSend("x", 1, t0 + seconds(1)).ok());
}

TEST(HoldTableReleases, AReleasedRankCannotWaitForAPrefillingEntry) {
  HoldTable t(LeaseConfig(30));
  ASSERT_TRUE(t.Admit("x", 1, t0).ok());
  ASSERT_EQ(t.ReleaseByDecoder(Fp("x"), 0, 2, t0).verdict, RV::kKept);
  PullAdmission pull = t.AdmitPull("x", 0, 2, std::nullopt, t0);
  EXPECT_EQ(pull.verdict, Verdict::kFail);
  EXPECT_EQ(pull.error.code(), ErrorCode::kCancelled);
  ASSERT_TRUE(t.PrefillDone("x", 2, t0).ok());
  EXPECT_TRUE(t.TakeEvents().empty()) << "no pull of rank 0 waits";
}

TEST(HoldTableReleases, ReleasedIsEmittedExactlyOncePerEntryForEveryReason) {
  EXPECT_FALSE(LeftDecoderWaiting(ReleaseReason::kSent));
  EXPECT_FALSE(LeftDecoderWaiting(ReleaseReason::kReleasedByDecoder));
  for (ReleaseReason r :
       {ReleaseReason::kExpired, ReleaseReason::kDeadDecoder, ReleaseReason::kWaitTimeout,
        ReleaseReason::kLeaseMismatch, ReleaseReason::kAbortedByEngine}) {
    EXPECT_TRUE(LeftDecoderWaiting(r)) << ToString(r);
  }
  for (ReleaseReason reason : kAllReleaseReasons) {
    SCOPED_TRACE(ToString(reason));
    HoldTable t(LeaseConfig(30, 480));
    TimePoint now = t0;
    switch (reason) {
      case ReleaseReason::kSent:
        MakeReady(t, "x", now);
        ASSERT_EQ(t.AdmitPull("x", 0, 1, std::nullopt, now).verdict, Verdict::kReady);
        ASSERT_TRUE(t.BeginSend("x", 0, now).ok());
        ASSERT_TRUE(t.EndSend("x", 0, true, now).ok());
        break;
      case ReleaseReason::kExpired:
        MakeReady(t, "x", now);
        now += seconds(30);
        t.Expire(now);
        break;
      case ReleaseReason::kDeadDecoder:
        ASSERT_TRUE(t.Admit("x", 7, now).ok());
        ASSERT_TRUE(t.Renew(std::vector<Fingerprint>{Fp("x")}, now).has_value());
        now += seconds(30);
        t.Expire(now);
        break;
      case ReleaseReason::kWaitTimeout:
        ASSERT_EQ(t.AdmitPull("x", 0, 1, std::nullopt, now).verdict, Verdict::kWait);
        now += seconds(480);
        t.Expire(now);
        break;
      case ReleaseReason::kLeaseMismatch:
        MakeReady(t, "x", now);
        ASSERT_EQ(t.AdmitPull("x", 0, 1, seconds(5), now).verdict, Verdict::kFail);
        break;
      case ReleaseReason::kAbortedByEngine:
        MakeReady(t, "x", now);
        t.EngineFinished("x", now);
        break;
      case ReleaseReason::kReleasedByDecoder:
        MakeReady(t, "x", now);
        ASSERT_EQ(t.ReleaseByDecoder(Fp("x"), 0, 1, now).verdict, RV::kReleased);
        break;
    }
    ASSERT_FALSE(t.Contains("x"));
    auto events = EventsOf(t.TakeEvents(), "x");
    ASSERT_FALSE(events.empty());
    EXPECT_EQ(CountKind(events, Kind::kReleased), 1u);
    const HoldEvent& last = events.back();
    EXPECT_EQ(last.kind, Kind::kReleased) << "kReleased comes after the other events";
    EXPECT_EQ(last.reason, reason);
    if (LeftDecoderWaiting(reason)) {
      EXPECT_FALSE(last.status.ok()) << "a waiting decoder must hear why";
      EXPECT_FALSE(last.status.message().empty());
    }
    EXPECT_EQ(t.stats().released[reason], 1u);
    // Nothing that follows releases it again.
    t.EngineFinished("x", now);
    (void)t.ReleaseByDecoder(Fp("x"), 0, 1, now);
    (void)t.AdmitPull("x", 0, 1, std::nullopt, now);
    t.Expire(now + seconds(10000));
    EXPECT_EQ(CountKind(t.TakeEvents(), Kind::kReleased), 0u);
    std::uint64_t total = 0;
    for (ReleaseReason r : kAllReleaseReasons) total += t.stats().released[r];
    EXPECT_EQ(total, 1u);
  }
}

// kReleased carries "what a D rank still waiting should hear" (wire::AbortNotice): an entry
// whose release was deferred by a send must still say why it went.
TEST(HoldTableReleases, ReleaseDeferredByASendKeepsItsReasonsStatus) {
  HoldTable t(LeaseConfig(30));
  MakeReady(t, "x", t0);
  ASSERT_EQ(t.AdmitPull("x", 0, 2, seconds(30), t0).verdict, Verdict::kReady);
  ASSERT_TRUE(t.BeginSend("x", 0, t0).ok());
  const PullAdmission mismatch = t.AdmitPull("x", 1, 2, seconds(5), t0);
  ASSERT_EQ(mismatch.error.code(), ErrorCode::kLeaseMismatch);
  ASSERT_TRUE(t.EndSend("x", 0, true, t0 + seconds(1)).ok());
  auto events = t.TakeEvents();
  ASSERT_FALSE(events.empty());
  const HoldEvent& released = events.back();
  ASSERT_EQ(released.kind, Kind::kReleased);
  EXPECT_EQ(released.reason, ReleaseReason::kLeaseMismatch);
  EXPECT_EQ(released.status.code(), ErrorCode::kLeaseMismatch) << released.status.ToString();
}

TEST(HoldTableReleases, APlaceholderWhoseOnlyWaitingRankReleasedStillGoesAtItsWaitDeadline) {
  HoldTable t(LeaseConfig(30, 480));
  ASSERT_EQ(t.AdmitPull("x", 0, 2, std::nullopt, t0).verdict, Verdict::kWait);
  ASSERT_EQ(t.ReleaseByDecoder(Fp("x"), 0, 2, t0 + seconds(1)).verdict, RV::kKept);
  auto events = t.TakeEvents();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, Kind::kPullsFailed);
  EXPECT_EQ(events[0].ranks, std::uint64_t{1});
  EXPECT_EQ(t.PhaseOf("x"), HoldPhase::kPlaceholder);
  EXPECT_EQ(t.DeadlineOf("x"), t0 + seconds(480)) << "the wait deadline stays armed";
  EXPECT_LE(t.NextDeadline(), t0 + seconds(480));
  t.Expire(t0 + seconds(479));
  EXPECT_TRUE(t.Contains("x"));
  t.Expire(t0 + seconds(480));
  EXPECT_FALSE(t.Contains("x"));
  EXPECT_TRUE(t.IsTombstoned("x"));
  events = t.TakeEvents();
  ASSERT_EQ(events.size(), 1u) << "no pull waits and a placeholder has no prefill to abort";
  EXPECT_EQ(events[0].kind, Kind::kReleased);
  EXPECT_EQ(events[0].reason, ReleaseReason::kWaitTimeout);
  EXPECT_EQ(t.stats().entries[HoldPhase::kPlaceholder], 0u);
}

TEST(HoldTableReleases, APrefillOnceWaitedForStaysBoundedAfterItsWaiterReleased) {
  HoldTable t(NoLeaseConfig(480));
  ASSERT_TRUE(t.Admit("x", 2, t0).ok());
  ASSERT_EQ(t.AdmitPull("x", 0, 2, std::nullopt, t0).verdict, Verdict::kWait);
  ASSERT_EQ(t.ReleaseByDecoder(Fp("x"), 0, 2, t0).verdict, RV::kKept);
  (void)t.TakeEvents();
  EXPECT_EQ(t.DeadlineOf("x"), t0 + seconds(480));
  t.Expire(t0 + seconds(480));
  EXPECT_FALSE(t.Contains("x"));
  auto events = t.TakeEvents();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].kind, Kind::kAbortPrefill);
  EXPECT_EQ(events[0].reason, ReleaseReason::kWaitTimeout);
  EXPECT_EQ(events[1].kind, Kind::kReleased);
}

// P's engine refused a request it never admitted: D's pull of it fails at once, whether it
// comes after the refusal (tombstone) or already waits for it (placeholder), with P's reason.
TEST(HoldTableRefusals, RefusedTransferFailsItsPullAtOnce) {
  HoldTable t(LeaseConfig(30));
  ASSERT_TRUE(t.Refuse("late", Status(ErrorCode::kResourceExhausted, "queue full"), t0).ok());
  EXPECT_TRUE(t.IsTombstoned("late"));
  EXPECT_EQ(t.AdmitPull("late", 0, 1, seconds(30), t0).error.code(), ErrorCode::kTombstoned);
  ASSERT_EQ(t.AdmitPull("early", 0, 1, seconds(30), t0).verdict, Verdict::kWait);
  ASSERT_TRUE(t.Refuse("early", Status(ErrorCode::kResourceExhausted, "queue full"), t0).ok());
  auto events = t.TakeEvents();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].kind, Kind::kPullsFailed);
  EXPECT_EQ(events[0].status.code(), ErrorCode::kResourceExhausted);
  EXPECT_EQ(events[0].status.message(), "queue full");
  EXPECT_EQ(events[1].kind, Kind::kReleased);
  EXPECT_EQ(events[1].reason, ReleaseReason::kAbortedByEngine);
  EXPECT_FALSE(t.Contains("early"));
  EXPECT_TRUE(t.IsTombstoned("early"));
  EXPECT_EQ(t.Admit("early", 1, t0).code(), ErrorCode::kTombstoned);
}

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// A pull that reaches P just after the refusal hears the engine's reason, as one already
// waiting does (before, it heard only "already released": D could not tell a client who left
// P from a late pull). A second D rank's pull of a refused placeholder hears it too.
TEST(HoldTableRefusals, LatePullOfARefusedTransferHearsTheEnginesReason) {
  HoldTable t(LeaseConfig(30));
  ASSERT_TRUE(t.Refuse("late", Status(ErrorCode::kCancelled, "client left"), t0).ok());
  PullAdmission late = t.AdmitPull("late", 0, 1, seconds(30), t0 + seconds(1));
  EXPECT_EQ(late.error.code(), ErrorCode::kTombstoned);
  EXPECT_TRUE(Contains(late.error.message(), "client left")) << late.error.message();
  ASSERT_EQ(t.AdmitPull("early", 0, 2, seconds(30), t0).verdict, Verdict::kWait);
  ASSERT_TRUE(t.Refuse("early", Status(ErrorCode::kCancelled, "client left"), t0).ok());
  const std::string second = t.AdmitPull("early", 1, 2, seconds(30), t0).error.message();
  EXPECT_TRUE(Contains(second, "client left")) << second;
  // Released after admission: no engine reason to tell.
  ASSERT_TRUE(t.Admit("done", 1, t0).ok());
  t.EngineFinished("done", t0);
  const std::string done = t.AdmitPull("done", 0, 1, seconds(30), t0).error.message();
  EXPECT_TRUE(Contains(done, "already released")) << done;
}

// The kept reason is bounded (a client-controlled abort may fill every tombstone) and cut on a
// UTF-8 boundary, since D hands it to Python as text.
TEST(HoldTableRefusals, KeptRefusalReasonIsCutOnACharacterBoundary) {
  HoldTable t(LeaseConfig(30));
  std::string why(HoldTable::kMaxRefusalReasonBytes - 1, 'a');
  why += "\xc3\xa9 and more";  // 'é' straddles the cut
  ASSERT_TRUE(t.Refuse("x", Status(ErrorCode::kCancelled, why), t0).ok());
  const std::string heard = t.AdmitPull("x", 0, 1, seconds(30), t0).error.message();
  EXPECT_TRUE(Contains(heard, std::string(HoldTable::kMaxRefusalReasonBytes - 1, 'a') + " (late"))
      << heard;
  EXPECT_FALSE(Contains(heard, "\xc3")) << heard;
}

// Reasons have their own bound (a client can abort at will): beyond it the oldest reason goes
// and its tombstone stays, so the late pull still fails at once, only without the words.
TEST(HoldTableRefusals, ReasonsBeyondTheirCapGoOldestFirstAndTheirTombstonesStay) {
  HoldConfig c = LeaseConfig(30);
  c.max_refusal_reasons = 2;
  HoldTable t(c);
  for (const char* id : {"a", "b", "c"}) {
    ASSERT_TRUE(t.Refuse(id, Status(ErrorCode::kCancelled, std::string("left ") + id), t0).ok());
  }
  EXPECT_TRUE(t.IsTombstoned("a"));
  PullAdmission a = t.AdmitPull("a", 0, 1, seconds(30), t0);
  EXPECT_EQ(a.error.code(), ErrorCode::kTombstoned);
  EXPECT_TRUE(Contains(a.error.message(), "already released")) << a.error.message();
  EXPECT_TRUE(Contains(t.AdmitPull("b", 0, 1, seconds(30), t0).error.message(), "left b"));
  EXPECT_TRUE(Contains(t.AdmitPull("c", 0, 1, seconds(30), t0).error.message(), "left c"));
  EXPECT_EQ(t.stats().refusal_reasons, 2u);
}

// A reason leaves with its tombstone (evicted or expired), and an id refused again after that
// is told its new reason, whatever became of the old one.
TEST(HoldTableRefusals, AReasonLeavesWithItsTombstoneAndAReRefusedIdHearsTheNewOne) {
  HoldConfig c = LeaseConfig(30, 60);
  c.max_tombstones = 2;
  c.max_refusal_reasons = 2;
  HoldTable t(c);
  ASSERT_TRUE(t.Refuse("x", Status(ErrorCode::kCancelled, "first"), t0).ok());
  ASSERT_TRUE(t.Refuse("y", Status(ErrorCode::kCancelled, "why y"), t0).ok());
  ASSERT_TRUE(t.Refuse("z", Status(ErrorCode::kCancelled, "why z"), t0).ok());  // evicts x
  EXPECT_FALSE(t.IsTombstoned("x"));
  ASSERT_TRUE(t.Refuse("x", Status(ErrorCode::kCancelled, "second"), t0).ok());  // evicts y
  const std::string x = t.AdmitPull("x", 0, 1, seconds(30), t0).error.message();
  EXPECT_TRUE(Contains(x, "second")) << x;
  EXPECT_FALSE(Contains(x, "first")) << x;
  EXPECT_TRUE(Contains(t.AdmitPull("z", 0, 1, seconds(30), t0).error.message(), "why z"));
  EXPECT_EQ(t.stats().refusal_reasons, 2u);  // z's and x's: y's left with its tombstone
  // Expired with their tombstones; refused again later, the id keeps the newest words.
  t.Expire(t0 + seconds(61));
  EXPECT_FALSE(t.IsTombstoned("x"));
  EXPECT_EQ(t.stats().refusal_reasons, 0u);
  ASSERT_TRUE(t.Refuse("x", Status(ErrorCode::kCancelled, "third"), t0 + seconds(62)).ok());
  EXPECT_TRUE(
      Contains(t.AdmitPull("x", 0, 1, seconds(30), t0 + seconds(62)).error.message(), "third"));
}

// Many refusals: only the newest max_refusal_reasons keep their words, every id stays refused.
TEST(HoldTableRefusals, OnlyTheNewestReasonsAreKeptThroughAFloodOfRefusals) {
  HoldConfig c = LeaseConfig(30);
  c.max_tombstones = 1000;
  c.max_refusal_reasons = 100;
  HoldTable t(c);
  for (int i = 0; i < 5000; ++i) {
    ASSERT_TRUE(t.Refuse("r" + std::to_string(i), Status(ErrorCode::kCancelled, "gone"), t0).ok());
  }
  EXPECT_FALSE(t.IsTombstoned("r3999"));  // beyond max_tombstones
  for (int i = 4000; i < 5000; ++i) {
    const std::string heard =
        t.AdmitPull("r" + std::to_string(i), 0, 1, seconds(30), t0).error.message();
    EXPECT_EQ(Contains(heard, "gone"), i >= 4900) << i << ": " << heard;
    EXPECT_TRUE(t.IsTombstoned("r" + std::to_string(i)));
  }
  EXPECT_EQ(t.stats().refusal_reasons, 100u);
}

// A refusal never touches a transfer another request has admitted (a duplicate submission).
TEST(HoldTableRefusals, RefusalOfAnAdmittedTransferChangesNothing) {
  HoldTable t(LeaseConfig(30));
  ASSERT_TRUE(t.Admit("x", 1, t0).ok());
  EXPECT_EQ(t.Refuse("x", Status(ErrorCode::kInvalidArgument, "too large"), t0).code(),
            ErrorCode::kAlreadyExists);
  EXPECT_EQ(t.PhaseOf("x"), HoldPhase::kPrefilling);
  EXPECT_FALSE(t.IsTombstoned("x"));
  EXPECT_TRUE(t.TakeEvents().empty());
}

// The sum over ranks (/metrics) adds every field: each field of `b` holds its own value, so a
// field the sum skipped or added twice shows in the comparison.
TEST(HoldStatsSum, AddsEveryFieldOnce) {
  HoldStats a;
  HoldStats b;
  std::uint64_t v = 1;
  for (HoldPhase phase : kAllHoldPhases) b.entries[phase] = v++;
  for (ReleaseReason reason : kAllReleaseReasons) b.released[reason] = v++;
  for (std::uint64_t* f : {&b.blocks_ready, &b.sending, &b.renewals_extended, &b.renewals_unknown,
                           &b.renewals_rejected, &b.late_pulls_rejected, &b.tombstone_hits,
                           &b.tombstones_evicted, &b.decoder_releases,
                           &b.decoder_releases_ignored}) {
    *f = v++;
  }
  b.tombstones = v++;
  b.refusal_reasons = v++;
  a += b;
  a += b;
  for (HoldPhase phase : kAllHoldPhases) EXPECT_EQ(a.entries[phase], 2 * b.entries[phase]);
  for (ReleaseReason reason : kAllReleaseReasons) {
    EXPECT_EQ(a.released[reason], 2 * b.released[reason]);
  }
  EXPECT_EQ(a.blocks_ready, 2 * b.blocks_ready);
  EXPECT_EQ(a.sending, 2 * b.sending);
  EXPECT_EQ(a.tombstones, 2 * b.tombstones);
  EXPECT_EQ(a.refusal_reasons, 2 * b.refusal_reasons);
  EXPECT_EQ(a.renewals_extended, 2 * b.renewals_extended);
  EXPECT_EQ(a.renewals_unknown, 2 * b.renewals_unknown);
  EXPECT_EQ(a.renewals_rejected, 2 * b.renewals_rejected);
  EXPECT_EQ(a.late_pulls_rejected, 2 * b.late_pulls_rejected);
  EXPECT_EQ(a.tombstone_hits, 2 * b.tombstone_hits);
  EXPECT_EQ(a.tombstones_evicted, 2 * b.tombstones_evicted);
  EXPECT_EQ(a.decoder_releases, 2 * b.decoder_releases);
  EXPECT_EQ(a.decoder_releases_ignored, 2 * b.decoder_releases_ignored);
}

}  // namespace
}  // namespace kvferry::core
