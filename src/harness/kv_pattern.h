// The synthetic model's KV bytes: a deterministic function of (transfer seed, token position,
// KV head, byte), so that D can verify every received block without knowing anything P did.
//
// Why this function: a block written by the right P rank for the right transfer has exactly these
// bytes; a stale block (another request's, or a freed one's leftovers) differs because the seed
// differs; a slice that landed at the wrong head offset differs because the head index is mixed
// in; and a block never written is zero-filled, which the function (practically) never produces.
//
// Layout (core/tp_plan.h): within one rank's block the bytes are head-major. Rank r holds
// heads_per_rank heads starting at first_head(r); head h of the block starts at
// (h - first_head)·head_block_bytes, and token slot s of that head at s·head_bytes_per_token.
// Block i of a request holds token positions [i·block_tokens, (i+1)·block_tokens).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "kvferry/status.h"

namespace kvferry::harness {

struct KvGeometry {
  std::uint32_t tp = 1;
  std::uint32_t kv_heads = 4;  // of the whole model (same on P and D)
  std::uint32_t block_tokens = 16;
  std::uint32_t head_bytes_per_token = 16;  // KV bytes of one token in one head

  // kInvalidArgument unless every size is positive and heads and ranks divide.
  Status Validate() const;
  std::uint32_t heads_per_rank() const { return kv_heads >= tp ? kv_heads / tp : 1; }
  std::uint32_t first_head(std::uint32_t rank) const {
    const std::uint32_t replicas = tp > kv_heads ? tp / kv_heads : 1;
    return (rank / replicas) * heads_per_rank();
  }
  std::uint64_t head_block_bytes() const {
    return std::uint64_t{block_tokens} * head_bytes_per_token;
  }
  std::uint64_t block_len() const { return head_block_bytes() * heads_per_rank(); }
};

// The seed of a transfer (all ranks, both sides agree) and of a request without a transfer.
std::uint64_t SeedOfTransfer(std::string_view transfer_id);
std::uint64_t SeedOfLocalRequest(std::uint64_t handle);

// Writes block `block_index` of a request into `block` (block_len() bytes) as rank `rank` holds it.
void FillBlock(std::byte* block, const KvGeometry& geometry, std::uint32_t rank, std::uint64_t seed,
               std::uint32_t block_index);
// True when `block` holds exactly what FillBlock would write.
bool VerifyBlock(const std::byte* block, const KvGeometry& geometry, std::uint32_t rank,
                 std::uint64_t seed, std::uint32_t block_index);

// The synthetic model's output: token `position` of a request with `seed`.
std::uint32_t TokenAt(std::uint64_t seed, std::uint64_t position);

}  // namespace kvferry::harness
