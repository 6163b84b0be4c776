// Internal to the wire module: a tiny hand-written msgpack reader that never allocates (only
// turning a Fault into a Status formats a message).
//
// It serves two purposes. PeekType() reads a message's "t"/"v", and PeekId() its "id", without
// decoding the rest. And every decoder first runs ScanFrame() over the whole frame: it checks
// structure, depth and every declared size against the remaining bytes and the limits *before*
// msgpack-cxx builds objects, so a hostile header such as `dd e4 6d dc 5b 6d` (an array32
// declaring 3.8 G items) is refused in nanoseconds instead of asking the allocator for 128 GiB.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kvferry/status.h"

namespace kvferry::wire::internal {

struct ScanLimits {
  std::uint32_t array = 0;  // items per array
  std::uint32_t map = 0;    // pairs per map
  std::uint32_t str = 0;    // bytes per str
  std::uint32_t bin = 0;    // bytes per bin
  std::uint32_t ext = 0;    // bytes per ext (payload)
  std::uint32_t depth = 0;  // nested containers, the outermost counting as 1
  std::size_t objects = 0;  // msgpack objects in the frame (bounds msgpack-cxx's zone memory)
};

enum class Kind : std::uint8_t { kNil, kBool, kUint, kInt, kFloat, kStr, kBin, kExt, kArray, kMap };

// One decoded msgpack header. For kUint/kInt/kBool `value` is the value (kInt: two's complement
// of a negative number); for kStr/kBin/kExt the payload length (payload at `pos` after reading);
// for kArray/kMap the item/pair count.
struct Header {
  Kind kind = Kind::kNil;
  std::uint64_t value = 0;
};

// Why a raw read stopped, as plain values: ReadHeader and SkipObject report it without
// formatting a message, so they never allocate (PeekId relies on that). ToStatus() turns it
// into the Status a caller reports.
struct Fault {
  enum class Kind : std::uint8_t { kNone, kTruncated, kReservedByte, kOverLimit };
  Kind kind = Kind::kNone;
  std::size_t pos = 0;         // the byte at which the offending object starts
  const char* what = nullptr;  // kOverLimit: "str length", "array size", "nesting depth", ...
  std::uint64_t value = 0;     // kOverLimit: the declared size (or depth, or object count)
  std::uint64_t limit = 0;     // kOverLimit: the limit it exceeds

  bool ok() const { return kind == Kind::kNone; }
};

// kProtocol for kTruncated and kReservedByte, kOutOfRange for kOverLimit; OK for kNone.
[[nodiscard]] Status ToStatus(const Fault& fault);

// Reads the header at data[pos] and advances pos past it (not past a str/bin/ext payload).
// kTruncated, or kReservedByte on 0xc1.
[[nodiscard]] Fault ReadHeader(const std::uint8_t* data, std::size_t size, std::size_t& pos,
                               Header& out);

// Skips one complete object at data[pos], enforcing `limits` (`depth_above` containers already
// enclose it; `objects` is the running object count). kOverLimit on a limit, kTruncated or
// kReservedByte on malformed bytes.
[[nodiscard]] Fault SkipObject(const std::uint8_t* data, std::size_t size, std::size_t& pos,
                               const ScanLimits& limits, std::uint32_t depth_above,
                               std::size_t& objects);

// Checks that data[0, size) is exactly one well-formed msgpack object within `limits`. When the
// object is a map and the fault lies in the value of one of its keys, the reason starts with
// that key ("field 'fp': bin length of 57351 at byte 20 exceeds limit 57344").
[[nodiscard]] Status ScanFrame(const std::uint8_t* data, std::size_t size,
                               const ScanLimits& limits);

}  // namespace kvferry::wire::internal
