// Limits on JSON from the network (HTTP bodies of the bootstrap service, `kvferry serve` and
// `kvferry proxy`), checked on the raw text before a parser or a serializer sees it.
//
// Why a pre-scan: nlohmann::json parses deep nesting without recursion, but serializing (dump)
// and some accessors recurse once per level, so a 140 KB body nested 70,000 levels deep crashes
// a process that re-serializes what it parsed (the proxy did, with SIGSEGV). No OpenAI-style
// request needs more than a handful of levels; kMaxJsonDepth leaves ample room.
#pragma once

#include <cstddef>
#include <string_view>

namespace kvferry::control {

inline constexpr std::size_t kMaxJsonDepth = 32;
// Values in one body. An 8 MiB body of `[1,1,1,...]` is 4 M values, which nlohmann holds in
// about 64 MB; a prompt of 1 M token ids is far beyond any model's context.
inline constexpr std::size_t kMaxJsonValues = std::size_t{1} << 20;

// The deepest nesting of arrays and objects in `text`, ignoring brackets inside strings. O(n),
// no allocation; meaningful for valid JSON, a bound (never an underestimate) for invalid text.
[[nodiscard]] std::size_t JsonDepth(std::string_view text);

// An upper bound on the number of values in `text` (commas and opening brackets outside
// strings, plus one). O(n), no allocation.
[[nodiscard]] std::size_t JsonValues(std::string_view text);

}  // namespace kvferry::control
