// TransportKvWriter's verdicts: a failed write is kFailed (D may reuse the blocks at once) only
// when the receiver itself refused it; any other failure leaves bytes that may still land, so
// it is kUnsettled (D's deadline quarantines the blocks). Over the in-process data plane with
// injected faults.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "kvferry/transport/inprocess.h"
#include "runtime/prefill_worker.h"

namespace kvferry::runtime {
namespace {

using namespace std::chrono_literals;
using protocol::WriteEnd;
using transport::Fault;
using transport::FaultKind;

constexpr std::uint64_t kBlockLen = 256;
constexpr std::uint32_t kBlocks = 8;

class TransportKvWriterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto fabric = transport::MakeInProcessFabric();
    auto p = transport::MakeInProcessEngine(fabric, {"p", false});
    auto d = transport::MakeInProcessEngine(fabric, {"d", false});
    ASSERT_TRUE(p && d);
    p_ = std::move(*p);
    d_ = std::move(*d);
    auto src = p_->AllocateRegion(kBlocks * kBlockLen);
    auto dst = d_->AllocateRegion(kBlocks * kBlockLen);
    ASSERT_TRUE(src && dst);
    src_ = *src;
    dst_ = *dst;
    auto descriptor = d_->ExportDescriptor({});
    ASSERT_TRUE(descriptor);
    auto context = std::make_shared<protocol::PullContext>();
    context->d_engine_id = "decode";
    context->region_descriptor = std::make_shared<const std::vector<std::uint8_t>>(
        reinterpret_cast<const std::uint8_t*>(descriptor->data()),
        reinterpret_cast<const std::uint8_t*>(descriptor->data() + descriptor->size()));
    context->block_len = kBlockLen;
    context->num_blocks = kBlocks;
    context_ = context;
    TransportKvWriter::Options o;
    o.regions = {src->id};
    o.write_timeout = 200ms;
    // The in-process engine is shared by the test (faults) and the writer.
    engine_ = std::shared_ptr<transport::InProcessEngine>(p_.get(), [](auto*) {});
    writer_ = std::make_unique<TransportKvWriter>(engine_, o);
  }

  void TearDown() override {
    writer_.reset();
    engine_.reset();
  }

  protocol::WriteOutcome Write() {
    protocol::WriteJob job;
    job.context = context_;
    job.transfer_id = "xfer";
    job.dst_block_ids = {4, 5};
    job.writes = {{0, 4 * kBlockLen, 2 * kBlockLen}};  // source blocks 0, 1 (as planned)
    return writer_->Write(*context_, job);
  }

  std::unique_ptr<transport::InProcessEngine> p_, d_;
  transport::Region src_, dst_;
  std::shared_ptr<transport::InProcessEngine> engine_;
  std::shared_ptr<const protocol::PullContext> context_;
  std::unique_ptr<TransportKvWriter> writer_;
};

TEST_F(TransportKvWriterTest, AWriteThatLandsIsLandedWhereTheSessionPlannedIt) {
  std::memset(src_.base, 0x5a, 2 * kBlockLen);
  EXPECT_EQ(Write().end, WriteEnd::kLanded);
  for (std::uint64_t i = 0; i < kBlocks * kBlockLen; ++i) {
    const bool planned = i >= 4 * kBlockLen && i < 6 * kBlockLen;
    ASSERT_EQ(dst_.base[i], std::byte{planned ? std::uint8_t{0x5a} : std::uint8_t{0}}) << i;
  }
}

TEST_F(TransportKvWriterTest, TheReceiversOwnRefusalIsAPlainFailure) {
  p_->InjectFault("d", Fault{FaultKind::kFail, 1, {}, ErrorCode::kRejected});
  p_->InjectFault("d", Fault{FaultKind::kFail, 1, {}, ErrorCode::kOutOfRange});
  for (int i = 0; i < 2; ++i) {
    auto outcome = Write();
    EXPECT_EQ(outcome.end, WriteEnd::kFailed) << outcome.status.ToString();
  }
}

TEST_F(TransportKvWriterTest, AFailureOnTheSendersSideLeavesTheWriteUnsettled) {
  // The peer became unreachable: what was already sent may still be applied at D.
  p_->InjectFault("d", Fault{FaultKind::kFail, 1, {}, ErrorCode::kUnavailable});
  auto outcome = Write();
  EXPECT_EQ(outcome.end, WriteEnd::kUnsettled) << outcome.status.ToString();
  EXPECT_EQ(outcome.status.code(), ErrorCode::kUnavailable);
}

TEST_F(TransportKvWriterTest, AWriteThatTimesOutIsUnsettledAndNamesWhatItWaitedFor) {
  p_->InjectFault("d", Fault{FaultKind::kDrop, 1});
  auto outcome = Write();
  EXPECT_EQ(outcome.end, WriteEnd::kUnsettled) << outcome.status.ToString();
  EXPECT_EQ(outcome.status.code(), ErrorCode::kTimeout);
  EXPECT_NE(outcome.status.message().find("did not complete within 200 ms"), std::string::npos)
      << outcome.status.ToString();
  // The next write gets a fresh endpoint and lands.
  EXPECT_EQ(Write().end, WriteEnd::kLanded);
}


// A job of layers computed before the prefill ended (PrefillSession::LayersReady) names its
// planes: only those are written, at the planned offsets; a plane the writer does not have is
// refused before anything is sent.
TEST(TransportKvWriterPlanes, AJobNamingPlanesWritesOnlyThose) {
  auto fabric = transport::MakeInProcessFabric();
  auto p = transport::MakeInProcessEngine(fabric, {"p", false});
  auto d = transport::MakeInProcessEngine(fabric, {"d", false});
  ASSERT_TRUE(p && d);
  std::vector<transport::Region> src, dst;
  std::vector<transport::RegionId> src_ids, dst_ids;
  for (int plane = 0; plane < 3; ++plane) {
    auto s = (*p)->AllocateRegion(kBlocks * kBlockLen);
    auto t = (*d)->AllocateRegion(kBlocks * kBlockLen);
    ASSERT_TRUE(s && t);
    std::memset(s->base, 0x10 + plane, kBlocks * kBlockLen);
    src.push_back(*s);
    dst.push_back(*t);
    src_ids.push_back(s->id);
    dst_ids.push_back(t->id);
  }
  auto descriptor = (*d)->ExportDescriptor(dst_ids);
  ASSERT_TRUE(descriptor);
  auto context = std::make_shared<protocol::PullContext>();
  context->region_descriptor = std::make_shared<const std::vector<std::uint8_t>>(
      reinterpret_cast<const std::uint8_t*>(descriptor->data()),
      reinterpret_cast<const std::uint8_t*>(descriptor->data() + descriptor->size()));
  context->block_len = kBlockLen;
  context->num_blocks = kBlocks;
  TransportKvWriter::Options o;
  o.regions = src_ids;
  o.write_timeout = 1s;
  std::shared_ptr<transport::Engine> engine(p->get(), [](auto*) {});
  {
    TransportKvWriter writer(engine, o);
    protocol::WriteJob job;
    job.context = context;
    job.transfer_id = "xfer";
    job.dst_block_ids = {2};
    job.writes = {{0, 2 * kBlockLen, kBlockLen}};
    job.planes = {0, 2};
    ASSERT_EQ(writer.Write(*context, job).end, WriteEnd::kLanded);
    for (int plane = 0; plane < 3; ++plane) {
      const std::byte want{plane == 1 ? std::uint8_t{0} : static_cast<std::uint8_t>(0x10 + plane)};
      EXPECT_EQ(dst[plane].base[2 * kBlockLen], want) << plane;
      EXPECT_EQ(dst[plane].base[3 * kBlockLen], std::byte{0}) << plane;  // not planned
    }
    EXPECT_EQ(writer.bytes_written(), 2 * kBlockLen);
    job.planes = {3};
    const protocol::WriteOutcome outcome = writer.Write(*context, job);
    EXPECT_EQ(outcome.end, WriteEnd::kFailed);
    EXPECT_EQ(outcome.status.code(), ErrorCode::kOutOfRange);
    EXPECT_EQ(writer.bytes_written(), 2 * kBlockLen);
  }
}

}  // namespace
}  // namespace kvferry::runtime
