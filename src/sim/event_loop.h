// EventLoop: virtual time for the simulator. Events are ordered by (time, sequence number), so
// two events at the same instant run in the order they were scheduled and a run never depends on
// heap tie-breaking. Every event fired is folded into a trace hash: two runs with the same seed
// must produce the same hash (the determinism test compares them).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "kvferry/core/time.h"

namespace kvferry::sim {

using core::Duration;
using core::TimePoint;

// Virtual time starts at the epoch of the core's clock type; t seconds is kT0 + Seconds(t).
inline constexpr TimePoint kT0{};
inline double At(TimePoint t) { return core::ToSeconds(t - kT0); }

class EventLoop {
 public:
  using Fn = std::function<void()>;

  TimePoint now() const { return now_; }

  // Runs `fn` at `at` (clamped to now: the past cannot be scheduled). `kind` and `key` identify
  // the event in the trace (e.g. kind = "write start", key = request index).
  void Schedule(TimePoint at, std::uint32_t kind, std::uint64_t key, Fn fn);
  void After(Duration d, std::uint32_t kind, std::uint64_t key, Fn fn) {
    Schedule(now_ + d, kind, key, std::move(fn));
  }

  // Fires the earliest event if it is due no later than `until`; false when none is.
  bool Step(TimePoint until);
  bool empty() const { return heap_.empty(); }
  TimePoint next_time() const;

  // Folds an observation (an outcome, a decision) into the trace hash.
  void Note(std::uint64_t a, std::uint64_t b = 0);
  std::uint64_t trace_hash() const { return hash_; }
  std::uint64_t events_fired() const { return fired_; }

 private:
  struct Event {
    TimePoint at;
    std::uint64_t seq;
    std::uint32_t kind;
    std::uint64_t key;
    Fn fn;
  };
  // std::push_heap keeps the max at the front; "greater" puts the earliest (time, seq) there.
  static bool Later(const Event& a, const Event& b) {
    return a.at != b.at ? a.at > b.at : a.seq > b.seq;
  }
  void Mix(std::uint64_t v);

  TimePoint now_ = kT0;
  std::uint64_t seq_ = 0;
  std::uint64_t fired_ = 0;
  std::uint64_t hash_ = 0xcbf29ce484222325ull;
  std::vector<Event> heap_;
};

}  // namespace kvferry::sim
