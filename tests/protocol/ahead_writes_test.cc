// AheadWrites (protocol/ahead_writes.h): one ahead write per request in flight, the planes
// computed meanwhile next; a plane written ahead once; the request's own write and its listing
// wait for the one in flight; the worst end kept; the engine's free of blocks an ahead write
// reads held until the last one ends. Through the session: layer_writes_test.cc.
#include "protocol/ahead_writes.h"

#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <vector>

namespace kvferry::protocol {
namespace {

using Then = AheadWrites::Ended::Then;
using Shared = std::shared_ptr<const std::vector<core::BlockId>>;

const RequestRef kA{1, 0};
const RequestRef kB{1, 1};
const std::vector<core::BlockId> kBlocks{4, 5, 6};

bool Note(AheadWrites& ahead, const RequestRef& ref, std::vector<std::uint32_t> planes,
          const std::vector<core::BlockId>& blocks = kBlocks) {
  Shared shared;
  return ahead.Note(ref, blocks, planes, shared);
}

core::HoldEvent FreeOf(const core::TransferId& id) {
  core::HoldEvent event;
  event.kind = core::HoldEvent::Kind::kFreeBlocks;
  event.id = id;
  return event;
}

TEST(AheadWrites, PlanesComputedWhileAWriteIsInFlightGoTogetherInTheNext) {
  AheadWrites ahead(4);
  ASSERT_TRUE(Note(ahead, kA, {1, 0}));
  EXPECT_EQ(ahead.Begin(kA, "t"), (std::vector<std::uint32_t>{0, 1}));
  EXPECT_TRUE(ahead.InFlight(kA));
  // In flight: queued, no second write now; a plane already taken is not queued again.
  EXPECT_FALSE(Note(ahead, kA, {1, 3}));
  EXPECT_FALSE(Note(ahead, kA, {2}));
  AheadWrites::Ended ended = ahead.End(kA, "t", WriteOutcome::Landed());
  ASSERT_TRUE(ended.known);
  EXPECT_EQ(ended.then, Then::kWriteMore);
  EXPECT_EQ(ahead.Begin(kA, "t"), (std::vector<std::uint32_t>{2, 3}));
  ended = ahead.End(kA, "t", WriteOutcome::Landed());
  EXPECT_EQ(ended.then, Then::kNothing);  // nothing queued meanwhile
  // Every plane landed ahead: the request's own write has nothing left to take.
  EXPECT_EQ(ahead.PlanesLeft(kA, kBlocks), std::nullopt);
  EXPECT_FALSE(Note(ahead, kA, {0, 1, 2, 3}));  // each plane is written ahead once
}

TEST(AheadWrites, TheRequestsOwnWriteTakesOnlyThePlanesNoAheadWriteTook) {
  AheadWrites ahead(4);
  EXPECT_EQ(ahead.PlanesLeft(kA, kBlocks), std::vector<std::uint32_t>{});  // none: every plane
  ASSERT_TRUE(Note(ahead, kA, {2, 0}));
  ASSERT_EQ(ahead.Begin(kA, "t").size(), 2u);
  (void)ahead.End(kA, "t", WriteOutcome::Landed());
  EXPECT_EQ(ahead.PlanesLeft(kA, kBlocks), (std::vector<std::uint32_t>{1, 3}));
  // PrefillDone named other blocks than the ahead writes read: every plane is written again.
  EXPECT_EQ(ahead.PlanesLeft(kA, std::vector<core::BlockId>{4, 5, 7}),
            std::vector<std::uint32_t>{});
}

TEST(AheadWrites, LayersOfOtherBlocksThanTheFirstCallsAreNotWrittenAhead) {
  AheadWrites ahead(2);
  ASSERT_TRUE(Note(ahead, kA, {0}));
  ahead.DropQueued(kA);  // its plan wrote nothing: the planes are left to the request's write
  EXPECT_TRUE(ahead.Begin(kA, "t").empty());
  EXPECT_FALSE(Note(ahead, kA, {1}, {9, 9, 9}));
  EXPECT_TRUE(ahead.Begin(kA, "t").empty());
  EXPECT_FALSE(ahead.InFlight(kA));
}

TEST(AheadWrites, TheOwnWriteAndTheListingWaitForTheWriteInFlightAndAreHandedBackOnce) {
  AheadWrites ahead(2);
  ASSERT_TRUE(Note(ahead, kA, {0}));
  ahead.HoldSend(kA);  // nothing in flight: nothing to wait for, nothing kept
  EXPECT_FALSE(ahead.Defer(kA, {}));
  ASSERT_FALSE(ahead.Begin(kA, "t").empty());
  EXPECT_EQ(ahead.End(kA, "t", WriteOutcome::Landed()).then, Then::kNothing)
      << "a HoldSend with no write in flight was kept";
  ASSERT_TRUE(Note(ahead, kA, {1}));
  ASSERT_FALSE(ahead.Begin(kA, "t").empty());
  ahead.HoldSend(kA);
  EXPECT_EQ(ahead.End(kA, "t", WriteOutcome::Landed()).then, Then::kSend);

  ASSERT_TRUE(Note(ahead, kB, {0}));
  ASSERT_FALSE(ahead.Begin(kB, "u").empty());
  ASSERT_TRUE(ahead.Defer(kB, {/*wave=*/3, /*ok=*/false, Status(ErrorCode::kCancelled, "gone")}));
  ASSERT_FALSE(Note(ahead, kB, {1}));  // queued, but the listing comes first
  AheadWrites::Ended ended = ahead.End(kB, "u", WriteOutcome::Landed());
  ASSERT_EQ(ended.then, Then::kList);
  ASSERT_TRUE(ended.listing.has_value());
  EXPECT_EQ(ended.listing->wave, 3u);
  EXPECT_EQ(ended.listing->status.code(), ErrorCode::kCancelled);
}

TEST(AheadWrites, AFailedAheadWriteIsKeptWithItsReasonAndTheRequestTakesNoMoreLayers) {
  AheadWrites ahead(3);
  EXPECT_EQ(ahead.Failure(kA), nullptr);
  ASSERT_TRUE(Note(ahead, kA, {0, 1}));
  ASSERT_EQ(ahead.Begin(kA, "t"), (std::vector<std::uint32_t>{0, 1}));
  EXPECT_FALSE(Note(ahead, kA, {2}));  // queued meanwhile
  EXPECT_EQ(ahead.End(kA, "t", WriteOutcome::Failed(Status(ErrorCode::kUnavailable, "first"))).then,
            Then::kNothing);  // the queued plane is not written: the request fails
  const WriteOutcome* failure = ahead.Failure(kA);
  ASSERT_NE(failure, nullptr);
  EXPECT_EQ(failure->end, WriteEnd::kFailed);
  EXPECT_EQ(failure->status.code(), ErrorCode::kUnavailable);
  EXPECT_NE(failure->status.message().find("first"), std::string::npos);
  EXPECT_FALSE(Note(ahead, kA, {2}));
  EXPECT_TRUE(ahead.Begin(kA, "t").empty());
}

TEST(AheadWrites, AnAheadWriteThatMayStillLandLeavesTheRequestUnsettled) {
  AheadWrites ahead(2);
  ASSERT_TRUE(Note(ahead, kA, {0}));
  ASSERT_FALSE(ahead.Begin(kA, "t").empty());
  (void)ahead.End(kA, "t", WriteOutcome::Unsettled(Status(ErrorCode::kTimeout, "slow")));
  const WriteOutcome* failure = ahead.Failure(kA);
  ASSERT_NE(failure, nullptr);
  EXPECT_EQ(failure->end, WriteEnd::kUnsettled);
  EXPECT_EQ(failure->status.code(), ErrorCode::kTimeout);
  EXPECT_NE(failure->status.message().find("may still land"), std::string::npos);
}

TEST(AheadWrites, TheEnginesFreeOfBlocksAnAheadWriteReadsWaitsForTheLastOfThem) {
  AheadWrites ahead(2);
  core::HoldEvent early = FreeOf("t");
  EXPECT_FALSE(ahead.HoldFree(early));  // nothing reads t: the free goes now
  ASSERT_TRUE(Note(ahead, kA, {0}));
  ASSERT_TRUE(Note(ahead, kB, {0}));
  ASSERT_FALSE(ahead.Begin(kA, "t").empty());
  ASSERT_FALSE(ahead.Begin(kB, "t").empty());
  core::HoldEvent free = FreeOf("t");
  ASSERT_TRUE(ahead.HoldFree(free));
  EXPECT_FALSE(ahead.End(kA, "t", WriteOutcome::Landed()).freed.has_value());  // B still reads
  AheadWrites::Ended last =
      ahead.End(kB, "t", WriteOutcome::Failed(Status(ErrorCode::kInternal, "x")));
  ASSERT_TRUE(last.freed.has_value());
  EXPECT_EQ(last.freed->id, "t");
  EXPECT_EQ(last.freed->kind, core::HoldEvent::Kind::kFreeBlocks);
  // Forgotten requests keep nothing; a stray end finds nothing.
  ahead.Forget(kA);
  ahead.Forget(kB);
  EXPECT_EQ(ahead.requests(), 0u);
  EXPECT_FALSE(ahead.End(kA, "t", WriteOutcome::Landed()).known);
}

// Random LayersReady / write ends / holds, as the session makes them (a write is begun only
// when Note or End says so, and each begun write ends once): at most one write in flight per
// request, no plane begun twice, every held free handed back exactly once and only after the
// last write reading its transfer ended.
RC_GTEST_PROP(AheadWrites, OneWriteInFlightEachPlaneOnceAndEveryHeldFreeHandedBackOnce, ()) {
  constexpr std::uint32_t kPlanes = 6;
  AheadWrites ahead(kPlanes);
  const std::vector<RequestRef> refs{{1, 0}, {1, 1}, {2, 0}};
  auto transfer_of = [](const RequestRef& r) { return r.request == 1 ? "u" : "t"; };
  std::map<RequestRef, std::set<std::uint32_t>> begun;
  std::map<RequestRef, bool> in_flight;
  std::map<core::TransferId, int> reads;
  std::map<core::TransferId, int> held, handed;
  auto begin = [&](const RequestRef& r) {
    std::vector<std::uint32_t> planes = ahead.Begin(r, transfer_of(r));
    RC_ASSERT(!planes.empty());
    RC_ASSERT(!in_flight[r]);
    for (std::uint32_t p : planes) RC_ASSERT(begun[r].insert(p).second);
    in_flight[r] = true;
    ++reads[transfer_of(r)];
  };
  const int steps = *rc::gen::inRange(1, 60);
  for (int i = 0; i < steps; ++i) {
    const RequestRef r = refs[*rc::gen::inRange<std::size_t>(0, refs.size())];
    switch (*rc::gen::inRange(0, 4)) {
      case 0: {
        auto planes = *rc::gen::container<std::vector<std::uint32_t>>(
            rc::gen::inRange<std::uint32_t>(0, kPlanes));
        if (Note(ahead, r, planes)) begin(r);
        break;
      }
      case 1: {
        if (!in_flight[r]) break;
        const bool ok = *rc::gen::arbitrary<bool>();
        in_flight[r] = false;
        const core::TransferId t = transfer_of(r);
        AheadWrites::Ended ended = ahead.End(
            r, t,
            ok ? WriteOutcome::Landed() : WriteOutcome::Failed(Status(ErrorCode::kInternal, "x")));
        RC_ASSERT(ended.known);
        --reads[t];
        if (ended.freed) {
          RC_ASSERT(reads[t] == 0);
          ++handed[t];
        }
        if (ended.then == Then::kWriteMore) begin(r);
        break;
      }
      case 2: {
        const core::TransferId t = transfer_of(r);
        if (held[t] > 0) break;  // the engine frees a transfer's blocks once
        core::HoldEvent event = FreeOf(t);
        if (ahead.HoldFree(event)) {
          RC_ASSERT(reads[t] > 0);
          ++held[t];
        } else {
          RC_ASSERT(reads[t] == 0);
        }
        break;
      }
      case 3:
        RC_ASSERT(ahead.InFlight(r) == in_flight[r]);
        break;
    }
  }
  for (const auto& [t, n] : handed) RC_ASSERT(n <= held[t]);
  for (const auto& [t, n] : held) {
    if (reads[t] == 0) RC_ASSERT(handed[t] == n);
  }
}

}  // namespace
}  // namespace kvferry::protocol
