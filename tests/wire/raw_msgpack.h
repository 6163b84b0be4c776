// Test-only msgpack writer for hand-made (often malformed) frames: the codec's own encoders
// cannot produce wrong types, odd key orders or lying sizes, and tests must.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <span>
#include <string_view>
#include <vector>

namespace kvferry::wire::testing {

class Raw {
 public:
  Raw& Byte(std::uint8_t b) {
    out_.push_back(b);
    return *this;
  }
  Raw& Bytes(std::initializer_list<std::uint8_t> bs) {
    out_.insert(out_.end(), bs.begin(), bs.end());
    return *this;
  }
  Raw& Append(const std::vector<std::uint8_t>& bs) {
    out_.insert(out_.end(), bs.begin(), bs.end());
    return *this;
  }
  Raw& Map(std::uint32_t n) { return n < 16 ? Byte(0x80 | n) : Header(0xde, 0xdf, n); }
  Raw& Array(std::uint32_t n) { return n < 16 ? Byte(0x90 | n) : Header(0xdc, 0xdd, n); }
  Raw& Str(std::string_view s) {
    if (s.size() < 32) {
      Byte(static_cast<std::uint8_t>(0xa0 | s.size()));
    } else {
      Byte(0xd9 + (s.size() > 0xff) + (s.size() > 0xffff));
      Be(s.size(), s.size() > 0xffff ? 4 : (s.size() > 0xff ? 2 : 1));
    }
    out_.insert(out_.end(), s.begin(), s.end());
    return *this;
  }
  Raw& Bin(const std::vector<std::uint8_t>& b) {
    Byte(0xc4 + (b.size() > 0xff) + (b.size() > 0xffff));
    Be(b.size(), b.size() > 0xffff ? 4 : (b.size() > 0xff ? 2 : 1));
    return Append(b);
  }
  Raw& Uint(std::uint64_t v) {
    if (v < 128) return Byte(static_cast<std::uint8_t>(v));
    if (v <= 0xff) return Byte(0xcc).Be(v, 1);
    if (v <= 0xffff) return Byte(0xcd).Be(v, 2);
    if (v <= 0xffffffff) return Byte(0xce).Be(v, 4);
    return Byte(0xcf).Be(v, 8);
  }
  Raw& Nil() { return Byte(0xc0); }
  Raw& Bool(bool b) { return Byte(b ? 0xc3 : 0xc2); }
  // {"t": type, "v": version} opening a map of `keys` keys (t and v included).
  Raw& Head(std::uint32_t keys, std::uint64_t type, std::uint64_t version = 1) {
    return Map(keys).Str("t").Uint(type).Str("v").Uint(version);
  }
  const std::vector<std::uint8_t>& bytes() const { return out_; }
  operator const std::vector<std::uint8_t>&() const { return out_; }  // NOLINT
  operator std::span<const std::uint8_t>() const { return out_; }     // NOLINT

 private:
  Raw& Header(std::uint8_t b16, std::uint8_t b32, std::uint32_t n) {
    return n <= 0xffff ? Byte(b16).Be(n, 2) : Byte(b32).Be(n, 4);
  }
  Raw& Be(std::uint64_t v, int n) {
    for (int i = n - 1; i >= 0; --i) out_.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
    return *this;
  }
  std::vector<std::uint8_t> out_;
};

}  // namespace kvferry::wire::testing
