// Rng: the simulator's only source of randomness (xoshiro256**, seeded through splitmix64).
//
// Hand-written rather than std::mt19937 + std::uniform_*_distribution because the standard
// distributions are implementation-defined: the same seed must replay the same run, event for
// event, whatever standard library built the binary. Every draw goes through this one object in
// event order, so a run is a pure function of its configuration and seed.
#pragma once

#include <cstdint>

#include "kvferry/core/time.h"

namespace kvferry::sim {

class Rng {
 public:
  explicit Rng(std::uint64_t seed) {
    // splitmix64 spreads any seed (0 included) over the 256-bit state.
    for (std::uint64_t& word : s_) {
      seed += 0x9e3779b97f4a7c15ull;
      std::uint64_t z = seed;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      word = z ^ (z >> 31);
    }
  }

  std::uint64_t Next() {
    const std::uint64_t result = Rotl(s_[1] * 5, 7) * 9;
    const std::uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = Rotl(s_[3], 45);
    return result;
  }

  // Uniform in [0, 1) with 53 random bits.
  double Real() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }
  // Uniform integer in [lo, hi] (inclusive). Lemire's multiply-shift; the tiny bias is
  // irrelevant here and, unlike rejection sampling, the number of draws is fixed.
  std::uint64_t Between(std::uint64_t lo, std::uint64_t hi) {
    if (hi <= lo) return lo;
    const std::uint64_t span = hi - lo + 1;
    if (span == 0) return Next();                  // the full 64-bit range
    __extension__ using U128 = unsigned __int128;  // g++/clang builtin; silences -Wpedantic
    return lo + static_cast<std::uint64_t>((static_cast<U128>(Next()) * span) >> 64);
  }
  bool Chance(double p) { return p > 0 && Real() < p; }
  // Uniform duration in [lo, hi].
  core::Duration Span(core::Duration lo, core::Duration hi) {
    if (hi <= lo) return lo;
    return lo + core::Duration(static_cast<std::int64_t>(
                    Between(0, static_cast<std::uint64_t>((hi - lo).count()))));
  }

 private:
  static std::uint64_t Rotl(std::uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  std::uint64_t s_[4];
};

}  // namespace kvferry::sim
