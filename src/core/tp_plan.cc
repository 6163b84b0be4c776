#include "kvferry/core/tp_plan.h"

#include <fmt/format.h>

#include <algorithm>

namespace kvferry::core {

Result<int> TpRatio(std::uint32_t local_tp, std::uint32_t remote_tp) {
  if (local_tp == 0 || remote_tp == 0) return Err(ErrorCode::kInvalidArgument, "tp size is 0");
  if (local_tp > kMaxTpSize || remote_tp > kMaxTpSize) {
    return Err(ErrorCode::kOutOfRange, fmt::format("tp sizes {} and {}: at most {} ranks", local_tp,
                                                   remote_tp, kMaxTpSize));
  }
  if (local_tp >= remote_tp) {
    if (local_tp % remote_tp != 0) {
      return Err(ErrorCode::kInvalidArgument,
                 fmt::format("tp sizes {} and {} do not divide", local_tp, remote_tp));
    }
    return static_cast<int>(local_tp / remote_tp);
  }
  if (remote_tp % local_tp != 0) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("tp sizes {} and {} do not divide", local_tp, remote_tp));
  }
  return -static_cast<int>(remote_tp / local_tp);
}

Result<std::vector<std::uint32_t>> PullTargets(std::uint32_t d_rank, std::uint32_t d_tp,
                                               std::uint32_t p_tp) {
  auto ratio = TpRatio(d_tp, p_tp);
  if (!ratio) return tl::unexpected(ratio.error());
  if (d_rank >= d_tp) {
    return Err(ErrorCode::kOutOfRange, fmt::format("decoder rank {} >= tp {}", d_rank, d_tp));
  }
  std::vector<std::uint32_t> out;
  if (*ratio > 0) {
    out.push_back(d_rank / static_cast<std::uint32_t>(*ratio));
  } else {
    const auto n = static_cast<std::uint32_t>(-*ratio);
    for (std::uint32_t i = 0; i < n; ++i) out.push_back(d_rank * n + i);
  }
  return out;
}

Result<std::vector<std::uint32_t>> PairedDecoderRanks(std::uint32_t p_rank, std::uint32_t p_tp,
                                                      std::uint32_t d_tp) {
  if (p_rank >= p_tp) {
    return Err(ErrorCode::kOutOfRange, fmt::format("prefill rank {} >= tp {}", p_rank, p_tp));
  }
  std::vector<std::uint32_t> out;
  for (std::uint32_t d = 0; d < d_tp; ++d) {
    auto targets = PullTargets(d, d_tp, p_tp);
    if (!targets) return tl::unexpected(targets.error());
    if (std::find(targets->begin(), targets->end(), p_rank) != targets->end()) out.push_back(d);
  }
  return out;
}

namespace {

struct HeadRange {
  std::uint32_t first;
  std::uint32_t count;
  std::uint32_t replicas;  // ranks that hold this same range
};

HeadRange HeadsOf(std::uint32_t rank, std::uint32_t tp, std::uint32_t heads) {
  const std::uint32_t per_rank = std::max<std::uint32_t>(1, heads / tp);
  const std::uint32_t replicas = std::max<std::uint32_t>(1, tp / heads);
  return {(rank / replicas) * per_rank, per_rank, replicas};
}

}  // namespace

Result<Slice> PlanSlice(std::uint32_t p_rank, const TpLayout& p, std::uint32_t d_rank,
                        const TpLayout& d) {
  auto targets = PullTargets(d_rank, d.tp, p.tp);
  if (!targets) return tl::unexpected(targets.error());
  if (std::find(targets->begin(), targets->end(), p_rank) == targets->end()) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("decoder rank {} (tp {}) does not pull from prefill rank {} (tp {})",
                           d_rank, d.tp, p_rank, p.tp));
  }
  if (p.kv_heads != d.kv_heads) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("kv heads differ: prefill {}, decoder {}", p.kv_heads, d.kv_heads));
  }
  // Unknown head count (0 on both sides): assume as many heads as the larger TP, which splits
  // evenly on both.
  const std::uint32_t heads = p.kv_heads != 0 ? p.kv_heads : std::max(p.tp, d.tp);
  for (std::uint32_t tp : {p.tp, d.tp}) {
    if (heads % tp != 0 && tp % heads != 0) {
      return Err(ErrorCode::kInvalidArgument,
                 fmt::format("{} kv heads do not split over tp {}", heads, tp));
    }
  }
  const HeadRange ph = HeadsOf(p_rank, p.tp, heads);
  const HeadRange dh = HeadsOf(d_rank, d.tp, heads);
  if (p.block_len % ph.count != 0 || d.block_len % dh.count != 0 ||
      p.block_len / ph.count != d.block_len / dh.count) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("block layouts disagree: prefill {} B for {} heads, decoder {} B for "
                           "{} heads",
                           p.block_len, ph.count, d.block_len, dh.count));
  }
  const std::uint64_t head_bytes = p.block_len / ph.count;
  const std::uint32_t lo = std::max(ph.first, dh.first);
  const std::uint32_t hi = std::min(ph.first + ph.count, dh.first + dh.count);
  if (lo >= hi) {
    return Err(ErrorCode::kInternal,
               fmt::format("paired ranks P{} and D{} share no heads", p_rank, d_rank));
  }
  Slice slice;
  slice.src_offset = (lo - ph.first) * head_bytes;
  slice.dst_offset = (lo - dh.first) * head_bytes;
  slice.length = (hi - lo) * head_bytes;
  // Only the lowest of this D rank's targets holding the same heads writes.
  for (std::uint32_t other : *targets) {
    if (other >= p_rank) break;
    const HeadRange oh = HeadsOf(other, p.tp, heads);
    if (oh.first == ph.first) {
      slice.should_write = false;
      break;
    }
  }
  return slice;
}

Result<std::vector<BlockWrite>> PlanWrites(std::span<const BlockId> src_blocks,
                                           std::span<const BlockId> dst_blocks, const Slice& slice,
                                           std::uint64_t src_block_len,
                                           std::uint64_t dst_block_len) {
  if (src_blocks.size() != dst_blocks.size()) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("{} source blocks for {} destination blocks", src_blocks.size(),
                           dst_blocks.size()));
  }
  if (slice.src_offset + slice.length > src_block_len ||
      slice.dst_offset + slice.length > dst_block_len) {
    return Err(ErrorCode::kOutOfRange, "slice exceeds a block");
  }
  std::vector<BlockWrite> ops;
  if (!slice.should_write || slice.length == 0) return ops;
  // Runs merge only when each side's consecutive blocks are adjacent in memory, i.e. the slice
  // covers whole blocks on both sides.
  const bool mergeable = slice.length == src_block_len && slice.length == dst_block_len;
  for (std::size_t i = 0; i < src_blocks.size(); ++i) {
    const std::uint64_t src = src_blocks[i] * src_block_len + slice.src_offset;
    const std::uint64_t dst = dst_blocks[i] * dst_block_len + slice.dst_offset;
    if (mergeable && !ops.empty() && ops.back().src_offset + ops.back().length == src &&
        ops.back().dst_offset + ops.back().length == dst) {
      ops.back().length += slice.length;
    } else {
      ops.push_back({src, dst, slice.length});
    }
  }
  return ops;
}

}  // namespace kvferry::core
