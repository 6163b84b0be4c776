// Randomized fault exploration: many small runs, each with a random topology, workload, lease
// configuration (matched or not between P and D) and faults, checked against the invariants
// RunCluster enforces (SimResult::violations):
//   - no WRITE starts or lands in a D block freed or reallocated since its pull;
//   - every request ends exactly once, with success or an error that says why;
//   - once the system is quiet nothing is held on P or D (holds, blocks, receives, renewals);
//   - after every expiry pass no P entry is held past its deadline — which bounds how long P
//     keeps a dead decoder's KV to one lease after its last renewal plus one pass.
// Run `seed` is a pure function of the seed: `kvferry sim --explore 1 --seed S` replays it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cluster.h"

namespace kvferry::sim {

// The random configuration of run `seed` (small: a few requests, a few seconds of traffic).
SimConfig RandomConfig(std::uint64_t seed);
// One line naming the configuration's shape and faults, for failure reports.
std::string Describe(const SimConfig& config);

struct ExploreOptions {
  std::uint64_t first_seed = 1;
  std::uint64_t runs = 1000;
  bool stop_at_first_failure = false;
  Variants variants;  // tests inject broken holds/ledgers here
};

struct ExploreFailure {
  std::uint64_t seed;
  std::string description;
  std::vector<std::string> violations;
};

struct ExploreReport {
  std::uint64_t runs = 0;
  std::uint64_t events = 0;
  std::uint64_t requests = 0;
  std::uint64_t ok = 0, failed = 0, aborted = 0;
  std::uint64_t pull_timeouts = 0, late_replies = 0, fences = 0, duplicate_pulls_dropped = 0;
  std::uint64_t hostile_pulls = 0, messages_to_silent_engines = 0, messages_unsent = 0;
  std::uint64_t releases_delivered = 0, notices_delivered = 0, failed_by_notice = 0;
  std::uint64_t unsettled_writes = 0, unsettled_writes_landed = 0, layer_writes = 0;
  std::uint64_t p_restarts = 0, pulls_to_restarted = 0, replies_to_closed = 0;
  std::uint64_t shared_key_quarantines = 0;  // runs that reached SimResult::shared_key_quarantine
  std::vector<ExploreFailure> failures;
};

ExploreReport Explore(const ExploreOptions& options);

// The command that replays `seed` alone.
std::string ReproCommand(std::uint64_t seed);

}  // namespace kvferry::sim
