// The messages that end a hold early (docs/protocol.md §3.5-3.7): Release (D -> P),
// ReleaseReply (P -> D) and AbortNotice (P -> D, unsolicited), each a schema (wire/schema.h)
// from which its encoder, Validate and decoder follow, as in messages.cc.

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
#include "wire/schema.h"

namespace kvferry::wire {
namespace {

using internal::FieldErr;
using internal::Label;
using internal::ScanLimits;

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
// The schemas (wire/schema.h)

namespace {

using internal::Column;
using internal::DecodeWith;
using internal::EncodeWith;
using internal::EntryList;
using internal::ErrorCodeRule;
using internal::Field;
using internal::FingerprintsRule;
using internal::IdRule;
using internal::MakeSchema;
using internal::Presence;
using internal::StatusRule;
using internal::TextRule;
using internal::UintRule;
using internal::ValidateWith;

// ---- Release

constexpr Label kReleaseTpRank{"tr", "d_tp_rank"};

Status ReleaseRelations(const Release& m) {
  if (m.d_tp_rank >= m.d_tp_size) {
    return FieldErr(ErrorCode::kOutOfRange, kReleaseTpRank,
                    std::to_string(m.d_tp_rank) + " is not below d_tp_size " +
                        std::to_string(m.d_tp_size))
        .value();
  }
  return Status::Ok();
}

// A release of nothing can only be a sender bug (a keep-alive is a Renewal's job): at least one
// fingerprint.
constexpr auto kReleaseSchema =
    MakeSchema<Release>(MessageType::kRelease, kReleaseLimits, /*has_id=*/true, &ReleaseRelations,
                        Field{Label{"e", "d_engine_id"}, &Release::d_engine_id, IdRule{}},
                        Field{Label{"ts", "d_tp_size"}, &Release::d_tp_size,
                              UintRule<std::uint32_t>{1, core::kMaxTpSize}},
                        Field{kReleaseTpRank, &Release::d_tp_rank, UintRule<std::uint32_t>{}},
                        Field{Label{"fp", "fingerprints"}, &Release::fingerprints,
                              FingerprintsRule{1, kMaxFingerprintsPerRelease}});

// ---- ReleaseReply

constexpr auto kReleaseReplySchema = MakeSchema<ReleaseReply>(
    MessageType::kReleaseReply, kReleaseReplyLimits, /*has_id=*/true, nullptr,
    Field{Label{"s", "status"}, &ReleaseReply::status,
          StatusRule<ReleaseStatus>{ReleaseStatus::kError}},
    Field{Label{"r", "released"}, &ReleaseReply::released, UintRule<std::uint64_t>{}},
    Field{Label{"k", "kept"}, &ReleaseReply::kept, UintRule<std::uint64_t>{}},
    Field{Label{"u", "unknown"}, &ReleaseReply::unknown, UintRule<std::uint64_t>{}},
    Field{Label{"m", "message"}, &ReleaseReply::message, TextRule{},
          Presence::kOmittedWhenDefault});

// ---- AbortNotice

// At the limits an AbortNotice stays well within one frame (about 4.3 MiB): no frame check.
static_assert(kMaxAbortsPerNotice * (kMaxIdBytes + kMaxTextBytes + 12) + kMaxIdBytes + 64 <
              kMaxFrameBytes);

// Unsolicited: no id is written, and one that arrives must be a uint but is ignored. An abort
// entry: [transfer_id, code, reason, ...ignored].
constexpr auto kAbortNoticeSchema = MakeSchema<AbortNotice>(
    MessageType::kAbortNotice, kAbortNoticeLimits, /*has_id=*/false, nullptr,
    Field{Label{"e", "p_engine_id"}, &AbortNotice::p_engine_id, IdRule{}},
    Field{Label{"pr", "p_tp_rank"}, &AbortNotice::p_tp_rank,
          UintRule<std::uint32_t>{0, core::kMaxTpSize - 1}},
    Field{Label{"a", "aborted"}, &AbortNotice::aborted,
          EntryList<AbortedTransfer, Column<AbortedTransfer, core::TransferId, IdRule>,
                    Column<AbortedTransfer, ErrorCode, ErrorCodeRule>,
                    Column<AbortedTransfer, std::string, TextRule>>{
              1,
              kMaxAbortsPerNotice,
              {{"transfer_id", &AbortedTransfer::transfer_id, IdRule{}},
               {"code", &AbortedTransfer::code, ErrorCodeRule{}},
               {"reason", &AbortedTransfer::reason, TextRule{}}}}});

}  // namespace

std::vector<std::uint8_t> Encode(const Release& msg) { return EncodeWith(kReleaseSchema, msg); }
std::vector<std::uint8_t> Encode(const ReleaseReply& msg) {
  return EncodeWith(kReleaseReplySchema, msg);
}
std::vector<std::uint8_t> Encode(const AbortNotice& msg) {
  return EncodeWith(kAbortNoticeSchema, msg);
}

Status Validate(const Release& msg) { return ValidateWith(kReleaseSchema, msg); }
Status Validate(const ReleaseReply& msg) { return ValidateWith(kReleaseReplySchema, msg); }
Status Validate(const AbortNotice& msg) { return ValidateWith(kAbortNoticeSchema, msg); }

Result<Release> DecodeRelease(const std::uint8_t* data, std::size_t size) {
  return DecodeWith(kReleaseSchema, data, size);
}
Result<ReleaseReply> DecodeReleaseReply(const std::uint8_t* data, std::size_t size) {
  return DecodeWith(kReleaseReplySchema, data, size);
}
Result<AbortNotice> DecodeAbortNotice(const std::uint8_t* data, std::size_t size) {
  return DecodeWith(kAbortNoticeSchema, data, size);
}

}  // namespace kvferry::wire
