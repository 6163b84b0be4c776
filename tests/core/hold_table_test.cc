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
  ASSERT_EQ(events.size(), 1u) << "only the waiting pull is answered; the engine owns the blocks";
  EXPECT_EQ(events[0].kind, Kind::kPullsFailed);
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

}  // namespace
}  // namespace kvferry::core
