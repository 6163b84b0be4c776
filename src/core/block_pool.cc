#include "kvferry/core/block_pool.h"

namespace kvferry::core {

BlockPool::BlockPool(std::uint32_t num_blocks, Observer observer)
    : observer_(std::move(observer)), generation_(num_blocks, 0), owner_(num_blocks) {
  for (BlockId b = 0; b < num_blocks; ++b) free_.push_back(b);
}

std::optional<std::vector<BlockId>> BlockPool::Allocate(std::uint32_t n, Owner owner) {
  if (n > free_.size()) return std::nullopt;
  std::vector<BlockId> out(free_.begin(), free_.begin() + n);
  free_.erase(free_.begin(), free_.begin() + n);
  for (BlockId b : out) {
    owner_[b] = owner;
    ++generation_[b];
    if (observer_) observer_(b, generation_[b], true, owner);
  }
  return out;
}

bool BlockPool::Free(std::span<const BlockId> blocks, Owner owner) {
  bool ok = true;
  for (BlockId b : blocks) {
    if (b >= owner_.size() || owner_[b] != owner) {
      ++double_frees_;
      ok = false;
      continue;
    }
    owner_[b].reset();
    ++generation_[b];
    if (observer_) observer_(b, generation_[b], false, owner);
    free_.push_back(b);
  }
  return ok;
}

std::optional<BlockPool::Owner> BlockPool::owner(BlockId block) const { return owner_.at(block); }

}  // namespace kvferry::core
