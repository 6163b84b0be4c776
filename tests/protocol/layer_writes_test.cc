// PrefillSession::LayersReady: layers written into a parked pull's blocks before the prefill
// ends (issue 22's overlap), sans-IO. What each test pins is a lifetime rule the ahead writes
// must not bend: a request is answered only once every write of it ended, P's blocks are freed
// only after, and a failure of any write reaches D (unsettled when bytes may still land).
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <variant>
#include <vector>

#include "protocol/prefill_session.h"
#include "wire/messages.h"

namespace kvferry::protocol {
namespace {

using namespace std::chrono_literals;
using core::TimePoint;

constexpr TimePoint kT0{std::chrono::hours(1)};
const std::vector<core::BlockId> kBlocks{0, 1};

wire::Pull OnePull(std::uint64_t id, const std::string& req, const std::string& xfer) {
  wire::Pull pull;
  pull.id = id;
  pull.d_engine_id = "d-engine";
  pull.region_descriptor = std::vector<std::uint8_t>{1, 2, 3};
  pull.block_len = 4096;
  pull.num_blocks = 1024;
  pull.requests.push_back({req, xfer, {10, 11}});
  return pull;
}

class LayerWritesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    PrefillSessionOptions options;
    options.block_len = 4096;
    options.num_blocks = 1024;
    options.num_planes = 4;
    session_.emplace(options);
  }
  PrefillSession& s() { return *session_; }
  // Admitted, with D's pull parked for it.
  void Parked(const std::string& xfer = "x1", std::uint64_t pull_id = 1) {
    ASSERT_TRUE(s().Admit(xfer, 7, kT0).ok());
    s().OnPull("d0", OnePull(pull_id, "r-" + xfer, xfer), kT0);
    ASSERT_TRUE(s().TakeWrites().empty());
    ASSERT_EQ(s().stats().requests_parked, 1u);
  }
  std::vector<wire::PullResponse> Responses() {
    std::vector<wire::PullResponse> out;
    for (Outgoing& o : s().TakeOutgoing()) {
      if (auto* r = std::get_if<wire::PullResponse>(&o.message)) out.push_back(std::move(*r));
    }
    return out;
  }
  std::size_t Frees() {
    std::size_t n = 0;
    for (const core::HoldEvent& e : s().TakeEngineEvents()) {
      if (e.kind == core::HoldEvent::Kind::kFreeBlocks) ++n;
    }
    return n;
  }
  WriteJob OneWrite() {
    std::vector<WriteJob> writes = s().TakeWrites();
    EXPECT_EQ(writes.size(), 1u);
    return writes.empty() ? WriteJob{} : writes[0];
  }

  std::optional<PrefillSession> session_;
};

TEST_F(LayerWritesTest, AParkedPullGetsLayersAsComputedAndTheRestAtPrefillDone) {
  Parked();
  ASSERT_TRUE(s().LayersReady("x1", kBlocks, std::vector<std::uint32_t>{1, 0}, kT0).ok());
  WriteJob ahead = OneWrite();
  EXPECT_EQ(ahead.planes, (std::vector<std::uint32_t>{0, 1}));
  EXPECT_EQ(ahead.dst_block_ids, (std::vector<core::BlockId>{10, 11}));
  EXPECT_EQ(ahead.writes, (std::vector<core::BlockWrite>{{0, 10 * 4096, 8192}}));
  s().OnWriteDone(ahead.ticket, WriteOutcome::Landed(), kT0 + 1ms);
  EXPECT_TRUE(Responses().empty());  // the request is not done: two planes are not written

  ASSERT_TRUE(s().PrefillDone("x1", kBlocks, kT0 + 2ms).ok());
  WriteJob rest = OneWrite();
  EXPECT_EQ(rest.planes, (std::vector<std::uint32_t>{2, 3}));
  EXPECT_TRUE(Responses().empty());
  EXPECT_EQ(Frees(), 0u);
  s().OnWriteDone(rest.ticket, WriteOutcome::Landed(), kT0 + 3ms);
  std::vector<wire::PullResponse> replies = Responses();
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].status, wire::PullStatus::kFinish);
  EXPECT_EQ(replies[0].ok, std::vector<core::RequestId>{"r-x1"});
  EXPECT_EQ(Frees(), 1u);
  EXPECT_EQ(s().stats().layer_writes, 1u);
  EXPECT_EQ(s().stats().writes_started, 2u);
}

TEST_F(LayerWritesTest, EveryPlaneWrittenAheadIsAnsweredAtPrefillDoneWithoutAnotherWrite) {
  Parked();
  ASSERT_TRUE(s().LayersReady("x1", kBlocks, std::vector<std::uint32_t>{0, 1}, kT0).ok());
  WriteJob first = OneWrite();
  // Computed while the first is written: they wait for it, and go together.
  ASSERT_TRUE(s().LayersReady("x1", kBlocks, std::vector<std::uint32_t>{1, 2}, kT0).ok());
  ASSERT_TRUE(s().LayersReady("x1", kBlocks, std::vector<std::uint32_t>{3}, kT0).ok());
  EXPECT_TRUE(s().TakeWrites().empty());
  s().OnWriteDone(first.ticket, WriteOutcome::Landed(), kT0 + 1ms);
  WriteJob second = OneWrite();
  EXPECT_EQ(second.planes, (std::vector<std::uint32_t>{2, 3}));  // plane 1 is not written twice
  s().OnWriteDone(second.ticket, WriteOutcome::Landed(), kT0 + 1ms);
  ASSERT_TRUE(s().PrefillDone("x1", kBlocks, kT0 + 2ms).ok());
  EXPECT_TRUE(s().TakeWrites().empty());
  std::vector<wire::PullResponse> replies = Responses();
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].ok, std::vector<core::RequestId>{"r-x1"});
  EXPECT_EQ(Frees(), 1u);
}

// P's blocks are freed when the last write of them ends: the request's own write must not
// start (and end, and free them) while an ahead write still reads them.
TEST_F(LayerWritesTest, TheRequestsOwnWriteWaitsForAheadWritesStillInFlight) {
  Parked();
  ASSERT_TRUE(s().LayersReady("x1", kBlocks, std::vector<std::uint32_t>{0}, kT0).ok());
  WriteJob ahead = OneWrite();
  ASSERT_TRUE(s().PrefillDone("x1", kBlocks, kT0 + 1ms).ok());
  EXPECT_TRUE(s().TakeWrites().empty());
  EXPECT_EQ(Frees(), 0u);
  s().OnWriteDone(ahead.ticket, WriteOutcome::Landed(), kT0 + 2ms);
  WriteJob rest = OneWrite();
  EXPECT_EQ(rest.planes, (std::vector<std::uint32_t>{1, 2, 3}));
  EXPECT_EQ(Frees(), 0u);
  EXPECT_TRUE(Responses().empty());
  s().OnWriteDone(rest.ticket, WriteOutcome::Landed(), kT0 + 3ms);
  EXPECT_EQ(Responses().size(), 1u);
  EXPECT_EQ(Frees(), 1u);
}

TEST_F(LayerWritesTest, AFailedAheadWriteFailsTheRequestWithItsReasonAndNoFurtherWrite) {
  Parked();
  ASSERT_TRUE(s().LayersReady("x1", kBlocks, std::vector<std::uint32_t>{0}, kT0).ok());
  WriteJob ahead = OneWrite();
  s().OnWriteDone(ahead.ticket, WriteOutcome::Failed(Status(ErrorCode::kUnavailable, "gone")),
                  kT0 + 1ms);
  ASSERT_TRUE(s().LayersReady("x1", kBlocks, std::vector<std::uint32_t>{1}, kT0 + 1ms).ok());
  EXPECT_TRUE(s().TakeWrites().empty());  // the request fails: nothing more is written for it
  ASSERT_TRUE(s().PrefillDone("x1", kBlocks, kT0 + 2ms).ok());
  EXPECT_TRUE(s().TakeWrites().empty());
  std::vector<wire::PullResponse> replies = Responses();
  ASSERT_EQ(replies.size(), 1u);
  ASSERT_EQ(replies[0].err.size(), 1u);
  EXPECT_EQ(replies[0].err[0].code, ErrorCode::kUnavailable);
  EXPECT_FALSE(replies[0].err[0].unsettled);
  EXPECT_NE(replies[0].err[0].reason.find("before the prefill's end) failed: gone"),
            std::string::npos)
      << replies[0].err[0].reason;
  // As for any failed send: the entry stays for another try.
  EXPECT_EQ(s().hold().PhaseOf("x1"), core::HoldPhase::kReady);
  EXPECT_EQ(s().stats().writes_failed, 1u);
}

// The engine aborts the request while an ahead write runs: D must not hear of it before the
// write ended (it would free blocks P still writes), and hears `unsettled` if it may land.
TEST_F(LayerWritesTest, ARequestAbortedDuringAnAheadWriteIsAnsweredOnlyOnceTheWriteEnded) {
  Parked();
  ASSERT_TRUE(s().LayersReady("x1", kBlocks, std::vector<std::uint32_t>{0, 1}, kT0).ok());
  WriteJob ahead = OneWrite();
  s().EngineFinished("x1", kT0 + 1ms);
  EXPECT_TRUE(Responses().empty());
  s().OnWriteDone(ahead.ticket,
                  WriteOutcome::Unsettled(Status(ErrorCode::kTimeout, "not fenced")), kT0 + 5ms);
  std::vector<wire::PullResponse> replies = Responses();
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].status, wire::PullStatus::kFinish);
  ASSERT_EQ(replies[0].err.size(), 1u);
  EXPECT_TRUE(replies[0].err[0].unsettled);
  EXPECT_NE(replies[0].err[0].code, ErrorCode::kTimeout);  // the abort's reason leads
  EXPECT_EQ(s().stats().pulls_in_progress, 0u);
  EXPECT_EQ(s().stats().writes_unsettled, 1u);
}

// Found by exploration (seeds 288987, 337086, 345872): one D rank released the transfer while
// its ahead write ran, the other rank pulled it once the prefill ended, and the entry left the
// table; the engine must not get the blocks back while the write still reads them.
TEST_F(LayerWritesTest, BlocksAnAheadWriteStillReadsAreFreedOnlyOnceItEnded) {
  ASSERT_TRUE(s().Admit("x1", 7, kT0).ok());
  for (std::uint32_t rank = 0; rank < 2; ++rank) {
    wire::Pull pull = OnePull(1, "r" + std::to_string(rank), "x1");
    pull.d_tp_size = 2;
    pull.d_tp_rank = rank;
    pull.block_len = 2048;  // one of P's two heads per D rank
    s().OnPull("d" + std::to_string(rank), pull, kT0);
  }
  ASSERT_TRUE(s().LayersReady("x1", kBlocks, std::vector<std::uint32_t>{0}, kT0).ok());
  std::vector<WriteJob> ahead = s().TakeWrites();
  ASSERT_EQ(ahead.size(), 2u);  // one per D rank's pull
  wire::Release release;
  release.id = 2;
  release.d_engine_id = "d-engine";
  release.d_tp_size = 2;
  release.d_tp_rank = 0;
  const std::vector<core::TransferId> released{"x1"};
  release.fingerprints = wire::FingerprintsOf(released);
  s().OnRelease("d0", release, kT0 + 1ms);
  EXPECT_TRUE(Responses().empty());  // rank 0's answer waits for its ahead write
  ASSERT_TRUE(s().PrefillDone("x1", kBlocks, kT0 + 2ms).ok());
  s().OnWriteDone(ahead[1].ticket, WriteOutcome::Landed(), kT0 + 3ms);
  WriteJob rest = OneWrite();  // rank 1's other planes
  EXPECT_EQ(rest.context->d_tp_rank, 1u);
  s().OnWriteDone(rest.ticket, WriteOutcome::Landed(), kT0 + 4ms);
  EXPECT_FALSE(s().hold().Contains("x1"));  // every rank pulled or released it
  EXPECT_EQ(Frees(), 0u);                   // but rank 0's ahead write still reads the blocks
  EXPECT_EQ(Responses().size(), 1u);        // rank 1's ok
  s().OnWriteDone(ahead[0].ticket, WriteOutcome::Landed(), kT0 + 5ms);
  EXPECT_EQ(Frees(), 1u);
  std::vector<wire::PullResponse> replies = Responses();
  ASSERT_EQ(replies.size(), 1u);
  ASSERT_EQ(replies[0].err.size(), 1u);
  EXPECT_EQ(replies[0].err[0].d_req_id, "r0");
  EXPECT_FALSE(replies[0].err[0].unsettled);
}

TEST_F(LayerWritesTest, ShutdownAnswersAParkedRequestOnlyOnceItsAheadWriteEnded) {
  Parked();
  ASSERT_TRUE(s().LayersReady("x1", kBlocks, std::vector<std::uint32_t>{3}, kT0).ok());
  WriteJob ahead = OneWrite();
  s().Shutdown(kT0 + 1ms);
  EXPECT_TRUE(Responses().empty());
  s().OnWriteDone(ahead.ticket, WriteOutcome::Landed(), kT0 + 2ms);
  std::vector<wire::PullResponse> replies = Responses();
  ASSERT_EQ(replies.size(), 1u);
  ASSERT_EQ(replies[0].err.size(), 1u);
  EXPECT_EQ(replies[0].err[0].code, ErrorCode::kCancelled);
  EXPECT_FALSE(replies[0].err[0].unsettled);
}

TEST_F(LayerWritesTest, APrefillDoneNamingOtherBlocksRewritesEveryPlane) {
  Parked();
  ASSERT_TRUE(s().LayersReady("x1", kBlocks, std::vector<std::uint32_t>{0, 1}, kT0).ok());
  s().OnWriteDone(OneWrite().ticket, WriteOutcome::Landed(), kT0);
  ASSERT_TRUE(s().PrefillDone("x1", {4, 5}, kT0 + 1ms).ok());
  WriteJob rest = OneWrite();
  EXPECT_TRUE(rest.planes.empty());  // every plane
  EXPECT_EQ(rest.writes, (std::vector<core::BlockWrite>{{4 * 4096, 10 * 4096, 8192}}));
}

TEST_F(LayerWritesTest, LayersOfATransferNoPullWaitsForWriteNothing) {
  ASSERT_TRUE(s().Admit("x1", 7, kT0).ok());
  ASSERT_TRUE(s().LayersReady("x1", kBlocks, std::vector<std::uint32_t>{0}, kT0).ok());
  EXPECT_TRUE(s().TakeWrites().empty());
  // The pull that comes after the prefill is written whole, as always.
  ASSERT_TRUE(s().PrefillDone("x1", kBlocks, kT0).ok());
  s().OnPull("d0", OnePull(1, "r1", "x1"), kT0);
  EXPECT_TRUE(OneWrite().planes.empty());
  EXPECT_EQ(s().stats().layer_writes, 0u);
}

TEST_F(LayerWritesTest, BadBlocksOrPlanesAreRefusedAndChangeNothing) {
  Parked();
  EXPECT_EQ(s().LayersReady("x1", kBlocks, std::vector<std::uint32_t>{4}, kT0).code(),
            ErrorCode::kOutOfRange);
  EXPECT_EQ(s().LayersReady("x1", std::vector<core::BlockId>{0, 1024},
                            std::vector<std::uint32_t>{0}, kT0)
                .code(),
            ErrorCode::kOutOfRange);
  std::vector<core::BlockId> too_many(wire::kMaxBlocksPerRequest + 1, 0);
  EXPECT_EQ(s().LayersReady("x1", too_many, std::vector<std::uint32_t>{0}, kT0).code(),
            ErrorCode::kInvalidArgument);
  EXPECT_TRUE(s().TakeWrites().empty());
  EXPECT_EQ(s().stats().writes_started, 0u);

  PrefillSessionOptions plain;
  plain.block_len = 4096;
  plain.num_blocks = 1024;
  PrefillSession without(plain);  // num_planes unknown
  EXPECT_EQ(without.LayersReady("x1", kBlocks, std::vector<std::uint32_t>{0}, kT0).code(),
            ErrorCode::kInvalidArgument);
  plain.num_planes = kMaxPlanes + 1;
  EXPECT_EQ(PrefillSession::ValidateOptions(plain).code(), ErrorCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvferry::protocol
