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

// Optional messages a P worker reads, advertised in its bootstrap registration
// ("protocol_features"). Bits are never reused.
inline constexpr std::uint32_t kFeatureRelease = 1u << 0;  // Release (t = 5) / ReleaseReply
// What this build's P reads.
inline constexpr std::uint32_t kProtocolFeatures = kFeatureRelease;

// Value of key "t". Never renumber: the numbers are on the wire.
enum class MessageType : std::uint8_t {
  kPull = 1,          // D -> P: write these transfers into my blocks
  kRenewal = 2,       // D -> P: extend the lease of these transfers
  kRenewalReply = 3,  // P -> D: answer to one Renewal
  kPullResponse = 4,  // P -> D: one of possibly several answers to one Pull
  kRelease = 5,       // D -> P: this D rank no longer needs these transfers
  kReleaseReply = 6,  // P -> D: answer to one Release
  kAbortNotice = 7,   // P -> D: P dropped these transfers D renewed (unsolicited)
};
// The highest MessageType this build knows.
inline constexpr std::uint8_t kMaxMessageType = 7;
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
inline constexpr std::size_t kMaxFingerprintsPerRelease = kMaxFingerprintsPerRenewal;
inline constexpr std::size_t kMaxAbortsPerNotice = 1024;
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

// Every message has `id` (key "id", omitted when 0): D numbers its Pulls, Renewals and Releases
// (non-zero, unique among the messages outstanding on one socket) and P copies the id into each
// PullResponse/RenewalReply/ReleaseReply, so D can run several pulls at once on one DEALER. P
// answers 0 only when it could not read the id (see PeekId). AbortNotice, unsolicited, has none.

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
  // Key "k", omitted when 0 (an optional key: a P that predates it ignores it). D's credential
  // for the writes of this pull (transport::WriteKey): P stamps each of them with it, and a D
  // that fences its writers refuses writes with a key it revoked, or with none.
  std::uint64_t write_key = 0;

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
  // Key "n", omitted when false (an optional key: a P that predates it ignores it). True: this
  // socket reads AbortNotice messages, so P may tell it when it drops a transfer renewed here.
  bool accepts_notices = false;

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
  // The write failed and bytes of it may still land (protocol.md §3.4): D fails the request
  // at once but must not reuse its blocks until the writer is fenced or known stopped. On the
  // wire: a fourth element `true`, absent otherwise (a D that predates it ignores it).
  bool unsettled = false;

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

// ---- D -> P: Release (t = 5) ----

// This D rank will not pull (or pull again) these transfers: the request was aborted, finished
// or rejected before its pull, or its receive failed. P frees an entry once every paired D rank
// has either pulled it or released it (never while a send reads its blocks), aborts a prefill
// nobody needs any more, and tombstones the id. Best effort: losing one changes only when P
// frees (the lease, or abort_request_timeout, still does).
struct Release {
  core::EngineId d_engine_id;   // non-empty, <= kMaxIdBytes
  std::uint32_t d_tp_size = 1;  // 1..core::kMaxTpSize: P derives how many D ranks pull from it
  std::uint32_t d_tp_rank = 0;  // < d_tp_size
  // core::FingerprintOf(transfer_id), as in Renewal. 1..kMaxFingerprintsPerRelease.
  std::vector<core::Fingerprint> fingerprints;
  std::uint64_t id = 0;

  friend bool operator==(const Release&, const Release&) = default;
};

// ---- P -> D: ReleaseReply (t = 6) ----

enum class ReleaseStatus : std::uint8_t {
  kAccepted = 0,  // processed (see the counts)
  kError = 1,     // not processed (message says why): nothing changed
};

struct ReleaseReply {
  ReleaseStatus status = ReleaseStatus::kAccepted;
  std::uint64_t released = 0;  // entries freed now, or as soon as the sends reading them end
  std::uint64_t kept = 0;      // entries other D ranks still need: this rank is marked done
  std::uint64_t unknown = 0;   // not held here (already freed, never seen, not paired)
  std::string message;         // <= kMaxTextBytes; empty = absent on the wire
  std::uint64_t id = 0;        // the Release's id

  friend bool operator==(const ReleaseReply&, const ReleaseReply&) = default;
};

// ---- P -> D: AbortNotice (t = 7) ----

// One transfer P dropped without sending it to the D ranks that renewed it (P's engine aborted
// it, its prefill failed, a lease mismatch, a wait timeout, its lease expired).
struct AbortedTransfer {
  core::TransferId transfer_id;            // non-empty, <= kMaxIdBytes
  ErrorCode code = ErrorCode::kCancelled;  // never kOk
  std::string reason;                      // <= kMaxTextBytes

  friend bool operator==(const AbortedTransfer&, const AbortedTransfer&) = default;
};

// Unsolicited (no reply; `id` is 0 on the wire), sent only to a socket whose Renewal set
// accepts_notices. Best effort: a D that misses it learns the same from its pull (kTombstoned).
struct AbortNotice {
  core::EngineId p_engine_id;            // non-empty, <= kMaxIdBytes
  std::uint32_t p_tp_rank = 0;           // < core::kMaxTpSize
  std::vector<AbortedTransfer> aborted;  // 1..kMaxAbortsPerNotice

  friend bool operator==(const AbortNotice&, const AbortNotice&) = default;
};

// ---- Codec ----

[[nodiscard]] std::vector<std::uint8_t> Encode(const Pull& msg);
[[nodiscard]] std::vector<std::uint8_t> Encode(const Renewal& msg);
[[nodiscard]] std::vector<std::uint8_t> Encode(const RenewalReply& msg);
[[nodiscard]] std::vector<std::uint8_t> Encode(const PullResponse& msg);
[[nodiscard]] std::vector<std::uint8_t> Encode(const Release& msg);
[[nodiscard]] std::vector<std::uint8_t> Encode(const ReleaseReply& msg);
[[nodiscard]] std::vector<std::uint8_t> Encode(const AbortNotice& msg);

// The limits and field rules the decoder enforces, checked on a struct (for senders and tests).
[[nodiscard]] Status Validate(const Pull& msg);
[[nodiscard]] Status Validate(const Renewal& msg);
[[nodiscard]] Status Validate(const RenewalReply& msg);
[[nodiscard]] Status Validate(const PullResponse& msg);
[[nodiscard]] Status Validate(const Release& msg);
[[nodiscard]] Status Validate(const ReleaseReply& msg);
[[nodiscard]] Status Validate(const AbortNotice& msg);

[[nodiscard]] Result<Pull> DecodePull(const std::uint8_t* data, std::size_t size);
[[nodiscard]] Result<Renewal> DecodeRenewal(const std::uint8_t* data, std::size_t size);
[[nodiscard]] Result<RenewalReply> DecodeRenewalReply(const std::uint8_t* data, std::size_t size);
[[nodiscard]] Result<PullResponse> DecodePullResponse(const std::uint8_t* data, std::size_t size);
[[nodiscard]] Result<Release> DecodeRelease(const std::uint8_t* data, std::size_t size);
[[nodiscard]] Result<ReleaseReply> DecodeReleaseReply(const std::uint8_t* data, std::size_t size);
[[nodiscard]] Result<AbortNotice> DecodeAbortNotice(const std::uint8_t* data, std::size_t size);

// The type of a message, for dispatch, without decoding it: reads the map header and the keys
// "t" and "v". Fast when they are the first two keys (as every kvferry encoder writes them);
// otherwise scans the top-level keys, skipping values within the limits. Fails (kProtocol) on a
// non-map, a missing or mistyped "t"/"v", an unknown type and "unsupported version N", and
// (kOutOfRange) on an oversized frame or a limit hit while skipping — the cases in which P
// answers a PullResponse ERROR. Known types are 1..kMaxMessageType; a higher one (a newer peer's
// message) is "unknown message type N". Success does not imply that the full decoder will succeed;
// a successful decode does imply that PeekType returns the decoded type.
[[nodiscard]] Result<MessageType> PeekType(const std::uint8_t* data, std::size_t size);

// The message's correlation id without decoding it: the value of the first top-level key "id"
// when the frame is a map within the limits (kMaxFrameBytes, kMaxMapKeys, and while skipping the
// keys before it, PeekType's slow-path limits) and that value is a uint; 0 otherwise (absent,
// mistyped, not a map, malformed or over a limit before "id"). Bytes after the id's value are
// not looked at. Never fails and never allocates. P uses it to answer a message it cannot
// decode (an unknown type, a decode error) with a PullResponse ERROR that carries the message's
// id, so D can tell which of its outstanding messages the ERROR answers. A successful decode
// implies that PeekId returns the decoded id.
[[nodiscard]] std::uint64_t PeekId(const std::uint8_t* data, std::size_t size);

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
[[nodiscard]] inline Result<Release> DecodeRelease(std::span<const std::uint8_t> b) {
  return DecodeRelease(b.data(), b.size());
}
[[nodiscard]] inline Result<Release> DecodeRelease(std::span<const std::byte> b) {
  return DecodeRelease(AsU8(b), b.size());
}
[[nodiscard]] inline Result<ReleaseReply> DecodeReleaseReply(std::span<const std::uint8_t> b) {
  return DecodeReleaseReply(b.data(), b.size());
}
[[nodiscard]] inline Result<ReleaseReply> DecodeReleaseReply(std::span<const std::byte> b) {
  return DecodeReleaseReply(AsU8(b), b.size());
}
[[nodiscard]] inline Result<AbortNotice> DecodeAbortNotice(std::span<const std::uint8_t> b) {
  return DecodeAbortNotice(b.data(), b.size());
}
[[nodiscard]] inline Result<AbortNotice> DecodeAbortNotice(std::span<const std::byte> b) {
  return DecodeAbortNotice(AsU8(b), b.size());
}
[[nodiscard]] inline Result<MessageType> PeekType(std::span<const std::uint8_t> b) {
  return PeekType(b.data(), b.size());
}
[[nodiscard]] inline Result<MessageType> PeekType(std::span<const std::byte> b) {
  return PeekType(AsU8(b), b.size());
}
[[nodiscard]] inline std::uint64_t PeekId(std::span<const std::uint8_t> b) {
  return PeekId(b.data(), b.size());
}
[[nodiscard]] inline std::uint64_t PeekId(std::span<const std::byte> b) {
  return PeekId(AsU8(b), b.size());
}

}  // namespace kvferry::wire
