// PrefillSession, sans-IO: messages, engine calls and write completions in; replies, writes and
// hold events out. No sockets and no clock: every test runs in microseconds of virtual time.
// The holes named "hole N" are those of the protocol-sessions issue; each test here failed (or
// crashed) on the listener that predates the session.
#include "protocol/prefill_session.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <variant>
#include <vector>

#include "kvferry/core/tp_plan.h"
#include "wire/messages.h"

namespace kvferry::protocol {
namespace {

using namespace std::chrono_literals;
using core::TimePoint;

constexpr TimePoint kT0{std::chrono::hours(1)};

wire::Pull MakePull(std::uint64_t id, std::vector<std::pair<std::string, std::string>> requests,
                    std::optional<std::uint64_t> d_lease_ms = std::nullopt) {
  wire::Pull pull;
  pull.id = id;
  pull.d_engine_id = "d-engine";
  pull.d_lease_ms = d_lease_ms;
  pull.region_descriptor = std::vector<std::uint8_t>{1, 2, 3};
  pull.block_len = 4096;
  pull.num_blocks = 1024;
  std::uint32_t block = 0;
  for (auto& [req, xfer] : requests) {
    pull.requests.push_back({req, xfer, {block, block + 1}});
    block += 2;
  }
  return pull;
}

class PrefillSessionTest : public ::testing::Test {
 protected:
  void Make(PrefillSessionOptions options = {}) { session_.emplace(std::move(options)); }
  PrefillSession& s() { return *session_; }

  std::vector<wire::PullResponse> Responses(const std::string& peer = "") {
    std::vector<wire::PullResponse> out;
    for (Outgoing& o : s().TakeOutgoing()) {
      if (!peer.empty()) {
        EXPECT_EQ(o.peer, peer);
      }
      if (auto* r = std::get_if<wire::PullResponse>(&o.message)) out.push_back(std::move(*r));
    }
    return out;
  }
  void Ready(const std::string& xfer, std::uint64_t handle = 7) {
    ASSERT_TRUE(s().Admit(xfer, handle, kT0).ok());
    ASSERT_TRUE(s().PrefillDone(xfer, 2, kT0).ok());
  }

  std::optional<PrefillSession> session_;
};

TEST_F(PrefillSessionTest, ReadyPullWritesThenFinishes) {
  Make();
  Ready("x1");
  s().OnPull("d0", MakePull(5, {{"r1", "x1"}}), kT0);
  EXPECT_TRUE(Responses().empty());  // the write is still running
  std::vector<WriteJob> writes = s().TakeWrites();
  ASSERT_EQ(writes.size(), 1u);
  EXPECT_EQ(writes[0].handle, 7u);
  EXPECT_EQ(writes[0].d_req_id, "r1");
  EXPECT_EQ(writes[0].pull_id, 5u);
  s().OnWriteDone(writes[0].ticket, WriteOutcome::Landed(), kT0 + 1ms);
  std::vector<wire::PullResponse> replies = Responses("d0");
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].status, wire::PullStatus::kFinish);
  EXPECT_EQ(replies[0].id, 5u);
  EXPECT_EQ(replies[0].ok, std::vector<core::RequestId>{"r1"});
  // Every paired D rank pulled it: P frees the blocks.
  std::vector<core::HoldEvent> events = s().TakeEngineEvents();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, core::HoldEvent::Kind::kFreeBlocks);
  EXPECT_EQ(s().stats().pulls_in_progress, 0u);
}

// Hole 1: d_tp_size is bounded before any per-rank work, by the codec and by the session.
TEST_F(PrefillSessionTest, HugeDecoderTpSizeIsRefusedAndChangesNothing) {
  Make();
  Ready("x1");
  wire::Pull pull = MakePull(9, {{"r1", "x1"}});
  pull.d_tp_size = 1u << 31;
  pull.d_tp_rank = 0;
  s().OnMessage("d0", wire::Encode(pull), kT0);  // through the codec
  s().OnPull("d0", pull, kT0);                   // and past it
  std::vector<wire::PullResponse> replies = Responses();
  ASSERT_EQ(replies.size(), 2u);
  for (const wire::PullResponse& r : replies) {
    EXPECT_EQ(r.status, wire::PullStatus::kError);
    EXPECT_NE(r.message.find("64"), std::string::npos) << r.message;
  }
  EXPECT_EQ(replies[0].code, ErrorCode::kOutOfRange);
  EXPECT_TRUE(s().TakeWrites().empty());
  EXPECT_EQ(s().hold().PhaseOf("x1"), core::HoldPhase::kReady);
  EXPECT_EQ(s().stats().pulls_unpaired, 1u);
}

// Hole 2: one D rank waits at most once per transfer, so nothing grows and nothing wraps (a
// 16-bit counter used to wrap after 65,536 waits and leave the entry with no deadline).
TEST_F(PrefillSessionTest, RepeatedWaitsOfOneRankAreRefusedAndTheDeadlineHolds) {
  PrefillSessionOptions options;
  options.hold.abort_request_timeout = 480s;
  Make(options);
  constexpr std::uint64_t kRepeats = 70000;
  for (std::uint64_t i = 1; i <= kRepeats; ++i) {
    s().OnPull("d0", MakePull(i, {{"r" + std::to_string(i), "x1"}}), kT0);
  }
  std::vector<wire::PullResponse> replies = Responses();
  ASSERT_EQ(replies.size(), kRepeats - 1);
  for (const wire::PullResponse& r : replies) {
    ASSERT_EQ(r.err.size(), 1u);
    EXPECT_EQ(r.err[0].code, ErrorCode::kAlreadyExists);
  }
  EXPECT_EQ(s().stats().requests_parked, 1u);
  EXPECT_EQ(s().hold().DeadlineOf("x1"), kT0 + 480s);
  // The one parked pull is answered at the wait deadline.
  s().OnTimeout(kT0 + 480s);
  replies = Responses();
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].id, 1u);
  ASSERT_EQ(replies[0].err.size(), 1u);
  EXPECT_EQ(replies[0].err[0].code, ErrorCode::kTimeout);
}

TEST_F(PrefillSessionTest, ParkedRequestsBeyondTheCapFailWithoutTouchingTheTable) {
  PrefillSessionOptions options;
  options.max_parked_requests = 2;
  Make(options);
  s().OnPull("d0", MakePull(1, {{"r1", "x1"}, {"r2", "x2"}, {"r3", "x3"}}), kT0);
  std::vector<wire::PullResponse> replies = Responses();
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].status, wire::PullStatus::kContinue);
  ASSERT_EQ(replies[0].err.size(), 1u);
  EXPECT_EQ(replies[0].err[0].d_req_id, "r3");
  EXPECT_EQ(replies[0].err[0].code, ErrorCode::kResourceExhausted);
  EXPECT_FALSE(s().hold().Contains("x3"));
  EXPECT_EQ(s().hold().size(), 2u);
  EXPECT_EQ(s().stats().requests_over_limit, 1u);
}

TEST_F(PrefillSessionTest, PullsBeyondTheCapGetAnErrorAndChangeNothing) {
  PrefillSessionOptions options;
  options.max_pulls_in_progress = 1;
  Make(options);
  s().OnPull("d0", MakePull(1, {{"r1", "x1"}}), kT0);
  s().OnPull("d0", MakePull(2, {{"r2", "x2"}}), kT0);
  std::vector<wire::PullResponse> replies = Responses();
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].id, 2u);
  EXPECT_EQ(replies[0].code, ErrorCode::kResourceExhausted);
  EXPECT_FALSE(s().hold().Contains("x2"));
  EXPECT_EQ(s().stats().pulls_over_limit, 1u);
}

// A duplicate of a pull in progress is not answered: D would take the answer to the copy
// ("already waiting": err) for the original's and reuse blocks the original may still write.
TEST_F(PrefillSessionTest, DuplicatePullIdFromOnePeerIsDroppedUnanswered) {
  Make();
  s().OnPull("d0", MakePull(3, {{"r1", "x1"}}), kT0);
  s().OnPull("d0", MakePull(3, {{"r1", "x1"}}), kT0);
  EXPECT_TRUE(Responses().empty());
  EXPECT_EQ(s().stats().pulls_duplicate, 1u);
  // The same id from another socket is another pull (ids are per socket).
  wire::Pull other = MakePull(3, {{"r9", "x9"}});
  other.d_engine_id = "d-other";
  s().OnPull("d1", other, kT0);
  EXPECT_EQ(s().stats().pulls_in_progress, 2u);
  EXPECT_EQ(s().stats().pulls_duplicate, 1u);
}

// A copy that arrives after its original was answered is dropped too: had the original's write
// failed (D settled the entry and freed the blocks), answering the copy would write into them.
TEST_F(PrefillSessionTest, LateDuplicateOfAFinishedOrRefusedPullIsDropped) {
  PrefillSessionOptions options;
  options.remembered_pull_ids = 2;
  Make(options);
  Ready("x1");
  s().OnPull("d0", MakePull(1, {{"r1", "x1"}}), kT0);
  std::vector<WriteJob> writes = s().TakeWrites();
  ASSERT_EQ(writes.size(), 1u);
  s().OnWriteDone(writes[0].ticket,
                  WriteOutcome::Failed(Status(ErrorCode::kUnavailable, "peer closed")), kT0);
  ASSERT_EQ(Responses().size(), 1u);
  wire::Pull refused = MakePull(2, {{"r2", "x2"}});
  refused.d_engine_id = "d-unknown";
  refused.region_descriptor.reset();  // ERROR kNotFound: no descriptor known for it
  s().OnPull("d0", refused, kT0);
  ASSERT_EQ(Responses().size(), 1u);
  s().OnPull("d0", MakePull(1, {{"r1", "x1"}}), kT0 + 1s);  // late copy of the failed pull
  s().OnPull("d0", refused, kT0 + 1s);
  EXPECT_TRUE(s().TakeWrites().empty());
  EXPECT_TRUE(Responses().empty());
  EXPECT_EQ(s().stats().pulls_duplicate, 2u);
  // The memory is bounded: the oldest id is forgotten once newer ones push it out.
  s().OnPull("d0", MakePull(3, {}), kT0 + 2s);
  s().OnPull("d0", MakePull(1, {{"r1", "x1"}}), kT0 + 3s);
  EXPECT_EQ(s().TakeWrites().size(), 1u);
}

// Hole 8: a writer that could not fence its write leaves the request unanswered (D's deadline
// quarantines the blocks), and the pull never ends with FINISH.
TEST_F(PrefillSessionTest, UnsettledWriteIsNeverListedAndThePullNeverFinishes) {
  Make();
  Ready("x1");
  Ready("x2", 8);
  s().OnPull("d0", MakePull(4, {{"r1", "x1"}, {"r2", "x2"}}), kT0);
  std::vector<WriteJob> writes = s().TakeWrites();
  ASSERT_EQ(writes.size(), 2u);
  s().OnWriteDone(writes[0].ticket, WriteOutcome::Landed(), kT0 + 1ms);
  EXPECT_TRUE(Responses().empty());  // one wave: waits for both writes
  s().OnWriteDone(writes[1].ticket,
                  WriteOutcome::Unsettled(Status(ErrorCode::kInternal, "could not be fenced")),
                  kT0 + 2ms);
  std::vector<wire::PullResponse> replies = Responses();
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].status, wire::PullStatus::kContinue);
  EXPECT_EQ(replies[0].ok, std::vector<core::RequestId>{"r1"});
  EXPECT_TRUE(replies[0].err.empty());
  EXPECT_EQ(s().stats().pulls_in_progress, 0u);
  EXPECT_EQ(s().stats().writes_unsettled, 1u);
}

TEST_F(PrefillSessionTest, FailedWriteIsListedInErrWithItsReason) {
  Make();
  Ready("x1");
  s().OnPull("d0", MakePull(4, {{"r1", "x1"}}), kT0);
  std::vector<WriteJob> writes = s().TakeWrites();
  ASSERT_EQ(writes.size(), 1u);
  s().OnWriteDone(writes[0].ticket,
                  WriteOutcome::Failed(Status(ErrorCode::kUnavailable, "peer closed")), kT0);
  std::vector<wire::PullResponse> replies = Responses();
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].status, wire::PullStatus::kFinish);
  ASSERT_EQ(replies[0].err.size(), 1u);
  EXPECT_EQ(replies[0].err[0].code, ErrorCode::kUnavailable);
  EXPECT_NE(replies[0].err[0].reason.find("peer closed"), std::string::npos);
  // A failed send does not count: the entry stays for another try.
  EXPECT_EQ(s().hold().PhaseOf("x1"), core::HoldPhase::kReady);
}

// Hole 7: a pull refused for a lease mismatch frees P's KV at once, naming both values.
TEST_F(PrefillSessionTest, LeaseMismatchFreesTheKvAtOnceAndNamesBothValues) {
  Make();  // P without a lease
  Ready("x1");
  s().OnPull("d0", MakePull(1, {{"r1", "x1"}}, /*d_lease_ms=*/30000), kT0);
  std::vector<wire::PullResponse> replies = Responses();
  ASSERT_EQ(replies.size(), 1u);
  ASSERT_EQ(replies[0].err.size(), 1u);
  EXPECT_EQ(replies[0].err[0].code, ErrorCode::kLeaseMismatch);
  EXPECT_NE(replies[0].err[0].reason.find("30"), std::string::npos);
  EXPECT_NE(replies[0].err[0].reason.find("off"), std::string::npos);
  std::vector<core::HoldEvent> events = s().TakeEngineEvents();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, core::HoldEvent::Kind::kFreeBlocks);
  EXPECT_EQ(events[0].reason, core::ReleaseReason::kLeaseMismatch);
  EXPECT_EQ(s().stats().lease_mismatches, 1u);
}

TEST_F(PrefillSessionTest, UnpairedPullCachesNoDescriptorAndIsCounted) {
  PrefillSessionOptions options;
  options.p_tp_size = 2;
  options.p_tp_rank = 1;
  Make(options);
  wire::Pull pull = MakePull(1, {{"r1", "x1"}});
  pull.d_tp_size = 2;
  pull.d_tp_rank = 0;  // D rank 0 of 2 pulls from P rank 0, not 1
  s().OnPull("d0", pull, kT0);
  std::vector<wire::PullResponse> replies = Responses();
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].code, ErrorCode::kInvalidArgument);
  EXPECT_EQ(s().stats().pulls_unpaired, 1u);
  EXPECT_EQ(s().hold().size(), 0u);
  // Its descriptor was not cached: a paired pull without one must resend it.
  wire::Pull paired = MakePull(2, {{"r2", "x2"}});
  paired.d_tp_size = 2;
  paired.d_tp_rank = 1;
  paired.region_descriptor.reset();
  s().OnPull("d0", paired, kT0);
  replies = Responses();
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].code, ErrorCode::kNotFound);
}

TEST_F(PrefillSessionTest, ChangedDescriptorOfOneDecoderRankIsCounted) {
  Make();
  s().OnPull("d0", MakePull(1, {}), kT0);
  wire::Pull changed = MakePull(2, {});
  changed.region_descriptor = std::vector<std::uint8_t>{9, 9};
  s().OnPull("d0", changed, kT0);
  s().OnPull("d0", MakePull(3, {}), kT0);  // back to the first one
  EXPECT_EQ(s().stats().descriptors_replaced, 2u);
  EXPECT_EQ(Responses().size(), 3u);  // notify-only pulls: FINISH each
}

TEST_F(PrefillSessionTest, RenewalIsAnsweredAtOnceAndExtendsOnlyKnownTransfers) {
  PrefillSessionOptions options;
  options.hold.lease = 30s;
  Make(options);
  Ready("x1");
  wire::Renewal renewal;
  renewal.id = 11;
  renewal.d_engine_id = "d-engine";
  renewal.d_lease_ms = 30000;
  renewal.fingerprints = wire::FingerprintsOf(std::vector<core::TransferId>{"x1", "nope"});
  s().OnMessage("d0", wire::Encode(renewal), kT0 + 20s);
  std::vector<Outgoing> out = s().TakeOutgoing();
  ASSERT_EQ(out.size(), 1u);
  const auto* reply = std::get_if<wire::RenewalReply>(&out[0].message);
  ASSERT_NE(reply, nullptr);
  EXPECT_EQ(reply->id, 11u);
  EXPECT_EQ(reply->status, wire::RenewalStatus::kAccepted);
  EXPECT_EQ(reply->extended, 1u);
  EXPECT_EQ(reply->unknown, 1u);
  EXPECT_EQ(s().hold().DeadlineOf("x1"), kT0 + 40s);
}

TEST_F(PrefillSessionTest, ShutdownAnswersParkedRequestsAndRefusesNewPulls) {
  Make();
  s().OnPull("d0", MakePull(1, {{"r1", "x1"}}), kT0);
  s().Shutdown(kT0);
  std::vector<wire::PullResponse> replies = Responses();
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].status, wire::PullStatus::kFinish);
  ASSERT_EQ(replies[0].err.size(), 1u);
  EXPECT_EQ(replies[0].err[0].code, ErrorCode::kCancelled);
  s().OnPull("d0", MakePull(2, {{"r2", "x2"}}), kT0);
  replies = Responses();
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].code, ErrorCode::kUnavailable);
}

TEST_F(PrefillSessionTest, GarbageGetsAnErrorAndChangesNothing) {
  Make();
  Ready("x1");
  const std::vector<std::uint8_t> garbage = {0xc1, 0x00, 0xff};
  s().OnMessage("d0", garbage, kT0);
  std::vector<wire::PullResponse> replies = Responses();
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].status, wire::PullStatus::kError);
  EXPECT_EQ(s().stats().messages_malformed, 1u);
  EXPECT_EQ(s().hold().PhaseOf("x1"), core::HoldPhase::kReady);
}

// Found in review: what pulls retain is bounded in blocks too, and answered requests drop
// theirs, so a peer cannot hold P's memory with many parked pulls naming many blocks.
TEST_F(PrefillSessionTest, BlocksRetainedByPullsInProgressAreCapped) {
  PrefillSessionOptions options;
  options.max_retained_blocks = 4;
  Make(options);
  s().OnPull("d0", MakePull(1, {{"r1", "x1"}, {"r2", "x2"}}), kT0);  // 4 blocks, parked
  s().OnPull("d0", MakePull(2, {{"r3", "x3"}}), kT0);                // 2 more: refused
  std::vector<wire::PullResponse> replies = Responses();
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].id, 2u);
  EXPECT_EQ(replies[0].code, ErrorCode::kResourceExhausted);
  EXPECT_FALSE(s().hold().Contains("x3"));
  // Once the parked requests are answered (the engine aborted them), their blocks are released.
  s().EngineFinished("x1", kT0);
  s().EngineFinished("x2", kT0);
  ASSERT_EQ(Responses().size(), 2u);  // one answer per call: CONTINUE, then FINISH
  s().OnPull("d0", MakePull(3, {{"r3", "x3"}}), kT0);
  EXPECT_TRUE(Responses().empty());  // accepted and parked
  EXPECT_TRUE(s().hold().Contains("x3"));
}

// Found in review: a pull may use only a descriptor its own socket sent, so no peer can make P
// write into another decoder's region by naming that decoder.
TEST_F(PrefillSessionTest, CachedDescriptorServesOnlyTheSocketThatSentIt) {
  Make();
  Ready("x1");
  s().OnPull("d0", MakePull(1, {}), kT0);  // d0 sends its descriptor (notify-only)
  ASSERT_EQ(Responses().size(), 1u);
  wire::Pull forged = MakePull(2, {{"r1", "x1"}});  // same d_engine_id and rank, another socket
  forged.region_descriptor.reset();
  s().OnPull("intruder", forged, kT0);
  std::vector<wire::PullResponse> replies = Responses();
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].code, ErrorCode::kNotFound);
  EXPECT_TRUE(s().TakeWrites().empty());
}

TEST(PrefillSessionOptionsTest, TpBeyondTheLimitIsRefused) {
  PrefillSessionOptions options;
  options.p_tp_size = core::kMaxTpSize + 1;
  EXPECT_EQ(PrefillSession::ValidateOptions(options).code(), ErrorCode::kInvalidArgument);
  options.p_tp_size = 2;
  options.p_tp_rank = 2;
  EXPECT_EQ(PrefillSession::ValidateOptions(options).code(), ErrorCode::kInvalidArgument);
  options.p_tp_rank = 1;
  EXPECT_TRUE(PrefillSession::ValidateOptions(options).ok());
}

}  // namespace
}  // namespace kvferry::protocol
