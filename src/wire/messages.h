// Side-channel messages between a D worker (ZeroMQ DEALER) and a P worker (ROUTER), and their
// msgpack codec. docs/protocol.md is the normative description of the bytes; this header is the
// C++ view of it.
//
// Contracts shared by every function here:
//  - Decoders are pure: they read only the given bytes, change no state, never throw, and on
//    failure return a Status whose message is non-empty and names the offending field.
//    Codes: kOutOfRange when a size, count, depth or value exceeds a limit below; kProtocol for
//    everything else (not msgpack, not a map, missing or mistyped field, wrong message type,
//    "unsupported version N").
//  - Limits are checked against the declared sizes before anything is allocated for them, so a
//    few hostile bytes cannot make a decoder allocate much (see kMax* below).
//  - Encoders never fail. A message that fails Validate() is still encoded, but the peer will
//    reject it, so senders validate first (or build messages within the limits by construction).
//  - A message that Validate() accepts round-trips: Decode(Encode(m)) == m.
//
// msgpack itself stays in the .cc files; including this header costs only the standard library.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/core/ids.h"
#include "kvferry/status.h"

namespace kvferry::wire {

// The major protocol version this build speaks. Additions that old peers may ignore are new
// optional keys (unknown keys are skipped); anything else bumps this number.
inline constexpr std::uint32_t kProtocolVersion = 1;

// Value of key "t". Never renumber: the numbers are on the wire.
enum class MessageType : std::uint8_t {
  kPull = 1,          // D -> P: write these transfers into my blocks
  kRenewal = 2,       // D -> P: extend the lease of these transfers
  kRenewalReply = 3,  // P -> D: answer to one Renewal
  kPullResponse = 4,  // P -> D: one of possibly several answers to one Pull
};
std::string_view ToString(MessageType type);

// ---- Limits (docs/protocol.md §Limits). A peer never needs more; decoders reject more. ----
inline constexpr std::size_t kMaxFrameBytes = std::size_t{8} << 20;  // one msgpack frame
inline constexpr std::size_t kMaxIdBytes = 256;     // engine, request and transfer ids
inline constexpr std::size_t kMaxTextBytes = 4096;  // free-text messages and reasons
inline constexpr std::size_t kMaxDescriptorBytes = std::size_t{64} << 10;  // Pull region desc.
inline constexpr std::size_t kMaxRequestsPerPull = 4096;
inline constexpr std::size_t kMaxBlocksPerRequest = 65536;
inline constexpr std::size_t kMaxBlocksPerPull = std::size_t{1} << 20;
inline constexpr std::size_t kMaxFingerprintsPerRenewal = 8192;
// A lease in ms (Pull and Renewal `d_lease_ms`): one year. Bounded so that converting it to
// nanoseconds can never overflow.
inline constexpr std::uint64_t kMaxLeaseMs = 365ull * 24 * 3600 * 1000;
// ok + err entries of one PullResponse: one response never lists more than its pull held.
inline constexpr std::size_t kMaxEntriesPerResponse = kMaxRequestsPerPull;
// Keys in one message map, unknown ones included (forward compatibility, but bounded).
inline constexpr std::size_t kMaxMapKeys = 64;
// Nested msgpack containers, the top-level map counting as 1. v1 uses at most 3.
inline constexpr std::size_t kMaxDepth = 8;

// ---- D -> P: Pull (t = 1) ----

// One request of a pull: write transfer `transfer_id` into D's blocks `block_ids` (in order:
// the i-th block of the transfer goes to block_ids[i]) and report it under `d_req_id`.
struct PullRequest {
  core::RequestId d_req_id;              // non-empty, <= kMaxIdBytes
  core::TransferId transfer_id;          // non-empty, <= kMaxIdBytes
  std::vector<core::BlockId> block_ids;  // <= kMaxBlocksPerRequest; may be empty

  friend bool operator==(const PullRequest&, const PullRequest&) = default;
};

// Every message has `id` (key "id", omitted when 0): D numbers its Pulls and Renewals (non-zero,
// unique among the messages outstanding on one socket) and P copies the id into each
// PullResponse/RenewalReply, so D can run several pulls at once on one DEALER. P answers 0 only
// when it could not read the id (an undecodable message).

struct Pull {
  core::EngineId d_engine_id;   // non-empty, <= kMaxIdBytes
  std::uint32_t d_tp_size = 1;  // >= 1
  std::uint32_t d_tp_rank = 0;  // < d_tp_size
  // D's kv_lease_duration in ms. nullopt: D predates leases and does not say (P does not
  // compare); 0: D runs without a lease. P fails the requests if it differs from its own lease.
  std::optional<std::uint64_t> d_lease_ms;
  // Data-plane descriptor of D's KV region, opaque here (made by the transport layer),
  // <= kMaxDescriptorBytes. nullopt: unchanged since the last pull P accepted from this
  // (d_engine_id, d_tp_rank); a P that has none answers ERROR kNotFound (docs/protocol.md).
  std::optional<std::vector<std::uint8_t>> region_descriptor;
  std::uint64_t block_len = 0;        // bytes per block in D's region (stride), >= 1
  std::uint32_t num_blocks = 0;       // blocks D registered; every block id must be below this
  std::vector<PullRequest> requests;  // <= kMaxRequestsPerPull; empty = notify-only pull
  std::uint64_t id = 0;

  friend bool operator==(const Pull&, const Pull&) = default;
};

// ---- D -> P: Renewal (t = 2) ----

struct Renewal {
  core::EngineId d_engine_id;  // non-empty, <= kMaxIdBytes
  std::uint64_t d_lease_ms = 0;
  // core::FingerprintOf(transfer_id) of each renewed transfer, each <= core::kFingerprintMask
  // (the encoder keeps only the low 56 bits). <= kMaxFingerprintsPerRenewal; duplicates allowed.
  std::vector<core::Fingerprint> fingerprints;
  std::uint64_t id = 0;

  friend bool operator==(const Renewal&, const Renewal&) = default;
};

// Renewal fingerprints for these transfer ids, in order.
[[nodiscard]] std::vector<core::Fingerprint> FingerprintsOf(
    std::span<const core::TransferId> transfer_ids);

// ---- P -> D: RenewalReply (t = 3) ----

enum class RenewalStatus : std::uint8_t {
  kAccepted = 0,  // P has a lease and processed the renewal (see extended/unknown)
  kRejected = 1,  // P runs without a lease; D warns once per P engine and keeps pulling
  kError = 2,     // P could not process it (message says why)
};

struct RenewalReply {
  RenewalStatus status = RenewalStatus::kAccepted;
  std::uint64_t extended = 0;    // fingerprints that matched a transfer P holds
  std::uint64_t unknown = 0;     // fingerprints P does not know (freed, not yet seen, ...)
  std::uint64_t p_lease_ms = 0;  // P's lease (0 = none), so D can report a mismatch
  std::string message;           // <= kMaxTextBytes; empty = absent on the wire
  std::uint64_t id = 0;          // the Renewal's id

  friend bool operator==(const RenewalReply&, const RenewalReply&) = default;
};

// ---- P -> D: PullResponse (t = 4) ----

enum class PullStatus : std::uint8_t {
  kFinish = 0,    // last response for this pull message
  kContinue = 1,  // more responses follow
  kError = 2,     // the whole pull message failed; every request of it fails with `code`
};

struct RequestError {
  core::RequestId d_req_id;               // non-empty, <= kMaxIdBytes
  ErrorCode code = ErrorCode::kInternal;  // never kOk
  std::string reason;                     // <= kMaxTextBytes

  friend bool operator==(const RequestError&, const RequestError&) = default;
};

struct PullResponse {
  PullStatus status = PullStatus::kFinish;
  std::vector<core::RequestId> ok;  // ids <= kMaxIdBytes; empty when status is kError
  std::vector<RequestError> err;    // empty when status is kError
  // kError only: why the whole message failed (never kOk). kOk for FINISH/CONTINUE.
  ErrorCode code = ErrorCode::kOk;
  std::string message;   // <= kMaxTextBytes; non-empty when status is kError
  std::uint64_t id = 0;  // the Pull's id

  friend bool operator==(const PullResponse&, const PullResponse&) = default;
};

// ---- Codec ----

[[nodiscard]] std::vector<std::uint8_t> Encode(const Pull& msg);
[[nodiscard]] std::vector<std::uint8_t> Encode(const Renewal& msg);
[[nodiscard]] std::vector<std::uint8_t> Encode(const RenewalReply& msg);
[[nodiscard]] std::vector<std::uint8_t> Encode(const PullResponse& msg);

// The limits and field rules the decoder enforces, checked on a struct (for senders and tests).
[[nodiscard]] Status Validate(const Pull& msg);
[[nodiscard]] Status Validate(const Renewal& msg);
[[nodiscard]] Status Validate(const RenewalReply& msg);
[[nodiscard]] Status Validate(const PullResponse& msg);

[[nodiscard]] Result<Pull> DecodePull(const std::uint8_t* data, std::size_t size);
[[nodiscard]] Result<Renewal> DecodeRenewal(const std::uint8_t* data, std::size_t size);
[[nodiscard]] Result<RenewalReply> DecodeRenewalReply(const std::uint8_t* data, std::size_t size);
[[nodiscard]] Result<PullResponse> DecodePullResponse(const std::uint8_t* data, std::size_t size);

// The type of a message, for dispatch, without decoding it: reads the map header and the keys
// "t" and "v". Fast when they are the first two keys (as every kvferry encoder writes them);
// otherwise scans the top-level keys, skipping values within the limits. Fails (kProtocol) on a
// non-map, a missing or mistyped "t"/"v", an unknown type and "unsupported version N", and
// (kOutOfRange) on an oversized frame or a limit hit while skipping — the cases in which P
// answers a PullResponse ERROR. Success does not imply that the full decoder will succeed; a
// successful decode does imply that PeekType returns the decoded type.
[[nodiscard]] Result<MessageType> PeekType(const std::uint8_t* data, std::size_t size);

// P's check of one request's blocks against the region D described (num_blocks): kOutOfRange
// naming the request and the first bad block, so P can list it in `err` and serve the rest.
[[nodiscard]] Status CheckBlockIds(const PullRequest& request, std::uint32_t num_blocks);

// Span spellings of the above: std::span<const std::uint8_t> (what Encode returns) and
// std::span<const std::byte>.
inline const std::uint8_t* AsU8(std::span<const std::byte> b) {
  return reinterpret_cast<const std::uint8_t*>(b.data());
}
[[nodiscard]] inline Result<Pull> DecodePull(std::span<const std::uint8_t> b) {
  return DecodePull(b.data(), b.size());
}
[[nodiscard]] inline Result<Pull> DecodePull(std::span<const std::byte> b) {
  return DecodePull(AsU8(b), b.size());
}
[[nodiscard]] inline Result<Renewal> DecodeRenewal(std::span<const std::uint8_t> b) {
  return DecodeRenewal(b.data(), b.size());
}
[[nodiscard]] inline Result<Renewal> DecodeRenewal(std::span<const std::byte> b) {
  return DecodeRenewal(AsU8(b), b.size());
}
[[nodiscard]] inline Result<RenewalReply> DecodeRenewalReply(std::span<const std::uint8_t> b) {
  return DecodeRenewalReply(b.data(), b.size());
}
[[nodiscard]] inline Result<RenewalReply> DecodeRenewalReply(std::span<const std::byte> b) {
  return DecodeRenewalReply(AsU8(b), b.size());
}
[[nodiscard]] inline Result<PullResponse> DecodePullResponse(std::span<const std::uint8_t> b) {
  return DecodePullResponse(b.data(), b.size());
}
[[nodiscard]] inline Result<PullResponse> DecodePullResponse(std::span<const std::byte> b) {
  return DecodePullResponse(AsU8(b), b.size());
}
[[nodiscard]] inline Result<MessageType> PeekType(std::span<const std::uint8_t> b) {
  return PeekType(b.data(), b.size());
}
[[nodiscard]] inline Result<MessageType> PeekType(std::span<const std::byte> b) {
  return PeekType(AsU8(b), b.size());
}

}  // namespace kvferry::wire
