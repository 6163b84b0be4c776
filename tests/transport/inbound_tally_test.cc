// The receiver's tally of inbound batches (src/transport/inbound_tally.h): one verdict per
// batch when its last op is accounted for, the first error winning, and a bound on open batches
// that forgets the longest-open one, so a sender that never finishes cannot grow it.
#include "inbound_tally.h"

#include <gtest/gtest.h>

namespace kvferry::transport::internal {
namespace {

TEST(InboundTally, ABatchHasItsVerdictWhenItsLastOpLandsAndNotBefore) {
  InboundTally t;
  EXPECT_EQ(t.Landed(1, 10, 3, ErrorCode::kOk), std::nullopt);
  EXPECT_EQ(t.Landed(1, 10, 3, ErrorCode::kOk), std::nullopt);
  ASSERT_TRUE(t.Find(1, 10).has_value());
  EXPECT_EQ(t.Find(1, 10)->landed, 2u);
  EXPECT_EQ(t.Landed(1, 10, 3, ErrorCode::kOk), ErrorCode::kOk);
  EXPECT_EQ(t.open(), 0u);
  EXPECT_FALSE(t.Find(1, 10).has_value());
  // A message carrying several ops (WRITEV) counts them all.
  EXPECT_EQ(t.Landed(1, 11, 5, ErrorCode::kOk, 5), ErrorCode::kOk);
}

TEST(InboundTally, TheFirstRefusalIsTheBatchsVerdict) {
  InboundTally t;
  EXPECT_EQ(t.Landed(1, 10, 3, ErrorCode::kOk), std::nullopt);
  EXPECT_EQ(t.Landed(1, 10, 3, ErrorCode::kOutOfRange), std::nullopt);
  EXPECT_EQ(t.Landed(1, 10, 3, ErrorCode::kRejected), ErrorCode::kOutOfRange);
}

TEST(InboundTally, BatchesOfTwoSendersWithOneIdAreTwoBatches) {
  InboundTally t;
  EXPECT_EQ(t.Landed(1, 10, 2, ErrorCode::kOk), std::nullopt);
  EXPECT_EQ(t.Landed(2, 10, 2, ErrorCode::kRejected), std::nullopt);
  EXPECT_EQ(t.Landed(1, 10, 2, ErrorCode::kOk), ErrorCode::kOk);
  EXPECT_EQ(t.Landed(2, 10, 2, ErrorCode::kOk), ErrorCode::kRejected);
}

TEST(InboundTally, ASenderForgottenTakesOnlyItsOwnOpenBatches) {
  InboundTally t;
  (void)t.Landed(1, 10, 2, ErrorCode::kOk);
  (void)t.Landed(1, 11, 2, ErrorCode::kOk);
  (void)t.Landed(2, 10, 2, ErrorCode::kOk);
  t.ForgetSender(1);
  EXPECT_EQ(t.open(), 1u);
  EXPECT_FALSE(t.Find(1, 10).has_value());
  EXPECT_EQ(t.Landed(2, 10, 2, ErrorCode::kOk), ErrorCode::kOk);
  // Its batch's next op starts over: it cannot complete what was forgotten.
  EXPECT_EQ(t.Landed(1, 10, 2, ErrorCode::kOk), std::nullopt);
}

TEST(InboundTally, OpeningPastTheBoundForgetsTheLongestOpenBatch) {
  InboundTally t(3);
  (void)t.Landed(1, 1, 2, ErrorCode::kOk);
  (void)t.Landed(1, 2, 2, ErrorCode::kOk);
  (void)t.Landed(1, 3, 2, ErrorCode::kOk);
  EXPECT_EQ(t.Landed(1, 2, 2, ErrorCode::kOk), ErrorCode::kOk);  // batch 2 done: 2 open
  (void)t.Landed(1, 4, 2, ErrorCode::kOk);                       // 3 open: 1, 3, 4
  EXPECT_EQ(t.forgotten(), 0u);
  (void)t.Landed(1, 5, 2, ErrorCode::kOk);  // forgets 1, the longest open
  EXPECT_EQ(t.forgotten(), 1u);
  EXPECT_EQ(t.open(), 3u);
  EXPECT_FALSE(t.Find(1, 1).has_value());
  EXPECT_EQ(t.Landed(1, 3, 2, ErrorCode::kOk), ErrorCode::kOk);
  EXPECT_EQ(t.Landed(1, 1, 2, ErrorCode::kOk), std::nullopt);  // reopened, half done
}

// A sender that opens batches without end, each with a new id (or a new claimed sender uid):
// the tally never holds more than its bound.
TEST(InboundTally, AFloodOfBatchesNeverFinishedStaysWithinTheBound) {
  InboundTally t(1000);
  for (std::uint64_t i = 0; i < 100000; ++i) {
    (void)t.Landed(i % 7, i, 0xffffffffu, ErrorCode::kOk);
    ASSERT_LE(t.open(), 1000u);
  }
  EXPECT_EQ(t.forgotten(), 99000u);
  EXPECT_EQ(t.Landed(99, 1, 1, ErrorCode::kOk), ErrorCode::kOk);  // still answers
}

}  // namespace
}  // namespace kvferry::transport::internal
