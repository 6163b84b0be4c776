#include "wire/scan.h"

#include <array>
#include <string>
#include <string_view>

namespace kvferry::wire::internal {
namespace {

std::uint64_t LoadBig(const std::uint8_t* p, int n) {
  std::uint64_t v = 0;
  for (int i = 0; i < n; ++i) v = (v << 8) | p[i];
  return v;
}

Fault Truncated(std::size_t pos) { return {Fault::Kind::kTruncated, pos}; }

Fault OverLimit(const char* what, std::uint64_t n, std::uint64_t limit, std::size_t pos) {
  return {Fault::Kind::kOverLimit, pos, what, n, limit};
}

}  // namespace

Status ToStatus(const Fault& fault) {
  switch (fault.kind) {
    case Fault::Kind::kNone:
      return Status::Ok();
    case Fault::Kind::kTruncated:
      return Status(ErrorCode::kProtocol, "truncated msgpack at byte " + std::to_string(fault.pos));
    case Fault::Kind::kReservedByte:
      return Status(ErrorCode::kProtocol,
                    "invalid msgpack byte 0xc1 at byte " + std::to_string(fault.pos));
    case Fault::Kind::kOverLimit:
      return Status(ErrorCode::kOutOfRange, std::string(fault.what) + " of " +
                                                std::to_string(fault.value) + " at byte " +
                                                std::to_string(fault.pos) + " exceeds limit " +
                                                std::to_string(fault.limit));
  }
  return Status(ErrorCode::kInternal, "unknown scan fault");
}

Fault ReadHeader(const std::uint8_t* data, std::size_t size, std::size_t& pos, Header& out) {
  if (pos >= size) return Truncated(pos);
  const std::uint8_t b = data[pos];
  const std::size_t left = size - pos - 1;  // bytes after the type byte
  // A header whose value or length follows in n big-endian bytes.
  auto fixed = [&](Kind kind, int n) -> Fault {
    if (left < static_cast<std::size_t>(n)) return Truncated(pos);
    out.kind = kind;
    out.value = LoadBig(data + pos + 1, n);
    pos += 1 + static_cast<std::size_t>(n);
    return {};
  };
  if (b <= 0x7f) {
    out = {Kind::kUint, b};
    ++pos;
    return {};
  }
  if (b >= 0xe0) {
    out = {Kind::kInt,
           static_cast<std::uint64_t>(static_cast<std::int64_t>(static_cast<std::int8_t>(b)))};
    ++pos;
    return {};
  }
  if (b <= 0x8f) {
    out = {Kind::kMap, static_cast<std::uint64_t>(b & 0x0f)};
    ++pos;
    return {};
  }
  if (b <= 0x9f) {
    out = {Kind::kArray, static_cast<std::uint64_t>(b & 0x0f)};
    ++pos;
    return {};
  }
  if (b <= 0xbf) {
    out = {Kind::kStr, static_cast<std::uint64_t>(b & 0x1f)};
    ++pos;
    return {};
  }
  switch (b) {
    case 0xc0:
      out = {Kind::kNil, 0};
      ++pos;
      return {};
    case 0xc2:
      out = {Kind::kBool, 0};
      ++pos;
      return {};
    case 0xc3:
      out = {Kind::kBool, 1};
      ++pos;
      return {};
    case 0xc4:
      return fixed(Kind::kBin, 1);
    case 0xc5:
      return fixed(Kind::kBin, 2);
    case 0xc6:
      return fixed(Kind::kBin, 4);
    case 0xc7:  // ext8/16/32: length, then a type byte that belongs to the payload here
    case 0xc8:
    case 0xc9: {
      const int n = b == 0xc7 ? 1 : (b == 0xc8 ? 2 : 4);
      Fault f = fixed(Kind::kExt, n);
      if (f.ok()) out.value += 1;
      return f;
    }
    case 0xca: {
      Fault f = fixed(Kind::kFloat, 4);
      out.value = 0;
      return f;
    }
    case 0xcb: {
      Fault f = fixed(Kind::kFloat, 8);
      out.value = 0;
      return f;
    }
    case 0xcc:
      return fixed(Kind::kUint, 1);
    case 0xcd:
      return fixed(Kind::kUint, 2);
    case 0xce:
      return fixed(Kind::kUint, 4);
    case 0xcf:
      return fixed(Kind::kUint, 8);
    case 0xd0:
    case 0xd1:
    case 0xd2:
    case 0xd3: {
      const int n = 1 << (b - 0xd0);
      Fault f = fixed(Kind::kInt, n);
      if (!f.ok()) return f;
      // Sign-extend; msgpack-cxx (and so our decoders) treat a non-negative intN as a uint.
      const int shift = 64 - 8 * n;
      const auto v = static_cast<std::int64_t>(out.value << shift) >> shift;
      out.value = static_cast<std::uint64_t>(v);
      if (v >= 0) out.kind = Kind::kUint;
      return {};
    }
    case 0xd4:
    case 0xd5:
    case 0xd6:
    case 0xd7:
    case 0xd8:  // fixext 1..16 (+1 type byte)
      out = {Kind::kExt, (std::uint64_t{1} << (b - 0xd4)) + 1};
      ++pos;
      return {};
    case 0xd9:
      return fixed(Kind::kStr, 1);
    case 0xda:
      return fixed(Kind::kStr, 2);
    case 0xdb:
      return fixed(Kind::kStr, 4);
    case 0xdc:
      return fixed(Kind::kArray, 2);
    case 0xdd:
      return fixed(Kind::kArray, 4);
    case 0xde:
      return fixed(Kind::kMap, 2);
    case 0xdf:
      return fixed(Kind::kMap, 4);
    default:  // 0xc1 is reserved
      return {Fault::Kind::kReservedByte, pos};
  }
}

Fault SkipObject(const std::uint8_t* data, std::size_t size, std::size_t& pos,
                 const ScanLimits& limits, std::uint32_t depth_above, std::size_t& objects) {
  // Items still to read in each open container; the bottom entry is the object itself.
  std::array<std::uint64_t, 1 + 64> pending{};
  const std::uint32_t max_open = limits.depth < 64 ? limits.depth : 64;
  std::uint32_t open = 0;  // containers opened by this call
  pending[0] = 1;
  while (true) {
    while (pending[open] == 0) {
      if (open == 0) return {};
      --open;
    }
    --pending[open];
    const std::size_t at = pos;
    Header h;
    if (Fault f = ReadHeader(data, size, pos, h); !f.ok()) return f;
    if (++objects > limits.objects) return OverLimit("object count", objects, limits.objects, at);
    const std::size_t left = size - pos;
    switch (h.kind) {
      case Kind::kStr:
      case Kind::kBin:
      case Kind::kExt: {
        const std::uint32_t limit =
            h.kind == Kind::kStr ? limits.str : (h.kind == Kind::kBin ? limits.bin : limits.ext);
        const char* what = h.kind == Kind::kStr
                               ? "str length"
                               : (h.kind == Kind::kBin ? "bin length" : "ext length");
        if (h.value > limit) return OverLimit(what, h.value, limit, at);
        if (h.value > left) return Truncated(at);
        pos += h.value;
        break;
      }
      case Kind::kArray:
      case Kind::kMap: {
        const bool is_map = h.kind == Kind::kMap;
        const std::uint32_t limit = is_map ? limits.map : limits.array;
        if (h.value > limit) {
          return OverLimit(is_map ? "map size" : "array size", h.value, limit, at);
        }
        const std::uint64_t items = is_map ? 2 * h.value : h.value;
        // Every item takes at least one byte: a count beyond the bytes left is a lie.
        if (items > left) return Truncated(at);
        if (depth_above + open + 1 > max_open) {
          return OverLimit("nesting depth", depth_above + open + 1, limits.depth, at);
        }
        pending[++open] = items;
        break;
      }
      default:
        break;
    }
  }
}

namespace {

// The top-level key whose value holds `fault`, for ScanFrame's reason: once the map header
// passed (the fault is past byte 0), the same walk again (same order, depth and object count,
// so the same value fails first), remembering keys. Empty when the fault is in the map header or
// a key, or the key is not a short printable str. Runs only on the error path.
std::string_view FaultyTopLevelKey(const std::uint8_t* data, std::size_t size,
                                   const ScanLimits& limits, const Fault& fault) {
  constexpr std::size_t kMaxKeyShown = 16;
  if (fault.pos == 0) return {};
  std::size_t pos = 0;
  Header map;
  if (!ReadHeader(data, size, pos, map).ok() || map.kind != Kind::kMap) return {};
  std::size_t objects = 1;
  for (std::uint64_t i = 0; i < map.value; ++i) {
    std::size_t after_header = pos;
    Header key;
    if (!ReadHeader(data, size, after_header, key).ok()) return {};
    if (!SkipObject(data, size, pos, limits, 1, objects).ok()) return {};
    const std::size_t value_at = pos;
    if (!SkipObject(data, size, pos, limits, 1, objects).ok()) {
      if (fault.pos < value_at || key.kind != Kind::kStr || key.value == 0 ||
          key.value > kMaxKeyShown) {
        return {};
      }
      const std::string_view text(reinterpret_cast<const char*>(data + after_header), key.value);
      for (char c : text) {
        if (c < 0x21 || c > 0x7e) return {};
      }
      return text;
    }
  }
  return {};
}

}  // namespace

Status ScanFrame(const std::uint8_t* data, std::size_t size, const ScanLimits& limits) {
  std::size_t pos = 0;
  std::size_t objects = 0;
  if (Fault f = SkipObject(data, size, pos, limits, 0, objects); !f.ok()) {
    Status s = ToStatus(f);
    const std::string_view key = FaultyTopLevelKey(data, size, limits, f);
    if (key.empty()) return s;
    return Status(s.code(), "field '" + std::string(key) + "': " + s.message());
  }
  if (pos != size) {
    return Status(ErrorCode::kProtocol, std::to_string(size - pos) +
                                            " trailing bytes after the message at byte " +
                                            std::to_string(pos));
  }
  return Status::Ok();
}

}  // namespace kvferry::wire::internal
