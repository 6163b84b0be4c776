// The seed experiments (SPEC §8 A–D) at the seed's full scale, in virtual time.
//
// Each scenario builds its configurations, runs them through RunCluster and derives its figures
// from the runs; nothing here is canned. Report*() renders a figure table beside the seed's own
// numbers (quoted from seeds/000_… and seeds/002_…, which are the only constants here).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cluster.h"

namespace kvferry::sim {

// P's KV usage (%) at virtual time t seconds, from a run's samples (the latest at or before t).
double PctAt(const SimResult& run, double t);

// ---- A. D crash: 480 s timeout (no lease) vs 30 s lease. ----
SimConfig ScenarioAConfig(bool lease, std::uint64_t seed);
struct FiguresA {
  double kv_left_full_s = -1;  // after the crash, when P's KV first fell below 95% (-1: never)
  double kv_below_5_s = -1;    // when P's KV first fell below 5% (-1: never)
  double kv_at_end_pct = 0;    // P's KV at the end of the run (660 s)
  double kv_at_crash_plus_30_pct = 0;
  double probe10_s = -1;          // latency of the probe sent at t = 10 s (-1: never answered)
  double later_probe_min_s = -1;  // probes sent once P's KV was below 5%
  double later_probe_max_s = -1;
  std::size_t requests_ok = 0;
};
FiguresA ComputeFiguresA(const SimResult& run);
struct ScenarioA {
  SimResult timeout;
  SimResult lease;
};
ScenarioA RunScenarioA(std::uint64_t seed);
std::string ReportA(const ScenarioA& a);
// t, P KV % (timeout), P KV % (lease), every `every_s` seconds.
std::string TimelineA(const ScenarioA& a, double every_s, bool csv);

// ---- B. D overload without a crash: 20 s timeout vs 20 s lease. ----
SimConfig ScenarioBConfig(bool lease, std::uint64_t seed);
struct FiguresB {
  std::size_t ok = 0, failed = 0, total = 0;
  double max_wait_on_d_s = 0;      // arrival → D allocates blocks and pulls
  std::uint64_t expired_on_p = 0;  // holds that ran out on P (rank 0)
  double p_full_s = 0;             // seconds P's KV was >= 95%
  double max_probe_s = 0;
};
FiguresB ComputeFiguresB(const SimResult& run);
struct ScenarioB {
  SimResult timeout;
  SimResult lease;
};
ScenarioB RunScenarioB(std::uint64_t seed);
std::string ReportB(const ScenarioB& b);

// ---- C. Multi-peer write-after-free: P TP2 → D TP1, old ledger vs fixed ledger. ----
// `old_logic` drives LegacyLedger (the seed's buggy baseline) instead of core::ReceiveLedger.
SimConfig ScenarioCConfig(bool old_logic, std::uint64_t seed);
struct FiguresC {
  std::size_t requests = 0;
  std::uint64_t written_by_both = 0;
  std::uint64_t p0_failures = 0;
  std::uint64_t p1_after_free = 0;
  std::uint64_t p1_after_realloc = 0;
  std::size_t failed = 0;
};
FiguresC ComputeFiguresC(const SimResult& run);
struct ScenarioC {
  SimResult old_logic;
  SimResult fixed;
};
ScenarioC RunScenarioC(std::uint64_t seed);
std::string ReportC(const ScenarioC& c);

// ---- D. Late pull: a pull for a transfer P already freed. ----
enum class LatePullVariant : std::uint8_t {
  kTimeout,       // no lease; P's 20 s abort_request_timeout freed it
  kLease,         // 20 s lease; D's renewals were lost, so the lease ran out
  kNoTombstones,  // today's P without tombstones (max_tombstones = 0), 20 s timeout
};
SimConfig ScenarioDConfig(LatePullVariant variant, std::uint64_t seed);
struct FiguresD {
  double pull_sent_s = -1;  // when D pulled the late request
  double time_to_fail_s = -1;
  bool failed = false;
  std::string error;
};
FiguresD ComputeFiguresD(const SimResult& run);
struct ScenarioD {
  SimResult timeout;
  SimResult lease;
  SimResult no_tombstones;
};
ScenarioD RunScenarioD(std::uint64_t seed);
std::string ReportD(const ScenarioD& d);

// ---- E. 30% of clients cancel on D only (vLLM #50425): what P keeps for nobody. ----
// The seed deployment's load (128 requests, 2.4x D's KV, so most queue on D); requests i with
// i % 10 < 3 leave D at a random time in [2 s, 40 s] and nobody tells P. Three policies: the
// 480 s timeout without lease or release (today's default), a 30 s lease without release, and
// the 30 s lease with release.
enum class CancelPolicy : std::uint8_t { kTimeout, kLease, kLeaseAndRelease };
SimConfig ScenarioEConfig(CancelPolicy policy, std::uint64_t seed);
struct ScenarioE {
  SimResult timeout;
  SimResult lease;
  SimResult release;
};
ScenarioE RunScenarioE(std::uint64_t seed);
std::string ReportE(const ScenarioE& e);
// t, P KV % under each policy, every `every_s` seconds.
std::string TimelineE(const ScenarioE& e, double every_s, bool csv);

}  // namespace kvferry::sim
