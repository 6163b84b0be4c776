// DecodeAdapter: the engine glue's decisions, each with its test (docs/design.md, "The engine
// adapter"), and a property over arbitrary interleavings of rank results.
#include "protocol/decode_adapter.h"

#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <algorithm>

namespace kvferry::protocol {
namespace {

const RemoteSource kSource{"xfer-1", "prefill-0", "127.0.0.1:8998"};

std::vector<DecodeRankCall::Kind> Kinds(const std::vector<DecodeRankCall>& calls) {
  std::vector<DecodeRankCall::Kind> kinds;
  for (const DecodeRankCall& c : calls) kinds.push_back(c.kind);
  return kinds;
}

template <typename T>
std::vector<T> Only(const std::vector<AdapterEvent>& events) {
  std::vector<T> out;
  for (const AdapterEvent& e : events) {
    if (const T* t = std::get_if<T>(&e)) out.push_back(*t);
  }
  return out;
}

DecodeAdapter Loading(std::uint32_t ranks) {
  DecodeAdapter adapter({.ranks = ranks});
  EXPECT_TRUE(adapter.Track("r", kSource).ok());
  EXPECT_TRUE(adapter.StartLoad("r", kSource, {4, 5}).ok());
  (void)adapter.TakeCommands();
  return adapter;
}

TEST(DecodeAdapterTest, EveryEngineCallBecomesTheSameCallOnEveryRank) {
  DecodeAdapter adapter({.ranks = 3});
  ASSERT_TRUE(adapter.Track("r", kSource).ok());
  ASSERT_TRUE(adapter.StartLoad("r", kSource, {7, 8}).ok());
  adapter.Finish("r");
  const std::vector<DecodeRankCall> calls = adapter.TakeCommands();
  ASSERT_EQ(calls.size(), 9u);
  for (std::uint32_t i = 0; i < 9; ++i) {
    EXPECT_EQ(calls[i].rank, i % 3);
    EXPECT_EQ(calls[i].request, "r");
    EXPECT_EQ(calls[i].source.transfer_id, "xfer-1");
  }
  EXPECT_EQ(calls[0].kind, DecodeRankCall::Kind::kTrack);
  EXPECT_EQ(calls[3].kind, DecodeRankCall::Kind::kStartLoad);
  EXPECT_EQ(calls[3].blocks, (std::vector<core::BlockId>{7, 8}));
  EXPECT_EQ(calls[6].kind, DecodeRankCall::Kind::kFinish);
}

TEST(DecodeAdapterTest, ALoadEndsOnlyWhenEveryRankEndedWithTheFirstFailure) {
  DecodeAdapter adapter = Loading(3);
  adapter.OnReceiveDone(1, "r", false, Status(ErrorCode::kTimeout, "rank 1 timed out"), false);
  adapter.OnReceiveDone(0, "r", true, {}, false);
  EXPECT_TRUE(adapter.TakeEvents().empty());
  adapter.OnReceiveDone(2, "r", false, Status(ErrorCode::kUnavailable, "rank 2"), false);
  const auto done = Only<LoadDone>(adapter.TakeEvents());
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].status.code(), ErrorCode::kTimeout);
  EXPECT_FALSE(done[0].quarantined);
}

TEST(DecodeAdapterTest, ARankWhoseStartFailedCountsAsEndedWithNothingToQuarantine) {
  DecodeAdapter adapter = Loading(2);
  adapter.OnStartFailed(0, "r", Status(ErrorCode::kOutOfRange, "block 5 outside the region"));
  adapter.OnReceiveDone(1, "r", true, {}, false);
  const std::vector<AdapterEvent> events = adapter.TakeEvents();
  ASSERT_EQ(Only<LoadDone>(events).size(), 1u);
  EXPECT_EQ(Only<LoadDone>(events)[0].status.code(), ErrorCode::kOutOfRange);
  ASSERT_EQ(Only<BlocksReusable>(events).size(), 1u);
  EXPECT_FALSE(Only<BlocksReusable>(events)[0].after_quarantine);
}

TEST(DecodeAdapterTest, BlocksAreReusableOnlyOnceEveryQuarantiningRankReleasedThem) {
  DecodeAdapter adapter = Loading(2);
  adapter.OnReceiveDone(0, "r", false, Status(ErrorCode::kTimeout, "pull timed out"), true);
  adapter.OnReceiveDone(1, "r", false, Status(ErrorCode::kTimeout, "pull timed out"), true);
  std::vector<AdapterEvent> events = adapter.TakeEvents();
  ASSERT_EQ(Only<LoadDone>(events).size(), 1u);
  EXPECT_TRUE(Only<LoadDone>(events)[0].quarantined);
  EXPECT_TRUE(Only<BlocksReusable>(events).empty());
  EXPECT_EQ(adapter.stats().quarantined, 1u);
  adapter.OnReleased(1, "r");
  EXPECT_TRUE(adapter.TakeEvents().empty());
  adapter.OnReleased(1, "r");  // twice: a stray, changes nothing
  EXPECT_TRUE(adapter.TakeEvents().empty());
  EXPECT_EQ(adapter.stats().stray_results, 1u);
  adapter.OnReleased(0, "r");
  const auto reusable = Only<BlocksReusable>(adapter.TakeEvents());
  ASSERT_EQ(reusable.size(), 1u);
  EXPECT_TRUE(reusable[0].after_quarantine);
  EXPECT_EQ(adapter.stats().quarantined, 0u);
}

TEST(DecodeAdapterTest, AFinishedRequestIsForgottenOnlyOnceItsBlocksAreReusable) {
  DecodeAdapter adapter = Loading(1);
  adapter.Finish("r");  // the client left while the load ran
  EXPECT_EQ(Kinds(adapter.TakeCommands()), std::vector{DecodeRankCall::Kind::kFinish});
  EXPECT_EQ(adapter.stats().tracked, 1u);
  adapter.OnReceiveDone(0, "r", false, Status(ErrorCode::kTimeout, "t"), true);
  EXPECT_EQ(adapter.stats().tracked, 1u);
  adapter.OnReleased(0, "r");
  EXPECT_EQ(Only<BlocksReusable>(adapter.TakeEvents()).size(), 1u);
  EXPECT_EQ(adapter.stats().tracked, 0u);
  adapter.Finish("r");  // idempotent: nothing more is called
  EXPECT_TRUE(adapter.TakeCommands().empty());
}

TEST(DecodeAdapterTest, ADuplicateRequestIdIsRefusedAndTheFirstGoesOnUntouched) {
  DecodeAdapter adapter({.ranks = 2});
  ASSERT_TRUE(adapter.Track("r", kSource).ok());
  (void)adapter.TakeCommands();
  const RemoteSource other{"xfer-2", "prefill-1", "10.0.0.2:8998"};
  EXPECT_EQ(adapter.Track("r", other).code(), ErrorCode::kAlreadyExists);
  EXPECT_TRUE(adapter.TakeCommands().empty());
  ASSERT_TRUE(adapter.StartLoad("r", kSource, {1}).ok());
  (void)adapter.TakeCommands();
  EXPECT_EQ(adapter.StartLoad("r", kSource, {2}).code(), ErrorCode::kAlreadyExists);
  EXPECT_TRUE(adapter.TakeCommands().empty());
  EXPECT_EQ(adapter.stats().loading, 1u);
}

TEST(DecodeAdapterTest, RequestsWithoutIdsOrBeyondTheBoundAreRefusedAndChangeNothing) {
  DecodeAdapter adapter({.ranks = 1, .max_requests = 2});
  EXPECT_EQ(adapter.Track("", kSource).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(adapter.Track("r", {"", "e", "a"}).code(), ErrorCode::kInvalidArgument);
  ASSERT_TRUE(adapter.Track("a", kSource).ok());
  ASSERT_TRUE(adapter.Track("b", kSource).ok());
  (void)adapter.TakeCommands();
  EXPECT_EQ(adapter.Track("c", kSource).code(), ErrorCode::kResourceExhausted);
  EXPECT_EQ(adapter.StartLoad("c", kSource, {1}).code(), ErrorCode::kResourceExhausted);
  EXPECT_TRUE(adapter.TakeCommands().empty());
  EXPECT_EQ(adapter.stats().tracked, 2u);
}

TEST(DecodeAdapterTest, ARefusedRequestIsReleasedToPOnEveryRank) {
  DecodeAdapter adapter({.ranks = 2});
  adapter.Refuse(kSource);
  const std::vector<DecodeRankCall> calls = adapter.TakeCommands();
  ASSERT_EQ(calls.size(), 2u);
  for (const DecodeRankCall& c : calls) {
    EXPECT_EQ(c.kind, DecodeRankCall::Kind::kRelease);
    EXPECT_EQ(c.source.transfer_id, "xfer-1");
  }
  EXPECT_EQ(adapter.stats().tracked, 0u);
}

TEST(DecodeAdapterTest, PsAbortNoticeIsToldOnceAndItsLoadFailsAtOnceWithoutARankCall) {
  DecodeAdapter adapter({.ranks = 2});
  ASSERT_TRUE(adapter.Track("r", kSource).ok());
  (void)adapter.TakeCommands();
  adapter.OnTransferAborted(0, "r", Status(ErrorCode::kTimeout, "no decoder renewed it"));
  adapter.OnTransferAborted(1, "r", Status(ErrorCode::kTimeout, "no decoder renewed it"));
  const auto dropped = Only<TransferDropped>(adapter.TakeEvents());
  ASSERT_EQ(dropped.size(), 1u);
  EXPECT_EQ(dropped[0].why.message(), "no decoder renewed it");
  EXPECT_EQ(adapter.stats().dropped, 1u);
  // An engine that cannot end a queued request (vLLM) schedules it: it fails unpulled.
  ASSERT_TRUE(adapter.StartLoad("r", kSource, {3}).ok());
  EXPECT_TRUE(adapter.TakeCommands().empty());
  const std::vector<AdapterEvent> events = adapter.TakeEvents();
  ASSERT_EQ(Only<LoadDone>(events).size(), 1u);
  EXPECT_EQ(Only<LoadDone>(events)[0].status.code(), ErrorCode::kTimeout);
  EXPECT_NE(Only<LoadDone>(events)[0].status.message().find("no decoder renewed it"),
            std::string::npos);
  EXPECT_EQ(Only<BlocksReusable>(events).size(), 1u);
}

TEST(DecodeAdapterTest, AnAbortNoticeForALoadAlreadyStartedChangesNothing) {
  DecodeAdapter adapter = Loading(1);
  adapter.OnTransferAborted(0, "r", Status(ErrorCode::kCancelled, "late notice"));
  EXPECT_TRUE(adapter.TakeEvents().empty());
  adapter.OnReceiveDone(0, "r", true, {}, false);
  const auto done = Only<LoadDone>(adapter.TakeEvents());
  ASSERT_EQ(done.size(), 1u);
  EXPECT_TRUE(done[0].status.ok());
}

TEST(DecodeAdapterTest, ResultsForNoLoadOfThatRankAreCountedAndChangeNothing) {
  DecodeAdapter adapter = Loading(2);
  adapter.OnReceiveDone(5, "r", true, {}, false);      // no such rank
  adapter.OnReceiveDone(0, "other", true, {}, false);  // no such request
  adapter.OnReceiveDone(0, "r", true, {}, false);
  adapter.OnReceiveDone(0, "r", true, {}, false);  // twice
  EXPECT_TRUE(adapter.TakeEvents().empty());
  EXPECT_EQ(adapter.stats().stray_results, 3u);
  adapter.OnReceiveDone(1, "r", true, {}, false);
  EXPECT_EQ(Only<LoadDone>(adapter.TakeEvents()).size(), 1u);
}

TEST(DecodeAdapterTest, StopReportsWhatWasStillUnsettledAndForgetsIt) {
  DecodeAdapter adapter = Loading(2);
  adapter.OnReceiveDone(0, "r", false, Status(ErrorCode::kTimeout, "t"), true);
  ASSERT_TRUE(adapter.Track("q", kSource).ok());
  const DecodeAdapterStopReport report = adapter.Stop();
  EXPECT_EQ(report.loading, 1u);
  EXPECT_EQ(report.quarantined, 1u);
  EXPECT_EQ(adapter.stats().tracked, 0u);
  EXPECT_TRUE(adapter.TakeCommands().empty());
}

// For any interleaving of rank results (ok, failed, quarantined, start failures, releases,
// duplicates, strays) and of the engine's Finish: LoadDone comes exactly once, only after every
// rank ended; BlocksReusable exactly once, after LoadDone and only when no rank still
// quarantines; and the entry is gone only after both the engine's Finish and BlocksReusable.
struct RankStep {
  std::uint32_t rank;
  int what;  // 0 ok, 1 failed, 2 failed+quarantined, 3 start failed, 4 released, 5 finish
};

RC_GTEST_PROP(DecodeAdapterProperties, ReusesBlocksOnlyWhenNoWriterCanTouchThem, ()) {
  const auto ranks = *rc::gen::inRange<std::uint32_t>(1, 5);
  const auto steps = *rc::gen::container<std::vector<RankStep>>(rc::gen::build<RankStep>(
      rc::gen::set(&RankStep::rank, rc::gen::inRange<std::uint32_t>(0, ranks + 1)),
      rc::gen::set(&RankStep::what, rc::gen::inRange(0, 6))));
  DecodeAdapter adapter({.ranks = ranks});
  RC_ASSERT(adapter.StartLoad("r", kSource, {1, 2}).ok());
  enum class M { kLoading, kEnded, kQuarantined };
  std::vector<M> model(ranks, M::kLoading);
  bool finished = false;
  int load_done = 0;
  int reusable = 0;
  for (const RankStep& s : steps) {
    const bool real = s.rank < ranks;
    switch (s.what) {
      case 0:
      case 1:
      case 2:
        adapter.OnReceiveDone(s.rank, "r", s.what == 0, Status(ErrorCode::kTimeout, "x"),
                              s.what == 2);
        if (real && model[s.rank] == M::kLoading) {
          model[s.rank] = s.what == 2 ? M::kQuarantined : M::kEnded;
        }
        break;
      case 3:
        adapter.OnStartFailed(s.rank, "r", Status(ErrorCode::kOutOfRange, "y"));
        if (real && model[s.rank] == M::kLoading) model[s.rank] = M::kEnded;
        break;
      case 4:
        adapter.OnReleased(s.rank, "r");
        if (real && model[s.rank] == M::kQuarantined) model[s.rank] = M::kEnded;
        break;
      default:
        adapter.Finish("r");
        finished = true;
        break;
    }
    const bool all_ended = std::none_of(model.begin(), model.end(),
                                        [](M m) { return m == M::kLoading; });
    const bool none_quarantined = std::none_of(model.begin(), model.end(),
                                               [](M m) { return m == M::kQuarantined; });
    for (const AdapterEvent& e : adapter.TakeEvents()) {
      if (std::holds_alternative<LoadDone>(e)) {
        RC_ASSERT(all_ended);
        ++load_done;
      } else if (std::holds_alternative<BlocksReusable>(e)) {
        RC_ASSERT(load_done == 1);
        RC_ASSERT(all_ended && none_quarantined);
        ++reusable;
      }
    }
    RC_ASSERT(load_done == (all_ended ? 1 : 0));
    RC_ASSERT(reusable == (all_ended && none_quarantined ? 1 : 0));
    RC_ASSERT(adapter.stats().tracked == (finished && reusable == 1 ? 0u : 1u));
    if (adapter.stats().tracked == 0) break;  // forgotten: later results are strays
  }
}

}  // namespace
}  // namespace kvferry::protocol
