// Identifiers shared by the core, the wire codec and the runtime.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace kvferry::core {

// The P/D join key chosen by the router ("xfer-<uuid>" in vLLM). P and D know a request by its
// own per-instance id; both know the transfer by this id.
using TransferId = std::string;
// D's per-instance request id (the key of D's receive ledger and of pull responses).
using RequestId = std::string;
// A P engine as D knows it (vLLM's remote_engine_id).
using EngineId = std::string;
// A block index in one rank's KV region.
using BlockId = std::uint32_t;

// Renewals name transfers by a 56-bit fingerprint of their id instead of the id itself: 7 bytes
// per id keeps a renewal of 128 ids under 1 KB (an "xfer-<uuid>" id is 41 bytes). A collision
// can only extend another live transfer's lease, never free or corrupt anything, and pulls always
// carry and check the full id. The function is FNV-1a 64 folded to 56 bits; it is part of the
// wire protocol (docs/protocol.md) and must never change without a protocol version bump.
using Fingerprint = std::uint64_t;
constexpr int kFingerprintBytes = 7;
constexpr Fingerprint kFingerprintMask = (Fingerprint{1} << (8 * kFingerprintBytes)) - 1;

constexpr Fingerprint FingerprintOf(std::string_view id) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (char c : id) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ull;
  }
  return (h ^ (h >> 56)) & kFingerprintMask;
}

}  // namespace kvferry::core
