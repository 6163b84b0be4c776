// P restarts in the simulator (Faults::p_restarts): a new process of P — a new incarnation, on
// the old side-channel addresses or on new ones — gets traffic again within a bound, with and
// without a liveness source, and D's sockets stay bounded however many addresses come and go.
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "cluster.h"

namespace kvferry::sim {
namespace {

using namespace std::chrono_literals;

// A clean network, small requests, one arriving every `every` from the start to `until`.
SimConfig CleanRun(std::uint32_t p_tp, std::uint32_t d_tp, Duration every, TimePoint until) {
  SimConfig c;
  c.p.tp = p_tp;
  c.d.tp = d_tp;
  c.model.block_tokens = 4;
  c.model.kv_heads = 4;
  c.model.kv_bytes_per_token_per_head = 4096;
  c.p.blocks = 400;
  c.d.blocks = 800;
  c.p.hold.abort_request_timeout = 5s;
  c.d.write_bound = 1s;
  c.d.pull_timeout = 8s;
  for (TimePoint t = kT0; t < until; t += every) {
    RequestSpec q;
    q.arrival = t;
    q.prompt = 32;
    q.output = 4;
    c.load.requests.push_back(q);
  }
  return c;
}

// One crash of P at 5 s and one restart 4 s later (at 9 s), on the same or on new addresses.
SimConfig OneRestart(std::uint32_t p_tp, bool same_address, bool liveness) {
  SimConfig c = CleanRun(p_tp, 1, 250ms, kT0 + 30s);
  c.faults.p_crash = kT0 + 5s;
  c.faults.p_restarts = 1;
  c.faults.p_down_for = 4s;
  c.faults.p_same_address = same_address;
  c.d.liveness = liveness;
  return c;
}

std::string Violations(const SimResult& r) {
  std::string text;
  for (const std::string& v : r.violations) text += "\n  " + v;
  return text;
}

// The bound D needs to find a restarted P: a failed lookup is believed for
// lookup_failure_ttl (2 s); a load sent to the dead process fails unsent after connect_wait
// (3 s) and is retried after a fresh lookup. After that, every request P's new process
// prefilled loads.
TEST(PRestart, ARestartedPServesEveryRequestThatArrivesOnceDHadTimeToFindIt) {
  for (const bool same_address : {false, true}) {
    for (const bool liveness : {false, true}) {
      for (const std::uint32_t p_tp : {1u, 2u}) {
        SCOPED_TRACE(testing::Message() << (same_address ? "same" : "new") << " addresses, "
                                        << (liveness ? "a" : "no") << " liveness source, P TP "
                                        << p_tp);
        const SimResult r = RunCluster(OneRestart(p_tp, same_address, liveness));
        EXPECT_TRUE(r.violations.empty()) << Violations(r);
        EXPECT_TRUE(r.quiet);
        EXPECT_EQ(r.p_restarts, 1u);
        EXPECT_GT(r.pulls_to_restarted, 0u);
        // Restart at 9 s; the first request that arrives after it may find D's stale view
        // (connect_wait) and, for a load from two P ranks (never retried), fail once.
        const TimePoint found = kT0 + 9s + 2s + 3s + 1s;
        std::size_t late = 0, late_ok = 0, before_crash_ok = 0;
        for (std::size_t i = 0; i < r.requests.size(); ++i) {
          const RequestResult& q = r.requests[i];
          if (q.arrival < kT0 + 4s) before_crash_ok += q.outcome == Outcome::kOk;
          if (q.arrival < found) continue;
          ++late;
          late_ok += q.outcome == Outcome::kOk;
          EXPECT_EQ(q.outcome, Outcome::kOk) << "req-" << i << ": " << q.error.ToString();
        }
        EXPECT_GT(late, 40u);
        EXPECT_EQ(late_ok, late);
        EXPECT_GT(before_crash_ok, 10u);
      }
    }
  }
}

// Every restart binds new addresses (as a P on port 0 does): 500 restarts of a TP-4 P are
// 2,000 side-channel addresses. D keeps at most max_idle_endpoints sockets idle and closes the
// rest; the run checks that it never holds more than max_endpoints and ends with no more than
// max_idle_endpoints (found by review: D kept every socket until EMFILE at its 1,024th address).
TEST(PRestart, TwoThousandPAddressesLeaveDWithinItsSocketBound) {
  SimConfig c = CleanRun(4, 2, 1s, kT0 + 500 * 6500ms);
  c.faults.p_crash = kT0 + 1s;
  c.faults.p_restarts = 500;
  c.faults.p_down_for = 500ms;
  c.faults.p_up_for = 6s;
  c.horizon = kT0 + 4000s;
  c.d.liveness = false;
  c.d.max_idle_endpoints = 8;
  c.d.max_endpoints = 64;
  const SimResult r = RunCluster(c);
  EXPECT_TRUE(r.violations.empty()) << Violations(r);
  EXPECT_TRUE(r.quiet);
  EXPECT_EQ(r.p_restarts, 500u);
  EXPECT_GT(r.pulls_to_restarted, 500u);
  // Each process lives 6 s: D finds it within connect_wait + a lookup, then loads from it.
  EXPECT_GT(r.Count(Outcome::kOk), r.requests.size() / 3);
}

// The invariant itself: a D whose restarted P is left out of its lookups (the bootstrap keeps
// answering with the dead process) is caught sending to the dead process.
TEST(PRestart, TheInvariantCatchesADecoderThatNeverFindsTheNewProcess) {
  SimConfig c = OneRestart(1, /*same_address=*/false, /*liveness=*/false);
  c.variants.stale_registry = true;
  const SimResult r = RunCluster(c);
  bool caught = false;
  for (const std::string& v : r.violations) {
    caught = caught || v.find("to a dead P process") != std::string::npos;
  }
  EXPECT_TRUE(caught) << Violations(r);
}

}  // namespace
}  // namespace kvferry::sim
