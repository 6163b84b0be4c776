// TP mapping and slicing between a P engine and a D engine with different tensor-parallel sizes
// (SPEC §5). Pure functions, no state.
//
// Heads are what ranks split. With H KV heads and tp ranks, rank r holds max(1, H/tp) heads
// starting at head (r / replicas)·heads_per_rank, where replicas = max(1, tp/H) ranks hold the
// same heads (replicated KV: MLA has H = 1). A P rank writes into a D block exactly the heads the
// two ranks share; among P ranks a D rank pulls from that hold the same heads, only the lowest
// writes and the others answer ok without writing (so counts still close).
//
// Within a block, bytes are head-major: head h of a rank's block starts at
// (h - first_head)·head_bytes. This is what makes a head range one contiguous byte range.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvferry/core/ids.h"
#include "kvferry/status.h"

namespace kvferry::core {

struct TpLayout {
  std::uint32_t tp = 1;         // tensor-parallel size
  std::uint32_t kv_heads = 0;   // total KV heads of the model (0: unknown, as many as the larger
                                // TP of the pair, so neither side replicates)
  std::uint64_t block_len = 0;  // bytes of one block in one region on one rank
};

// The largest tensor-parallel size kvferry accepts, on either side. P tracks which D ranks pulled
// a transfer in 64-bit masks (hold_table.h), and every size that arrives from the wire is
// checked against this before anything is allocated per rank (a pull naming d_tp_size 2^31 must
// cost nothing).
inline constexpr std::uint32_t kMaxTpSize = 64;

// local/remote ratio: local/remote when local >= remote, else -(remote/local). Sizes must divide
// and be in [1, kMaxTpSize] (kOutOfRange otherwise).
Result<int> TpRatio(std::uint32_t local_tp, std::uint32_t remote_tp);

// The P ranks D rank `d_rank` pulls from: [r / ratio] when D TP >= P TP, else
// [r·|ratio| + i for i < |ratio|].
Result<std::vector<std::uint32_t>> PullTargets(std::uint32_t d_rank, std::uint32_t d_tp,
                                               std::uint32_t p_tp);
// The D ranks that pull from P rank `p_rank`; P's need_send is its size.
Result<std::vector<std::uint32_t>> PairedDecoderRanks(std::uint32_t p_rank, std::uint32_t p_tp,
                                                      std::uint32_t d_tp);

// What P rank `p_rank` writes into each block of D rank `d_rank`.
struct Slice {
  bool should_write = true;      // false: replicated KV written by another P rank; answer ok only
  std::uint64_t src_offset = 0;  // inside P's block
  std::uint64_t dst_offset = 0;  // inside D's block
  std::uint64_t length = 0;
};
Result<Slice> PlanSlice(std::uint32_t p_rank, const TpLayout& p, std::uint32_t d_rank,
                        const TpLayout& d);

// One data-plane write, in bytes relative to the start of each side's region.
struct BlockWrite {
  std::uint64_t src_offset;
  std::uint64_t dst_offset;
  std::uint64_t length;
  friend bool operator==(const BlockWrite&, const BlockWrite&) = default;
};

// The writes that move `slice` of every block src_blocks[i] → dst_blocks[i] for one region,
// with contiguous runs (consecutive on both sides and covering whole blocks) merged into one op.
// Errors: kInvalidArgument when the lists differ in length.
Result<std::vector<BlockWrite>> PlanWrites(std::span<const BlockId> src_blocks,
                                           std::span<const BlockId> dst_blocks, const Slice& slice,
                                           std::uint64_t src_block_len,
                                           std::uint64_t dst_block_len);

}  // namespace kvferry::core
