// Time in the sans-IO core. The core never reads a clock: every call that depends on time takes
// `now`. Real processes pass std::chrono::steady_clock::now(); the simulator passes virtual time.
// Deadlines are stamped and compared in one process's clock and never cross the wire.
#pragma once

#include <chrono>
#include <cstdint>

namespace kvferry::core {

using Clock = std::chrono::steady_clock;
using TimePoint = Clock::time_point;
using Duration = std::chrono::nanoseconds;

constexpr TimePoint kNever = TimePoint::max();

inline constexpr Duration Seconds(double s) {
  // Rounded, not truncated: 4.1 s must be 4'100'000'000 ns, not 4'099'999'999.
  return std::chrono::round<Duration>(std::chrono::duration<double>(s));
}
inline constexpr double ToSeconds(Duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace kvferry::core
