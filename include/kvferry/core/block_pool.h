// BlockPool: a fixed-capacity KV block allocator whose blocks carry a generation, shared by the
// serving harness (`kvferry serve`) and the simulator, so both judge writes the same way. Sans-IO
// and single-owner, like the rest of the core.
//
// Every allocation and every free bumps the block's generation. A WRITE that remembers the
// generation its destination had when the pull was made can therefore tell, at any later
// instant, whether the block changed hands since (freed, or freed and given to another
// request): that is how write-after-free is detected, in the simulator directly and in real
// processes from traces of (time, block, generation) events. Free blocks are reused first-in
// first-out, as vLLM's free-block queue does, so a freed block is not handed out again at once.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "kvferry/core/ids.h"

namespace kvferry::core {

class BlockPool {
 public:
  // Whoever holds blocks: the caller's request handle.
  using Owner = std::uint64_t;
  // Called after every allocation and free of a block, with its new generation (for traces).
  using Observer =
      std::function<void(BlockId block, std::uint64_t generation, bool allocated, Owner owner)>;

  explicit BlockPool(std::uint32_t num_blocks, Observer observer = {});

  // `n` blocks for `owner`, all or none (nullopt: not enough free blocks).
  std::optional<std::vector<BlockId>> Allocate(std::uint32_t n, Owner owner);
  bool CanAllocate(std::uint32_t n) const { return free_.size() >= n; }
  // Returns `owner`'s blocks to the pool. A block `owner` does not hold (free, another owner's,
  // or out of range) is left alone and counted as a double free; returns false if any was.
  bool Free(std::span<const BlockId> blocks, Owner owner);

  std::uint32_t total() const { return static_cast<std::uint32_t>(generation_.size()); }
  std::uint32_t free_count() const { return static_cast<std::uint32_t>(free_.size()); }
  std::uint32_t used() const { return total() - free_count(); }
  std::uint64_t generation(BlockId block) const { return generation_.at(block); }
  // The block's owner, or nullopt while it is free.
  std::optional<Owner> owner(BlockId block) const;
  std::uint64_t double_frees() const { return double_frees_; }

 private:
  Observer observer_;
  std::deque<BlockId> free_;
  std::vector<std::uint64_t> generation_;
  std::vector<std::optional<Owner>> owner_;
  std::uint64_t double_frees_ = 0;
};

}  // namespace kvferry::core
