// DataPlane: the simulated one-sided WRITEs from P's ranks into D's blocks, and D's fences.
//
// A WRITE starts after the delay its writer drew, lasts latency + bytes / bandwidth (WRITEs do
// not share bandwidth), and lands unless D is down, the WRITE was fenced, or its write key was
// revoked before it started or ends (the receiver's check, as transport::WriteKey is). A WRITE
// whose sender gives up (Faults::unsettled_write) is reported to P early and may still land
// later, up to 2 s on: D must hold its blocks until a fence proves it cannot.
//
// The data plane judges its destination: a WRITE that starts or lands in a block D freed or
// handed to another request since the pull aimed at it is a violation (SimResult counts them).
// It owns no P or D state: what a WRITE's end means to P's session (its outcome, the mirror,
// freeing blocks) is the cluster's, through Hooks. Every random draw comes from the run's Rng in
// event order, so a run stays a pure function of its seed.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "cluster.h"
#include "event_loop.h"
#include "kvferry/core/block_pool.h"
#include "protocol/decode_session.h"
#include "rng.h"

namespace kvferry::sim {

struct Write {
  int req;
  std::uint32_t p_rank;
  std::uint32_t d_rank;
  std::vector<core::BlockId> dest;
  std::vector<std::uint64_t> gens;
  std::uint64_t key;  // the pull's write key, as P's session handed it to the writer
  bool fenced = false;
  bool err_after = false;    // scenario C's injected P0 failure
  std::uint64_t ticket = 0;  // the session's write ticket
  bool give_up = false;      // Faults::unsettled_write: the sender gives up before the end
  bool reported = false;     // P's session heard the outcome already (kUnsettled)
  std::uint32_t p_gen = 0;   // the P process whose write it is
  bool ahead = false;        // layers written before the prefill ended (WriteJob::ahead)
};

// The event kinds the data plane schedules (folded into the run's trace hash).
struct DataPlaneKinds {
  std::uint32_t start;
  std::uint32_t end;
  std::uint32_t give_up;
};

class DataPlane {
 public:
  // What the data plane asks of the cluster around it.
  struct Hooks {
    std::function<bool(std::uint32_t p_gen)> p_alive;  // that P process still runs
    std::function<bool()> d_alive;
    std::function<void(std::string)> violation;
    // The WRITE landed in intact blocks and its sender still waits for it.
    std::function<void(const Write&)> landed;
    // The sender learns the WRITE's end: `ok` when it landed (P's session then judges it).
    std::function<void(const Write&, bool ok)> settled;
    // The sender gave up with the bytes in flight (kUnsettled).
    std::function<void(const Write&)> given_up;
  };

  DataPlane(const DataPlaneConfig& config, std::uint32_t d_ranks, const core::BlockPool& d_pool,
            Rng& rng, EventLoop& loop, DataPlaneKinds kinds, SimResult& res, Hooks hooks)
      : config_(config), d_pool_(d_pool), rng_(rng), loop_(loop), kinds_(kinds), res_(res),
        hooks_(std::move(hooks)), revoked_(d_ranks) {}
  DataPlane(const DataPlane&) = delete;
  DataPlane& operator=(const DataPlane&) = delete;

  // Starts `w` (`bytes` long) after `delay`.
  void Start(Write w, std::uint64_t bytes, Duration delay);
  // P restarted: the old process's WRITEs died with it (their events find nothing).
  void ForgetWrites() { writes_.clear(); }

  // A pull with write key `key` went from D rank `d_rank` to P process `p_gen`.
  void NotePull(std::uint32_t d_rank, std::uint64_t key, std::uint32_t p_gen) {
    key_gens_[{d_rank, key}].insert(p_gen);
  }
  // Whether a WRITE stamped `key` by D rank `d_rank` may come from P process `p_gen`: a pull
  // with that key went there, or the key is unknown (so nothing proves it cannot).
  bool KeyMayReach(std::uint32_t d_rank, std::uint64_t key, std::uint32_t p_gen) const;
  // Whether pulls with `key` went to `p_gen` and to another process too.
  bool KeySharedBeyond(std::uint32_t d_rank, std::uint64_t key, std::uint32_t p_gen) const;
  // D rank `d_rank` revokes `keys` (of P rank `p_rank`): WRITEs stamped with them fail from now
  // on, also those already started.
  void Fence(std::uint32_t d_rank, std::uint32_t p_rank, const std::vector<std::uint64_t>& keys);

 private:
  // Faults::unsettled_write: the sender stops waiting for a WRITE whose bytes are on their way.
  void GiveUp(std::uint64_t wid);
  // Whether the WRITE's destination blocks are still the ones its pull aimed at; counts and
  // flags the ones that are not (freed, or freed and handed to another request).
  bool DestinationIntact(const Write& w, bool at_start);
  // Returns false when the WRITE cannot start (it is then finished as failed).
  bool WriteStart(std::uint64_t wid);
  void WriteEnd(std::uint64_t wid, bool started);
  bool Lands(const Write& w) const {
    return hooks_.d_alive() && !w.fenced && revoked_[w.d_rank].count(w.key) == 0;
  }

  const DataPlaneConfig& config_;
  const core::BlockPool& d_pool_;
  Rng& rng_;
  EventLoop& loop_;
  const DataPlaneKinds kinds_;
  SimResult& res_;
  const Hooks hooks_;
  std::map<std::uint64_t, Write> writes_;
  std::uint64_t next_write_ = 0;
  std::vector<std::unordered_set<std::uint64_t>> revoked_;  // [d_rank]: write keys fenced
  // (d_rank, key): the P processes that got a pull with that write key.
  std::map<std::pair<std::uint32_t, std::uint64_t>, std::set<std::uint32_t>> key_gens_;
};

}  // namespace kvferry::sim
