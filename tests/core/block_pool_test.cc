// BlockPool: generations, all-or-none allocation, FIFO reuse, and frees only by the owner.
#include "kvferry/core/block_pool.h"

#include <gtest/gtest.h>

#include <tuple>
#include <vector>

namespace kvferry::core {
namespace {

TEST(BlockPoolRules, GenerationsOwnersAndFifoReuse) {
  std::vector<std::tuple<BlockId, std::uint64_t, bool, BlockPool::Owner>> seen;
  BlockPool pool(4, [&](BlockId b, std::uint64_t g, bool allocated, BlockPool::Owner owner) {
    seen.emplace_back(b, g, allocated, owner);
  });
  auto a = pool.Allocate(3, 10);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(pool.used(), 3u);
  EXPECT_FALSE(pool.Allocate(2, 11).has_value());  // all or nothing
  EXPECT_FALSE(pool.CanAllocate(2));
  EXPECT_EQ(pool.used(), 3u);
  EXPECT_EQ(pool.generation((*a)[0]), 1u);
  EXPECT_EQ(pool.owner((*a)[0]), BlockPool::Owner{10});
  EXPECT_TRUE(pool.Free(*a, 10));
  EXPECT_EQ(pool.used(), 0u);
  EXPECT_EQ(pool.generation((*a)[0]), 2u);
  EXPECT_FALSE(pool.owner((*a)[0]).has_value());
  // FIFO: the never-used block 3 comes first, then the freed ones in order.
  auto b = pool.Allocate(2, 11);
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ((*b)[0], 3u);
  EXPECT_EQ((*b)[1], (*a)[0]);
  EXPECT_EQ(pool.generation((*a)[0]), 3u);
  // a[0] is b's now and a[1], a[2] are free: the old owner frees nothing, and all three count.
  EXPECT_FALSE(pool.Free(*a, 10));
  EXPECT_EQ(pool.double_frees(), 3u);
  EXPECT_EQ(pool.owner((*a)[0]), BlockPool::Owner{11});
  EXPECT_FALSE(pool.Free(std::vector<BlockId>{99}, 11));  // out of range: counted, no crash
  EXPECT_EQ(pool.double_frees(), 4u);
  ASSERT_EQ(seen.size(), 3u + 3u + 2u);
  EXPECT_EQ(seen[3], std::make_tuple((*a)[0], std::uint64_t{2}, false, BlockPool::Owner{10}));
}

}  // namespace
}  // namespace kvferry::core
