#include "data_plane.h"

#include <fmt/format.h>

#include <chrono>

namespace kvferry::sim {

using namespace std::chrono_literals;

void DataPlane::Start(Write w, std::uint64_t bytes, Duration delay) {
  const std::uint64_t wid = next_write_++;
  const Duration duration =
      config_.latency + core::Seconds(static_cast<double>(bytes) / config_.bytes_per_s);
  writes_[wid] = std::move(w);
  loop_.After(delay, kinds_.start, wid, [this, wid, duration] {
    if (!WriteStart(wid)) return;
    Duration lands_after = duration;
    if (writes_[wid].give_up) {
      const auto give_up_after =
          std::chrono::duration_cast<Duration>(duration * 0.9 * rng_.Real());
      loop_.After(give_up_after, kinds_.give_up, wid, [this, wid] { GiveUp(wid); });
      // Bytes the sender gave up on may sit in a socket buffer or the receiver's queue for a
      // while: some land after D asked for a fence (and are refused), some before.
      lands_after += rng_.Span(Duration{0}, 2s);
    }
    loop_.After(lands_after, kinds_.end, wid, [this, wid] { WriteEnd(wid, true); });
  });
}

// P's memory is no longer read (the bytes left it), so P may free its blocks; D's may still be
// written until the WRITE ends (WriteEnd lands it unless D fenced the writer).
void DataPlane::GiveUp(std::uint64_t wid) {
  auto it = writes_.find(wid);
  if (it == writes_.end() || !hooks_.p_alive(it->second.p_gen) || it->second.reported) return;
  Write& w = it->second;
  w.reported = true;
  ++res_.unsettled_writes;
  hooks_.given_up(w);
}

bool DataPlane::DestinationIntact(const Write& w, bool at_start) {
  bool freed = false;
  bool reallocated = false;
  for (std::size_t i = 0; i < w.dest.size(); ++i) {
    if (d_pool_.generation(w.dest[i]) != w.gens[i]) {
      freed = true;
      if (d_pool_.owner(w.dest[i]).has_value()) reallocated = true;
    }
  }
  if (!freed) return true;
  if (at_start) {
    ++res_.writes_after_free[w.p_rank];
    if (reallocated) ++res_.writes_after_realloc[w.p_rank];
  }
  hooks_.violation(fmt::format("WRITE of P rank {} for req-{} {} after D {} its destination block",
                               w.p_rank, w.req, at_start ? "starts" : "lands",
                               reallocated ? "reallocated" : "freed"));
  return false;
}

bool DataPlane::WriteStart(std::uint64_t wid) {
  auto it = writes_.find(wid);
  if (it == writes_.end() || !hooks_.p_alive(it->second.p_gen)) return false;
  Write& w = it->second;
  const bool ok = Lands(w);
  if (ok) {
    ++res_.writes;
    DestinationIntact(w, true);
    loop_.Note(0x5a, wid);
  }
  if (!ok) WriteEnd(wid, false);
  return ok;
}

void DataPlane::WriteEnd(std::uint64_t wid, bool started) {
  auto it = writes_.find(wid);
  if (it == writes_.end() || !hooks_.p_alive(it->second.p_gen)) return;
  Write w = std::move(it->second);
  writes_.erase(it);
  const bool ok = Lands(w);
  if (started && ok) {
    DestinationIntact(w, false);
    if (w.reported) {
      ++res_.unsettled_writes_landed;  // after P answered err: D must still hold the blocks
      return;
    }
    hooks_.landed(w);
  }
  if (w.reported) return;  // P's session heard kUnsettled at GiveUp
  hooks_.settled(w, ok);
}

bool DataPlane::KeyMayReach(std::uint32_t d_rank, std::uint64_t key, std::uint32_t p_gen) const {
  auto it = key_gens_.find({d_rank, key});
  return it == key_gens_.end() || it->second.count(p_gen) != 0;
}

bool DataPlane::KeySharedBeyond(std::uint32_t d_rank, std::uint64_t key,
                                std::uint32_t p_gen) const {
  auto it = key_gens_.find({d_rank, key});
  return it != key_gens_.end() && it->second.size() > 1 && it->second.count(p_gen) != 0;
}

void DataPlane::Fence(std::uint32_t d_rank, std::uint32_t p_rank,
                      const std::vector<std::uint64_t>& keys) {
  revoked_[d_rank].insert(keys.begin(), keys.end());
  for (auto& [wid, w] : writes_) {
    if (w.d_rank == d_rank && revoked_[d_rank].count(w.key) != 0) w.fenced = true;
  }
  loop_.Note(0xfe, (d_rank << 8) | p_rank);
}

}  // namespace kvferry::sim
