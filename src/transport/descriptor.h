// Internal: the byte format of a transport descriptor, shared by every backend.
//
// Little-endian; all sizes are bounded and checked before anything is allocated:
//   "KVFD" u8:version(2) u8:backend(1 ucx, 2 inprocess) u16:0
//   u64:engine_uid  u32:address_len  address
//   u32:region_count, then per region:
//     u32:id u8:kind u8[3]:0 u64:base u64:length u32:rkey_len rkey
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvferry/status.h"
#include "kvferry/transport/transport.h"

namespace kvferry::transport::internal {

inline constexpr std::size_t kMaxAddressBytes = 64 * 1024;
inline constexpr std::size_t kMaxRkeyBytes = 64 * 1024;
inline constexpr std::size_t kMaxRegions = 4096;

struct DescriptorRegion {
  RemoteRegion info;
  std::vector<std::byte> rkey;  // packed remote key (empty for the in-process backend)
};

struct Descriptor {
  std::string backend;  // "ucx" or "inprocess"
  std::uint64_t engine_uid = 0;
  std::vector<std::byte> address;  // UCX worker address, or the in-process engine name
  std::vector<DescriptorRegion> regions;

  const DescriptorRegion* Find(RegionId id) const;
};

std::vector<std::byte> EncodeDescriptor(const Descriptor& d);

// What ExportDescriptor lists, for every backend: the regions `ids` names (every region when
// empty), each as `entry(region)` appended to d.regions. kNotFound for an id `regions` (a map
// from RegionId) lacks; d.regions is then incomplete and must not be encoded.
template <class Regions, class Entry>
Status AddRegions(Descriptor& d, const Regions& regions, std::span<const RegionId> ids,
                  Entry&& entry) {
  if (ids.empty()) {
    for (const auto& [id, r] : regions) d.regions.push_back(entry(r));
    return Status::Ok();
  }
  for (RegionId id : ids) {
    auto it = regions.find(id);
    if (it == regions.end()) return Status(ErrorCode::kNotFound, "unknown region");
    d.regions.push_back(entry(it->second));
  }
  return Status::Ok();
}
Result<Descriptor> DecodeDescriptor(std::span<const std::byte> bytes);

// True when [offset, offset + length) lies inside [0, size) (overflow-safe).
constexpr bool RangeFits(std::uint64_t offset, std::uint64_t length, std::uint64_t size) {
  return offset <= size && length <= size - offset;
}

// A random 64-bit id (from std::random_device) for engine instances.
std::uint64_t RandomUid();

}  // namespace kvferry::transport::internal
