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
#include "wire/schema.h"

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

using internal::DecodeWith;
using internal::EncodeWith;
using internal::FieldErr;
using internal::Label;
using internal::ScanLimits;
using internal::ValidateWith;

constexpr std::size_t kBlockIdBytes = internal::BlockIdsRule::kBytes;

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
// The schemas (wire/schema.h): each message's keys in wire order, with their rules.

using internal::BlockIdsRule;
using internal::BoolRule;
using internal::BytesRule;
using internal::Column;
using internal::EntryList;
using internal::ErrorCodeRule;
using internal::Field;
using internal::FingerprintsRule;
using internal::IdRule;
using internal::ListRule;
using internal::MakeSchema;
using internal::OptionalRule;
using internal::Presence;
using internal::StatusRule;
using internal::TextRule;
using internal::UintRule;
constexpr Presence kOmitted = Presence::kOmittedWhenDefault;

// ---- Pull

constexpr Label kPullTpSize{"ts", "d_tp_size"};
constexpr Label kPullTpRank{"tr", "d_tp_rank"};
constexpr Label kPullRequests{"rq", "requests"};

// No frame-size check needed: at the limits a pull encodes to < 6.5 MiB.
static_assert(kMaxRequestsPerPull * (2 * (kMaxIdBytes + 3) + 6) + kMaxBlocksPerPull * 4 +
                  kMaxDescriptorBytes + 2 * kMaxIdBytes <
              kMaxFrameBytes);

Status PullRelations(const Pull& m) {
  if (m.d_tp_rank >= m.d_tp_size) {
    return FieldErr(ErrorCode::kOutOfRange, kPullTpRank,
                    std::to_string(m.d_tp_rank) + " is not below d_tp_size " +
                        std::to_string(m.d_tp_size))
        .value();
  }
  std::size_t blocks = 0;
  for (const PullRequest& r : m.requests) blocks += r.block_ids.size();
  if (blocks > kMaxBlocksPerPull) {
    return FieldErr(ErrorCode::kOutOfRange, kPullRequests,
                    std::to_string(blocks) + " blocks in one pull exceed " +
                        std::to_string(kMaxBlocksPerPull))
        .value();
  }
  return Status::Ok();
}

// A request entry: [d_req_id, transfer_id, block ids bin, ...ignored].
constexpr auto kPullSchema = MakeSchema<Pull>(
    MessageType::kPull, kPullLimits, /*has_id=*/true, &PullRelations,
    Field{Label{"e", "d_engine_id"}, &Pull::d_engine_id, IdRule{}},
    Field{kPullTpSize, &Pull::d_tp_size, UintRule<std::uint32_t>{1, core::kMaxTpSize}},
    Field{kPullTpRank, &Pull::d_tp_rank, UintRule<std::uint32_t>{}},
    Field{Label{"l", "d_lease_ms"}, &Pull::d_lease_ms,
          OptionalRule<UintRule<std::uint64_t>>{{0, kMaxLeaseMs}}, kOmitted},
    Field{Label{"bl", "block_len"}, &Pull::block_len, UintRule<std::uint64_t>{1}},
    Field{Label{"nb", "num_blocks"}, &Pull::num_blocks, UintRule<std::uint32_t>{}},
    Field{Label{"rd", "region_descriptor"}, &Pull::region_descriptor,
          OptionalRule<BytesRule>{{kMaxDescriptorBytes}}, kOmitted},
    Field{Label{"k", "write_key"}, &Pull::write_key, UintRule<std::uint64_t>{}, kOmitted},
    Field{kPullRequests, &Pull::requests,
          EntryList<PullRequest, Column<PullRequest, core::RequestId, IdRule>,
                    Column<PullRequest, core::TransferId, IdRule>,
                    Column<PullRequest, std::vector<core::BlockId>, BlockIdsRule>>{
              0,
              kMaxRequestsPerPull,
              {{"d_req_id", &PullRequest::d_req_id, IdRule{}},
               {"transfer_id", &PullRequest::transfer_id, IdRule{}},
               {"block_ids", &PullRequest::block_ids, BlockIdsRule{kMaxBlocksPerRequest}}}}});

// ---- Renewal

// "n" is written only when true, and last: a renewal without it is byte for byte what a build
// that predates notices sends.
constexpr auto kRenewalSchema = MakeSchema<Renewal>(
    MessageType::kRenewal, kRenewalLimits, /*has_id=*/true, nullptr,
    Field{Label{"e", "d_engine_id"}, &Renewal::d_engine_id, IdRule{}},
    Field{Label{"l", "d_lease_ms"}, &Renewal::d_lease_ms, UintRule<std::uint64_t>{0, kMaxLeaseMs}},
    Field{Label{"fp", "fingerprints"}, &Renewal::fingerprints,
          FingerprintsRule{0, kMaxFingerprintsPerRenewal}},
    Field{Label{"n", "accepts_notices"}, &Renewal::accepts_notices, BoolRule{}, kOmitted});

// ---- RenewalReply

constexpr auto kRenewalReplySchema = MakeSchema<RenewalReply>(
    MessageType::kRenewalReply, kRenewalReplyLimits, /*has_id=*/true, nullptr,
    Field{Label{"s", "status"}, &RenewalReply::status,
          StatusRule<RenewalStatus>{RenewalStatus::kError}},
    Field{Label{"x", "extended"}, &RenewalReply::extended, UintRule<std::uint64_t>{}},
    Field{Label{"u", "unknown"}, &RenewalReply::unknown, UintRule<std::uint64_t>{}},
    Field{Label{"l", "p_lease_ms"}, &RenewalReply::p_lease_ms, UintRule<std::uint64_t>{}},
    Field{Label{"m", "message"}, &RenewalReply::message, TextRule{}, kOmitted});

// ---- PullResponse

constexpr Label kResponseCode{"c", "code"};
constexpr Label kResponseMessage{"m", "message"};
constexpr const char* kErrorCarriesLists = "status ERROR must not carry 'ok' or 'err'";

// "ok" and "err" belong to FINISH and CONTINUE (with ERROR D fails every request of the pull
// with its code and message: lists would be ambiguous); "c" to ERROR, and on another response
// it means nothing and is skipped like an unknown key.
constexpr internal::When<PullResponse> kUnlessError{
    +[](const PullResponse& m) { return m.status != PullStatus::kError; }, kErrorCarriesLists};
constexpr internal::When<PullResponse> kOnlyForError{
    +[](const PullResponse& m) { return m.status == PullStatus::kError; }};

Status PullResponseRelations(const PullResponse& m) {
  if (m.status == PullStatus::kError) {
    if (m.code == ErrorCode::kOk) {
      return FieldErr(ErrorCode::kProtocol, kResponseCode, "missing for ERROR").value();
    }
    if (m.message.empty()) {
      return FieldErr(ErrorCode::kProtocol, kResponseMessage, "missing for ERROR").value();
    }
    if (!m.ok.empty() || !m.err.empty()) return Status(ErrorCode::kProtocol, kErrorCarriesLists);
    return Status::Ok();
  }
  if (m.code != ErrorCode::kOk) {
    return FieldErr(ErrorCode::kProtocol, kResponseCode, "only for ERROR").value();
  }
  if (m.ok.size() + m.err.size() > kMaxEntriesPerResponse) {
    return Status(ErrorCode::kOutOfRange,
                  "'ok' + 'err' hold " + std::to_string(m.ok.size() + m.err.size()) +
                      " entries, more than " + std::to_string(kMaxEntriesPerResponse));
  }
  // 4096 maximal reasons would not fit in one frame: P splits such a response in CONTINUEs.
  std::size_t bound = 64 + m.message.size();
  for (const auto& id : m.ok) bound += 3 + id.size();
  for (const auto& e : m.err) bound += 11 + e.d_req_id.size() + e.reason.size();
  if (bound > kMaxFrameBytes && Encode(m).size() > kMaxFrameBytes) {
    return Status(ErrorCode::kOutOfRange, "frame too large: split into CONTINUE responses");
  }
  return Status::Ok();
}

// An err entry: [d_req_id, code, reason, unsettled (only when true), ...ignored].
constexpr auto kPullResponseSchema = MakeSchema<PullResponse>(
    MessageType::kPullResponse, kPullResponseLimits, /*has_id=*/true, &PullResponseRelations,
    Field{Label{"s", "status"}, &PullResponse::status, StatusRule<PullStatus>{PullStatus::kError}},
    Field{Label{"ok", "ok"}, &PullResponse::ok,
          ListRule<IdRule>{{}, "d_req_id", 0, kMaxEntriesPerResponse}, kOmitted, kUnlessError},
    Field{Label{"err", "err"}, &PullResponse::err,
          EntryList<RequestError, Column<RequestError, core::RequestId, IdRule>,
                    Column<RequestError, ErrorCode, ErrorCodeRule>,
                    Column<RequestError, std::string, TextRule>,
                    Column<RequestError, bool, BoolRule>>{
              0,
              kMaxEntriesPerResponse,
              {{"d_req_id", &RequestError::d_req_id, IdRule{}},
               {"code", &RequestError::code, ErrorCodeRule{}},
               {"reason", &RequestError::reason, TextRule{}},
               {"unsettled", &RequestError::unsettled, BoolRule{}, kOmitted}}},
          kOmitted, kUnlessError},
    Field{kResponseCode, &PullResponse::code, ErrorCodeRule{}, kOmitted, kOnlyForError},
    Field{kResponseMessage, &PullResponse::message, TextRule{}, kOmitted});

}  // namespace

std::vector<std::uint8_t> Encode(const Pull& msg) { return EncodeWith(kPullSchema, msg); }
std::vector<std::uint8_t> Encode(const Renewal& msg) { return EncodeWith(kRenewalSchema, msg); }
std::vector<std::uint8_t> Encode(const RenewalReply& msg) {
  return EncodeWith(kRenewalReplySchema, msg);
}
std::vector<std::uint8_t> Encode(const PullResponse& msg) {
  return EncodeWith(kPullResponseSchema, msg);
}

Status Validate(const Pull& msg) { return ValidateWith(kPullSchema, msg); }
Status Validate(const Renewal& msg) { return ValidateWith(kRenewalSchema, msg); }
Status Validate(const RenewalReply& msg) { return ValidateWith(kRenewalReplySchema, msg); }
Status Validate(const PullResponse& msg) { return ValidateWith(kPullResponseSchema, msg); }

Result<Pull> DecodePull(const std::uint8_t* data, std::size_t size) {
  return DecodeWith(kPullSchema, data, size);
}
Result<Renewal> DecodeRenewal(const std::uint8_t* data, std::size_t size) {
  return DecodeWith(kRenewalSchema, data, size);
}
Result<RenewalReply> DecodeRenewalReply(const std::uint8_t* data, std::size_t size) {
  return DecodeWith(kRenewalReplySchema, data, size);
}
Result<PullResponse> DecodePullResponse(const std::uint8_t* data, std::size_t size) {
  return DecodeWith(kPullResponseSchema, data, size);
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
