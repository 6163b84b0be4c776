#include "explore.h"

#include <fmt/format.h>

#include <algorithm>

#include "rng.h"

namespace kvferry::sim {

namespace {

Duration Ms(std::uint64_t ms) { return std::chrono::milliseconds(ms); }

}  // namespace

SimConfig RandomConfig(std::uint64_t seed) {
  // The run's own Rng (inside RunCluster) starts from the same seed; this one only shapes the
  // configuration and is salted so the two streams differ.
  Rng r(seed ^ 0x636f6e666967ull);
  SimConfig c;
  c.seed = seed;
  static constexpr std::uint32_t kTp[] = {1, 2, 4};
  static constexpr std::uint32_t kHeads[] = {1, 2, 4, 8};
  c.model.block_tokens = 4;
  c.model.kv_heads = kHeads[r.Between(0, 3)];
  c.model.kv_bytes_per_token_per_head = 4096;
  c.p.tp = kTp[r.Between(0, 2)];
  c.d.tp = kTp[r.Between(0, 2)];

  // Workload: 1–6 requests within 3 s; small prompts, short outputs.
  const std::uint64_t n = r.Between(1, 6);
  std::uint32_t max_prompt_blocks = 1, max_total_blocks = 1;
  for (std::uint64_t i = 0; i < n; ++i) {
    RequestSpec q;
    q.arrival = kT0 + r.Span(Duration{0}, 3s);
    q.prompt = static_cast<std::uint32_t>(r.Between(4, 64));
    q.output = static_cast<std::uint32_t>(r.Between(1, 30));
    if (r.Chance(0.15)) q.abort_at = q.arrival + r.Span(Duration{0}, 5s);
    if (r.Chance(0.1)) q.d_cancel_at = q.arrival + r.Span(Duration{0}, 5s);
    if (r.Chance(0.1)) q.p_abort_at = q.arrival + r.Span(Duration{0}, 5s);
    max_prompt_blocks = std::max(max_prompt_blocks, (q.prompt + 3) / 4);
    max_total_blocks = std::max(max_total_blocks, (q.prompt + q.output + 3) / 4);
    c.load.requests.push_back(q);
  }
  // Pools from "exactly one request fits" to a few: small pools make D reuse blocks quickly.
  c.p.blocks = max_prompt_blocks * static_cast<std::uint32_t>(r.Between(1, 4));
  c.d.blocks = max_total_blocks * static_cast<std::uint32_t>(r.Between(1, 3));
  c.p.max_batch_tokens = 64;
  c.p.step_overhead = 1ms;
  c.p.per_token = Ms(r.Between(1, 20)) / 10;
  c.p.jitter = 0.2;
  c.d.step_base = 5ms;
  c.d.per_seq = 1ms;

  // Lifetime configuration, mismatched between P and D now and then.
  c.p.hold.abort_request_timeout = Ms(r.Between(2000, 20000));
  c.p.hold.max_tombstones = r.Chance(0.1) ? r.Between(0, 4) : 1024;
  if (r.Chance(0.5)) c.p.hold.lease = Ms(r.Between(1000, 6000));
  const double mismatch = r.Real();
  if (mismatch < 0.8) {
    c.d.lease = c.p.hold.lease;
  } else if (mismatch < 0.9) {
    c.d.lease = Duration{0};
  } else {
    c.d.lease = Ms(r.Between(1000, 6000));
  }
  c.d.send_lease = r.Chance(0.85);
  c.d.send_releases = r.Chance(0.8);
  c.p.timer_late_max = Ms(r.Between(50, 1000));
  // D's deadline is as short as its options allow (P's wait bound plus the write bound) or a
  // little longer. Lost messages, slow writes and delayed replies still make pulls time out
  // now and then, so quarantine, fences and late replies are exercised.
  c.d.write_bound = Ms(r.Between(100, 5000));
  c.d.pull_timeout = c.p.hold.abort_request_timeout + c.d.write_bound + Ms(r.Between(1, 10000));
  c.d.peer_dead_detect = Ms(r.Between(100, 3000));

  // Control network.
  c.net.latency = std::chrono::microseconds(r.Between(10, 2000));
  if (r.Chance(0.3)) c.net.jitter = Ms(r.Between(0, 20));
  if (r.Chance(0.3)) c.net.loss = r.Real() * 0.05;
  if (r.Chance(0.3)) c.net.duplicate = r.Real() * 0.1;
  if (r.Chance(0.3)) {
    c.net.delay_prob = r.Real() * 0.2;
    // Sometimes long enough for a reply to arrive after D's deadline (a late reply).
    c.net.delay_max = Ms(r.Chance(0.2) ? r.Between(3000, 30000) : r.Between(0, 3000));
  }
  if (r.Chance(0.3)) c.net.reorder = r.Real() * 0.3;
  if (r.Chance(0.3)) c.net.release_loss = r.Real();
  if (r.Chance(0.1)) {
    c.net.drop_renewals_from = kT0 + r.Span(Duration{0}, 5s);
    c.net.drop_renewals_until = c.net.drop_renewals_from + r.Span(Duration{0}, 10s);
  }
  c.dp.bytes_per_s = 1e9;
  c.dp.fence_latency = Ms(r.Between(0, 200));

  // Faults.
  if (r.Chance(0.15)) c.faults.d_crash = kT0 + r.Span(Duration{0}, 10s);
  if (r.Chance(0.1)) c.faults.p_crash = kT0 + r.Span(Duration{0}, 10s);
  if (r.Chance(0.1)) c.faults.p_declared_down = kT0 + r.Span(Duration{0}, 10s);
  if (r.Chance(0.2)) c.faults.peer_err = r.Real() * 0.2;
  if (r.Chance(0.1)) c.faults.peer_msg_error = r.Real() * 0.1;
  // Drawn and unused: the fault it chose (a P that leaves a request out of its answer) edited a
  // session's answer; the draw stays so that every other seed keeps its configuration.
  if (r.Chance(0.1)) (void)r.Real();
  if (r.Chance(0.1)) c.faults.p0_err_after_write = r.Real() * 0.3;
  if (r.Chance(0.25)) c.faults.p1_write_delay = Ms(r.Between(0, 1000));
  if (r.Chance(0.25)) {
    c.faults.slow_write = r.Real() * 0.5;
    c.faults.slow_max = Ms(r.Between(0, 3000));
  }
  if (c.net.loss == 0 && r.Chance(0.3)) c.faults.fence_unsupported = true;
  if (r.Chance(0.1)) c.faults.late_pull = r.Real() * 0.2;
  if (r.Chance(0.2)) c.faults.silent_engines = static_cast<std::uint32_t>(r.Between(1, 20));
  if (r.Chance(0.2)) c.faults.hostile_pulls = static_cast<std::uint32_t>(r.Between(1, 30));
  // Drawn last, so the seeds of runs without it keep their configurations.
  if (r.Chance(0.15) && !c.faults.fence_unsupported) c.faults.unsettled_write = r.Real() * 0.2;
  // P restarts, drawn after everything else for the same reason: 1–4 new processes, each
  // 0–8 s after a crash, on the same addresses or new ones, with or without a liveness source;
  // D keeps at most 0–3 idle side channels (so churn closes them) and 1–8 more in all; and the
  // workload goes on after each restart (copies of its requests, shifted in time).
  if (r.Chance(0.15)) {
    if (c.faults.p_crash == core::kNever) c.faults.p_crash = kT0 + r.Span(Duration{0}, 4s);
    c.faults.p_restarts = static_cast<std::uint32_t>(r.Between(1, 4));
    c.faults.p_down_for = Ms(r.Between(0, 8000));
    c.faults.p_up_for = Ms(r.Between(500, 15000));
    c.faults.p_same_address = r.Chance(0.5);
    // A D that cannot fence a live P learns that P died only from a liveness source: without
    // one, the blocks of a pull the old process never answered stay quarantined for good (the
    // known limit Faults::fence_unsupported states).
    c.d.liveness = r.Chance(0.5) || c.faults.fence_unsupported;
    c.d.max_idle_endpoints = r.Between(0, 3);
    c.d.max_endpoints = c.d.max_idle_endpoints + r.Between(1, 8);
    TimePoint up = c.faults.p_crash + c.faults.p_down_for;
    for (std::uint32_t k = 0; k < c.faults.p_restarts; ++k) {
      const std::uint64_t more = r.Between(1, 3);
      for (std::uint64_t j = 0; j < more; ++j) {
        RequestSpec q = c.load.requests[r.Between(0, n - 1)];
        const Duration shift = up + r.Span(Duration{0}, c.faults.p_up_for) - q.arrival;
        q.arrival += shift;
        for (TimePoint* t : {&q.abort_at, &q.d_cancel_at, &q.p_abort_at}) {
          if (*t != core::kNever) *t += shift;
        }
        c.load.requests.push_back(q);
      }
      up += c.faults.p_up_for + c.faults.p_down_for;
    }
  }
  // Layer writes (PrefillConfig::layer_planes), drawn last so that the runs without them are
  // the runs of the seeds before they existed.
  if (r.Chance(0.5)) c.p.layer_planes = static_cast<std::uint32_t>(r.Between(2, 8));
  c.horizon = kT0 + 2h;
  return c;
}

std::string Describe(const SimConfig& c) {
  auto secs = [](Duration d) { return core::ToSeconds(d); };
  std::string out = fmt::format(
      "P tp{} ({} blocks) -> D tp{} ({} blocks), {} heads, {} requests; P lease {:.3g}s "
      "timeout {:.3g}s timer late <= {:.3g}s tombstones {}; D lease {:.3g}s{}; pull timeout {:.3g}s",
      c.p.tp, c.p.blocks, c.d.tp, c.d.blocks, c.model.kv_heads, c.load.requests.size(),
      secs(c.p.hold.lease), secs(c.p.hold.abort_request_timeout), secs(c.p.timer_late_max),
      c.p.hold.max_tombstones, secs(c.d.lease), c.d.send_lease ? "" : " (not declared)",
      secs(c.d.pull_timeout));
  auto add = [&out](bool on, std::string what) {
    if (on) out += "; " + what;
  };
  add(c.net.loss > 0, fmt::format("loss {:.3f}", c.net.loss));
  add(c.net.duplicate > 0, fmt::format("dup {:.3f}", c.net.duplicate));
  add(c.net.delay_prob > 0,
      fmt::format("delay {:.2f}x{:.2g}s", c.net.delay_prob, secs(c.net.delay_max)));
  add(c.net.reorder > 0, fmt::format("reorder {:.2f}", c.net.reorder));
  add(!c.d.send_releases, "D sends no releases");
  add(c.net.release_loss > 0, fmt::format("releases/notices lost {:.2f}", c.net.release_loss));
  add(c.net.drop_renewals_from != core::kNever,
      fmt::format("renewals lost {:.2f}-{:.2f}s", At(c.net.drop_renewals_from),
                  At(c.net.drop_renewals_until)));
  add(c.p.layer_planes > 0, fmt::format("layer writes over {} planes", c.p.layer_planes));
  add(c.faults.d_crash != core::kNever, fmt::format("D crash {:.2f}s", At(c.faults.d_crash)));
  add(c.faults.p_crash != core::kNever, fmt::format("P crash {:.2f}s", At(c.faults.p_crash)));
  add(c.faults.p_restarts > 0,
      fmt::format("{} P restarts ({:.2g}s down, {:.2g}s up, {} addresses, {}); D keeps {} idle "
                  "side channels, {} in all",
                  c.faults.p_restarts, secs(c.faults.p_down_for), secs(c.faults.p_up_for),
                  c.faults.p_same_address ? "same" : "new",
                  c.d.liveness ? "liveness source" : "no liveness source", c.d.max_idle_endpoints,
                  c.d.max_endpoints));
  add(c.faults.p_declared_down != core::kNever,
      fmt::format("P declared down while alive {:.2f}s", At(c.faults.p_declared_down)));
  add(c.faults.fence_unsupported, "no fence of a live P");
  add(c.faults.late_pull > 0, fmt::format("late pulls {:.2f}", c.faults.late_pull));
  add(c.faults.silent_engines > 0, fmt::format("{} silent P engines", c.faults.silent_engines));
  add(c.faults.hostile_pulls > 0, fmt::format("{} hostile pulls", c.faults.hostile_pulls));
  add(c.faults.peer_err > 0, fmt::format("peer err {:.2f}", c.faults.peer_err));
  add(c.faults.peer_msg_error > 0, fmt::format("peer ERROR {:.2f}", c.faults.peer_msg_error));
  add(c.faults.p0_err_after_write > 0,
      fmt::format("P0 err after write {:.2f}", c.faults.p0_err_after_write));
  add(c.faults.p1_write_delay.count() > 0,
      fmt::format("P1 delay {:.2g}s", secs(c.faults.p1_write_delay)));
  add(c.faults.unsettled_write > 0,
      fmt::format("unsettled writes {:.2f}", c.faults.unsettled_write));
  add(c.faults.slow_write > 0,
      fmt::format("slow writes {:.2f}x{:.2g}s", c.faults.slow_write, secs(c.faults.slow_max)));
  std::size_t aborts = 0;
  for (const RequestSpec& q : c.load.requests) aborts += q.abort_at != core::kNever;
  add(aborts > 0, fmt::format("{} aborts", aborts));
  return out;
}

std::string ReproCommand(std::uint64_t seed) {
  return fmt::format("kvferry sim --explore 1 --seed {}", seed);
}

ExploreReport Explore(const ExploreOptions& options) {
  ExploreReport report;
  for (std::uint64_t i = 0; i < options.runs; ++i) {
    const std::uint64_t seed = options.first_seed + i;
    SimConfig config = RandomConfig(seed);
    config.variants = options.variants;
    SimResult run = RunCluster(config);
    ++report.runs;
    report.events += run.events;
    report.pull_timeouts += run.pull_timeouts;
    report.late_replies += run.late_replies;
    report.fences += run.fences;
    report.duplicate_pulls_dropped += run.duplicate_pulls_dropped;
    report.layer_writes += run.layer_writes;
    report.hostile_pulls += run.hostile_pulls_sent;
    report.messages_to_silent_engines += run.messages_to_silent_engines;
    report.messages_unsent += run.messages_unsent;
    report.p_restarts += run.p_restarts;
    report.pulls_to_restarted += run.pulls_to_restarted;
    report.replies_to_closed += run.replies_to_closed;
    report.shared_key_quarantines += run.shared_key_quarantine ? 1 : 0;
    report.releases_delivered += run.releases_delivered;
    report.notices_delivered += run.notices_delivered;
    report.failed_by_notice += run.failed_by_notice;
    report.unsettled_writes += run.unsettled_writes;
    report.unsettled_writes_landed += run.unsettled_writes_landed;
    report.requests += run.requests.size();
    report.ok += run.Count(Outcome::kOk);
    report.failed += run.Count(Outcome::kFailed);
    report.aborted += run.Count(Outcome::kAborted);
    if (!run.violations.empty()) {
      report.failures.push_back({seed, Describe(config), std::move(run.violations)});
      if (options.stop_at_first_failure) break;
    }
  }
  return report;
}

}  // namespace kvferry::sim
