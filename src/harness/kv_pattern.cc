#include "harness/kv_pattern.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

namespace kvferry::harness {

namespace {

constexpr std::uint64_t Mix(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The bytes of one (token, head) cell: a keyed stream of 64-bit words.
template <typename Fn>
void ForEachCell(const KvGeometry& g, std::uint32_t rank, std::uint64_t seed,
                 std::uint32_t block_index, Fn&& fn) {
  const std::uint32_t first = g.first_head(rank);
  for (std::uint32_t j = 0; j < g.heads_per_rank(); ++j) {
    const std::uint64_t head = first + j;
    for (std::uint32_t s = 0; s < g.block_tokens; ++s) {
      const std::uint64_t position = std::uint64_t{block_index} * g.block_tokens + s;
      const std::uint64_t key = Mix(seed ^ Mix((position << 20) ^ head));
      const std::size_t offset = j * g.head_block_bytes() + std::size_t{s} * g.head_bytes_per_token;
      fn(offset, key);
    }
  }
}

void CellBytes(std::uint64_t key, std::byte* out, std::uint32_t n) {
  for (std::uint32_t w = 0; w * 8 < n; ++w) {
    const std::uint64_t word = Mix(key + w);
    std::memcpy(out + w * 8, &word, std::min<std::uint32_t>(8, n - w * 8));
  }
}

}  // namespace

Status KvGeometry::Validate() const {
  if (tp == 0 || kv_heads == 0 || block_tokens == 0 || head_bytes_per_token == 0) {
    return Status(ErrorCode::kInvalidArgument, "kv geometry: every size must be positive");
  }
  if ((kv_heads >= tp && kv_heads % tp != 0) || (kv_heads < tp && tp % kv_heads != 0)) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("kv geometry: {} kv heads do not divide over tp {}", kv_heads, tp));
  }
  if (head_bytes_per_token > 4096 || block_tokens > 4096) {
    return Status(ErrorCode::kInvalidArgument, "kv geometry: block too large");
  }
  return Status::Ok();
}

std::uint64_t SeedOfTransfer(std::string_view transfer_id) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (char c : transfer_id) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ull;
  }
  return Mix(h ^ 0x7472616e73666572ull);  // domain-separated from local requests
}

std::uint64_t SeedOfLocalRequest(std::uint64_t handle) { return Mix(handle ^ 0x6c6f63616cull); }

void FillBlock(std::byte* block, const KvGeometry& geometry, std::uint32_t rank, std::uint64_t seed,
               std::uint32_t block_index) {
  ForEachCell(geometry, rank, seed, block_index, [&](std::size_t offset, std::uint64_t key) {
    CellBytes(key, block + offset, geometry.head_bytes_per_token);
  });
}

bool VerifyBlock(const std::byte* block, const KvGeometry& geometry, std::uint32_t rank,
                 std::uint64_t seed, std::uint32_t block_index) {
  bool ok = true;
  std::byte expected[4096];
  ForEachCell(geometry, rank, seed, block_index, [&](std::size_t offset, std::uint64_t key) {
    if (!ok) return;
    CellBytes(key, expected, geometry.head_bytes_per_token);
    ok = std::memcmp(expected, block + offset, geometry.head_bytes_per_token) == 0;
  });
  return ok;
}

std::uint32_t TokenAt(std::uint64_t seed, std::uint64_t position) {
  return static_cast<std::uint32_t>(Mix(seed ^ Mix(position + 0x746f6b)) % 32000);
}

}  // namespace kvferry::harness
