// Encoders and decoders of the side-channel messages (docs/protocol.md).
//
// Decoding is three steps, cheapest first:
//  1. internal::ScanFrame walks the raw bytes with the per-message limits (no allocation), so
//     hostile sizes, depth bombs and truncation are refused before msgpack-cxx sees them;
//  2. msgpack::unpack with the same limits as unpack_limit (defence in depth) builds objects
//     that *reference* the input buffer (str/bin are not copied);
//  3. a walk over the top-level map that checks every field and builds the struct.
// Only step 3 allocates for the result, after the sizes it allocates for were checked.

// The shared helpers (packing, field readers, the unpack step) are in codec.h; Release,
// ReleaseReply and AbortNotice are in notices.cc.

#include "wire/messages.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <msgpack.hpp>
#include <string>
#include <utility>

#include "kvferry/core/tp_plan.h"
#include "wire/codec.h"
#include "wire/scan.h"

namespace kvferry::wire {

std::string_view ToString(MessageType type) {
  switch (type) {
    case MessageType::kPull:
      return "pull";
    case MessageType::kRenewal:
      return "renewal";
    case MessageType::kRenewalReply:
      return "renewal_reply";
    case MessageType::kPullResponse:
      return "pull_response";
    case MessageType::kRelease:
      return "release";
    case MessageType::kReleaseReply:
      return "release_reply";
    case MessageType::kAbortNotice:
      return "abort_notice";
  }
  return "unknown";
}

std::vector<core::Fingerprint> FingerprintsOf(std::span<const core::TransferId> transfer_ids) {
  std::vector<core::Fingerprint> out;
  out.reserve(transfer_ids.size());
  for (const auto& id : transfer_ids) out.push_back(core::FingerprintOf(id));
  return out;
}

namespace {

using internal::FieldErr;
using internal::Fields;
using internal::GetArray;
using internal::GetBin;
using internal::GetBool;
using internal::GetFingerprintBin;
using internal::GetStr;
using internal::GetUint;
using internal::IsErrorCode;
using internal::Label;
using internal::LoadFingerprints;
using internal::LoadLe32;
using internal::Packer;
using internal::PackFingerprints;
using internal::PackHeader;
using internal::PackKey;
using internal::PackStr;
using internal::Parse;
using internal::ScanLimits;
using internal::VecBuffer;

constexpr std::size_t kBlockIdBytes = 4;  // block ids travel as little-endian u32 in a bin

// Per-message limits for the raw scan and for msgpack::unpack_limit, derived from messages.h.
// `objects` bounds what msgpack-cxx allocates (24 bytes per object): a pull of 4096 requests
// needs ~4 objects per request; the rest is headroom for unknown keys.
constexpr ScanLimits kPullLimits{
    .array = kMaxRequestsPerPull,
    .map = kMaxMapKeys,
    .str = kMaxTextBytes,
    .bin = static_cast<std::uint32_t>(
        std::max(kMaxBlocksPerRequest * kBlockIdBytes, kMaxDescriptorBytes)),
    .ext = kMaxTextBytes,
    .depth = kMaxDepth,
    .objects = 8 * kMaxRequestsPerPull,
};
constexpr ScanLimits kPullResponseLimits{
    .array = kMaxEntriesPerResponse,
    .map = kMaxMapKeys,
    .str = kMaxTextBytes,
    .bin = kMaxTextBytes,
    .ext = kMaxTextBytes,
    .depth = kMaxDepth,
    .objects = 8 * kMaxEntriesPerResponse,
};
constexpr ScanLimits kRenewalLimits{
    .array = kMaxMapKeys,
    .map = kMaxMapKeys,
    .str = kMaxTextBytes,
    .bin = static_cast<std::uint32_t>(kMaxFingerprintsPerRenewal * core::kFingerprintBytes),
    .ext = kMaxTextBytes,
    .depth = kMaxDepth,
    .objects = 1024,
};
constexpr ScanLimits kRenewalReplyLimits{
    .array = kMaxMapKeys,
    .map = kMaxMapKeys,
    .str = kMaxTextBytes,
    .bin = kMaxTextBytes,
    .ext = kMaxTextBytes,
    .depth = kMaxDepth,
    .objects = 1024,
};

// ---------------------------------------------------------------------------------------------
// Pull

enum PullField {
  kPT,
  kPV,
  kPId,
  kPEngine,
  kPTpSize,
  kPTpRank,
  kPLease,
  kPDesc,
  kPBlockLen,
  kPNumBlocks,
  kPRequests,
  kPWriteKey,
  kPullFieldCount
};
const std::array<Label, kPullFieldCount> kPullLabels{{
    {"t", "type"},
    {"v", "version"},
    {"id", "id"},
    {"e", "d_engine_id"},
    {"ts", "d_tp_size"},
    {"tr", "d_tp_rank"},
    {"l", "d_lease_ms"},
    {"rd", "region_descriptor"},
    {"bl", "block_len"},
    {"nb", "num_blocks"},
    {"rq", "requests"},
    {"k", "write_key"},
}};

// Elements of one request entry: [d_req_id, transfer_id, block ids bin, ...ignored].
constexpr std::size_t kRequestFields = 3;

}  // namespace

std::vector<std::uint8_t> Encode(const Pull& msg) {
  std::size_t estimate = 64 + msg.d_engine_id.size();
  if (msg.region_descriptor) estimate += msg.region_descriptor->size() + 8;
  for (const auto& r : msg.requests) {
    estimate += 16 + r.d_req_id.size() + r.transfer_id.size() + kBlockIdBytes * r.block_ids.size();
  }
  std::vector<std::uint8_t> out;
  out.reserve(estimate);
  VecBuffer buf{&out};
  Packer pk(buf);
  PackHeader(pk,
             6 + (msg.d_lease_ms ? 1 : 0) + (msg.region_descriptor ? 1 : 0) +
                 (msg.write_key != 0 ? 1 : 0),
             MessageType::kPull, msg.id);
  PackKey(pk, "e");
  PackStr(pk, msg.d_engine_id);
  PackKey(pk, "ts");
  pk.pack_uint32(msg.d_tp_size);
  PackKey(pk, "tr");
  pk.pack_uint32(msg.d_tp_rank);
  if (msg.d_lease_ms) {
    PackKey(pk, "l");
    pk.pack_uint64(*msg.d_lease_ms);
  }
  PackKey(pk, "bl");
  pk.pack_uint64(msg.block_len);
  PackKey(pk, "nb");
  pk.pack_uint32(msg.num_blocks);
  if (msg.region_descriptor) {
    PackKey(pk, "rd");
    const auto& d = *msg.region_descriptor;
    pk.pack_bin(static_cast<std::uint32_t>(d.size()));
    pk.pack_bin_body(reinterpret_cast<const char*>(d.data()), static_cast<std::uint32_t>(d.size()));
  }
  if (msg.write_key != 0) {
    PackKey(pk, "k");
    pk.pack_uint64(msg.write_key);
  }
  PackKey(pk, "rq");
  pk.pack_array(static_cast<std::uint32_t>(msg.requests.size()));
  for (const auto& r : msg.requests) {
    pk.pack_array(kRequestFields);
    PackStr(pk, r.d_req_id);
    PackStr(pk, r.transfer_id);
    const std::size_t n = r.block_ids.size();
    pk.pack_bin(static_cast<std::uint32_t>(n * kBlockIdBytes));
    const std::size_t at = out.size();
    out.resize(at + n * kBlockIdBytes);
    std::uint8_t* p = out.data() + at;
    for (core::BlockId b : r.block_ids) {
      p[0] = static_cast<std::uint8_t>(b);
      p[1] = static_cast<std::uint8_t>(b >> 8);
      p[2] = static_cast<std::uint8_t>(b >> 16);
      p[3] = static_cast<std::uint8_t>(b >> 24);
      p += kBlockIdBytes;
    }
  }
  return out;
}

Status Validate(const Pull& msg) {
  auto bad = [](ErrorCode code, std::string what) { return Status(code, std::move(what)); };
  if (msg.d_engine_id.empty()) return bad(ErrorCode::kProtocol, "d_engine_id: empty");
  if (msg.d_engine_id.size() > kMaxIdBytes)
    return bad(ErrorCode::kOutOfRange, "d_engine_id: too long");
  if (msg.d_tp_size == 0) return bad(ErrorCode::kOutOfRange, "d_tp_size: must be >= 1");
  if (msg.d_tp_size > core::kMaxTpSize) {
    return bad(ErrorCode::kOutOfRange,
               "d_tp_size: at most " + std::to_string(core::kMaxTpSize) + " ranks");
  }
  if (msg.d_tp_rank >= msg.d_tp_size) {
    return bad(ErrorCode::kOutOfRange, "d_tp_rank: must be < d_tp_size");
  }
  if (msg.block_len == 0) return bad(ErrorCode::kOutOfRange, "block_len: must be >= 1");
  if (msg.d_lease_ms && *msg.d_lease_ms > kMaxLeaseMs) {
    return bad(ErrorCode::kOutOfRange, "d_lease_ms: too large");
  }
  if (msg.region_descriptor && msg.region_descriptor->size() > kMaxDescriptorBytes) {
    return bad(ErrorCode::kOutOfRange, "region_descriptor: too long");
  }
  if (msg.requests.size() > kMaxRequestsPerPull) {
    return bad(ErrorCode::kOutOfRange, "requests: too many");
  }
  std::size_t blocks = 0;
  for (std::size_t i = 0; i < msg.requests.size(); ++i) {
    const auto& r = msg.requests[i];
    const std::string at = "requests[" + std::to_string(i) + "].";
    if (r.d_req_id.empty()) return bad(ErrorCode::kProtocol, at + "d_req_id: empty");
    if (r.transfer_id.empty()) return bad(ErrorCode::kProtocol, at + "transfer_id: empty");
    if (r.d_req_id.size() > kMaxIdBytes)
      return bad(ErrorCode::kOutOfRange, at + "d_req_id: too long");
    if (r.transfer_id.size() > kMaxIdBytes) {
      return bad(ErrorCode::kOutOfRange, at + "transfer_id: too long");
    }
    if (r.block_ids.size() > kMaxBlocksPerRequest) {
      return bad(ErrorCode::kOutOfRange, at + "block_ids: too many");
    }
    blocks += r.block_ids.size();
  }
  if (blocks > kMaxBlocksPerPull) return bad(ErrorCode::kOutOfRange, "requests: too many blocks");
  // No frame-size check needed: at the limits above a pull encodes to < 6.5 MiB.
  static_assert(kMaxRequestsPerPull * (2 * (kMaxIdBytes + 3) + 6) + kMaxBlocksPerPull * 4 +
                    kMaxDescriptorBytes + 2 * kMaxIdBytes <
                kMaxFrameBytes);
  return Status::Ok();
}

Result<Pull> DecodePull(const std::uint8_t* data, std::size_t size) {
  Pull msg;
  msgpack::object_handle handle;
  Fields<kPullFieldCount> f{kPullLabels};
  if (Status s = Parse(data, size, MessageType::kPull, kPullLimits, handle, f, msg.id); !s.ok()) {
    return tl::unexpected(std::move(s));
  }
  for (std::size_t i : {kPEngine, kPTpSize, kPTpRank, kPBlockLen, kPNumBlocks, kPRequests}) {
    if (f[i] == nullptr) return f.Missing(i);
  }
  std::string_view engine;
  KVF_ASSIGN(engine, GetStr(*f[kPEngine], kPullLabels[kPEngine], kMaxIdBytes, true));
  std::uint64_t tp_size = 0;
  std::uint64_t tp_rank = 0;
  KVF_ASSIGN(tp_size, GetUint(*f[kPTpSize], kPullLabels[kPTpSize], core::kMaxTpSize));
  KVF_ASSIGN(tp_rank, GetUint(*f[kPTpRank], kPullLabels[kPTpRank], UINT32_MAX));
  if (tp_size == 0) return FieldErr(ErrorCode::kOutOfRange, kPullLabels[kPTpSize], "must be >= 1");
  if (tp_rank >= tp_size) {
    return FieldErr(ErrorCode::kOutOfRange, kPullLabels[kPTpRank],
                    std::to_string(tp_rank) + " is not below d_tp_size " + std::to_string(tp_size));
  }
  KVF_ASSIGN(msg.block_len, GetUint(*f[kPBlockLen], kPullLabels[kPBlockLen]));
  if (msg.block_len == 0) {
    return FieldErr(ErrorCode::kOutOfRange, kPullLabels[kPBlockLen], "must be >= 1");
  }
  std::uint64_t num_blocks = 0;
  KVF_ASSIGN(num_blocks, GetUint(*f[kPNumBlocks], kPullLabels[kPNumBlocks], UINT32_MAX));
  if (f[kPLease] != nullptr) {
    std::uint64_t lease = 0;
    KVF_ASSIGN(lease, GetUint(*f[kPLease], kPullLabels[kPLease], kMaxLeaseMs));
    msg.d_lease_ms = lease;
  }
  if (f[kPWriteKey] != nullptr) {
    KVF_ASSIGN(msg.write_key, GetUint(*f[kPWriteKey], kPullLabels[kPWriteKey]));
  }
  std::span<const std::uint8_t> desc;
  if (f[kPDesc] != nullptr) {
    KVF_ASSIGN(desc, GetBin(*f[kPDesc], kPullLabels[kPDesc], kMaxDescriptorBytes));
  }
  std::span<const msgpack::object> requests;
  KVF_ASSIGN(requests, GetArray(*f[kPRequests], kPullLabels[kPRequests], kMaxRequestsPerPull));

  // Check every request (and the total block count) before allocating any of them.
  std::size_t total_blocks = 0;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const Label entry{"rq", "", i};
    std::span<const msgpack::object> e;
    KVF_ASSIGN(e, GetArray(requests[i], entry, kMaxMapKeys, kRequestFields));
    std::string_view id;
    KVF_ASSIGN(id, GetStr(e[0], Label{"rq", "d_req_id", i}, kMaxIdBytes, true));
    KVF_ASSIGN(id, GetStr(e[1], Label{"rq", "transfer_id", i}, kMaxIdBytes, true));
    const Label blocks_label{"rq", "block_ids", i};
    std::span<const std::uint8_t> blocks;
    KVF_ASSIGN(blocks, GetBin(e[2], blocks_label, kMaxBlocksPerRequest * kBlockIdBytes));
    if (blocks.size() % kBlockIdBytes != 0) {
      return FieldErr(ErrorCode::kProtocol, blocks_label,
                      "bin length " + std::to_string(blocks.size()) +
                          " is not a multiple of 4 (little-endian u32 block ids)");
    }
    total_blocks += blocks.size() / kBlockIdBytes;
  }
  if (total_blocks > kMaxBlocksPerPull) {
    return FieldErr(ErrorCode::kOutOfRange, kPullLabels[kPRequests],
                    std::to_string(total_blocks) + " blocks in one pull exceed " +
                        std::to_string(kMaxBlocksPerPull));
  }

  msg.d_engine_id.assign(engine);
  msg.d_tp_size = static_cast<std::uint32_t>(tp_size);
  msg.d_tp_rank = static_cast<std::uint32_t>(tp_rank);
  msg.num_blocks = static_cast<std::uint32_t>(num_blocks);
  if (f[kPDesc] != nullptr) msg.region_descriptor.emplace(desc.begin(), desc.end());
  msg.requests.resize(requests.size());
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const msgpack::object* e = requests[i].via.array.ptr;
    PullRequest& r = msg.requests[i];
    r.d_req_id.assign(e[0].via.str.ptr, e[0].via.str.size);
    r.transfer_id.assign(e[1].via.str.ptr, e[1].via.str.size);
    const auto* p = reinterpret_cast<const std::uint8_t*>(e[2].via.bin.ptr);
    const std::size_t n = e[2].via.bin.size / kBlockIdBytes;
    r.block_ids.resize(n);
    if constexpr (std::endian::native == std::endian::little) {
      if (n != 0) std::memcpy(r.block_ids.data(), p, n * kBlockIdBytes);
    } else {
      for (std::size_t b = 0; b < n; ++b) r.block_ids[b] = LoadLe32(p + b * kBlockIdBytes);
    }
  }
  return msg;
}

Status CheckBlockIds(const PullRequest& request, std::uint32_t num_blocks) {
  for (std::size_t i = 0; i < request.block_ids.size(); ++i) {
    if (request.block_ids[i] >= num_blocks) {
      return Status(ErrorCode::kOutOfRange,
                    "request " + request.d_req_id + ": block_ids[" + std::to_string(i) +
                        "] = " + std::to_string(request.block_ids[i]) +
                        " is not below num_blocks " + std::to_string(num_blocks));
    }
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// Renewal

namespace {
enum RenewalField {
  kRT,
  kRV,
  kRId,
  kREngine,
  kRLease,
  kRFingerprints,
  kRNotices,
  kRenewalFieldCount
};
const std::array<Label, kRenewalFieldCount> kRenewalLabels{{
    {"t", "type"},
    {"v", "version"},
    {"id", "id"},
    {"e", "d_engine_id"},
    {"l", "d_lease_ms"},
    {"fp", "fingerprints"},
    {"n", "accepts_notices"},
}};
}  // namespace

std::vector<std::uint8_t> Encode(const Renewal& msg) {
  std::vector<std::uint8_t> out;
  out.reserve(32 + msg.d_engine_id.size() + core::kFingerprintBytes * msg.fingerprints.size());
  VecBuffer buf{&out};
  Packer pk(buf);
  // "n" is written only when true, and last: a renewal without it is byte for byte what a build
  // that predates notices sends.
  PackHeader(pk, 3 + (msg.accepts_notices ? 1 : 0), MessageType::kRenewal, msg.id);
  PackKey(pk, "e");
  PackStr(pk, msg.d_engine_id);
  PackKey(pk, "l");
  pk.pack_uint64(msg.d_lease_ms);
  PackKey(pk, "fp");
  PackFingerprints(pk, out, msg.fingerprints);
  if (msg.accepts_notices) {
    PackKey(pk, "n");
    pk.pack_true();
  }
  return out;
}

Status Validate(const Renewal& msg) {
  if (msg.d_engine_id.empty()) return Status(ErrorCode::kProtocol, "d_engine_id: empty");
  if (msg.d_engine_id.size() > kMaxIdBytes) {
    return Status(ErrorCode::kOutOfRange, "d_engine_id: too long");
  }
  if (msg.fingerprints.size() > kMaxFingerprintsPerRenewal) {
    return Status(ErrorCode::kOutOfRange, "fingerprints: too many");
  }
  if (msg.d_lease_ms > kMaxLeaseMs) return Status(ErrorCode::kOutOfRange, "d_lease_ms: too large");
  for (core::Fingerprint fp : msg.fingerprints) {
    if (fp > core::kFingerprintMask) {
      return Status(ErrorCode::kOutOfRange, "fingerprints: value wider than 56 bits");
    }
  }
  return Status::Ok();
}

Result<Renewal> DecodeRenewal(const std::uint8_t* data, std::size_t size) {
  Renewal msg;
  msgpack::object_handle handle;
  Fields<kRenewalFieldCount> f{kRenewalLabels};
  if (Status s = Parse(data, size, MessageType::kRenewal, kRenewalLimits, handle, f, msg.id);
      !s.ok()) {
    return tl::unexpected(std::move(s));
  }
  for (std::size_t i : {kREngine, kRLease, kRFingerprints}) {
    if (f[i] == nullptr) return f.Missing(i);
  }
  std::string_view engine;
  KVF_ASSIGN(engine, GetStr(*f[kREngine], kRenewalLabels[kREngine], kMaxIdBytes, true));
  KVF_ASSIGN(msg.d_lease_ms, GetUint(*f[kRLease], kRenewalLabels[kRLease], kMaxLeaseMs));
  std::span<const std::uint8_t> fps;
  KVF_ASSIGN(fps, GetFingerprintBin(*f[kRFingerprints], kRenewalLabels[kRFingerprints],
                                    kMaxFingerprintsPerRenewal));
  if (f[kRNotices] != nullptr) {
    KVF_ASSIGN(msg.accepts_notices, GetBool(*f[kRNotices], kRenewalLabels[kRNotices]));
  }
  msg.d_engine_id.assign(engine);
  LoadFingerprints(fps, msg.fingerprints);
  return msg;
}

// ---------------------------------------------------------------------------------------------
// RenewalReply

namespace {
enum ReplyField {
  kYT,
  kYV,
  kYId,
  kYStatus,
  kYExtended,
  kYUnknown,
  kYLease,
  kYMessage,
  kReplyFieldCount
};
const std::array<Label, kReplyFieldCount> kReplyLabels{{
    {"t", "type"},
    {"v", "version"},
    {"id", "id"},
    {"s", "status"},
    {"x", "extended"},
    {"u", "unknown"},
    {"l", "p_lease_ms"},
    {"m", "message"},
}};
}  // namespace

std::vector<std::uint8_t> Encode(const RenewalReply& msg) {
  std::vector<std::uint8_t> out;
  out.reserve(48 + msg.message.size());
  VecBuffer buf{&out};
  Packer pk(buf);
  PackHeader(pk, 4 + (msg.message.empty() ? 0 : 1), MessageType::kRenewalReply, msg.id);
  PackKey(pk, "s");
  pk.pack_uint8(static_cast<std::uint8_t>(msg.status));
  PackKey(pk, "x");
  pk.pack_uint64(msg.extended);
  PackKey(pk, "u");
  pk.pack_uint64(msg.unknown);
  PackKey(pk, "l");
  pk.pack_uint64(msg.p_lease_ms);
  if (!msg.message.empty()) {
    PackKey(pk, "m");
    PackStr(pk, msg.message);
  }
  return out;
}

Status Validate(const RenewalReply& msg) {
  if (static_cast<std::uint8_t>(msg.status) > static_cast<std::uint8_t>(RenewalStatus::kError)) {
    return Status(ErrorCode::kProtocol, "status: unknown value");
  }
  if (msg.message.size() > kMaxTextBytes)
    return Status(ErrorCode::kOutOfRange, "message: too long");
  return Status::Ok();
}

Result<RenewalReply> DecodeRenewalReply(const std::uint8_t* data, std::size_t size) {
  RenewalReply msg;
  msgpack::object_handle handle;
  Fields<kReplyFieldCount> f{kReplyLabels};
  if (Status s =
          Parse(data, size, MessageType::kRenewalReply, kRenewalReplyLimits, handle, f, msg.id);
      !s.ok()) {
    return tl::unexpected(std::move(s));
  }
  for (std::size_t i : {kYStatus, kYExtended, kYUnknown, kYLease}) {
    if (f[i] == nullptr) return f.Missing(i);
  }
  KVF_ASSIGN(msg.status, GetStatus(*f[kYStatus], kReplyLabels[kYStatus], RenewalStatus::kError));
  KVF_ASSIGN(msg.extended, GetUint(*f[kYExtended], kReplyLabels[kYExtended]));
  KVF_ASSIGN(msg.unknown, GetUint(*f[kYUnknown], kReplyLabels[kYUnknown]));
  KVF_ASSIGN(msg.p_lease_ms, GetUint(*f[kYLease], kReplyLabels[kYLease]));
  if (Status s = GetMessageText(f[kYMessage], kReplyLabels[kYMessage], msg.message); !s.ok()) {
    return tl::unexpected(std::move(s));
  }
  return msg;
}

// ---------------------------------------------------------------------------------------------
// PullResponse

namespace {
enum ResponseField {
  kST,
  kSV,
  kSId,
  kSStatus,
  kSOk,
  kSErr,
  kSCode,
  kSMessage,
  kResponseFieldCount
};
const std::array<Label, kResponseFieldCount> kResponseLabels{{
    {"t", "type"},
    {"v", "version"},
    {"id", "id"},
    {"s", "status"},
    {"ok", "ok"},
    {"err", "err"},
    {"c", "code"},
    {"m", "message"},
}};
// Elements of one err entry: [d_req_id, code, reason, unsettled (optional), ...ignored].
constexpr std::size_t kErrFields = 3;
// An err entry of a write whose bytes may still land carries a fourth element, `unsettled`.
constexpr std::size_t kErrFieldsUnsettled = 4;
}  // namespace

std::vector<std::uint8_t> Encode(const PullResponse& msg) {
  std::size_t estimate = 32 + msg.message.size();
  for (const auto& id : msg.ok) estimate += 3 + id.size();
  for (const auto& e : msg.err) estimate += 8 + e.d_req_id.size() + e.reason.size();
  std::vector<std::uint8_t> out;
  out.reserve(estimate);
  VecBuffer buf{&out};
  Packer pk(buf);
  const bool is_error = msg.status == PullStatus::kError;
  PackHeader(pk,
             1 + (msg.ok.empty() ? 0 : 1) + (msg.err.empty() ? 0 : 1) + (is_error ? 1 : 0) +
                 (msg.message.empty() ? 0 : 1),
             MessageType::kPullResponse, msg.id);
  PackKey(pk, "s");
  pk.pack_uint8(static_cast<std::uint8_t>(msg.status));
  if (!msg.ok.empty()) {
    PackKey(pk, "ok");
    pk.pack_array(static_cast<std::uint32_t>(msg.ok.size()));
    for (const auto& id : msg.ok) PackStr(pk, id);
  }
  if (!msg.err.empty()) {
    PackKey(pk, "err");
    pk.pack_array(static_cast<std::uint32_t>(msg.err.size()));
    for (const auto& e : msg.err) {
      pk.pack_array(e.unsettled ? kErrFieldsUnsettled : kErrFields);
      PackStr(pk, e.d_req_id);
      pk.pack_uint8(static_cast<std::uint8_t>(e.code));
      PackStr(pk, e.reason);
      if (e.unsettled) pk.pack_true();
    }
  }
  if (is_error) {
    PackKey(pk, "c");
    pk.pack_uint8(static_cast<std::uint8_t>(msg.code));
  }
  if (!msg.message.empty()) {
    PackKey(pk, "m");
    PackStr(pk, msg.message);
  }
  return out;
}

Status Validate(const PullResponse& msg) {
  if (static_cast<std::uint8_t>(msg.status) > static_cast<std::uint8_t>(PullStatus::kError)) {
    return Status(ErrorCode::kProtocol, "status: unknown value");
  }
  if (msg.message.size() > kMaxTextBytes)
    return Status(ErrorCode::kOutOfRange, "message: too long");
  if (msg.status == PullStatus::kError) {
    if (!IsErrorCode(static_cast<std::uint8_t>(msg.code))) {
      return Status(ErrorCode::kProtocol, "code: ERROR needs an error code");
    }
    if (msg.message.empty()) return Status(ErrorCode::kProtocol, "message: ERROR needs a reason");
    if (!msg.ok.empty() || !msg.err.empty()) {
      return Status(ErrorCode::kProtocol, "ERROR carries no ok/err lists");
    }
    return Status::Ok();
  }
  if (msg.code != ErrorCode::kOk) return Status(ErrorCode::kProtocol, "code: only for ERROR");
  if (msg.ok.size() + msg.err.size() > kMaxEntriesPerResponse) {
    return Status(ErrorCode::kOutOfRange, "ok + err: too many entries");
  }
  for (const auto& id : msg.ok) {
    if (id.empty()) return Status(ErrorCode::kProtocol, "ok: empty id");
    if (id.size() > kMaxIdBytes) return Status(ErrorCode::kOutOfRange, "ok: id too long");
  }
  for (const auto& e : msg.err) {
    if (e.d_req_id.empty()) return Status(ErrorCode::kProtocol, "err: empty id");
    if (e.d_req_id.size() > kMaxIdBytes) return Status(ErrorCode::kOutOfRange, "err: id too long");
    if (!IsErrorCode(static_cast<std::uint8_t>(e.code))) {
      return Status(ErrorCode::kProtocol, "err: code is not an error code");
    }
    if (e.reason.size() > kMaxTextBytes)
      return Status(ErrorCode::kOutOfRange, "err: reason too long");
  }
  // 4096 maximal reasons would not fit in one frame: P splits such a response in CONTINUEs.
  std::size_t bound = 64 + msg.message.size();
  for (const auto& id : msg.ok) bound += 3 + id.size();
  for (const auto& e : msg.err) bound += 11 + e.d_req_id.size() + e.reason.size();
  if (bound > kMaxFrameBytes && Encode(msg).size() > kMaxFrameBytes) {
    return Status(ErrorCode::kOutOfRange, "frame too large: split into CONTINUE responses");
  }
  return Status::Ok();
}

Result<PullResponse> DecodePullResponse(const std::uint8_t* data, std::size_t size) {
  PullResponse msg;
  msgpack::object_handle handle;
  Fields<kResponseFieldCount> f{kResponseLabels};
  if (Status s =
          Parse(data, size, MessageType::kPullResponse, kPullResponseLimits, handle, f, msg.id);
      !s.ok()) {
    return tl::unexpected(std::move(s));
  }
  if (f[kSStatus] == nullptr) return f.Missing(kSStatus);
  KVF_ASSIGN(msg.status, GetStatus(*f[kSStatus], kResponseLabels[kSStatus], PullStatus::kError));
  if (Status s = GetMessageText(f[kSMessage], kResponseLabels[kSMessage], msg.message); !s.ok()) {
    return tl::unexpected(std::move(s));
  }
  if (msg.status == PullStatus::kError) {
    // D fails every request of the pull with this code and message; lists would be ambiguous.
    if (f[kSCode] == nullptr) return f.Missing(kSCode);
    std::uint64_t code = 0;
    KVF_ASSIGN(code, GetUint(*f[kSCode], kResponseLabels[kSCode]));
    if (!IsErrorCode(code)) {
      return FieldErr(ErrorCode::kProtocol, kResponseLabels[kSCode],
                      "unknown error code " + std::to_string(code));
    }
    msg.code = static_cast<ErrorCode>(code);
    if (msg.message.empty()) {
      return FieldErr(ErrorCode::kProtocol, kResponseLabels[kSMessage], "missing for ERROR");
    }
    if (f[kSOk] != nullptr || f[kSErr] != nullptr) {
      return Err(ErrorCode::kProtocol, "status ERROR must not carry 'ok' or 'err'");
    }
    return msg;
  }
  std::span<const msgpack::object> ok;
  std::span<const msgpack::object> err;
  if (f[kSOk] != nullptr) {
    KVF_ASSIGN(ok, GetArray(*f[kSOk], kResponseLabels[kSOk], kMaxEntriesPerResponse));
  }
  if (f[kSErr] != nullptr) {
    KVF_ASSIGN(err, GetArray(*f[kSErr], kResponseLabels[kSErr], kMaxEntriesPerResponse));
  }
  if (ok.size() + err.size() > kMaxEntriesPerResponse) {
    return Err(ErrorCode::kOutOfRange,
               "'ok' + 'err' hold " + std::to_string(ok.size() + err.size()) +
                   " entries, more than " + std::to_string(kMaxEntriesPerResponse));
  }
  msg.ok.reserve(ok.size());
  for (std::size_t i = 0; i < ok.size(); ++i) {
    std::string_view id;
    KVF_ASSIGN(id, GetStr(ok[i], Label{"ok", "d_req_id", i}, kMaxIdBytes, true));
    msg.ok.emplace_back(id);
  }
  msg.err.reserve(err.size());
  for (std::size_t i = 0; i < err.size(); ++i) {
    std::span<const msgpack::object> e;
    KVF_ASSIGN(e, GetArray(err[i], Label{"err", "", i}, kMaxMapKeys, kErrFields));
    RequestError re;
    std::string_view id;
    KVF_ASSIGN(id, GetStr(e[0], Label{"err", "d_req_id", i}, kMaxIdBytes, true));
    std::uint64_t code = 0;
    const Label code_label{"err", "code", i};
    KVF_ASSIGN(code, GetUint(e[1], code_label));
    if (!IsErrorCode(code)) {
      return FieldErr(ErrorCode::kProtocol, code_label,
                      "unknown error code " + std::to_string(code));
    }
    std::string_view reason;
    KVF_ASSIGN(reason, GetStr(e[2], Label{"err", "reason", i}, kMaxTextBytes, false));
    if (e.size() >= kErrFieldsUnsettled) {
      KVF_ASSIGN(re.unsettled, GetBool(e[3], Label{"err", "unsettled", i}));
    }
    re.d_req_id.assign(id);
    re.code = static_cast<ErrorCode>(code);
    re.reason.assign(reason);
    msg.err.push_back(std::move(re));
  }
  return msg;
}

// ---------------------------------------------------------------------------------------------
// PeekType

namespace {
// The slow path skips values of any message type, so it uses the loosest per-type limits.
constexpr ScanLimits kPeekLimits{
    .array = kMaxRequestsPerPull,
    .map = kMaxMapKeys,
    .str = kMaxTextBytes,
    .bin = kPullLimits.bin,
    .ext = kMaxTextBytes,
    .depth = kMaxDepth,
    .objects = 8 * kMaxRequestsPerPull,
};

// Reads the uint value of key `key` at data[pos] (slow path).
Result<std::uint64_t> PeekUint(const std::uint8_t* data, std::size_t size, std::size_t& pos,
                               const Label& label) {
  internal::Header h;
  if (internal::Fault f = internal::ReadHeader(data, size, pos, h); !f.ok()) {
    return tl::unexpected(internal::ToStatus(f));
  }
  if (h.kind != internal::Kind::kUint) {
    return FieldErr(ErrorCode::kProtocol, label, "expected uint");
  }
  return h.value;
}
}  // namespace

Result<MessageType> PeekType(const std::uint8_t* data, std::size_t size) {
  if (size > kMaxFrameBytes) {
    return Err(ErrorCode::kOutOfRange, "frame of " + std::to_string(size) +
                                           " bytes exceeds limit " +
                                           std::to_string(kMaxFrameBytes));
  }
  if (size == 0 || data == nullptr) return Err(ErrorCode::kProtocol, "empty frame");
  std::size_t pos = 0;
  internal::Header h;
  if (internal::Fault f = internal::ReadHeader(data, size, pos, h); !f.ok()) {
    return tl::unexpected(internal::ToStatus(f));
  }
  if (h.kind != internal::Kind::kMap)
    return Err(ErrorCode::kProtocol, "message is not a msgpack map");
  const std::uint64_t keys = h.value;
  if (keys > kMaxMapKeys) {
    return Err(ErrorCode::kOutOfRange, "map of " + std::to_string(keys) + " keys exceeds limit " +
                                           std::to_string(kMaxMapKeys));
  }
  std::uint64_t type = 0;
  std::uint64_t version = 0;
  bool have_type = false;
  bool have_version = false;
  const std::uint8_t* p = data + pos;
  // Fast path: {"t": fixint, "v": fixint, ...} as every kvferry encoder writes it; 6 bytes.
  if (keys >= 2 && size - pos >= 6 && p[0] == 0xa1 && p[1] == 't' && p[2] <= 0x7f && p[3] == 0xa1 &&
      p[4] == 'v' && p[5] <= 0x7f) {
    type = p[2];
    version = p[5];
    have_type = have_version = true;
  } else {
    // Slow path: look at every key, skip every other value, stop once both are found.
    std::size_t objects = 0;
    for (std::uint64_t i = 0; i < keys && !(have_type && have_version); ++i) {
      const std::size_t key_at = pos;
      internal::Header k;
      if (internal::Fault f = internal::ReadHeader(data, size, pos, k); !f.ok()) {
        return tl::unexpected(internal::ToStatus(f));
      }
      const bool one_char = k.kind == internal::Kind::kStr && k.value == 1 && pos < size;
      const char c = one_char ? static_cast<char>(data[pos]) : '\0';
      if (one_char && (c == 't' || c == 'v')) {
        ++pos;
        const Label& label = c == 't' ? internal::kTypeLabel : internal::kVersionLabel;
        std::uint64_t value = 0;
        KVF_ASSIGN(value, PeekUint(data, size, pos, label));
        (c == 't' ? type : version) = value;
        (c == 't' ? have_type : have_version) = true;
        continue;
      }
      pos = key_at;
      for (int item = 0; item < 2; ++item) {  // the key, then its value
        if (internal::Fault f = internal::SkipObject(data, size, pos, kPeekLimits, 1, objects);
            !f.ok()) {
          return tl::unexpected(internal::ToStatus(f));
        }
      }
    }
  }
  if (!have_version) return FieldErr(ErrorCode::kProtocol, internal::kVersionLabel, "missing");
  if (version == 0 || version > kProtocolVersion) {
    return Err(ErrorCode::kProtocol, "unsupported version " + std::to_string(version));
  }
  if (!have_type) return FieldErr(ErrorCode::kProtocol, internal::kTypeLabel, "missing");
  if (type < 1 || type > kMaxMessageType) {
    return Err(ErrorCode::kProtocol, "unknown message type " + std::to_string(type));
  }
  return static_cast<MessageType>(type);
}

// ---------------------------------------------------------------------------------------------
// PeekId

std::uint64_t PeekId(const std::uint8_t* data, std::size_t size) {
  if (size > kMaxFrameBytes || size == 0 || data == nullptr) return 0;
  std::size_t pos = 0;
  internal::Header h;
  if (!internal::ReadHeader(data, size, pos, h).ok() || h.kind != internal::Kind::kMap) {
    return 0;
  }
  const std::uint64_t keys = h.value;
  if (keys > kMaxMapKeys) return 0;
  // Like PeekType's slow path: look at every key, skip every other value, stop at the first
  // "id". Every kvferry encoder writes it third, after "t" and "v", so this usually reads a
  // dozen bytes. The walker reports faults without formatting them: nothing allocates.
  std::size_t objects = 0;
  for (std::uint64_t i = 0; i < keys; ++i) {
    const std::size_t key_at = pos;
    internal::Header k;
    if (!internal::ReadHeader(data, size, pos, k).ok()) return 0;
    if (k.kind == internal::Kind::kStr && k.value == 2 && size - pos >= 2 && data[pos] == 'i' &&
        data[pos + 1] == 'd') {
      pos += 2;
      internal::Header v;
      if (!internal::ReadHeader(data, size, pos, v).ok()) return 0;
      return v.kind == internal::Kind::kUint ? v.value : 0;
    }
    pos = key_at;
    if (!internal::SkipObject(data, size, pos, kPeekLimits, 1, objects).ok()) return 0;
    if (!internal::SkipObject(data, size, pos, kPeekLimits, 1, objects).ok()) return 0;
  }
  return 0;
}

}  // namespace kvferry::wire
