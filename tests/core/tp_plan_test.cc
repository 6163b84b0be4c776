// TP mapping and slicing (SPEC §5).
#include "kvferry/core/tp_plan.h"

#include <gtest/gtest.h>

namespace kvferry::core {
namespace {

using V = std::vector<std::uint32_t>;

TEST(TpPlanRules, RatioIsLocalOverRemoteOrNegative) {
  EXPECT_EQ(*TpRatio(4, 2), 2);
  EXPECT_EQ(*TpRatio(2, 2), 1);
  EXPECT_EQ(*TpRatio(1, 4), -4);
  EXPECT_FALSE(TpRatio(3, 2).has_value()) << "sizes must divide";
  EXPECT_FALSE(TpRatio(0, 2).has_value());
}

// Sizes come from the wire: 2^31 once overflowed `int` and made P allocate per rank.
TEST(TpPlanRules, SizesAboveTheRankLimitAreRefused) {
  EXPECT_EQ(*TpRatio(kMaxTpSize, 1), static_cast<int>(kMaxTpSize));
  EXPECT_EQ(TpRatio(kMaxTpSize + 1, 1).error().code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(TpRatio(1, 1u << 31).error().code(), ErrorCode::kOutOfRange);
  EXPECT_FALSE(PairedDecoderRanks(0, 1, 1u << 31).has_value());
}

TEST(TpPlanRules, DecoderTpAtLeastPrefillPullsFromOneRank) {
  // P TP1 → D TP2: both D ranks pull from P0.
  EXPECT_EQ(*PullTargets(0, 2, 1), V{0});
  EXPECT_EQ(*PullTargets(1, 2, 1), V{0});
  // P TP2 → D TP4: D rank r pulls from P r/2.
  EXPECT_EQ(*PullTargets(3, 4, 2), V{1});
}

TEST(TpPlanRules, PrefillTpAboveDecoderPullsFromSeveralRanks) {
  EXPECT_EQ(*PullTargets(0, 1, 2), (V{0, 1}));     // P TP2 → D TP1
  EXPECT_EQ(*PullTargets(1, 2, 4), (V{2, 3}));     // P TP4 → D TP2
  EXPECT_FALSE(PullTargets(2, 2, 4).has_value());  // rank out of range
}

TEST(TpPlanRules, NeedSendIsNumberOfPairedDecoderRanks) {
  EXPECT_EQ(*PairedDecoderRanks(0, 1, 2), (V{0, 1}));  // P TP1 → D TP2: need_send 2
  EXPECT_EQ(*PairedDecoderRanks(1, 2, 1), V{0});       // P TP2 → D TP1: need_send 1
  EXPECT_EQ(*PairedDecoderRanks(3, 4, 2), V{1});
}

TEST(TpPlanRules, PrefillTpAboveDecoderWritesWholeBlockAtRankOffset) {
  // P TP2 → D TP1, 8 heads: each P rank holds 4 heads; D's block is twice as large.
  const TpLayout p{2, 8, 4096}, d{1, 8, 8192};
  auto s0 = *PlanSlice(0, p, 0, d);
  auto s1 = *PlanSlice(1, p, 0, d);
  EXPECT_TRUE(s0.should_write && s1.should_write);
  EXPECT_EQ(s0.src_offset, 0u);
  EXPECT_EQ(s0.dst_offset, 0u);
  EXPECT_EQ(s1.dst_offset, 4096u);  // (p_rank % ratio) · block_len
  EXPECT_EQ(s1.length, 4096u);
}

TEST(TpPlanRules, PrefillTpBelowDecoderWritesTheSliceOfThePullingRank) {
  // P TP1 → D TP2, 8 heads: P holds all 8; D rank 1 gets heads 4..7.
  const TpLayout p{1, 8, 8192}, d{2, 8, 4096};
  auto s = *PlanSlice(0, p, 1, d);
  EXPECT_EQ(s.src_offset, 4096u);  // (d_rank % |ratio|) · remote block_len
  EXPECT_EQ(s.dst_offset, 0u);
  EXPECT_EQ(s.length, 4096u);
}

TEST(TpPlanRules, ReplicatedKvRanksAnswerWithoutWriting) {
  // MLA-like: one latent "head" replicated on every rank. P TP2 → D TP1.
  const TpLayout p{2, 1, 1024}, d{1, 1, 1024};
  EXPECT_TRUE(PlanSlice(0, p, 0, d)->should_write);
  EXPECT_FALSE(PlanSlice(1, p, 0, d)->should_write);
  // TP above the number of KV heads: P TP4 with 2 heads → D TP2.
  const TpLayout p4{4, 2, 512}, d2{2, 2, 512};
  EXPECT_TRUE(PlanSlice(2, p4, 1, d2)->should_write);
  EXPECT_FALSE(PlanSlice(3, p4, 1, d2)->should_write);
}

TEST(TpPlanRules, RejectsUnpairedRanksAndMismatchedLayouts) {
  EXPECT_FALSE(PlanSlice(1, {2, 8, 4096}, 0, {2, 8, 4096}).has_value());  // D0 pulls from P0
  EXPECT_FALSE(PlanSlice(0, {1, 8, 8192}, 0, {1, 8, 4096}).has_value());  // head bytes differ
}

TEST(TpPlanRules, UnknownHeadCountSplitsLikeTheLargerTp) {
  // kv_heads 0 on both sides: P TP2 → D TP1 still slices by rank.
  auto s1 = PlanSlice(1, {2, 0, 4096}, 0, {1, 0, 8192});
  ASSERT_TRUE(s1.has_value()) << s1.error().ToString();
  EXPECT_EQ(s1->dst_offset, 4096u);
  EXPECT_FALSE(PlanSlice(0, {4, 6, 1536}, 0, {4, 6, 1536}).has_value()) << "6 heads over TP4";
}

TEST(TpPlanRules, ContiguousRunsOfWholeBlocksAreCoalesced) {
  const Slice whole{true, 0, 0, 100};
  const std::vector<BlockId> src = {3, 4, 5, 9, 10};
  const std::vector<BlockId> dst = {0, 1, 2, 3, 7};
  auto ops = *PlanWrites(src, dst, whole, 100, 100);
  // 3..5→0..2 is one run; 9→3 breaks (dst continues, src jumps); 10→7 breaks again.
  EXPECT_EQ(ops, (std::vector<BlockWrite>{{300, 0, 300}, {900, 300, 100}, {1000, 700, 100}}));
}

TEST(TpPlanRules, PartialSlicesAreNotMergedAcrossBlocks) {
  const Slice half{true, 50, 0, 50};
  const std::vector<BlockId> src = {0, 1}, dst = {0, 1};
  auto ops = *PlanWrites(src, dst, half, 100, 50);
  EXPECT_EQ(ops, (std::vector<BlockWrite>{{50, 0, 50}, {150, 50, 50}}));
}

TEST(TpPlanRules, NonWritingSliceProducesNoOpsAndBadInputIsRejected) {
  const std::vector<BlockId> one = {1};
  EXPECT_TRUE(PlanWrites(one, one, Slice{false, 0, 0, 100}, 100, 100)->empty());
  EXPECT_FALSE(PlanWrites(one, std::vector<BlockId>{}, Slice{true, 0, 0, 100}, 100, 100));
  EXPECT_FALSE(PlanWrites(one, one, Slice{true, 50, 0, 100}, 100, 100)) << "slice past block";
}

}  // namespace
}  // namespace kvferry::core
