// Internal to the wire module: one schema per message, from which its encoder, its Validate and
// its decoder follow (docs/protocol.md §8 says why a table of typed fields and not a generator).
//
// A message's schema lists its keys in wire order. Each field names its key, the struct member
// it fills and a *rule*: the kind of value on the wire and its bounds (an id of at most
// kMaxIdBytes, a uint of at most kMaxLeaseMs, ...). A rule is written once and used three ways:
//   Pack   the encoder writes the member;
//   Check  Validate checks the member against the bounds (what a sender runs before sending);
//   Read   the decoder reads the value into the member, enforcing the same bounds.
// So Validate and the decoder cannot disagree on a limit, and a decoded message always
// validates. Rules that relate fields (d_tp_rank < d_tp_size, an ERROR carries a code) are one
// function per message, `relations`, which both Validate and the decoder run on the struct.
//
// Presence: a kRequired field is always written and must be present; a kOmittedWhenDefault
// field is written only when its member differs from the member's default (an empty text, a
// false flag, 0, nullopt) and reads as that default when absent — how optional keys were added
// without a version bump (docs/protocol.md §6).
//
// Lists of entries (a Pull's requests, a PullResponse's err, an AbortNotice's aborted) travel as
// arrays of arrays: EntryList's columns are positional, trailing columns may be omitted when
// default, and elements beyond the known columns are ignored (a newer peer's additions).
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "wire/codec.h"

namespace kvferry::wire::internal {

enum class Presence : std::uint8_t { kRequired, kOmittedWhenDefault };

// Rules' Read reports a failure through `error` and returns false, so that the success path of a
// decode builds no Status per field (measured: a Status per field cost the decoders 6-16%).
inline bool Fail(Status status, Status& error) {
  error = std::move(status);
  return false;
}

// Whether a kOmittedWhenDefault member is left out: it equals its type's default.
template <class T>
bool IsDefault(const T& v) {
  return v == T{};
}

// ---------------------------------------------------------------------------------------------
// Rules

// A string of at most `max` bytes; kNonEmpty: an empty one is refused. IdRule (engine, request
// and transfer ids) and TextRule (reasons, free-text messages) are its two uses.
template <bool kNonEmpty, std::size_t kDefaultMax>
struct StringRule {
  std::size_t max = kDefaultMax;
  void Pack(Packer& pk, std::vector<std::uint8_t>&, const std::string& v) const { PackStr(pk, v); }
  std::size_t Size(const std::string& v) const { return 5 + v.size(); }
  Status Check(const std::string& v, const Label& label) const {
    if (kNonEmpty && v.empty()) return FieldErr(ErrorCode::kProtocol, label, "empty").value();
    if (v.size() > max) return TooLong(label, v.size(), max).value();
    return Status::Ok();
  }
  bool Read(const msgpack::object& o, const Label& label, std::string& out, Status& error) const {
    Result<std::string_view> s = GetStr(o, label, max, kNonEmpty);
    if (!s) return Fail(s.error(), error);
    out.assign(*s);
    return true;
  }
};
using IdRule = StringRule<true, kMaxIdBytes>;
using TextRule = StringRule<false, kMaxTextBytes>;

// An unsigned integer in [min, max] (msgpack packs it in its shortest form).
template <class T>
struct UintRule {
  std::uint64_t min = 0;
  std::uint64_t max = std::numeric_limits<T>::max();
  void Pack(Packer& pk, std::vector<std::uint8_t>&, T v) const { pk.pack_uint64(v); }
  std::size_t Size(T) const { return 9; }
  Status Check(T v, const Label& label) const {
    if (v < min) return FieldErr(ErrorCode::kOutOfRange, label, Below(min)).value();
    if (v > max) return TooLarge(label, v, max).value();
    return Status::Ok();
  }
  bool Read(const msgpack::object& o, const Label& label, T& out, Status& error) const {
    Result<std::uint64_t> v = GetUint(o, label, max);
    if (!v) return Fail(v.error(), error);
    if (*v < min) return Fail(FieldErr(ErrorCode::kOutOfRange, label, Below(min)).value(), error);
    out = static_cast<T>(*v);
    return true;
  }
  static std::string Below(std::uint64_t min) { return "must be >= " + std::to_string(min); }
};

// A msgpack bool, never an integer.
struct BoolRule {
  void Pack(Packer& pk, std::vector<std::uint8_t>&, bool v) const {
    if (v) {
      pk.pack_true();
    } else {
      pk.pack_false();
    }
  }
  std::size_t Size(bool) const { return 1; }
  Status Check(bool, const Label&) const { return Status::Ok(); }
  bool Read(const msgpack::object& o, const Label& label, bool& out, Status& error) const {
    Result<bool> v = GetBool(o, label);
    if (!v) return Fail(v.error(), error);
    out = *v;
    return true;
  }
};

// A status enum as a uint: values above `last` (the highest this build knows) are a protocol
// error, since new status values need a new major version (docs/protocol.md §6).
template <class Enum>
struct StatusRule {
  Enum last;
  void Pack(Packer& pk, std::vector<std::uint8_t>&, Enum v) const {
    pk.pack_uint8(static_cast<std::uint8_t>(v));
  }
  std::size_t Size(Enum) const { return 2; }
  Status Check(Enum v, const Label& label) const {
    if (static_cast<std::uint8_t>(v) > static_cast<std::uint8_t>(last)) {
      return FieldErr(ErrorCode::kProtocol, label,
                      "unknown value " + std::to_string(static_cast<unsigned>(v)))
          .value();
    }
    return Status::Ok();
  }
  bool Read(const msgpack::object& o, const Label& label, Enum& out, Status& error) const {
    Result<Enum> v = GetStatus(o, label, last);
    if (!v) return Fail(v.error(), error);
    out = *v;
    return true;
  }
};

// An ErrorCode that may travel as an error (IsErrorCode: never kOk or kUnauthenticated).
struct ErrorCodeRule {
  void Pack(Packer& pk, std::vector<std::uint8_t>&, ErrorCode v) const {
    pk.pack_uint8(static_cast<std::uint8_t>(v));
  }
  std::size_t Size(ErrorCode) const { return 2; }
  Status Check(ErrorCode v, const Label& label) const {
    if (!IsErrorCode(static_cast<std::uint64_t>(v)))
      return Unknown(label, static_cast<std::uint64_t>(v));
    return Status::Ok();
  }
  bool Read(const msgpack::object& o, const Label& label, ErrorCode& out, Status& error) const {
    Result<std::uint64_t> v = GetUint(o, label);
    if (!v) return Fail(v.error(), error);
    if (!IsErrorCode(*v)) return Fail(Unknown(label, *v), error);
    out = static_cast<ErrorCode>(*v);
    return true;
  }
  static Status Unknown(const Label& label, std::uint64_t v) {
    return FieldErr(ErrorCode::kProtocol, label, "unknown error code " + std::to_string(v)).value();
  }
};

// Opaque bytes of at most `max` (a Pull's region descriptor).
struct BytesRule {
  std::size_t max;
  void Pack(Packer& pk, std::vector<std::uint8_t>&, const std::vector<std::uint8_t>& v) const {
    pk.pack_bin(static_cast<std::uint32_t>(v.size()));
    pk.pack_bin_body(reinterpret_cast<const char*>(v.data()), static_cast<std::uint32_t>(v.size()));
  }
  std::size_t Size(const std::vector<std::uint8_t>& v) const { return 5 + v.size(); }
  Status Check(const std::vector<std::uint8_t>& v, const Label& label) const {
    if (v.size() > max) return TooLong(label, v.size(), max).value();
    return Status::Ok();
  }
  bool Read(const msgpack::object& o, const Label& label, std::vector<std::uint8_t>& out,
            Status& error) const {
    Result<std::span<const std::uint8_t>> bin = GetBin(o, label, max);
    if (!bin) return Fail(bin.error(), error);
    out.assign(bin->begin(), bin->end());
    return true;
  }
};

// Fingerprints as one bin of 7-byte little-endian values (docs/protocol.md §7), `min`..`max` of
// them, each within core::kFingerprintMask.
struct FingerprintsRule {
  std::size_t min = 0;
  std::size_t max;
  void Pack(Packer& pk, std::vector<std::uint8_t>& out,
            const std::vector<core::Fingerprint>& v) const {
    PackFingerprints(pk, out, v);
  }
  std::size_t Size(const std::vector<core::Fingerprint>& v) const {
    return 5 + core::kFingerprintBytes * v.size();
  }
  Status Check(const std::vector<core::Fingerprint>& v, const Label& label) const {
    if (v.size() < min) return Empty(label);
    if (v.size() > max) return TooManyItems(label, v.size(), max).value();
    for (core::Fingerprint fp : v) {
      if (fp > core::kFingerprintMask) {
        return FieldErr(ErrorCode::kOutOfRange, label, "value wider than 56 bits").value();
      }
    }
    return Status::Ok();
  }
  bool Read(const msgpack::object& o, const Label& label, std::vector<core::Fingerprint>& out,
            Status& error) const {
    Result<std::span<const std::uint8_t>> bin = GetFingerprintBin(o, label, max);
    if (!bin) return Fail(bin.error(), error);
    if (bin->size() / core::kFingerprintBytes < min) return Fail(Empty(label), error);
    LoadFingerprints(*bin, out);
    return true;
  }
  // A release of nothing can only be a sender bug (a keep-alive is a Renewal's job).
  static Status Empty(const Label& label) {
    return FieldErr(ErrorCode::kProtocol, label, "empty").value();
  }
};

// Block ids as one bin of little-endian u32 values, at most `max` of them.
struct BlockIdsRule {
  static constexpr std::size_t kBytes = 4;
  std::size_t max;
  void Pack(Packer& pk, std::vector<std::uint8_t>& out, const std::vector<core::BlockId>& v) const {
    pk.pack_bin(static_cast<std::uint32_t>(v.size() * kBytes));
    const std::size_t at = out.size();
    out.resize(at + v.size() * kBytes);
    std::uint8_t* p = out.data() + at;
    for (core::BlockId b : v) {
      p[0] = static_cast<std::uint8_t>(b);
      p[1] = static_cast<std::uint8_t>(b >> 8);
      p[2] = static_cast<std::uint8_t>(b >> 16);
      p[3] = static_cast<std::uint8_t>(b >> 24);
      p += kBytes;
    }
  }
  std::size_t Size(const std::vector<core::BlockId>& v) const { return 5 + kBytes * v.size(); }
  Status Check(const std::vector<core::BlockId>& v, const Label& label) const {
    if (v.size() > max) return TooManyItems(label, v.size(), max).value();
    return Status::Ok();
  }
  bool Read(const msgpack::object& o, const Label& label, std::vector<core::BlockId>& out,
            Status& error) const {
    Result<std::span<const std::uint8_t>> bin = GetBin(o, label, max * kBytes);
    if (!bin) return Fail(bin.error(), error);
    if (bin->size() % kBytes != 0) {
      return Fail(FieldErr(ErrorCode::kProtocol, label,
                           "bin length " + std::to_string(bin->size()) +
                               " is not a multiple of 4 (little-endian u32 block ids)")
                      .value(),
                  error);
    }
    const std::size_t n = bin->size() / kBytes;
    out.resize(n);
    if constexpr (std::endian::native == std::endian::little) {
      if (n != 0) std::memcpy(out.data(), bin->data(), n * kBytes);
    } else {
      for (std::size_t b = 0; b < n; ++b) out[b] = LoadLe32(bin->data() + b * kBytes);
    }
    return true;
  }
};

// std::optional<T> of an inner rule: written when it holds a value (use kOmittedWhenDefault).
template <class Inner>
struct OptionalRule {
  Inner inner;
  template <class T>
  void Pack(Packer& pk, std::vector<std::uint8_t>& out, const std::optional<T>& v) const {
    inner.Pack(pk, out, *v);
  }
  template <class T>
  std::size_t Size(const std::optional<T>& v) const {
    return v ? inner.Size(*v) : 0;
  }
  template <class T>
  Status Check(const std::optional<T>& v, const Label& label) const {
    return v ? inner.Check(*v, label) : Status::Ok();
  }
  template <class T>
  bool Read(const msgpack::object& o, const Label& label, std::optional<T>& out,
            Status& error) const {
    T value{};
    if (!inner.Read(o, label, value, error)) return false;
    out = std::move(value);
    return true;
  }
};

// A list of `min`..`max` values of one rule, as a msgpack array; `item` names an element in
// errors ("field 'ok'[3].d_req_id").
template <class Item>
struct ListRule {
  Item rule;
  const char* item;
  std::size_t min = 0;
  std::size_t max;
  template <class T>
  void Pack(Packer& pk, std::vector<std::uint8_t>& out, const std::vector<T>& v) const {
    pk.pack_array(static_cast<std::uint32_t>(v.size()));
    for (const T& x : v) rule.Pack(pk, out, x);
  }
  template <class T>
  std::size_t Size(const std::vector<T>& v) const {
    std::size_t n = 5;
    for (const T& x : v) n += rule.Size(x);
    return n;
  }
  template <class T>
  Status Check(const std::vector<T>& v, const Label& label) const {
    if (v.size() < min) return TooFewItems(label, v.size(), min).value();
    if (v.size() > max) return TooManyItems(label, v.size(), max).value();
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (Status s = rule.Check(v[i], Label{label.key, item, i}); !s.ok()) return s;
    }
    return Status::Ok();
  }
  template <class T>
  bool Read(const msgpack::object& o, const Label& label, std::vector<T>& out,
            Status& error) const {
    Result<std::span<const msgpack::object>> items = GetArray(o, label, max, min);
    if (!items) return Fail(items.error(), error);
    out.resize(items->size());
    for (std::size_t i = 0; i < items->size(); ++i) {
      if (!rule.Read((*items)[i], Label{label.key, item, i}, out[i], error)) return false;
    }
    return true;
  }
};

// One positional element of an entry: its name in errors, the member and its rule.
template <class Entry, class T, class Rule>
struct Column {
  const char* name;
  T Entry::*member;
  Rule rule;
  Presence presence = Presence::kRequired;
};

// A list of `min`..`max` entries, each a msgpack array of the columns in order. Trailing
// kOmittedWhenDefault columns are left out when default; elements past the known columns are
// ignored; an entry needs at least the required columns (and at most kMaxMapKeys elements).
template <class Entry, class... Columns>
struct EntryList {
  std::size_t min = 0;
  std::size_t max;
  std::tuple<Columns...> columns;

  void Pack(Packer& pk, std::vector<std::uint8_t>& out, const std::vector<Entry>& v) const {
    pk.pack_array(static_cast<std::uint32_t>(v.size()));
    for (const Entry& e : v) {
      std::size_t n = 0;
      std::size_t written = 0;
      std::apply(
          [&](const auto&... c) {
            ((++n, written = (c.presence == Presence::kRequired || !IsDefault(e.*(c.member)))
                                 ? n
                                 : written),
             ...);
          },
          columns);
      pk.pack_array(static_cast<std::uint32_t>(written));
      std::size_t at = 0;
      std::apply(
          [&](const auto&... c) {
            ((at++ < written ? c.rule.Pack(pk, out, e.*(c.member)) : void()), ...);
          },
          columns);
    }
  }
  std::size_t Size(const std::vector<Entry>& v) const {
    std::size_t n = 5;
    for (const Entry& e : v) {
      n += 1;
      std::apply([&](const auto&... c) { ((n += c.rule.Size(e.*(c.member))), ...); }, columns);
    }
    return n;
  }
  Status Check(const std::vector<Entry>& v, const Label& label) const {
    if (v.size() < min) return TooFewItems(label, v.size(), min).value();
    if (v.size() > max) return TooManyItems(label, v.size(), max).value();
    for (std::size_t i = 0; i < v.size(); ++i) {
      Status status;
      std::apply(
          [&](const auto&... c) {
            ((status.ok()
                  ? (void)(status = c.rule.Check(v[i].*(c.member), Label{label.key, c.name, i}))
                  : void()),
             ...);
          },
          columns);
      if (!status.ok()) return status;
    }
    return Status::Ok();
  }
  bool Read(const msgpack::object& o, const Label& label, std::vector<Entry>& out,
            Status& error) const {
    Result<std::span<const msgpack::object>> items = GetArray(o, label, max, min);
    if (!items) return Fail(items.error(), error);
    out.resize(items->size());
    for (std::size_t i = 0; i < items->size(); ++i) {
      Result<std::span<const msgpack::object>> e =
          GetArray((*items)[i], Label{label.key, "", i}, kMaxMapKeys, RequiredCount());
      if (!e) return Fail(e.error(), error);
      bool ok = true;
      std::size_t at = 0;
      std::apply(
          [&](const auto&... c) {
            ((ok = ok && (at >= e->size() || c.rule.Read((*e)[at], Label{label.key, c.name, i},
                                                         out[i].*(c.member), error)),
              ++at),
             ...);
          },
          columns);
      if (!ok) return false;
    }
    return true;
  }
  std::size_t RequiredCount() const {
    std::size_t n = 0;
    std::apply([&](const auto&... c) { ((n += c.presence == Presence::kRequired ? 1 : 0), ...); },
               columns);
    return n;
  }
};

// ---------------------------------------------------------------------------------------------
// Fields and schemas

// When a key means something: `holds` reads members of fields declared before it (the decoder
// reads fields in order). Where it does not hold, the field is never written nor checked, and a
// key that arrives anyway is skipped like an unknown key (`refusal` nullptr) or refused with
// kProtocol and `refusal`. Default: always.
template <class Msg>
struct When {
  bool (*holds)(const Msg&) = nullptr;
  const char* refusal = nullptr;
  bool operator()(const Msg& msg) const { return holds == nullptr || holds(msg); }
};

// One key of a message: its label (key and name), the member it fills, its rule, presence and
// condition.
template <class Msg, class T, class Rule>
struct Field {
  Label label;
  T Msg::*member;
  Rule rule;
  Presence presence = Presence::kRequired;
  When<Msg> when = {};

  bool Written(const Msg& msg) const {
    return when(msg) && (presence == Presence::kRequired || !IsDefault(msg.*member));
  }
};

// Deduction guides: clang before 17 does not deduce an aggregate's arguments by itself.
template <class Msg, class T, class Rule>
Field(Label, T Msg::*, Rule) -> Field<Msg, T, Rule>;
template <class Msg, class T, class Rule>
Field(Label, T Msg::*, Rule, Presence) -> Field<Msg, T, Rule>;
template <class Msg, class T, class Rule>
Field(Label, T Msg::*, Rule, Presence, When<Msg>) -> Field<Msg, T, Rule>;

template <class Msg, class... F>
struct Schema {
  MessageType type;
  const ScanLimits* limits;
  // false: the message answers nothing and carries no id (AbortNotice): none is written, and
  // one that arrives must still be a uint but is ignored.
  bool has_id;
  // The rules relating fields, run on the struct by Validate and after decoding; nullptr: none.
  Status (*relations)(const Msg&);
  std::tuple<F...> fields;
  // "t", "v", "id", then the fields' labels in order: what Fields<N> collects.
  std::array<Label, 3 + sizeof...(F)> labels;
};

template <class Msg, class... F>
constexpr Schema<Msg, F...> MakeSchema(MessageType type, const ScanLimits& limits, bool has_id,
                                       Status (*relations)(const Msg&), F... fields) {
  return Schema<Msg, F...>{type,
                           &limits,
                           has_id,
                           relations,
                           std::tuple<F...>(fields...),
                           {kTypeLabel, kVersionLabel, kIdLabel, fields.label...}};
}

template <class Msg, class... F>
std::vector<std::uint8_t> EncodeWith(const Schema<Msg, F...>& schema, const Msg& msg) {
  std::size_t keys = 0;
  std::size_t estimate = 24;
  std::apply(
      [&](const auto&... f) {
        ((f.Written(msg) ? (void)(++keys, estimate += 4 + f.rule.Size(msg.*(f.member))) : void()),
         ...);
      },
      schema.fields);
  std::vector<std::uint8_t> out;
  out.reserve(estimate);
  VecBuffer buf{&out};
  Packer pk(buf);
  std::uint64_t id = 0;
  if constexpr (requires { msg.id; }) id = schema.has_id ? msg.id : 0;
  PackHeader(pk, static_cast<std::uint32_t>(keys), schema.type, id);
  std::apply(
      [&](const auto&... f) {
        ((f.Written(msg) ? (void)(PackKey(pk, f.label.key), f.rule.Pack(pk, out, msg.*(f.member)))
                         : void()),
         ...);
      },
      schema.fields);
  return out;
}

template <class Msg, class... F>
Status ValidateWith(const Schema<Msg, F...>& schema, const Msg& msg) {
  // A field left out when default is not on the wire: nothing of it to check.
  Status status;
  std::apply(
      [&](const auto&... f) {
        ((status.ok() && f.Written(msg) ? (void)(status = f.rule.Check(msg.*(f.member), f.label))
                                        : void()),
         ...);
      },
      schema.fields);
  if (!status.ok()) return status;
  return schema.relations != nullptr ? schema.relations(msg) : Status::Ok();
}

template <class Msg, class T, class Rule>
bool ReadField(const Field<Msg, T, Rule>& f, const msgpack::object& value, Msg& msg,
               Status& error) {
  if (!f.when(msg)) {
    return f.when.refusal == nullptr || Fail(Status(ErrorCode::kProtocol, f.when.refusal), error);
  }
  return f.rule.Read(value, f.label, msg.*(f.member), error);
}

template <class Msg, class... F>
Result<Msg> DecodeWith(const Schema<Msg, F...>& schema, const std::uint8_t* data,
                       std::size_t size) {
  constexpr std::size_t kCount = 3 + sizeof...(F);
  Msg msg{};
  msgpack::object_handle handle;
  Fields<kCount> found{schema.labels};
  std::uint64_t id = 0;
  if (Status s = Parse(data, size, schema.type, *schema.limits, handle, found, id); !s.ok()) {
    return tl::unexpected(std::move(s));
  }
  if constexpr (requires { msg.id; }) msg.id = schema.has_id ? id : 0;
  // Every required key first, then each value: a message missing a key is named for that.
  Status status;
  std::size_t i = 3;
  std::apply(
      [&](const auto&... f) {
        ((status.ok() && found[i] == nullptr && f.presence == Presence::kRequired
              ? (void)(status = found.Missing(i).value())
              : void(),
          ++i),
         ...);
      },
      schema.fields);
  if (!status.ok()) return tl::unexpected(std::move(status));
  i = 3;
  bool ok = true;
  std::apply(
      [&](const auto&... f) {
        ((ok = ok && (found[i] == nullptr || ReadField(f, *found[i], msg, status)), ++i), ...);
      },
      schema.fields);
  if (!ok) return tl::unexpected(std::move(status));
  if (schema.relations != nullptr) {
    if (Status s = schema.relations(msg); !s.ok()) return tl::unexpected(std::move(s));
  }
  return msg;
}

}  // namespace kvferry::wire::internal
