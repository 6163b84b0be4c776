// WriteFence: a fencing receiver's rule for which inbound writes may land (Engine::
// RevokeWriteKeys, UcxOptions::fence_writes), apart from UCX and locking.
//
// A write may land when its key was never revoked, and, when the receiver fences, when it
// carries a key at all (kNoWriteKey is refused: a writer that stamps nothing cannot be fenced).
// An admitted write counts as landing from its admission (Admit, before its first byte is
// copied) until its copy or receive ends (Landed), so a revocation can wait until nothing
// stamped with its keys is still landing: after that, no byte of those keys lands again.
// Revocations are for good: keys come from the receiver's own sessions (one per epoch of a
// writer), never from the wire, so the set grows by one per fenced epoch.
//
// Not thread-safe: the engine calls it under its mutex (the handlers admit on the progress
// thread; RevokeWriteKeys waits on the caller's).
#pragma once

#include <span>
#include <unordered_map>
#include <unordered_set>

#include "kvferry/transport/transport.h"

namespace kvferry::transport::internal {

class WriteFence {
 public:
  explicit WriteFence(bool fences) : fences_(fences) {}

  bool fences() const { return fences_; }
  // May a write stamped with `key` land now? Always, for a receiver that does not fence.
  bool Admitted(WriteKey key) const {
    return !fences_ || (key != kNoWriteKey && revoked_.count(key) == 0);
  }
  // Admits a write stamped with `key` (the caller checked Admitted): it lands until Landed.
  void Admit(WriteKey key) { ++landing_[key]; }
  // A write admitted with `key` stopped landing (copied, or its receive ended either way).
  void Landed(WriteKey key) {
    auto it = landing_.find(key);
    if (it != landing_.end() && --it->second <= 0) landing_.erase(it);
  }
  // From now on, writes stamped with any of `keys` are refused.
  void Revoke(std::span<const WriteKey> keys) { revoked_.insert(keys.begin(), keys.end()); }
  // Does a write admitted with one of `keys` still land?
  bool AnyLanding(std::span<const WriteKey> keys) const {
    for (WriteKey key : keys) {
      if (landing_.count(key) != 0) return true;
    }
    return false;
  }

 private:
  bool fences_;
  std::unordered_set<WriteKey> revoked_;
  std::unordered_map<WriteKey, int> landing_;
};

}  // namespace kvferry::transport::internal
