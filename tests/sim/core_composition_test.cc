// Found by exploration (message duplication): how a transport duplicate of a pull composes
// HoldTable and ReceiveLedger into a write-after-free unless P drops the duplicate unanswered.
//
// P's hold correctly refuses a second writer for the same (transfer, D rank). But if P answers
// the duplicate with that refusal as an `err`, D's ledger cannot tell it from a failure of the
// original pull (responses name only the request): the entry settles as failed, the receive
// completes, D frees the blocks — while the original WRITE is still in flight. Pulls therefore
// need an id, and a P worker must drop a pull id it has already seen (the simulator's P worker
// does; the wire protocol and runtime must too).
#include <gtest/gtest.h>

#include "kvferry/core/hold_table.h"
#include "kvferry/core/receive_ledger.h"

namespace kvferry::core {
namespace {

TEST(CoreComposition, DuplicatePullRefusalLooksLikeAFailureToD) {
  const TimePoint t0{};
  HoldTable hold(HoldConfig{});
  ASSERT_TRUE(hold.Admit("xfer-1", 1, t0).ok());
  ASSERT_TRUE(hold.PrefillDone("xfer-1", 4, t0).ok());
  ASSERT_EQ(hold.AdmitPull("xfer-1", 0, 1, std::nullopt, t0).verdict,
            PullAdmission::Verdict::kReady);
  ASSERT_TRUE(hold.BeginSend("xfer-1", 0, t0).ok());  // the original WRITE is in flight

  // The network delivers the same pull again.
  const PullAdmission dup = hold.AdmitPull("xfer-1", 0, 1, std::nullopt, t0);
  ASSERT_NE(dup.verdict, PullAdmission::Verdict::kReady) << "two writers for one D rank";
  ASSERT_EQ(dup.verdict, PullAdmission::Verdict::kFail);

  // Were that refusal sent to D as `err`, D would complete and free during the WRITE:
  ReceiveLedger ledger;
  const PeerId peers[] = {0};
  ASSERT_TRUE(ledger.Begin("req-1", {10, 11, 12, 13}, peers).ok());
  ASSERT_EQ(ledger.Settle("req-1", 0, Settle::kErr, dup.error), SettleOutcome::kSettled);
  const std::vector<LedgerEvent> events = ledger.TakeEvents();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, LedgerEvent::Kind::kCompleted);
  EXPECT_FALSE(events[0].quarantined);  // blocks reusable at once, yet P is still writing
}

}  // namespace
}  // namespace kvferry::core
