// Encoders and decoders of the messages that end a hold early (docs/protocol.md §3.5-3.7):
// Release (D -> P), ReleaseReply (P -> D) and AbortNotice (P -> D, unsolicited). Same three
// decoding steps and the same helpers (codec.h) as the messages in messages.cc.

#include <array>
#include <cstdint>
#include <msgpack.hpp>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvferry/core/tp_plan.h"
#include "wire/codec.h"
#include "wire/messages.h"
#include "wire/scan.h"

namespace kvferry::wire {
namespace {

using internal::FieldErr;
using internal::Fields;
using internal::GetArray;
using internal::GetFingerprintBin;
using internal::GetStr;
using internal::GetUint;
using internal::IsErrorCode;
using internal::kIdLabel;
using internal::kTypeLabel;
using internal::kVersionLabel;
using internal::Label;
using internal::LoadFingerprints;
using internal::Packer;
using internal::PackFingerprints;
using internal::PackHeader;
using internal::PackKey;
using internal::PackStr;
using internal::Parse;
using internal::ScanLimits;
using internal::VecBuffer;

// Per-message limits for the raw scan and for msgpack::unpack_limit (see messages.cc).
constexpr ScanLimits kReleaseLimits{
    .array = kMaxMapKeys,
    .map = kMaxMapKeys,
    .str = kMaxTextBytes,
    .bin = static_cast<std::uint32_t>(kMaxFingerprintsPerRelease * core::kFingerprintBytes),
    .ext = kMaxTextBytes,
    .depth = kMaxDepth,
    .objects = 1024,
};
constexpr ScanLimits kReleaseReplyLimits{
    .array = kMaxMapKeys,
    .map = kMaxMapKeys,
    .str = kMaxTextBytes,
    .bin = kMaxTextBytes,
    .ext = kMaxTextBytes,
    .depth = kMaxDepth,
    .objects = 1024,
};
// An abort entry is 4 objects; the rest is headroom for unknown keys and trailing elements.
constexpr ScanLimits kAbortNoticeLimits{
    .array = kMaxAbortsPerNotice,
    .map = kMaxMapKeys,
    .str = kMaxTextBytes,
    .bin = kMaxTextBytes,
    .ext = kMaxTextBytes,
    .depth = kMaxDepth,
    .objects = 8 * kMaxAbortsPerNotice,
};
// PeekType's and PeekId's slow paths skip values of every message type with the Pull's limits
// (the loosest): a valid message of these types must never exceed them.
static_assert(kMaxAbortsPerNotice <= kMaxRequestsPerPull);
static_assert(kMaxFingerprintsPerRelease * core::kFingerprintBytes <= kMaxBlocksPerRequest * 4);

}  // namespace

// ---------------------------------------------------------------------------------------------
// Release

namespace {
enum ReleaseField {
  kLT,
  kLV,
  kLId,
  kLEngine,
  kLTpSize,
  kLTpRank,
  kLFingerprints,
  kReleaseFieldCount
};
const std::array<Label, kReleaseFieldCount> kReleaseLabels{{
    kTypeLabel,
    kVersionLabel,
    kIdLabel,
    {"e", "d_engine_id"},
    {"ts", "d_tp_size"},
    {"tr", "d_tp_rank"},
    {"fp", "fingerprints"},
}};
}  // namespace

std::vector<std::uint8_t> Encode(const Release& msg) {
  std::vector<std::uint8_t> out;
  out.reserve(40 + msg.d_engine_id.size() + core::kFingerprintBytes * msg.fingerprints.size());
  VecBuffer buf{&out};
  Packer pk(buf);
  PackHeader(pk, 4, MessageType::kRelease, msg.id);
  PackKey(pk, "e");
  PackStr(pk, msg.d_engine_id);
  PackKey(pk, "ts");
  pk.pack_uint32(msg.d_tp_size);
  PackKey(pk, "tr");
  pk.pack_uint32(msg.d_tp_rank);
  PackKey(pk, "fp");
  PackFingerprints(pk, out, msg.fingerprints);
  return out;
}

Status Validate(const Release& msg) {
  if (msg.d_engine_id.empty()) return Status(ErrorCode::kProtocol, "d_engine_id: empty");
  if (msg.d_engine_id.size() > kMaxIdBytes) {
    return Status(ErrorCode::kOutOfRange, "d_engine_id: too long");
  }
  if (msg.d_tp_size == 0) return Status(ErrorCode::kOutOfRange, "d_tp_size: must be >= 1");
  if (msg.d_tp_size > core::kMaxTpSize) {
    return Status(ErrorCode::kOutOfRange,
                  "d_tp_size: at most " + std::to_string(core::kMaxTpSize) + " ranks");
  }
  if (msg.d_tp_rank >= msg.d_tp_size) {
    return Status(ErrorCode::kOutOfRange, "d_tp_rank: must be < d_tp_size");
  }
  if (msg.fingerprints.empty()) return Status(ErrorCode::kProtocol, "fingerprints: empty");
  if (msg.fingerprints.size() > kMaxFingerprintsPerRelease) {
    return Status(ErrorCode::kOutOfRange, "fingerprints: too many");
  }
  for (core::Fingerprint fp : msg.fingerprints) {
    if (fp > core::kFingerprintMask) {
      return Status(ErrorCode::kOutOfRange, "fingerprints: value wider than 56 bits");
    }
  }
  return Status::Ok();
}

Result<Release> DecodeRelease(const std::uint8_t* data, std::size_t size) {
  Release msg;
  msgpack::object_handle handle;
  Fields<kReleaseFieldCount> f{kReleaseLabels};
  if (Status s = Parse(data, size, MessageType::kRelease, kReleaseLimits, handle, f, msg.id);
      !s.ok()) {
    return tl::unexpected(std::move(s));
  }
  for (std::size_t i : {kLEngine, kLTpSize, kLTpRank, kLFingerprints}) {
    if (f[i] == nullptr) return f.Missing(i);
  }
  std::string_view engine;
  KVF_ASSIGN(engine, GetStr(*f[kLEngine], kReleaseLabels[kLEngine], kMaxIdBytes, true));
  std::uint64_t tp_size = 0;
  std::uint64_t tp_rank = 0;
  KVF_ASSIGN(tp_size, GetUint(*f[kLTpSize], kReleaseLabels[kLTpSize], core::kMaxTpSize));
  KVF_ASSIGN(tp_rank, GetUint(*f[kLTpRank], kReleaseLabels[kLTpRank], UINT32_MAX));
  if (tp_size == 0) {
    return FieldErr(ErrorCode::kOutOfRange, kReleaseLabels[kLTpSize], "must be >= 1");
  }
  if (tp_rank >= tp_size) {
    return FieldErr(ErrorCode::kOutOfRange, kReleaseLabels[kLTpRank],
                    std::to_string(tp_rank) + " is not below d_tp_size " + std::to_string(tp_size));
  }
  std::span<const std::uint8_t> fps;
  KVF_ASSIGN(fps, GetFingerprintBin(*f[kLFingerprints], kReleaseLabels[kLFingerprints],
                                    kMaxFingerprintsPerRelease));
  // A release of nothing can only be a sender bug (a keep-alive is a Renewal's job).
  if (fps.empty()) return FieldErr(ErrorCode::kProtocol, kReleaseLabels[kLFingerprints], "empty");
  msg.d_engine_id.assign(engine);
  msg.d_tp_size = static_cast<std::uint32_t>(tp_size);
  msg.d_tp_rank = static_cast<std::uint32_t>(tp_rank);
  LoadFingerprints(fps, msg.fingerprints);
  return msg;
}

// ---------------------------------------------------------------------------------------------
// ReleaseReply

namespace {
enum ReleaseReplyField {
  kQT,
  kQV,
  kQId,
  kQStatus,
  kQReleased,
  kQKept,
  kQUnknown,
  kQMessage,
  kReleaseReplyFieldCount
};
const std::array<Label, kReleaseReplyFieldCount> kReleaseReplyLabels{{
    kTypeLabel,
    kVersionLabel,
    kIdLabel,
    {"s", "status"},
    {"r", "released"},
    {"k", "kept"},
    {"u", "unknown"},
    {"m", "message"},
}};
}  // namespace

std::vector<std::uint8_t> Encode(const ReleaseReply& msg) {
  std::vector<std::uint8_t> out;
  out.reserve(48 + msg.message.size());
  VecBuffer buf{&out};
  Packer pk(buf);
  PackHeader(pk, 4 + (msg.message.empty() ? 0 : 1), MessageType::kReleaseReply, msg.id);
  PackKey(pk, "s");
  pk.pack_uint8(static_cast<std::uint8_t>(msg.status));
  PackKey(pk, "r");
  pk.pack_uint64(msg.released);
  PackKey(pk, "k");
  pk.pack_uint64(msg.kept);
  PackKey(pk, "u");
  pk.pack_uint64(msg.unknown);
  if (!msg.message.empty()) {
    PackKey(pk, "m");
    PackStr(pk, msg.message);
  }
  return out;
}

Status Validate(const ReleaseReply& msg) {
  if (static_cast<std::uint8_t>(msg.status) > static_cast<std::uint8_t>(ReleaseStatus::kError)) {
    return Status(ErrorCode::kProtocol, "status: unknown value");
  }
  if (msg.message.size() > kMaxTextBytes) {
    return Status(ErrorCode::kOutOfRange, "message: too long");
  }
  return Status::Ok();
}

Result<ReleaseReply> DecodeReleaseReply(const std::uint8_t* data, std::size_t size) {
  ReleaseReply msg;
  msgpack::object_handle handle;
  Fields<kReleaseReplyFieldCount> f{kReleaseReplyLabels};
  if (Status s =
          Parse(data, size, MessageType::kReleaseReply, kReleaseReplyLimits, handle, f, msg.id);
      !s.ok()) {
    return tl::unexpected(std::move(s));
  }
  for (std::size_t i : {kQStatus, kQReleased, kQKept, kQUnknown}) {
    if (f[i] == nullptr) return f.Missing(i);
  }
  KVF_ASSIGN(msg.status,
             GetStatus(*f[kQStatus], kReleaseReplyLabels[kQStatus], ReleaseStatus::kError));
  KVF_ASSIGN(msg.released, GetUint(*f[kQReleased], kReleaseReplyLabels[kQReleased]));
  KVF_ASSIGN(msg.kept, GetUint(*f[kQKept], kReleaseReplyLabels[kQKept]));
  KVF_ASSIGN(msg.unknown, GetUint(*f[kQUnknown], kReleaseReplyLabels[kQUnknown]));
  if (Status s = GetMessageText(f[kQMessage], kReleaseReplyLabels[kQMessage], msg.message);
      !s.ok()) {
    return tl::unexpected(std::move(s));
  }
  return msg;
}

// ---------------------------------------------------------------------------------------------
// AbortNotice

namespace {
enum AbortNoticeField { kAT, kAV, kAId, kAEngine, kATpRank, kAAborted, kAbortNoticeFieldCount };
const std::array<Label, kAbortNoticeFieldCount> kAbortNoticeLabels{{
    kTypeLabel,
    kVersionLabel,
    kIdLabel,
    {"e", "p_engine_id"},
    {"pr", "p_tp_rank"},
    {"a", "aborted"},
}};
// Elements of one abort entry: [transfer_id, code, reason, ...ignored].
constexpr std::size_t kAbortFields = 3;

// At the limits an AbortNotice stays well within one frame (about 4.3 MiB): no frame check.
static_assert(kMaxAbortsPerNotice * (kMaxIdBytes + kMaxTextBytes + 12) + kMaxIdBytes + 64 <
              kMaxFrameBytes);
}  // namespace

std::vector<std::uint8_t> Encode(const AbortNotice& msg) {
  std::size_t estimate = 32 + msg.p_engine_id.size();
  for (const auto& a : msg.aborted) estimate += 8 + a.transfer_id.size() + a.reason.size();
  std::vector<std::uint8_t> out;
  out.reserve(estimate);
  VecBuffer buf{&out};
  Packer pk(buf);
  PackHeader(pk, 3, MessageType::kAbortNotice, 0);  // unsolicited: never an id
  PackKey(pk, "e");
  PackStr(pk, msg.p_engine_id);
  PackKey(pk, "pr");
  pk.pack_uint32(msg.p_tp_rank);
  PackKey(pk, "a");
  pk.pack_array(static_cast<std::uint32_t>(msg.aborted.size()));
  for (const auto& a : msg.aborted) {
    pk.pack_array(kAbortFields);
    PackStr(pk, a.transfer_id);
    pk.pack_uint8(static_cast<std::uint8_t>(a.code));
    PackStr(pk, a.reason);
  }
  return out;
}

Status Validate(const AbortNotice& msg) {
  if (msg.p_engine_id.empty()) return Status(ErrorCode::kProtocol, "p_engine_id: empty");
  if (msg.p_engine_id.size() > kMaxIdBytes) {
    return Status(ErrorCode::kOutOfRange, "p_engine_id: too long");
  }
  if (msg.p_tp_rank >= core::kMaxTpSize) {
    return Status(ErrorCode::kOutOfRange,
                  "p_tp_rank: must be < " + std::to_string(core::kMaxTpSize));
  }
  if (msg.aborted.empty()) return Status(ErrorCode::kProtocol, "aborted: empty");
  if (msg.aborted.size() > kMaxAbortsPerNotice) {
    return Status(ErrorCode::kOutOfRange, "aborted: too many");
  }
  for (const auto& a : msg.aborted) {
    if (a.transfer_id.empty()) return Status(ErrorCode::kProtocol, "aborted: empty transfer_id");
    if (a.transfer_id.size() > kMaxIdBytes) {
      return Status(ErrorCode::kOutOfRange, "aborted: transfer_id too long");
    }
    if (!IsErrorCode(static_cast<std::uint8_t>(a.code))) {
      return Status(ErrorCode::kProtocol, "aborted: code is not an error code");
    }
    if (a.reason.size() > kMaxTextBytes) {
      return Status(ErrorCode::kOutOfRange, "aborted: reason too long");
    }
  }
  return Status::Ok();
}

Result<AbortNotice> DecodeAbortNotice(const std::uint8_t* data, std::size_t size) {
  AbortNotice msg;
  msgpack::object_handle handle;
  Fields<kAbortNoticeFieldCount> f{kAbortNoticeLabels};
  // A notice answers nothing: an "id" must still be a uint (as in every message), and is ignored.
  std::uint64_t ignored_id = 0;
  if (Status s =
          Parse(data, size, MessageType::kAbortNotice, kAbortNoticeLimits, handle, f, ignored_id);
      !s.ok()) {
    return tl::unexpected(std::move(s));
  }
  for (std::size_t i : {kAEngine, kATpRank, kAAborted}) {
    if (f[i] == nullptr) return f.Missing(i);
  }
  std::string_view engine;
  KVF_ASSIGN(engine, GetStr(*f[kAEngine], kAbortNoticeLabels[kAEngine], kMaxIdBytes, true));
  std::uint64_t tp_rank = 0;
  KVF_ASSIGN(tp_rank, GetUint(*f[kATpRank], kAbortNoticeLabels[kATpRank], core::kMaxTpSize - 1));
  std::span<const msgpack::object> aborted;
  KVF_ASSIGN(aborted,
             GetArray(*f[kAAborted], kAbortNoticeLabels[kAAborted], kMaxAbortsPerNotice, 1));

  // Check every entry before allocating any of them.
  for (std::size_t i = 0; i < aborted.size(); ++i) {
    std::span<const msgpack::object> e;
    KVF_ASSIGN(e, GetArray(aborted[i], Label{"a", "", i}, kMaxMapKeys, kAbortFields));
    std::string_view text;
    KVF_ASSIGN(text, GetStr(e[0], Label{"a", "transfer_id", i}, kMaxIdBytes, true));
    std::uint64_t code = 0;
    const Label code_label{"a", "code", i};
    KVF_ASSIGN(code, GetUint(e[1], code_label));
    if (!IsErrorCode(code)) {
      return FieldErr(ErrorCode::kProtocol, code_label,
                      "unknown error code " + std::to_string(code));
    }
    KVF_ASSIGN(text, GetStr(e[2], Label{"a", "reason", i}, kMaxTextBytes, false));
  }

  msg.p_engine_id.assign(engine);
  msg.p_tp_rank = static_cast<std::uint32_t>(tp_rank);
  msg.aborted.resize(aborted.size());
  for (std::size_t i = 0; i < aborted.size(); ++i) {
    const msgpack::object* e = aborted[i].via.array.ptr;
    AbortedTransfer& a = msg.aborted[i];
    a.transfer_id.assign(e[0].via.str.ptr, e[0].via.str.size);
    a.code = static_cast<ErrorCode>(e[1].via.u64);
    a.reason.assign(e[2].via.str.ptr, e[2].via.str.size);
  }
  return msg;
}

}  // namespace kvferry::wire
