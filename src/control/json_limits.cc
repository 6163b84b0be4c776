#include "control/json_limits.h"

#include <algorithm>

namespace kvferry::control {
namespace {

// Calls `on(c)` for every character of `text` outside JSON strings (escapes honoured).
template <typename F>
void ForEachOutsideStrings(std::string_view text, F&& on) {
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else {
      on(c);
    }
  }
}

}  // namespace

std::size_t JsonDepth(std::string_view text) {
  std::size_t depth = 0, max_depth = 0;
  ForEachOutsideStrings(text, [&](char c) {
    if (c == '[' || c == '{') {
      max_depth = std::max(max_depth, ++depth);
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  });
  return max_depth;
}

std::size_t JsonValues(std::string_view text) {
  std::size_t values = 1;
  ForEachOutsideStrings(text, [&](char c) {
    if (c == ',' || c == '[' || c == '{') ++values;
  });
  return values;
}

}  // namespace kvferry::control
