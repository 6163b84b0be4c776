// Encoders and decoders of the side-channel messages (docs/protocol.md).
//
// Decoding is three steps, cheapest first:
//  1. internal::ScanFrame walks the raw bytes with the per-message limits (no allocation), so
//     hostile sizes, depth bombs and truncation are refused before msgpack-cxx sees them;
//  2. msgpack::unpack with the same limits as unpack_limit (defence in depth) builds objects
//     that *reference* the input buffer (str/bin are not copied);
//  3. a walk over the top-level map that checks every field and builds the struct.
// Only step 3 allocates for the result, after the sizes it allocates for were checked.

#include "wire/messages.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <exception>
#include <limits>
#include <msgpack.hpp>
#include <string>
#include <utility>

#include "kvferry/core/tp_plan.h"
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

using internal::ScanLimits;

constexpr std::size_t kBlockIdBytes = 4;  // block ids travel as little-endian u32 in a bin
constexpr std::uint8_t kMaxErrorCode = static_cast<std::uint8_t>(ErrorCode::kInternal);

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
// Encoding

// msgpack::packer's buffer: appends to a byte vector.
struct VecBuffer {
  std::vector<std::uint8_t>* out;
  void write(const char* p, std::size_t n) { out->insert(out->end(), p, p + n); }
};
using Packer = msgpack::packer<VecBuffer>;

void PackKey(Packer& pk, std::string_view key) {
  pk.pack_str(static_cast<std::uint32_t>(key.size()));
  pk.pack_str_body(key.data(), static_cast<std::uint32_t>(key.size()));
}
void PackStr(Packer& pk, std::string_view s) {
  pk.pack_str(static_cast<std::uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<std::uint32_t>(s.size()));
}
// "t" and "v" come first so PeekType's fast path finds them in the first bytes; "id" (omitted
// when 0) follows. `num_keys` counts the message's other keys.
void PackHeader(Packer& pk, std::uint32_t num_keys, MessageType type, std::uint64_t id) {
  pk.pack_map(num_keys + 2 + (id != 0 ? 1 : 0));
  PackKey(pk, "t");
  pk.pack_uint8(static_cast<std::uint8_t>(type));
  PackKey(pk, "v");
  pk.pack_uint32(kProtocolVersion);
  if (id != 0) {
    PackKey(pk, "id");
    pk.pack_uint64(id);
  }
}

// ---------------------------------------------------------------------------------------------
// Decoding helpers

const char* TypeName(msgpack::type::object_type t) {
  switch (t) {
    case msgpack::type::NIL:
      return "nil";
    case msgpack::type::BOOLEAN:
      return "bool";
    case msgpack::type::POSITIVE_INTEGER:
      return "uint";
    case msgpack::type::NEGATIVE_INTEGER:
      return "negative int";
    case msgpack::type::FLOAT32:
    case msgpack::type::FLOAT64:
      return "float";
    case msgpack::type::STR:
      return "str";
    case msgpack::type::BIN:
      return "bin";
    case msgpack::type::ARRAY:
      return "array";
    case msgpack::type::MAP:
      return "map";
    case msgpack::type::EXT:
      return "ext";
  }
  return "unknown";
}

// Names a field in error reasons: "'e' (d_engine_id)" or "'rq'[3].transfer_id". Built only when
// an error is reported, so the success path never formats strings.
struct Label {
  std::string_view key;
  const char* name;
  std::size_t index = std::numeric_limits<std::size_t>::max();
  std::string str() const {
    if (index == std::numeric_limits<std::size_t>::max()) {
      return "field '" + std::string(key) + "' (" + name + ")";
    }
    return "field '" + std::string(key) + "'[" + std::to_string(index) + "]." + name;
  }
};

tl::unexpected<Status> FieldErr(ErrorCode code, const Label& label, const std::string& what) {
  return Err(code, label.str() + ": " + what);
}
tl::unexpected<Status> WrongType(const Label& label, const char* want, const msgpack::object& o) {
  return FieldErr(ErrorCode::kProtocol, label,
                  std::string("expected ") + want + ", got " + TypeName(o.type));
}

Result<std::uint64_t> GetUint(const msgpack::object& o, const Label& label,
                              std::uint64_t max = std::numeric_limits<std::uint64_t>::max()) {
  if (o.type != msgpack::type::POSITIVE_INTEGER) return WrongType(label, "uint", o);
  if (o.via.u64 > max) {
    return FieldErr(ErrorCode::kOutOfRange, label,
                    std::to_string(o.via.u64) + " exceeds " + std::to_string(max));
  }
  return o.via.u64;
}

// Ids must be non-empty: an empty id can only be a sender bug and would alias across requests.
Result<std::string_view> GetStr(const msgpack::object& o, const Label& label, std::size_t max_len,
                                bool non_empty) {
  if (o.type != msgpack::type::STR) return WrongType(label, "str", o);
  if (o.via.str.size > max_len) {
    return FieldErr(
        ErrorCode::kOutOfRange, label,
        "length " + std::to_string(o.via.str.size) + " exceeds " + std::to_string(max_len));
  }
  if (non_empty && o.via.str.size == 0) return FieldErr(ErrorCode::kProtocol, label, "empty");
  return std::string_view(o.via.str.ptr, o.via.str.size);
}

Result<std::span<const std::uint8_t>> GetBin(const msgpack::object& o, const Label& label,
                                             std::size_t max_len) {
  if (o.type != msgpack::type::BIN) return WrongType(label, "bin", o);
  if (o.via.bin.size > max_len) {
    return FieldErr(
        ErrorCode::kOutOfRange, label,
        "length " + std::to_string(o.via.bin.size) + " exceeds " + std::to_string(max_len));
  }
  return std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(o.via.bin.ptr),
                                       o.via.bin.size);
}

Result<std::span<const msgpack::object>> GetArray(const msgpack::object& o, const Label& label,
                                                  std::size_t max_len, std::size_t min_len = 0) {
  if (o.type != msgpack::type::ARRAY) return WrongType(label, "array", o);
  if (o.via.array.size > max_len) {
    return FieldErr(ErrorCode::kOutOfRange, label,
                    std::to_string(o.via.array.size) + " items exceed " + std::to_string(max_len));
  }
  if (o.via.array.size < min_len) {
    return FieldErr(
        ErrorCode::kProtocol, label,
        std::to_string(o.via.array.size) + " items, need at least " + std::to_string(min_len));
  }
  return std::span<const msgpack::object>(o.via.array.ptr, o.via.array.size);
}

[[maybe_unused]] std::uint32_t LoadLe32(const std::uint8_t* p) {  // big-endian hosts only
  return static_cast<std::uint32_t>(p[0]) | static_cast<std::uint32_t>(p[1]) << 8 |
         static_cast<std::uint32_t>(p[2]) << 16 | static_cast<std::uint32_t>(p[3]) << 24;
}
std::uint64_t LoadLe56(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (int i = core::kFingerprintBytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Keys are 1-3 bytes: an inline loop beats memcmp calls (this runs ~N*keys times per decode).
inline bool KeyEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}

// The known keys of one message, found in one pass over the top-level map. Indices 0, 1 and 2
// are "t", "v" and "id" in every message. Unknown keys (and non-str keys) are skipped.
template <std::size_t N>
struct Fields {
  const std::array<Label, N>& labels;
  std::array<const msgpack::object*, N> value{};
  const Label* duplicate = nullptr;

  void Collect(const msgpack::object_map& map) {
    for (std::uint32_t i = 0; i < map.size; ++i) {
      const msgpack::object& k = map.ptr[i].key;
      if (k.type != msgpack::type::STR) continue;
      const std::string_view key(k.via.str.ptr, k.via.str.size);
      for (std::size_t f = 0; f < N; ++f) {
        if (KeyEquals(key, labels[f].key)) {
          if (value[f] != nullptr && duplicate == nullptr) duplicate = &labels[f];
          value[f] = &map.ptr[i].val;
          break;
        }
      }
    }
  }
  const msgpack::object* operator[](std::size_t f) const { return value[f]; }
  tl::unexpected<Status> Missing(std::size_t f) const {
    return FieldErr(ErrorCode::kProtocol, labels[f], "missing");
  }
};

// Steps 1 and 2 of decoding, then the version and type checks shared by all messages. On
// success `handle` owns the objects; they point into `data`, which must outlive them.
template <std::size_t N>
Status Parse(const std::uint8_t* data, std::size_t size, MessageType want, const ScanLimits& limits,
             msgpack::object_handle& handle, Fields<N>& fields, std::uint64_t& id) {
  if (size > kMaxFrameBytes) {
    return Status(ErrorCode::kOutOfRange, "frame of " + std::to_string(size) +
                                              " bytes exceeds limit " +
                                              std::to_string(kMaxFrameBytes));
  }
  if (size == 0 || data == nullptr) return Status(ErrorCode::kProtocol, "empty frame");
  if (Status s = internal::ScanFrame(data, size, limits); !s.ok()) return s;
  try {
    std::size_t offset = 0;
    const msgpack::unpack_limit limit(limits.array, limits.map, limits.str, limits.bin, limits.ext,
                                      limits.depth);
    // Reference str/bin/ext in place instead of copying them into the zone.
    auto reference_all = [](msgpack::type::object_type, std::size_t, void*) { return true; };
    handle = msgpack::unpack(reinterpret_cast<const char*>(data), size, offset, reference_all,
                             nullptr, limit);
    if (offset != size) {
      return Status(ErrorCode::kProtocol, std::to_string(size - offset) + " trailing bytes");
    }
  } catch (const std::exception& e) {
    // Unreachable after ScanFrame unless the two disagree; still a clean error, never a throw.
    return Status(ErrorCode::kProtocol, std::string("msgpack: ") + e.what());
  }
  const msgpack::object& top = handle.get();
  if (top.type != msgpack::type::MAP) {
    return Status(ErrorCode::kProtocol,
                  std::string("message is not a msgpack map (got ") + TypeName(top.type) + ")");
  }
  fields.Collect(top.via.map);
  // Version first: a newer peer may have changed anything else.
  if (fields[1] == nullptr) return fields.Missing(1).value();
  if (fields[1]->type != msgpack::type::POSITIVE_INTEGER) {
    return WrongType(fields.labels[1], "uint", *fields[1]).value();
  }
  const std::uint64_t version = fields[1]->via.u64;
  if (version == 0 || version > kProtocolVersion) {
    return Status(ErrorCode::kProtocol, "unsupported version " + std::to_string(version));
  }
  if (fields[0] == nullptr) return fields.Missing(0).value();
  if (fields[0]->type != msgpack::type::POSITIVE_INTEGER) {
    return WrongType(fields.labels[0], "uint", *fields[0]).value();
  }
  const std::uint64_t type = fields[0]->via.u64;
  if (type != static_cast<std::uint64_t>(want)) {
    std::string got = type >= 1 && type <= 4 ? std::string(ToString(static_cast<MessageType>(type)))
                                             : std::string("unknown");
    return Status(ErrorCode::kProtocol, "message type " + std::to_string(type) + " (" + got +
                                            ") is not a " + std::string(ToString(want)));
  }
  if (fields.duplicate != nullptr) {
    return FieldErr(ErrorCode::kProtocol, *fields.duplicate, "duplicate key").value();
  }
  id = 0;
  if (fields[2] != nullptr) {
    auto value = GetUint(*fields[2], fields.labels[2]);
    if (!value) return value.error();
    id = *value;
  }
  return Status::Ok();
}

// Assigns a Result<T> expression's value to `lhs`, or returns its error from the enclosing
// function (which returns a Result). One use per line.
#define KVF_CONCAT_INNER(a, b) a##b
#define KVF_CONCAT(a, b) KVF_CONCAT_INNER(a, b)
#define KVF_ASSIGN_IMPL(tmp, lhs, expr)                    \
  auto tmp = (expr);                                       \
  if (!tmp) return tl::unexpected(std::move(tmp).error()); \
  lhs = *std::move(tmp)
#define KVF_ASSIGN(lhs, expr) KVF_ASSIGN_IMPL(KVF_CONCAT(kvf_result_, __LINE__), lhs, expr)

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
  PackHeader(pk, 6 + (msg.d_lease_ms ? 1 : 0) + (msg.region_descriptor ? 1 : 0), MessageType::kPull,
             msg.id);
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
enum RenewalField { kRT, kRV, kRId, kREngine, kRLease, kRFingerprints, kRenewalFieldCount };
const std::array<Label, kRenewalFieldCount> kRenewalLabels{{
    {"t", "type"},
    {"v", "version"},
    {"id", "id"},
    {"e", "d_engine_id"},
    {"l", "d_lease_ms"},
    {"fp", "fingerprints"},
}};
}  // namespace

std::vector<std::uint8_t> Encode(const Renewal& msg) {
  std::vector<std::uint8_t> out;
  out.reserve(32 + msg.d_engine_id.size() + core::kFingerprintBytes * msg.fingerprints.size());
  VecBuffer buf{&out};
  Packer pk(buf);
  PackHeader(pk, 3, MessageType::kRenewal, msg.id);
  PackKey(pk, "e");
  PackStr(pk, msg.d_engine_id);
  PackKey(pk, "l");
  pk.pack_uint64(msg.d_lease_ms);
  PackKey(pk, "fp");
  const std::size_t n = msg.fingerprints.size();
  pk.pack_bin(static_cast<std::uint32_t>(n * core::kFingerprintBytes));
  const std::size_t at = out.size();
  out.resize(at + n * core::kFingerprintBytes);
  std::uint8_t* p = out.data() + at;
  for (core::Fingerprint fp : msg.fingerprints) {
    for (int i = 0; i < core::kFingerprintBytes; ++i)
      *p++ = static_cast<std::uint8_t>(fp >> (8 * i));
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
  KVF_ASSIGN(fps, GetBin(*f[kRFingerprints], kRenewalLabels[kRFingerprints],
                         kMaxFingerprintsPerRenewal * core::kFingerprintBytes));
  if (fps.size() % core::kFingerprintBytes != 0) {
    return FieldErr(ErrorCode::kProtocol, kRenewalLabels[kRFingerprints],
                    "bin length " + std::to_string(fps.size()) +
                        " is not a multiple of 7 (little-endian 56-bit fingerprints)");
  }
  msg.d_engine_id.assign(engine);
  const std::size_t n = fps.size() / core::kFingerprintBytes;
  msg.fingerprints.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    msg.fingerprints[i] = LoadLe56(fps.data() + i * core::kFingerprintBytes);
  }
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
  std::uint64_t status = 0;
  KVF_ASSIGN(status, GetUint(*f[kYStatus], kReplyLabels[kYStatus]));
  if (status > static_cast<std::uint8_t>(RenewalStatus::kError)) {
    return FieldErr(ErrorCode::kProtocol, kReplyLabels[kYStatus],
                    "unknown value " + std::to_string(status));
  }
  msg.status = static_cast<RenewalStatus>(status);
  KVF_ASSIGN(msg.extended, GetUint(*f[kYExtended], kReplyLabels[kYExtended]));
  KVF_ASSIGN(msg.unknown, GetUint(*f[kYUnknown], kReplyLabels[kYUnknown]));
  KVF_ASSIGN(msg.p_lease_ms, GetUint(*f[kYLease], kReplyLabels[kYLease]));
  if (f[kYMessage] != nullptr) {
    std::string_view m;
    KVF_ASSIGN(m, GetStr(*f[kYMessage], kReplyLabels[kYMessage], kMaxTextBytes, false));
    msg.message.assign(m);
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
// Elements of one err entry: [d_req_id, code, reason, ...ignored].
constexpr std::size_t kErrFields = 3;

bool IsErrorCode(std::uint64_t v) { return v >= 1 && v <= kMaxErrorCode; }
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
      pk.pack_array(kErrFields);
      PackStr(pk, e.d_req_id);
      pk.pack_uint8(static_cast<std::uint8_t>(e.code));
      PackStr(pk, e.reason);
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
  for (const auto& e : msg.err) bound += 10 + e.d_req_id.size() + e.reason.size();
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
  std::uint64_t status = 0;
  KVF_ASSIGN(status, GetUint(*f[kSStatus], kResponseLabels[kSStatus]));
  if (status > static_cast<std::uint8_t>(PullStatus::kError)) {
    return FieldErr(ErrorCode::kProtocol, kResponseLabels[kSStatus],
                    "unknown value " + std::to_string(status));
  }
  msg.status = static_cast<PullStatus>(status);
  if (f[kSMessage] != nullptr) {
    std::string_view m;
    KVF_ASSIGN(m, GetStr(*f[kSMessage], kResponseLabels[kSMessage], kMaxTextBytes, false));
    msg.message.assign(m);
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
  if (Status s = internal::ReadHeader(data, size, pos, h); !s.ok()) return tl::unexpected(s);
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
  if (Status s = internal::ReadHeader(data, size, pos, h); !s.ok()) return tl::unexpected(s);
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
      if (Status s = internal::ReadHeader(data, size, pos, k); !s.ok()) return tl::unexpected(s);
      const bool one_char = k.kind == internal::Kind::kStr && k.value == 1 && pos < size;
      const char c = one_char ? static_cast<char>(data[pos]) : '\0';
      if (one_char && (c == 't' || c == 'v')) {
        ++pos;
        const Label& label = c == 't' ? kPullLabels[kPT] : kPullLabels[kPV];
        std::uint64_t value = 0;
        KVF_ASSIGN(value, PeekUint(data, size, pos, label));
        (c == 't' ? type : version) = value;
        (c == 't' ? have_type : have_version) = true;
        continue;
      }
      pos = key_at;
      if (Status s = internal::SkipObject(data, size, pos, kPeekLimits, 1, objects); !s.ok()) {
        return tl::unexpected(s);
      }
      if (Status s = internal::SkipObject(data, size, pos, kPeekLimits, 1, objects); !s.ok()) {
        return tl::unexpected(s);
      }
    }
  }
  if (!have_version) return FieldErr(ErrorCode::kProtocol, kPullLabels[kPV], "missing");
  if (version == 0 || version > kProtocolVersion) {
    return Err(ErrorCode::kProtocol, "unsupported version " + std::to_string(version));
  }
  if (!have_type) return FieldErr(ErrorCode::kProtocol, kPullLabels[kPT], "missing");
  if (type < 1 || type > 4) {
    return Err(ErrorCode::kProtocol, "unknown message type " + std::to_string(type));
  }
  return static_cast<MessageType>(type);
}

}  // namespace kvferry::wire
