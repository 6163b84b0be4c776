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

// The deepest nesting of arrays and objects in `text`, ignoring brackets inside strings. O(n),
// no allocation; meaningful for valid JSON, a bound (never an underestimate) for invalid text.
[[nodiscard]] std::size_t JsonDepth(std::string_view text);

}  // namespace kvferry::control
