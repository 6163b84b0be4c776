#include "event_loop.h"

#include <algorithm>
#include <utility>

namespace kvferry::sim {

void EventLoop::Schedule(TimePoint at, std::uint32_t kind, std::uint64_t key, Fn fn) {
  heap_.push_back({std::max(at, now_), seq_++, kind, key, std::move(fn)});
  std::push_heap(heap_.begin(), heap_.end(), Later);
}

TimePoint EventLoop::next_time() const { return heap_.empty() ? core::kNever : heap_.front().at; }

bool EventLoop::Step(TimePoint until) {
  if (heap_.empty() || heap_.front().at > until) return false;
  std::pop_heap(heap_.begin(), heap_.end(), Later);
  Event ev = std::move(heap_.back());
  heap_.pop_back();
  now_ = ev.at;
  ++fired_;
  Mix(static_cast<std::uint64_t>((ev.at - kT0).count()));
  Mix(ev.seq);
  Mix(ev.kind);
  Mix(ev.key);
  ev.fn();
  return true;
}

void EventLoop::Note(std::uint64_t a, std::uint64_t b) {
  Mix(a);
  Mix(b);
}

void EventLoop::Mix(std::uint64_t v) {
  // FNV-1a over the 8 bytes: stable across platforms of the same endianness-free arithmetic.
  for (int i = 0; i < 8; ++i) {
    hash_ ^= (v >> (8 * i)) & 0xff;
    hash_ *= 0x100000001b3ull;
  }
}

}  // namespace kvferry::sim
