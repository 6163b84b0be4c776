#include "wire/scan.h"

#include <array>
#include <string>

namespace kvferry::wire::internal {
namespace {

std::uint64_t LoadBig(const std::uint8_t* p, int n) {
  std::uint64_t v = 0;
  for (int i = 0; i < n; ++i) v = (v << 8) | p[i];
  return v;
}

Status Truncated(std::size_t pos) {
  return Status(ErrorCode::kProtocol, "truncated msgpack at byte " + std::to_string(pos));
}

Status OverLimit(const char* what, std::uint64_t n, std::uint64_t limit, std::size_t pos) {
  return Status(ErrorCode::kOutOfRange, std::string(what) + " of " + std::to_string(n) +
                                            " at byte " + std::to_string(pos) + " exceeds limit " +
                                            std::to_string(limit));
}

}  // namespace

Status ReadHeader(const std::uint8_t* data, std::size_t size, std::size_t& pos, Header& out) {
  if (pos >= size) return Truncated(pos);
  const std::uint8_t b = data[pos];
  const std::size_t left = size - pos - 1;  // bytes after the type byte
  // A header whose value or length follows in n big-endian bytes.
  auto fixed = [&](Kind kind, int n) -> Status {
    if (left < static_cast<std::size_t>(n)) return Truncated(pos);
    out.kind = kind;
    out.value = LoadBig(data + pos + 1, n);
    pos += 1 + static_cast<std::size_t>(n);
    return Status::Ok();
  };
  if (b <= 0x7f) {
    out = {Kind::kUint, b};
    ++pos;
    return Status::Ok();
  }
  if (b >= 0xe0) {
    out = {Kind::kInt,
           static_cast<std::uint64_t>(static_cast<std::int64_t>(static_cast<std::int8_t>(b)))};
    ++pos;
    return Status::Ok();
  }
  if (b <= 0x8f) {
    out = {Kind::kMap, static_cast<std::uint64_t>(b & 0x0f)};
    ++pos;
    return Status::Ok();
  }
  if (b <= 0x9f) {
    out = {Kind::kArray, static_cast<std::uint64_t>(b & 0x0f)};
    ++pos;
    return Status::Ok();
  }
  if (b <= 0xbf) {
    out = {Kind::kStr, static_cast<std::uint64_t>(b & 0x1f)};
    ++pos;
    return Status::Ok();
  }
  switch (b) {
    case 0xc0:
      out = {Kind::kNil, 0};
      ++pos;
      return Status::Ok();
    case 0xc2:
      out = {Kind::kBool, 0};
      ++pos;
      return Status::Ok();
    case 0xc3:
      out = {Kind::kBool, 1};
      ++pos;
      return Status::Ok();
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
      Status s = fixed(Kind::kExt, n);
      if (s.ok()) out.value += 1;
      return s;
    }
    case 0xca: {
      Status s = fixed(Kind::kFloat, 4);
      out.value = 0;
      return s;
    }
    case 0xcb: {
      Status s = fixed(Kind::kFloat, 8);
      out.value = 0;
      return s;
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
      Status s = fixed(Kind::kInt, n);
      if (!s.ok()) return s;
      // Sign-extend; msgpack-cxx (and so our decoders) treat a non-negative intN as a uint.
      const int shift = 64 - 8 * n;
      const auto v = static_cast<std::int64_t>(out.value << shift) >> shift;
      out.value = static_cast<std::uint64_t>(v);
      if (v >= 0) out.kind = Kind::kUint;
      return Status::Ok();
    }
    case 0xd4:
    case 0xd5:
    case 0xd6:
    case 0xd7:
    case 0xd8:  // fixext 1..16 (+1 type byte)
      out = {Kind::kExt, (std::uint64_t{1} << (b - 0xd4)) + 1};
      ++pos;
      return Status::Ok();
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
      return Status(ErrorCode::kProtocol,
                    "invalid msgpack byte 0xc1 at byte " + std::to_string(pos));
  }
}

Status SkipObject(const std::uint8_t* data, std::size_t size, std::size_t& pos,
                  const ScanLimits& limits, std::uint32_t depth_above, std::size_t& objects) {
  // Items still to read in each open container; the bottom entry is the object itself.
  std::array<std::uint64_t, 1 + 64> pending{};
  const std::uint32_t max_open = limits.depth < 64 ? limits.depth : 64;
  std::uint32_t open = 0;  // containers opened by this call
  pending[0] = 1;
  while (true) {
    while (pending[open] == 0) {
      if (open == 0) return Status::Ok();
      --open;
    }
    --pending[open];
    const std::size_t at = pos;
    Header h;
    if (Status s = ReadHeader(data, size, pos, h); !s.ok()) return s;
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

Status ScanFrame(const std::uint8_t* data, std::size_t size, const ScanLimits& limits) {
  std::size_t pos = 0;
  std::size_t objects = 0;
  if (Status s = SkipObject(data, size, pos, limits, 0, objects); !s.ok()) return s;
  if (pos != size) {
    return Status(ErrorCode::kProtocol, std::to_string(size - pos) +
                                            " trailing bytes after the message at byte " +
                                            std::to_string(pos));
  }
  return Status::Ok();
}

}  // namespace kvferry::wire::internal
