#include "runtime/kv_memory.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <utility>

namespace kvferry::runtime {

namespace {

// The destructor's bound on waiting for the transport's last operations on a plane.
constexpr std::chrono::milliseconds kDeregisterTimeout{5000};

}  // namespace

Result<KvMemory> KvMemory::Register(std::shared_ptr<transport::Engine> engine,
                                    std::span<const KvPlane> planes, std::uint64_t block_len,
                                    std::uint32_t num_blocks) {
  if (block_len == 0 || num_blocks == 0) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("KV memory: block_len {} and num_blocks {} must be positive", block_len,
                           num_blocks));
  }
  if (block_len > std::numeric_limits<std::size_t>::max() / num_blocks) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("KV memory: {} blocks of {} bytes overflow", num_blocks, block_len));
  }
  const std::size_t plane_bytes = static_cast<std::size_t>(block_len) * num_blocks;
  if (planes.size() > kMaxKvPlanes) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("KV memory: {} planes, at most {}", planes.size(), kMaxKvPlanes));
  }
  for (std::size_t i = 0; i < planes.size(); ++i) {
    if (planes[i].base == nullptr || planes[i].length < plane_bytes) {
      return Err(ErrorCode::kInvalidArgument,
                 fmt::format("KV memory: plane {} has {} bytes{}, {} blocks of {} need {}", i,
                             planes[i].length, planes[i].base == nullptr ? " at null" : "",
                             num_blocks, block_len, plane_bytes));
    }
  }
  // Overlapping planes would receive two planes' bytes in one place: refused.
  std::vector<std::uintptr_t> bases;
  bases.reserve(planes.size());
  for (const KvPlane& plane : planes) bases.push_back(reinterpret_cast<std::uintptr_t>(plane.base));
  std::sort(bases.begin(), bases.end());
  for (std::size_t i = 0; i + 1 < bases.size(); ++i) {
    if (bases[i + 1] - bases[i] < plane_bytes) {
      return Err(ErrorCode::kInvalidArgument,
                 fmt::format("KV memory: planes at {:#x} and {:#x} overlap ({} bytes each)",
                             bases[i], bases[i + 1], plane_bytes));
    }
  }
  KvMemory memory;
  memory.engine_ = std::move(engine);
  if (planes.empty()) {
    auto region = memory.engine_->AllocateRegion(plane_bytes);
    if (!region) return tl::unexpected(region.error());
    memory.regions_.push_back(*region);
    return memory;
  }
  memory.regions_.reserve(planes.size());
  for (const KvPlane& plane : planes) {
    // Registered exactly as long as the blocks need: the rest of a caller's tensor is none of
    // the data plane's business.
    auto region = memory.engine_->RegisterMemory(plane.base, plane_bytes, plane.kind);
    if (!region) return tl::unexpected(region.error());  // ~KvMemory deregisters the others
    memory.regions_.push_back(*region);
  }
  return memory;
}

KvMemory::KvMemory(KvMemory&& other) noexcept
    : engine_(std::move(other.engine_)), regions_(std::move(other.regions_)) {
  other.regions_.clear();
}

KvMemory& KvMemory::operator=(KvMemory&& other) noexcept {
  if (this != &other) {
    (void)Deregister(core::Clock::now() + kDeregisterTimeout);
    engine_ = std::move(other.engine_);
    regions_ = std::move(other.regions_);
    other.regions_.clear();
  }
  return *this;
}

KvMemory::~KvMemory() { (void)Deregister(core::Clock::now() + kDeregisterTimeout); }

std::vector<transport::RegionId> KvMemory::ids() const {
  std::vector<transport::RegionId> out;
  out.reserve(regions_.size());
  for (const transport::Region& r : regions_) out.push_back(r.id);
  return out;
}

Status KvMemory::Deregister(core::TimePoint deadline) {
  Status first = Status::Ok();
  for (const transport::Region& r : regions_) {
    Status s = engine_->DeregisterMemory(r.id, deadline);
    if (first.ok() && !s.ok()) first = std::move(s);
  }
  regions_.clear();
  return first;
}

}  // namespace kvferry::runtime
