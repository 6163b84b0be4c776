// EnumArray: a fixed-size array indexed by an enum class whose enumerators are 0..N-1, so that
// counters kept per enumerator (hold entries by phase, releases by reason) are read and written
// by name — `stats.released[ReleaseReason::kExpired]` — never by a magic index.
#pragma once

#include <array>
#include <cstddef>

namespace kvferry::core {

template <typename Enum, typename T, std::size_t N>
class EnumArray {
 public:
  constexpr T& operator[](Enum e) { return values_[static_cast<std::size_t>(e)]; }
  constexpr const T& operator[](Enum e) const { return values_[static_cast<std::size_t>(e)]; }
  static constexpr std::size_t size() { return N; }

  friend bool operator==(const EnumArray&, const EnumArray&) = default;

 private:
  std::array<T, N> values_{};
};

}  // namespace kvferry::core
