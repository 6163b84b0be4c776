// The out-of-line parts of codec.h: the unpack step, the header checks, and every error path.
#include "wire/codec.h"

#include <exception>

namespace kvferry::wire::internal {

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

void PackFingerprints(Packer& pk, std::vector<std::uint8_t>& out,
                      std::span<const core::Fingerprint> fingerprints) {
  const std::size_t n = fingerprints.size();
  pk.pack_bin(static_cast<std::uint32_t>(n * core::kFingerprintBytes));
  const std::size_t at = out.size();
  out.resize(at + n * core::kFingerprintBytes);
  std::uint8_t* p = out.data() + at;
  for (core::Fingerprint fp : fingerprints) {
    for (int i = 0; i < core::kFingerprintBytes; ++i)
      *p++ = static_cast<std::uint8_t>(fp >> (8 * i));
  }
}

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

std::string Label::str() const {
  if (index == std::numeric_limits<std::size_t>::max()) {
    return "field '" + std::string(key) + "' (" + name + ")";
  }
  return "field '" + std::string(key) + "'[" + std::to_string(index) + "]." + name;
}

tl::unexpected<Status> FieldErr(ErrorCode code, const Label& label, const std::string& what) {
  return Err(code, label.str() + ": " + what);
}
tl::unexpected<Status> WrongType(const Label& label, const char* want, const msgpack::object& o) {
  return FieldErr(ErrorCode::kProtocol, label,
                  std::string("expected ") + want + ", got " + TypeName(o.type));
}
tl::unexpected<Status> TooLarge(const Label& label, std::uint64_t value, std::uint64_t max) {
  return FieldErr(ErrorCode::kOutOfRange, label,
                  std::to_string(value) + " exceeds " + std::to_string(max));
}
tl::unexpected<Status> TooLong(const Label& label, std::size_t length, std::size_t max) {
  return FieldErr(ErrorCode::kOutOfRange, label,
                  "length " + std::to_string(length) + " exceeds " + std::to_string(max));
}
tl::unexpected<Status> TooManyItems(const Label& label, std::size_t items, std::size_t max) {
  return FieldErr(ErrorCode::kOutOfRange, label,
                  std::to_string(items) + " items exceed " + std::to_string(max));
}
tl::unexpected<Status> TooFewItems(const Label& label, std::size_t items, std::size_t min) {
  return FieldErr(ErrorCode::kProtocol, label,
                  std::to_string(items) + " items, need at least " + std::to_string(min));
}

Result<std::span<const std::uint8_t>> GetFingerprintBin(const msgpack::object& o,
                                                        const Label& label, std::size_t max_count) {
  std::span<const std::uint8_t> bin;
  KVF_ASSIGN(bin, GetBin(o, label, max_count * core::kFingerprintBytes));
  if (bin.size() % core::kFingerprintBytes != 0) {
    return FieldErr(ErrorCode::kProtocol, label,
                    "bin length " + std::to_string(bin.size()) +
                        " is not a multiple of 7 (little-endian 56-bit fingerprints)");
  }
  return bin;
}

void LoadFingerprints(std::span<const std::uint8_t> bin, std::vector<core::Fingerprint>& out) {
  const std::size_t n = bin.size() / core::kFingerprintBytes;
  out.resize(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = LoadLe56(bin.data() + i * core::kFingerprintBytes);
}

Status Unpack(const std::uint8_t* data, std::size_t size, const ScanLimits& limits,
              msgpack::object_handle& handle) {
  if (size > kMaxFrameBytes) {
    return Status(ErrorCode::kOutOfRange, "frame of " + std::to_string(size) +
                                              " bytes exceeds limit " +
                                              std::to_string(kMaxFrameBytes));
  }
  if (size == 0 || data == nullptr) return Status(ErrorCode::kProtocol, "empty frame");
  if (Status s = ScanFrame(data, size, limits); !s.ok()) return s;
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
  return Status::Ok();
}

Status CheckHeader(const msgpack::object* type, const msgpack::object* version,
                   const msgpack::object* id_value, const Label* duplicate, MessageType want,
                   std::uint64_t& id) {
  // Version first: a newer peer may have changed anything else.
  if (version == nullptr) return FieldErr(ErrorCode::kProtocol, kVersionLabel, "missing").value();
  if (version->type != msgpack::type::POSITIVE_INTEGER) {
    return WrongType(kVersionLabel, "uint", *version).value();
  }
  if (version->via.u64 == 0 || version->via.u64 > kProtocolVersion) {
    return Status(ErrorCode::kProtocol, "unsupported version " + std::to_string(version->via.u64));
  }
  if (type == nullptr) return FieldErr(ErrorCode::kProtocol, kTypeLabel, "missing").value();
  if (type->type != msgpack::type::POSITIVE_INTEGER) {
    return WrongType(kTypeLabel, "uint", *type).value();
  }
  const std::uint64_t t = type->via.u64;
  if (t != static_cast<std::uint64_t>(want)) {
    const std::string got = t >= 1 && t <= kMaxMessageType
                                ? std::string(ToString(static_cast<MessageType>(t)))
                                : std::string("unknown");
    const std::string_view name = ToString(want);
    const bool vowel = name.find_first_of("aeiou") == 0;
    return Status(ErrorCode::kProtocol, "message type " + std::to_string(t) + " (" + got +
                                            ") is not " + (vowel ? "an " : "a ") +
                                            std::string(name));
  }
  if (duplicate != nullptr) {
    return FieldErr(ErrorCode::kProtocol, *duplicate, "duplicate key").value();
  }
  id = 0;
  if (id_value != nullptr) {
    auto value = GetUint(*id_value, kIdLabel);
    if (!value) return value.error();
    id = *value;
  }
  return Status::Ok();
}

}  // namespace kvferry::wire::internal
