// Internal to the wire module: the msgpack building blocks under the message schemas
// (schema.h's rules; messages.cc: Pull, Renewal, RenewalReply, PullResponse, PeekType/PeekId;
// notices.cc: Release, ReleaseReply, AbortNotice). Users include wire/messages.h, never this
// header: it pulls in msgpack-cxx.
//
// Hot-path helpers (the Get* field readers, Fields<N>) are inline so that each decoder's loop
// over its entries compiles without calls; the error paths and the unpack step live in codec.cc.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <msgpack.hpp>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvferry/core/ids.h"
#include "kvferry/status.h"
#include "wire/messages.h"
#include "wire/scan.h"

namespace kvferry::wire::internal {

// kUnauthenticated (after kInternal) never travels: authentication happens in the ZeroMQ
// handshake, below the protocol, so the wire's codes end at kInternal (docs/protocol.md §5).
inline constexpr std::uint8_t kMaxErrorCode = static_cast<std::uint8_t>(ErrorCode::kInternal);

// A `code` that may travel as an error: a known ErrorCode other than kOk or kUnauthenticated.
inline bool IsErrorCode(std::uint64_t v) { return v >= 1 && v <= kMaxErrorCode; }

// ---------------------------------------------------------------------------------------------
// Encoding

// msgpack::packer's buffer: appends to a byte vector.
struct VecBuffer {
  std::vector<std::uint8_t>* out;
  void write(const char* p, std::size_t n) { out->insert(out->end(), p, p + n); }
};
using Packer = msgpack::packer<VecBuffer>;

inline void PackKey(Packer& pk, std::string_view key) {
  pk.pack_str(static_cast<std::uint32_t>(key.size()));
  pk.pack_str_body(key.data(), static_cast<std::uint32_t>(key.size()));
}
inline void PackStr(Packer& pk, std::string_view s) {
  pk.pack_str(static_cast<std::uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<std::uint32_t>(s.size()));
}
// "t" and "v" come first so PeekType's fast path finds them in the first bytes; "id" (omitted
// when 0) follows. `num_keys` counts the message's other keys.
void PackHeader(Packer& pk, std::uint32_t num_keys, MessageType type, std::uint64_t id);

// Fingerprints as one bin of 7-byte little-endian values (docs/protocol.md §7), appended to
// `out`, the vector `pk` writes to. Only the low 56 bits of each value are kept.
void PackFingerprints(Packer& pk, std::vector<std::uint8_t>& out,
                      std::span<const core::Fingerprint> fingerprints);

// ---------------------------------------------------------------------------------------------
// Decoding helpers

const char* TypeName(msgpack::type::object_type t);

// Names a field in error reasons: "'e' (d_engine_id)" or "'rq'[3].transfer_id". Built only when
// an error is reported, so the success path never formats strings.
struct Label {
  std::string_view key;
  const char* name;
  std::size_t index = std::numeric_limits<std::size_t>::max();
  std::string str() const;
};

// The header keys, at indices 0, 1 and 2 of every message's label table (see Fields).
inline constexpr Label kTypeLabel{"t", "type"};
inline constexpr Label kVersionLabel{"v", "version"};
inline constexpr Label kIdLabel{"id", "id"};

tl::unexpected<Status> FieldErr(ErrorCode code, const Label& label, const std::string& what);
tl::unexpected<Status> WrongType(const Label& label, const char* want, const msgpack::object& o);
// Out-of-line halves of the Get* readers below: the reasons are formatted only on failure.
tl::unexpected<Status> TooLarge(const Label& label, std::uint64_t value, std::uint64_t max);
tl::unexpected<Status> TooLong(const Label& label, std::size_t length, std::size_t max);
tl::unexpected<Status> TooManyItems(const Label& label, std::size_t items, std::size_t max);
tl::unexpected<Status> TooFewItems(const Label& label, std::size_t items, std::size_t min);

inline Result<std::uint64_t> GetUint(
    const msgpack::object& o, const Label& label,
    std::uint64_t max = std::numeric_limits<std::uint64_t>::max()) {
  if (o.type != msgpack::type::POSITIVE_INTEGER) return WrongType(label, "uint", o);
  if (o.via.u64 > max) return TooLarge(label, o.via.u64, max);
  return o.via.u64;
}

// A status enum travelling as a uint: values above `last` (the highest this build knows) are a
// protocol error, since new status values need a new major version (docs/protocol.md §6).
template <typename Enum>
inline Result<Enum> GetStatus(const msgpack::object& o, const Label& label, Enum last) {
  if (o.type != msgpack::type::POSITIVE_INTEGER) return WrongType(label, "uint", o);
  if (o.via.u64 > static_cast<std::uint64_t>(last)) {
    return FieldErr(ErrorCode::kProtocol, label, "unknown value " + std::to_string(o.via.u64));
  }
  return static_cast<Enum>(o.via.u64);
}

// A msgpack bool (true/false), never an integer.
inline Result<bool> GetBool(const msgpack::object& o, const Label& label) {
  if (o.type != msgpack::type::BOOLEAN) return WrongType(label, "bool", o);
  return o.via.boolean;
}

// Ids must be non-empty: an empty id can only be a sender bug and would alias across requests.
inline Result<std::string_view> GetStr(const msgpack::object& o, const Label& label,
                                       std::size_t max_len, bool non_empty) {
  if (o.type != msgpack::type::STR) return WrongType(label, "str", o);
  if (o.via.str.size > max_len) return TooLong(label, o.via.str.size, max_len);
  if (non_empty && o.via.str.size == 0) return FieldErr(ErrorCode::kProtocol, label, "empty");
  return std::string_view(o.via.str.ptr, o.via.str.size);
}

inline Result<std::span<const std::uint8_t>> GetBin(const msgpack::object& o, const Label& label,
                                                    std::size_t max_len) {
  if (o.type != msgpack::type::BIN) return WrongType(label, "bin", o);
  if (o.via.bin.size > max_len) return TooLong(label, o.via.bin.size, max_len);
  return std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(o.via.bin.ptr),
                                       o.via.bin.size);
}

inline Result<std::span<const msgpack::object>> GetArray(const msgpack::object& o,
                                                         const Label& label, std::size_t max_len,
                                                         std::size_t min_len = 0) {
  if (o.type != msgpack::type::ARRAY) return WrongType(label, "array", o);
  if (o.via.array.size > max_len) return TooManyItems(label, o.via.array.size, max_len);
  if (o.via.array.size < min_len) return TooFewItems(label, o.via.array.size, min_len);
  return std::span<const msgpack::object>(o.via.array.ptr, o.via.array.size);
}

// A fingerprint bin (§7) of at most `max_count` values: the bin, its length a multiple of 7.
// Read the values with LoadFingerprints.
Result<std::span<const std::uint8_t>> GetFingerprintBin(const msgpack::object& o,
                                                        const Label& label, std::size_t max_count);
void LoadFingerprints(std::span<const std::uint8_t> bin, std::vector<core::Fingerprint>& out);

[[maybe_unused]] inline std::uint32_t LoadLe32(const std::uint8_t* p) {  // big-endian hosts only
  return static_cast<std::uint32_t>(p[0]) | static_cast<std::uint32_t>(p[1]) << 8 |
         static_cast<std::uint32_t>(p[2]) << 16 | static_cast<std::uint32_t>(p[3]) << 24;
}
inline std::uint64_t LoadLe56(const std::uint8_t* p) {
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
  static_assert(N >= 3, "every message has t, v and id");
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

// Steps 1 and 2 of decoding (ScanFrame, then msgpack::unpack with the same limits), ending with
// the check that the top level is a map. On success `handle` owns the objects; they point into
// `data`, which must outlive them.
Status Unpack(const std::uint8_t* data, std::size_t size, const ScanLimits& limits,
              msgpack::object_handle& handle);

// The checks shared by all messages once the known keys are collected: the version first (a
// newer peer may have changed anything else), then the type, duplicates, and `id` (0 if absent).
Status CheckHeader(const msgpack::object* type, const msgpack::object* version,
                   const msgpack::object* id_value, const Label* duplicate, MessageType want,
                   std::uint64_t& id);

// Steps 1 and 2 of decoding, then the version and type checks shared by all messages. On
// success `handle` owns the objects; they point into `data`, which must outlive them.
template <std::size_t N>
Status Parse(const std::uint8_t* data, std::size_t size, MessageType want, const ScanLimits& limits,
             msgpack::object_handle& handle, Fields<N>& fields, std::uint64_t& id) {
  if (Status s = Unpack(data, size, limits, handle); !s.ok()) return s;
  fields.Collect(handle.get().via.map);
  return CheckHeader(fields[0], fields[1], fields[2], fields.duplicate, want, id);
}

}  // namespace kvferry::wire::internal

// Assigns a Result<T> expression's value to `lhs`, or returns its error from the enclosing
// function (which returns a Result). One use per line.
#define KVF_CONCAT_INNER(a, b) a##b
#define KVF_CONCAT(a, b) KVF_CONCAT_INNER(a, b)
#define KVF_ASSIGN_IMPL(tmp, lhs, expr)                    \
  auto tmp = (expr);                                       \
  if (!tmp) return tl::unexpected(std::move(tmp).error()); \
  lhs = *std::move(tmp)
#define KVF_ASSIGN(lhs, expr) KVF_ASSIGN_IMPL(KVF_CONCAT(kvf_result_, __LINE__), lhs, expr)
