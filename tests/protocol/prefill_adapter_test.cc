// PrefillAdapter: P's engine glue, each decision with its test (docs/design.md, "The engine
// adapter"), and a property over arbitrary interleavings of rank answers and hold events.
#include "protocol/prefill_adapter.h"

#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <algorithm>

namespace kvferry::protocol {
namespace {

using Kind = PrefillRankCall::Kind;

std::vector<std::pair<std::uint32_t, Kind>> Calls(PrefillAdapter& a) {
  std::vector<std::pair<std::uint32_t, Kind>> out;
  for (const PrefillRankCall& c : a.TakeCommands()) out.emplace_back(c.rank, c.kind);
  return out;
}

template <typename T>
std::vector<T> Only(const std::vector<PrefillAdapterEvent>& events) {
  std::vector<T> out;
  for (const PrefillAdapterEvent& e : events) {
    if (const T* t = std::get_if<T>(&e)) out.push_back(*t);
  }
  return out;
}

core::HoldEvent Hold(core::HoldEvent::Kind kind, const core::TransferId& id,
                     core::ReleaseReason reason = core::ReleaseReason::kSent) {
  core::HoldEvent e;
  e.kind = kind;
  e.id = id;
  e.handle = 7;
  e.reason = reason;
  return e;
}

// Admitted on every rank (the calls and the event taken).
PrefillAdapter AdmittedOn(std::uint32_t ranks) {
  PrefillAdapter a({.ranks = ranks});
  EXPECT_TRUE(a.Admit("x", 7).ok());
  for (std::uint32_t r = 0; r < ranks; ++r) a.OnAdmitted(r, "x", Status::Ok());
  (void)a.TakeCommands();
  EXPECT_EQ(Only<Admitted>(a.TakeEvents()).size(), 1u);
  return a;
}

TEST(PrefillAdapterTest, ATransferIsAdmittedOnlyOnceEveryRankAdmittedIt) {
  PrefillAdapter a({.ranks = 2});
  ASSERT_TRUE(a.Admit("x", 7).ok());
  EXPECT_EQ(Calls(a), (std::vector<std::pair<std::uint32_t, Kind>>{{0, Kind::kAdmit},
                                                                    {1, Kind::kAdmit}}));
  a.OnAdmitted(1, "x", Status::Ok());
  EXPECT_TRUE(a.TakeEvents().empty());
  a.OnAdmitted(0, "x", Status::Ok());
  const auto admitted = Only<Admitted>(a.TakeEvents());
  ASSERT_EQ(admitted.size(), 1u);
  EXPECT_EQ(admitted[0].handle, 7u);
}

// Layer writes are a hint the ranks act on only for the request every rank admitted: a
// refused or duplicate transfer id must not lend this request's blocks to another's pull.
TEST(PrefillAdapterTest, LayersGoToEveryRankOnlyWhileTheTransferIsAdmittedForThatHandle) {
  PrefillAdapter a = AdmittedOn(2);
  const std::vector<core::BlockId> blocks{3, 4};
  const std::vector<std::uint32_t> planes{0, 1};
  EXPECT_FALSE(a.LayersReady("x", 8, blocks, planes));  // another request's handle
  EXPECT_FALSE(a.LayersReady("y", 7, blocks, planes));  // not known
  EXPECT_TRUE(a.TakeCommands().empty());
  ASSERT_TRUE(a.LayersReady("x", 7, blocks, planes));
  std::vector<PrefillRankCall> calls = a.TakeCommands();
  ASSERT_EQ(calls.size(), 2u);
  for (std::uint32_t r = 0; r < 2; ++r) {
    EXPECT_EQ(calls[r].rank, r);
    EXPECT_EQ(calls[r].kind, Kind::kLayersReady);
    EXPECT_EQ(calls[r].blocks, blocks);
    EXPECT_EQ(calls[r].planes, planes);
  }
  EXPECT_TRUE(a.TakeEvents().empty());  // not answered: nothing waits for it
  ASSERT_TRUE(a.PrefillDone("x", blocks).ok());
  (void)a.TakeCommands();
  EXPECT_FALSE(a.LayersReady("x", 7, blocks, planes));  // handed off already
  EXPECT_TRUE(a.TakeCommands().empty());
}

TEST(PrefillAdapterTest, LayersOfATransferBeingAdmittedRefusedOrFinishedGoNowhere) {
  PrefillAdapter a({.ranks = 2});
  ASSERT_TRUE(a.Admit("x", 7).ok());
  (void)a.TakeCommands();
  EXPECT_FALSE(a.LayersReady("x", 7, {1}, {0}));  // one rank has not answered yet
  a.OnAdmitted(0, "x", Status::Ok());
  a.OnAdmitted(1, "x", Status(ErrorCode::kTombstoned, "released by D"));
  (void)a.TakeCommands();
  EXPECT_FALSE(a.LayersReady("x", 7, {1}, {0}));  // refused
  PrefillAdapter b = AdmittedOn(1);
  b.Finish("x");
  (void)b.TakeCommands();
  EXPECT_FALSE(b.LayersReady("x", 7, {1}, {0}));
  EXPECT_TRUE(a.TakeCommands().empty());
  EXPECT_TRUE(b.TakeCommands().empty());
}

TEST(PrefillAdapterTest, ARefusalOnOneRankRollsBackTheOthersAndPrefillDoneThenFreesAtOnce) {
  PrefillAdapter a({.ranks = 3});
  ASSERT_TRUE(a.Admit("x", 7).ok());
  (void)a.TakeCommands();
  a.OnAdmitted(0, "x", Status::Ok());
  a.OnAdmitted(1, "x", Status(ErrorCode::kTombstoned, "released by D"));
  a.OnAdmitted(2, "x", Status::Ok());
  EXPECT_EQ(Calls(a), (std::vector<std::pair<std::uint32_t, Kind>>{
                          {0, Kind::kEngineFinished}, {2, Kind::kEngineFinished}}));
  const auto refused = Only<AdmitRefused>(a.TakeEvents());
  ASSERT_EQ(refused.size(), 1u);
  EXPECT_EQ(refused[0].why.code(), ErrorCode::kTombstoned);
  // vLLM prefills it anyway: its blocks come back at once, no rank is asked to hold them.
  ASSERT_TRUE(a.PrefillDone("x", {1, 2}).ok());
  EXPECT_TRUE(a.TakeCommands().empty());
  EXPECT_EQ(Only<FreeBlocks>(a.TakeEvents()).size(), 1u);
  EXPECT_EQ(a.stats().transfers, 0u);
}

TEST(PrefillAdapterTest, ADuplicateTransferIdIsRefusedAndTheFirstKeepsIt) {
  PrefillAdapter a = AdmittedOn(2);
  EXPECT_EQ(a.Admit("x", 8).code(), ErrorCode::kAlreadyExists);
  EXPECT_TRUE(a.TakeCommands().empty());
  ASSERT_TRUE(a.PrefillDone("x", {3}).ok());
  for (const PrefillRankCall& c : a.TakeCommands()) {
    EXPECT_EQ(c.kind, Kind::kPrefillDone);
    EXPECT_EQ(c.handle, 7u) << "the first request's blocks";
    EXPECT_EQ(c.blocks, (std::vector<core::BlockId>{3}));
  }
}

TEST(PrefillAdapterTest, BlocksAreFreedOnlyOnceNoRankHoldsThem) {
  PrefillAdapter a = AdmittedOn(2);
  ASSERT_TRUE(a.PrefillDone("x", {3, 4}).ok());
  (void)a.TakeCommands();
  a.OnPrefillDone(0, "x", Status::Ok());
  a.OnPrefillDone(1, "x", Status::Ok());
  EXPECT_EQ(a.stats().held, 1u);
  a.OnHoldEvent(0, Hold(core::HoldEvent::Kind::kFreeBlocks, "x"));
  EXPECT_TRUE(a.TakeEvents().empty());
  a.OnHoldEvent(0, Hold(core::HoldEvent::Kind::kFreeBlocks, "x"));  // twice: a stray
  EXPECT_EQ(a.stats().stray_results, 1u);
  a.OnHoldEvent(1, Hold(core::HoldEvent::Kind::kFreeBlocks, "x"));
  EXPECT_EQ(Only<FreeBlocks>(a.TakeEvents()).size(), 1u);
  EXPECT_EQ(a.stats().transfers, 0u);
}

TEST(PrefillAdapterTest, ARankThatCannotHoldItFailsTheHandOffAndTheOthersLetGo) {
  PrefillAdapter a = AdmittedOn(3);
  ASSERT_TRUE(a.PrefillDone("x", {3}).ok());
  (void)a.TakeCommands();
  a.OnPrefillDone(0, "x", Status::Ok());
  a.OnPrefillDone(1, "x", Status(ErrorCode::kNotFound, "its lease lapsed"));
  a.OnPrefillDone(2, "x", Status::Ok());
  const auto failed = Only<HandOffFailed>(a.TakeEvents());
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_EQ(failed[0].why.code(), ErrorCode::kNotFound);
  EXPECT_EQ(Calls(a), (std::vector<std::pair<std::uint32_t, Kind>>{
                          {0, Kind::kEngineFinished}, {2, Kind::kEngineFinished}}));
  a.OnHoldEvent(0, Hold(core::HoldEvent::Kind::kFreeBlocks, "x"));
  a.OnHoldEvent(2, Hold(core::HoldEvent::Kind::kFreeBlocks, "x"));
  EXPECT_EQ(Only<FreeBlocks>(a.TakeEvents()).size(), 1u);
}

TEST(PrefillAdapterTest, ARankAbortingThePrefillStopsTheRequestOnceAndItsHandOffFails) {
  PrefillAdapter a = AdmittedOn(2);
  a.OnHoldEvent(0, Hold(core::HoldEvent::Kind::kAbortPrefill, "x",
                        core::ReleaseReason::kDeadDecoder));
  a.OnHoldEvent(1, Hold(core::HoldEvent::Kind::kAbortPrefill, "x",
                        core::ReleaseReason::kDeadDecoder));
  const auto aborted = Only<AbortPrefill>(a.TakeEvents());
  ASSERT_EQ(aborted.size(), 1u);
  EXPECT_EQ(aborted[0].reason, core::ReleaseReason::kDeadDecoder);
  // An engine that learns of the request only now (`kvferry serve` admits on another thread)
  // can still ask whether it was told to stop it.
  EXPECT_TRUE(a.abort_told("x"));
  EXPECT_FALSE(a.abort_told("other"));
  // An engine that finishes the prefill all the same: nothing is held, the blocks come back.
  ASSERT_TRUE(a.PrefillDone("x", {3}).ok());
  EXPECT_TRUE(a.TakeCommands().empty());
  const std::vector<PrefillAdapterEvent> events = a.TakeEvents();
  EXPECT_EQ(Only<HandOffFailed>(events).size(), 1u);
  EXPECT_EQ(Only<FreeBlocks>(events).size(), 1u);
  EXPECT_FALSE(a.abort_told("x")) << "forgotten with the transfer";
}

TEST(PrefillAdapterTest, FinishBeforeTheHandOffReleasesEveryRankAndTheEngineKeepsItsBlocks) {
  PrefillAdapter a = AdmittedOn(2);
  a.Finish("x");
  EXPECT_EQ(Calls(a), (std::vector<std::pair<std::uint32_t, Kind>>{
                          {0, Kind::kEngineFinished}, {1, Kind::kEngineFinished}}));
  EXPECT_TRUE(a.TakeEvents().empty()) << "no FreeBlocks: the engine frees its own blocks";
  EXPECT_EQ(a.stats().transfers, 0u);
  a.Finish("x");  // idempotent
  EXPECT_TRUE(a.TakeCommands().empty());
}

TEST(PrefillAdapterTest, FinishAfterTheHandOffLetsEveryRankGoAndFreesThroughTheHoldTables) {
  PrefillAdapter a = AdmittedOn(2);
  ASSERT_TRUE(a.PrefillDone("x", {3}).ok());
  (void)a.TakeCommands();
  a.OnPrefillDone(0, "x", Status::Ok());
  a.Finish("x");  // rank 1's answer still due
  EXPECT_EQ(Calls(a), (std::vector<std::pair<std::uint32_t, Kind>>{{0, Kind::kEngineFinished}}));
  a.OnPrefillDone(1, "x", Status::Ok());
  EXPECT_EQ(Calls(a), (std::vector<std::pair<std::uint32_t, Kind>>{{1, Kind::kEngineFinished}}));
  a.OnHoldEvent(0, Hold(core::HoldEvent::Kind::kFreeBlocks, "x"));
  a.OnHoldEvent(1, Hold(core::HoldEvent::Kind::kFreeBlocks, "x"));
  EXPECT_EQ(Only<FreeBlocks>(a.TakeEvents()).size(), 1u);
}

TEST(PrefillAdapterTest, ARequestDroppedBeforeAdmissionIsTombstonedOnEveryRank) {
  PrefillAdapter a({.ranks = 2});
  a.Drop("y", Status(ErrorCode::kCancelled, "aborted while it queued"));
  const std::vector<PrefillRankCall> calls = a.TakeCommands();
  ASSERT_EQ(calls.size(), 2u);
  for (const PrefillRankCall& c : calls) {
    EXPECT_EQ(c.kind, Kind::kRefuse);
    EXPECT_EQ(c.why.message(), "aborted while it queued");
  }
  // A transfer another request holds is left alone.
  PrefillAdapter b = AdmittedOn(1);
  b.Drop("x", Status(ErrorCode::kCancelled, "?"));
  EXPECT_TRUE(b.TakeCommands().empty());
}

TEST(PrefillAdapterTest, BadIdsAndTransfersBeyondTheBoundAreRefusedAndChangeNothing) {
  PrefillAdapter a({.ranks = 1, .max_transfers = 1});
  EXPECT_EQ(a.Admit("", 1).code(), ErrorCode::kInvalidArgument);
  ASSERT_TRUE(a.Admit("x", 1).ok());
  (void)a.TakeCommands();
  EXPECT_EQ(a.Admit("y", 2).code(), ErrorCode::kResourceExhausted);
  EXPECT_EQ(a.PrefillDone("z", {1}).code(), ErrorCode::kNotFound);
  EXPECT_EQ(a.PrefillDone("x", {1}).code(), ErrorCode::kAlreadyExists) << "still admitting";
  EXPECT_TRUE(a.TakeCommands().empty());
  a.OnAdmitted(3, "x", Status::Ok());  // no such rank
  EXPECT_EQ(a.stats().stray_results, 1u);
}

// For any interleaving of rank answers and hold events: FreeBlocks comes at most once, only
// after the hand-off and when no rank holds the blocks; a rank is asked to hold only what it
// admitted; and once every rank's answer and free came, the transfer is forgotten.
RC_GTEST_PROP(PrefillAdapterProperties, FreesOnlyWhatNoRankHolds, ()) {
  const auto ranks = *rc::gen::inRange<std::uint32_t>(1, 5);
  const auto admit_ok = *rc::gen::container<std::vector<bool>>(ranks, rc::gen::arbitrary<bool>());
  const auto done_ok = *rc::gen::container<std::vector<bool>>(ranks, rc::gen::arbitrary<bool>());
  const auto order = *rc::gen::container<std::vector<std::uint32_t>>(
      ranks * 3, rc::gen::inRange<std::uint32_t>(0, ranks));
  PrefillAdapter a({.ranks = ranks});
  RC_ASSERT(a.Admit("x", 1).ok());
  (void)a.TakeCommands();
  for (std::uint32_t r = 0; r < ranks; ++r) {
    a.OnAdmitted(r, "x", admit_ok[r] ? Status::Ok() : Status(ErrorCode::kTombstoned, "t"));
  }
  const bool admitted = std::all_of(admit_ok.begin(), admit_ok.end(), [](bool b) { return b; });
  (void)a.TakeCommands();
  RC_ASSERT(a.PrefillDone("x", {1}).ok());
  std::vector<bool> asked(ranks, false);
  for (const PrefillRankCall& c : a.TakeCommands()) {
    RC_ASSERT(c.kind == Kind::kPrefillDone);
    RC_ASSERT(admitted);
    asked[c.rank] = true;
  }
  std::vector<bool> holding(ranks, false);
  std::vector<bool> answered(ranks, false);
  int frees = 0;
  auto count = [&] {
    for (const PrefillAdapterEvent& e : a.TakeEvents()) {
      if (std::holds_alternative<FreeBlocks>(e)) {
        ++frees;
        RC_ASSERT(std::none_of(holding.begin(), holding.end(), [](bool h) { return h; }));
      }
    }
    (void)a.TakeCommands();
  };
  count();
  for (std::uint32_t r : order) {
    if (asked[r] && !answered[r]) {
      answered[r] = true;
      a.OnPrefillDone(r, "x", done_ok[r] ? Status::Ok() : Status(ErrorCode::kNotFound, "n"));
      holding[r] = done_ok[r];
    } else {
      a.OnHoldEvent(r, Hold(core::HoldEvent::Kind::kFreeBlocks, "x"));
      holding[r] = false;
    }
    count();
    RC_ASSERT(frees <= 1);
  }
  const bool all_answered =
      std::equal(asked.begin(), asked.end(), answered.begin());
  const bool none_holding = std::none_of(holding.begin(), holding.end(), [](bool h) { return h; });
  if (!admitted || (all_answered && none_holding)) {
    RC_ASSERT(frees == 1);
    RC_ASSERT(a.stats().transfers == 0u);
  } else {
    RC_ASSERT(frees == 0);
  }
}

}  // namespace
}  // namespace kvferry::protocol
