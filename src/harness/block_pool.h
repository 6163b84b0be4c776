// BlockPool: the synthetic engine's fixed-capacity KV block allocator, one per instance (all TP
// ranks use the same block ids in their own regions). Not thread-safe: the engine thread owns it.
//
// Every block carries a generation that is bumped on free and again on allocation, so a trace of
// (t, block, generation, alloc/free) tells for any instant whether a block still belonged to the
// request a remote WRITE was aimed at. Free blocks are reused first-in first-out (as vLLM's free
// block queue does), so a freed block is not handed out again at once.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvferry/core/ids.h"

namespace kvferry::harness {

class TraceFile;

class BlockPool {
 public:
  // `trace` may be null; `role` names the instance in trace lines.
  BlockPool(std::uint32_t num_blocks, TraceFile* trace, std::string role);

  // `n` blocks for `request`, all or none.
  std::optional<std::vector<core::BlockId>> Allocate(std::uint32_t n, const std::string& request);
  // Returns blocks to the pool. Freeing a free block is a bug: it is ignored and counted.
  void Free(std::span<const core::BlockId> blocks, const std::string& request);

  std::uint32_t total() const { return static_cast<std::uint32_t>(generation_.size()); }
  std::uint32_t free_count() const { return static_cast<std::uint32_t>(free_.size()); }
  std::uint32_t used() const { return total() - free_count(); }
  std::uint64_t generation(core::BlockId block) const { return generation_.at(block); }
  std::uint64_t double_frees() const { return double_frees_; }

 private:
  void Trace(core::BlockId block, const char* event, const std::string& request);

  TraceFile* trace_;
  std::string role_;
  std::deque<core::BlockId> free_;
  std::vector<std::uint64_t> generation_;
  std::vector<bool> in_use_;
  std::uint64_t double_frees_ = 0;
};

}  // namespace kvferry::harness
