#include "kvferry/transport/inprocess.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace kvferry::transport {
namespace {

using namespace std::chrono_literals;

TimePoint Soon() { return Clock::now() + 5s; }

class InProcessTest : public ::testing::Test {
 protected:
  void Make(bool manual, bool fence_writes = false) {
    fabric_ = MakeInProcessFabric();
    auto p = MakeInProcessEngine(fabric_, {"P0", manual});
    auto d = MakeInProcessEngine(fabric_, {"D0", manual, fence_writes});
    ASSERT_TRUE(p && d);
    p_ = std::move(*p);
    d_ = std::move(*d);
    auto src = p_->AllocateRegion(1 << 20);
    auto dst = d_->AllocateRegion(1 << 20);
    ASSERT_TRUE(src && dst);
    src_ = *src;
    dst_ = *dst;
    for (std::size_t i = 0; i < src_.length; ++i) src_.base[i] = static_cast<std::byte>(i * 7 + 1);
    auto desc = d_->ExportDescriptor({});
    ASSERT_TRUE(desc);
    auto peer = p_->Connect(*desc, Soon());
    ASSERT_TRUE(peer) << peer.error().ToString();
    peer_ = *peer;
  }

  WriteOp Op(std::uint64_t src_off, std::uint64_t dst_off, std::uint64_t len) const {
    return WriteOp{src_.id, dst_.id, src_off, dst_off, len};
  }
  bool Landed(const WriteOp& op) const {
    return std::memcmp(src_.base + op.local_offset, dst_.base + op.remote_offset, op.length) == 0;
  }

  std::shared_ptr<InProcessFabric> fabric_;
  std::unique_ptr<InProcessEngine> p_, d_;
  Region src_, dst_;
  ConnectionId peer_ = 0;
};

TEST_F(InProcessTest, WritesEveryOpOfABatch) {
  Make(false);
  std::vector<WriteOp> ops = {Op(0, 4096, 4096), Op(65536, 0, 4096), Op(8192, 500000, 70000)};
  BatchWaiter w;
  ASSERT_TRUE(p_->SubmitWrites(peer_, ops, kNoWriteKey, w.Callback()));
  ASSERT_TRUE(w.Wait(Soon()).ok());
  for (const auto& op : ops) EXPECT_TRUE(Landed(op));
  EXPECT_TRUE(p_->ClosePeer(peer_, Soon()).ok());
}

TEST_F(InProcessTest, OutOfRangeIsRefusedBeforeAnythingIsPosted) {
  Make(true);
  bool called = false;
  auto cb = [&](BatchId, Status) { called = true; };
  std::vector<std::vector<WriteOp>> bad = {
      {Op(0, (1 << 20) - 10, 11)},                 // past the remote end
      {Op((1 << 20) - 10, 0, 11)},                 // past the local end
      {Op(0, 0, 16), Op(0, ~0ull - 4, 16)},        // offset overflow, after a good op
      {WriteOp{src_.id, dst_.id + 99, 0, 0, 16}},  // remote region not in descriptor
  };
  for (const auto& ops : bad) {
    auto r = p_->SubmitWrites(peer_, ops, kNoWriteKey, cb);
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error().code(), ErrorCode::kOutOfRange) << r.error().ToString();
  }
  auto unknown_local = p_->SubmitWrites(peer_, std::vector{WriteOp{999, dst_.id, 0, 0, 1}}, kNoWriteKey, cb);
  EXPECT_EQ(unknown_local.error().code(), ErrorCode::kNotFound);
  auto zero = p_->SubmitWrites(peer_, std::vector{Op(0, 0, 0)}, kNoWriteKey, cb);
  EXPECT_EQ(zero.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(p_->PendingBatches(), 0u);
  p_->Pump(TimePoint{} + 1h);
  EXPECT_FALSE(called);
  EXPECT_EQ(dst_.base[0], std::byte{0});
}

TEST_F(InProcessTest, ManualPumpIsDeterministicAndHonoursDelays) {
  Make(true);
  std::vector<BatchId> order;
  auto cb = [&](BatchId id, Status s) {
    EXPECT_TRUE(s.ok());
    order.push_back(id);
  };
  p_->InjectFault("D0", Fault{FaultKind::kDelay, 1, 10ms});
  auto a = p_->SubmitWrites(peer_, std::vector{Op(0, 0, 100)}, kNoWriteKey, cb);      // delayed 10 ms
  auto b = p_->SubmitWrites(peer_, std::vector{Op(100, 100, 100)}, kNoWriteKey, cb);  // not delayed
  ASSERT_TRUE(a && b);
  EXPECT_EQ(p_->Pump(TimePoint{}), 1u);  // only b is due at t=0
  EXPECT_EQ(order, std::vector<BatchId>{*b});
  EXPECT_FALSE(Landed(Op(0, 0, 100)));
  EXPECT_EQ(p_->Pump(TimePoint{} + 9ms), 0u);
  EXPECT_EQ(p_->Pump(TimePoint{} + 10ms), 1u);
  EXPECT_EQ(order, (std::vector<BatchId>{*b, *a}));
  EXPECT_TRUE(Landed(Op(0, 0, 100)));
}

TEST_F(InProcessTest, FailAndDropArePerPeerAndCounted) {
  Make(true);
  auto d1 = MakeInProcessEngine(fabric_, {"D1", true});
  ASSERT_TRUE(d1);
  auto dst1 = (*d1)->AllocateRegion(4096);
  auto peer1 = p_->Connect(*(*d1)->ExportDescriptor({}), Soon());
  ASSERT_TRUE(dst1 && peer1);

  p_->InjectFault("D0", Fault{FaultKind::kFail, 2, {}, ErrorCode::kRejected});
  p_->InjectFault("D0", Fault{FaultKind::kDrop, 1});
  std::vector<Status> got;
  auto cb = [&](BatchId, Status s) { got.push_back(s); };
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(p_->SubmitWrites(peer_, std::vector{Op(0, 0, 64)}, kNoWriteKey, cb));
  ASSERT_TRUE(p_->SubmitWrites(*peer1, std::vector{WriteOp{src_.id, dst1->id, 0, 0, 64}}, kNoWriteKey, cb));
  p_->Pump(TimePoint{} + 1s);
  ASSERT_EQ(got.size(), 4u);  // two failed, the 4th to D0 and the one to D1 succeeded
  EXPECT_EQ(got[0].code(), ErrorCode::kRejected);
  EXPECT_EQ(got[1].code(), ErrorCode::kRejected);
  EXPECT_TRUE(got[2].ok());
  EXPECT_TRUE(got[3].ok());
  EXPECT_EQ(p_->PendingBatches(), 1u);  // the dropped one
  // Closing cancels the dropped batch (its bytes never land) and reports no timeout for it.
  EXPECT_TRUE(p_->ClosePeer(peer_, Soon()).ok());
  ASSERT_EQ(got.size(), 5u);
  EXPECT_EQ(got[4].code(), ErrorCode::kCancelled);
  EXPECT_EQ(p_->ClosePeer(peer_, Soon()).code(), ErrorCode::kNotFound);
  auto after = p_->SubmitWrites(peer_, std::vector{Op(0, 0, 64)}, kNoWriteKey, cb);
  EXPECT_EQ(after.error().code(), ErrorCode::kNotFound);
}

TEST_F(InProcessTest, CloseCancelsUndeliveredBatchesAndReportsTimeout) {
  Make(true);
  BatchWaiter w;
  ASSERT_TRUE(p_->SubmitWrites(peer_, std::vector{Op(0, 0, 64)}, kNoWriteKey, w.Callback()));
  Status s = p_->ClosePeer(peer_, Soon());
  EXPECT_EQ(s.code(), ErrorCode::kTimeout);
  EXPECT_EQ(w.Wait(Soon()).code(), ErrorCode::kCancelled);
  EXPECT_FALSE(Landed(Op(0, 0, 64)));
}

TEST_F(InProcessTest, CloseWaitsForDelayedBatchesInAutomaticMode) {
  Make(false);
  p_->InjectFault("D0", Fault{FaultKind::kDelay, 1, 50ms});
  BatchWaiter w;
  ASSERT_TRUE(p_->SubmitWrites(peer_, std::vector{Op(0, 0, 4096)}, kNoWriteKey, w.Callback()));
  EXPECT_TRUE(p_->ClosePeer(peer_, Soon()).ok());
  EXPECT_TRUE(w.done());
  EXPECT_TRUE(w.Wait(Soon()).ok());
  EXPECT_TRUE(Landed(Op(0, 0, 4096)));
}

TEST_F(InProcessTest, ReceiverChecksItsRegistrationAtDelivery) {
  Make(true);
  BatchWaiter w;
  ASSERT_TRUE(p_->SubmitWrites(peer_, std::vector{Op(0, 0, 64)}, kNoWriteKey, w.Callback()));
  ASSERT_TRUE(d_->DeregisterMemory(dst_.id, Soon()).ok());
  p_->Pump(TimePoint{});
  EXPECT_EQ(w.Wait(Soon()).code(), ErrorCode::kOutOfRange);
}

TEST_F(InProcessTest, DeregisterWaitsForLocalBatches) {
  Make(true);
  BatchWaiter w;
  ASSERT_TRUE(p_->SubmitWrites(peer_, std::vector{Op(0, 0, 64)}, kNoWriteKey, w.Callback()));
  EXPECT_EQ(p_->DeregisterMemory(src_.id, Soon()).code(), ErrorCode::kTimeout);
  p_->Pump(TimePoint{});
  EXPECT_TRUE(w.Wait(Soon()).ok());
  EXPECT_TRUE(p_->DeregisterMemory(src_.id, Soon()).ok());
}

TEST_F(InProcessTest, BlockingCallsFromACallbackAreRefused) {
  Make(true);
  Status inner;
  auto cb = [&](BatchId, Status) { inner = p_->ClosePeer(peer_, Soon()); };
  ASSERT_TRUE(p_->SubmitWrites(peer_, std::vector{Op(0, 0, 64)}, kNoWriteKey, cb));
  p_->Pump(TimePoint{});
  EXPECT_EQ(inner.code(), ErrorCode::kInvalidArgument);
}

TEST_F(InProcessTest, ConnectChecksTheFabricAndBackend) {
  Make(true);
  auto dup = MakeInProcessEngine(fabric_, {"D0", true});
  EXPECT_EQ(dup.error().code(), ErrorCode::kAlreadyExists);
  auto desc = *d_->ExportDescriptor({});
  d_.reset();  // the peer is gone
  EXPECT_EQ(p_->Connect(desc, Soon()).error().code(), ErrorCode::kUnavailable);
  // A batch to a peer that vanished fails at delivery.
  BatchWaiter w;
  ASSERT_TRUE(p_->SubmitWrites(peer_, std::vector{Op(0, 0, 64)}, kNoWriteKey, w.Callback()));
  p_->Pump(TimePoint{});
  EXPECT_EQ(w.Wait(Soon()).code(), ErrorCode::kUnavailable);
}

// ---- Receiver-side fencing (Engine::RevokeWriteKeys) ----

TEST_F(InProcessTest, AFencingReceiverRefusesARevokedKeyAndAnUnstampedWriteAndLandsNothing) {
  Make(false, /*fence_writes=*/true);
  ASSERT_TRUE(d_->fences_writes());
  const WriteOp op = Op(0, 4096, 4096);
  auto write = [&](WriteKey key) {
    BatchWaiter w;
    EXPECT_TRUE(p_->SubmitWrites(peer_, std::vector{op}, key, w.Callback()));
    return w.Wait(Soon());
  };
  EXPECT_TRUE(write(7).ok());
  EXPECT_TRUE(Landed(op));
  std::memset(dst_.base, 0, dst_.length);
  ASSERT_TRUE(d_->RevokeWriteKeys(std::vector<WriteKey>{7}, Soon()).ok());
  EXPECT_EQ(write(7).code(), ErrorCode::kRejected);
  EXPECT_EQ(write(kNoWriteKey).code(), ErrorCode::kRejected);
  EXPECT_FALSE(Landed(op));
  EXPECT_TRUE(std::all_of(dst_.base, dst_.base + dst_.length, [](std::byte b) {
    return b == std::byte{0};
  }));
  // Other keys, over the same connection, still write.
  EXPECT_TRUE(write(8).ok());
  EXPECT_TRUE(Landed(op));
}

TEST_F(InProcessTest, AReceiverThatDoesNotFenceIgnoresKeysAndRefusesToRevoke) {
  Make(false);
  EXPECT_FALSE(d_->fences_writes());
  EXPECT_EQ(d_->RevokeWriteKeys(std::vector<WriteKey>{7}, Soon()).code(), ErrorCode::kRejected);
  BatchWaiter w;
  ASSERT_TRUE(p_->SubmitWrites(peer_, std::vector{Op(0, 0, 64)}, 7, w.Callback()));
  EXPECT_TRUE(w.Wait(Soon()).ok());
}

}  // namespace
}  // namespace kvferry::transport
