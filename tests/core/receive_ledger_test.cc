// ReceiveLedger: one test per multi-peer settlement rule (SPEC §3).
#include "kvferry/core/receive_ledger.h"

#include <gtest/gtest.h>

namespace kvferry::core {
namespace {

using Kind = LedgerEvent::Kind;
const PeerId kP0 = 0, kP1 = 1;
const std::vector<PeerId> kTwoPeers = {kP0, kP1};

Status Reason(const std::string& text) { return Status(ErrorCode::kUnavailable, text); }

TEST(ReceiveLedgerRules, SuccessCompletesAfterEveryPeerOk) {
  ReceiveLedger l;
  ASSERT_TRUE(l.Begin("r", {1, 2}, kTwoPeers).ok());
  EXPECT_EQ(l.Settle("r", kP0, Settle::kOk), SettleOutcome::kSettled);
  EXPECT_TRUE(l.TakeEvents().empty()) << "P1 may still be writing";
  EXPECT_EQ(l.Settle("r", kP1, Settle::kOk), SettleOutcome::kSettled);
  auto ev = l.TakeEvents();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].kind, Kind::kCompleted);
  EXPECT_TRUE(ev[0].ok);
  EXPECT_FALSE(ev[0].quarantined);
  EXPECT_EQ(l.active(), 0u);
}

TEST(ReceiveLedgerRules, OnlyAReceiveNoPeerSettledCanBeForgottenAndItLeavesNoTrace) {
  ReceiveLedger l;
  ASSERT_TRUE(l.Begin("r", {1, 2}, kTwoPeers).ok());
  EXPECT_TRUE(l.Forget("r").ok());
  EXPECT_TRUE(l.TakeEvents().empty());
  EXPECT_EQ(l.active(), 0u);
  EXPECT_EQ(l.Forget("r").code(), ErrorCode::kNotFound);
  ASSERT_TRUE(l.Begin("r", {1, 2}, kTwoPeers).ok()) << "the id is free again";
  // Once a peer answered or was given up on, its writer state matters: no forgetting.
  EXPECT_EQ(l.Settle("r", kP0, Settle::kTimeout, Reason("late")), SettleOutcome::kSettled);
  EXPECT_EQ(l.Forget("r").code(), ErrorCode::kAlreadyExists);
  EXPECT_EQ(l.active(), 1u);
}

TEST(ReceiveLedgerRules, FailureWaitsForOtherPeersBeforeCompleting) {
  // The seed's write-after-free: P0 fails while P1 still holds the destination addresses.
  ReceiveLedger l;
  ASSERT_TRUE(l.Begin("r", {1, 2}, kTwoPeers).ok());
  EXPECT_EQ(l.Settle("r", kP0, Settle::kErr, Reason("p0 failed")), SettleOutcome::kSettled);
  EXPECT_TRUE(l.TakeEvents().empty()) << "completing now would free blocks P1 writes into";
  EXPECT_EQ(l.Settle("r", kP1, Settle::kOk), SettleOutcome::kSettled);
  auto ev = l.TakeEvents();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_FALSE(ev[0].ok);
  EXPECT_EQ(ev[0].error.message(), "p0 failed");
  EXPECT_EQ(ev[0].blocks, (std::vector<BlockId>{1, 2})) << "invalid blocks reported";
}

TEST(ReceiveLedgerRules, EachSettleKindSettlesTheEntryOnce) {
  // Two peers, so the request is still receiving after the first entry settles: a second
  // settlement of that entry must be refused by the entry itself, not by a finished request.
  const Settle kinds[] = {Settle::kOk, Settle::kErr, Settle::kMessageError, Settle::kFinished,
                          Settle::kTimeout};
  for (Settle how : kinds) {
    ReceiveLedger l;
    ASSERT_TRUE(l.Begin("r", {1}, std::vector<PeerId>{kP0, kP1}).ok());
    EXPECT_EQ(l.Settle("r", kP0, how, Reason("x")), SettleOutcome::kSettled);
    EXPECT_TRUE(l.TakeEvents().empty()) << "completed while a peer is pending";
    EXPECT_TRUE(l.IsPending("r", kP1));
    for (Settle again : kinds) {
      if (how == Settle::kTimeout && again != Settle::kTimeout) continue;  // resolves, below
      EXPECT_EQ(l.Settle("r", kP0, again, Reason("again")), SettleOutcome::kAlreadySettled)
          << static_cast<int>(how) << " then " << static_cast<int>(again);
    }
    EXPECT_TRUE(l.TakeEvents().empty());
    EXPECT_EQ(l.Settle("r", kP1, Settle::kOk, {}), SettleOutcome::kSettled);
    auto ev = l.TakeEvents();
    ASSERT_EQ(ev.size(), 1u) << static_cast<int>(how);
    EXPECT_EQ(ev[0].kind, LedgerEvent::Kind::kCompleted);
    EXPECT_EQ(ev[0].ok, how == Settle::kOk);
    EXPECT_EQ(ev[0].quarantined, how == Settle::kTimeout);
  }
}

TEST(ReceiveLedgerRules, FinishSettlesPendingEntriesAsFailed) {
  // P omitted the request (e.g. it expired) and said FINISH: without this, the count never
  // reached zero and D leaked the blocks.
  ReceiveLedger l;
  ASSERT_TRUE(l.Begin("r", {1}, kTwoPeers).ok());
  ASSERT_EQ(l.Settle("r", kP0, Settle::kOk), SettleOutcome::kSettled);
  ASSERT_EQ(l.Settle("r", kP1, Settle::kFinished, Reason("finished without result")),
            SettleOutcome::kSettled);
  auto ev = l.TakeEvents();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_FALSE(ev[0].ok);
  EXPECT_EQ(l.active(), 0u);
}

TEST(ReceiveLedgerRules, FirstFailureIsReportedOnce) {
  ReceiveLedger l;
  ASSERT_TRUE(l.Begin("r", {1}, kTwoPeers).ok());
  ASSERT_EQ(l.Settle("r", kP1, Settle::kMessageError, Reason("first")), SettleOutcome::kSettled);
  ASSERT_EQ(l.Settle("r", kP0, Settle::kErr, Reason("second")), SettleOutcome::kSettled);
  auto ev = l.TakeEvents();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].error.message(), "first");
  EXPECT_EQ(l.duplicate_failures(), 1u);
}

TEST(ReceiveLedgerRules, MessagesAfterCompletionAreIgnored) {
  ReceiveLedger l;
  ASSERT_TRUE(l.Begin("r", {1}, kTwoPeers).ok());
  ASSERT_EQ(l.Settle("r", kP0, Settle::kOk), SettleOutcome::kSettled);
  ASSERT_EQ(l.Settle("r", kP1, Settle::kOk), SettleOutcome::kSettled);
  ASSERT_EQ(l.TakeEvents().size(), 1u);
  EXPECT_EQ(l.Settle("r", kP1, Settle::kErr, Reason("late")), SettleOutcome::kUnknownRequest);
  l.SettlePeer(kP0, Settle::kTimeout, Reason("late timeout"));
  EXPECT_TRUE(l.TakeEvents().empty()) << "no second completion for a running request";
}

TEST(ReceiveLedgerRules, BootstrapFailureWithNoPeersStillCompletes) {
  ReceiveLedger l;
  ASSERT_TRUE(l.Begin("r", {4, 5}, {}, Reason("bootstrap unreachable")).ok());
  auto ev = l.TakeEvents();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_FALSE(ev[0].ok);
  EXPECT_EQ(ev[0].error.message(), "bootstrap unreachable");
  EXPECT_EQ(l.active(), 0u);
}

TEST(ReceiveLedgerRules, EmptyPullProducesNoCompletion) {
  ReceiveLedger l;
  ASSERT_TRUE(l.Begin("r", {}, kTwoPeers).ok());
  EXPECT_TRUE(l.TakeEvents().empty());
  EXPECT_EQ(l.active(), 0u);
  EXPECT_EQ(l.Settle("r", kP0, Settle::kOk), SettleOutcome::kUnknownRequest);
}

TEST(ReceiveLedgerRules, TimeoutQuarantinesBlocksUntilPeerQuiesced) {
  ReceiveLedger l;
  ASSERT_TRUE(l.Begin("r", {1, 2, 3}, kTwoPeers).ok());
  ASSERT_EQ(l.Settle("r", kP0, Settle::kOk), SettleOutcome::kSettled);
  ASSERT_EQ(l.Settle("r", kP1, Settle::kTimeout, Reason("recv timeout")), SettleOutcome::kSettled);
  auto ev = l.TakeEvents();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_FALSE(ev[0].ok);
  EXPECT_TRUE(ev[0].quarantined) << "a timeout is not proof P1 stopped writing";
  EXPECT_EQ(l.quarantined_blocks(), 3u);
  l.PeerQuiesced(kP0);
  EXPECT_TRUE(l.TakeEvents().empty()) << "P0 was never the unknown writer";
  l.PeerQuiesced(kP1);
  ev = l.TakeEvents();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].kind, Kind::kBlocksReleased);
  EXPECT_EQ(ev[0].blocks, (std::vector<BlockId>{1, 2, 3}));
  EXPECT_EQ(l.quarantined_blocks(), 0u);
  EXPECT_EQ(l.active(), 0u);
}

TEST(ReceiveLedgerRules, LateAnswerFromTimedOutPeerReleasesQuarantine) {
  ReceiveLedger l;
  ASSERT_TRUE(l.Begin("r", {7}, std::vector<PeerId>{kP0}).ok());
  ASSERT_EQ(l.Settle("r", kP0, Settle::kTimeout, Reason("t")), SettleOutcome::kSettled);
  ASSERT_EQ(l.TakeEvents().size(), 1u);
  EXPECT_EQ(l.Settle("r", kP0, Settle::kOk), SettleOutcome::kResolvedQuarantine);
  auto ev = l.TakeEvents();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].kind, Kind::kBlocksReleased);
}

TEST(ReceiveLedgerRules, DeadPeerSettlesItsPendingEntries) {
  ReceiveLedger l;
  ASSERT_TRUE(l.Begin("a", {1}, kTwoPeers).ok());
  ASSERT_TRUE(l.Begin("b", {2}, std::vector<PeerId>{kP1}).ok());
  ASSERT_EQ(l.Settle("a", kP0, Settle::kOk), SettleOutcome::kSettled);
  l.PeerQuiesced(kP1);  // P1 died and its endpoint is closed: it cannot write any more
  auto ev = l.TakeEvents();
  ASSERT_EQ(ev.size(), 2u);
  for (const auto& e : ev) {
    EXPECT_FALSE(e.ok);
    EXPECT_FALSE(e.quarantined);
  }
}

TEST(ReceiveLedgerRules, RejectsDuplicateBeginAndUnknownPeer) {
  ReceiveLedger l;
  ASSERT_TRUE(l.Begin("r", {1}, kTwoPeers).ok());
  EXPECT_EQ(l.Begin("r", {1}, kTwoPeers).code(), ErrorCode::kAlreadyExists);
  EXPECT_EQ(l.Settle("r", 9, Settle::kOk), SettleOutcome::kNotAPeer);
  EXPECT_EQ(l.Begin("s", {1}, std::vector<PeerId>{kP0, kP0}).code(), ErrorCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvferry::core
