#include "scenarios.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "legacy_ledger.h"
#include "rng.h"

namespace kvferry::sim {

namespace {

TimePoint T(double s) { return kT0 + core::Seconds(s); }
double Secs(Duration d) { return core::ToSeconds(d); }
std::string Fmt(double v, const char* unit = "s", int digits = 1) {
  if (v < 0) return "never";
  return fmt::format("{:.{}f} {}", v, digits, unit);
}

// DeepSeek-MoE-16B as in seed 000: 28 layers, 16 KV heads of dim 128, bf16; block 16 tokens.
ModelConfig DeepSeekMoe16B() {
  ModelConfig m;
  m.block_tokens = 16;
  m.kv_heads = 16;
  m.kv_bytes_per_token_per_head = 2ull * 28 * 128 * 2;
  return m;
}

// Seed 000's deployment at full scale (docs/simulation.md, "Calibration"):
//  - D's KV holds 128 · 4,000 tokens / 2.4 = 213,333 tokens (13,333 blocks): ~53 requests at
//    once, so D always has a queue.
//  - P runs the same model on the same GPU type, so its pool is about the same: 13,250 blocks,
//    which 70 held 3,000-token prompts fill to 99.3% (the seed's "99%"); the 71st cannot fit.
//  - P prefills 4 ms + 70 µs per token per step (8,192-token budget), so a lone 512-token probe
//    takes ~40 ms (the seed's later probes: 36–46 ms) and the 128 prompts take ~27 s.
//  - D decodes a step in 20 ms + 0.3 ms per running sequence: ~36 ms at 53 sequences, ~36 s for
//    1,000 tokens, so the third wave waits ~80 s on D (the seed's case B).
SimConfig SeedDeployment(std::uint64_t seed) {
  SimConfig c;
  c.seed = seed;
  c.model = DeepSeekMoe16B();
  c.p.tp = 1;
  c.p.blocks = 13250;
  c.p.max_batch_tokens = 8192;
  c.p.step_overhead = 4ms;
  c.p.per_token = 70us;
  c.p.jitter = 0.1;
  c.p.timer_late_max = 1s;  // a worker that wakes up to a second late, as a 1 s scan would
  c.d.tp = 1;
  c.d.blocks = 13333;
  c.d.step_base = 20ms;
  c.d.per_seq = 300us;
  c.dp.bytes_per_s = 25e9;  // 200 Gb/s HDR InfiniBand
  for (int i = 0; i < 128; ++i) c.load.requests.push_back({kT0, 3000, 1000, core::kNever});
  // 128 concurrent streams: they reach P and D within ~100 ms, in unrelated orders.
  c.proxy_jitter = 100ms;
  c.load.probe_every = 10s;
  c.load.probe_tokens = 512;
  return c;
}

void SetPolicy(SimConfig& c, bool lease, double seconds) {
  if (lease) {
    c.p.hold.lease = core::Seconds(seconds);
    c.d.lease = core::Seconds(seconds);
    c.p.hold.abort_request_timeout = 480s;
  } else {
    c.p.hold.lease = Duration{0};
    c.d.lease = Duration{0};
    c.p.hold.abort_request_timeout = core::Seconds(seconds);
  }
  // D's own deadline for an answer: beyond anything P may legitimately make it wait.
  c.d.pull_timeout = c.p.hold.abort_request_timeout + c.d.write_bound + 30s;
}

double Latency(const ProbeResult& p) { return p.done == core::kNever ? -1 : Secs(p.done - p.sent); }

}  // namespace

double PctAt(const SimResult& r, double t) {
  double v = 0;
  for (const KvSample& s : r.samples) {
    if (s.t > t + 1e-9) break;
    v = s.p_pct;
  }
  return v;
}

// ------------------------------------------------------------------------------------------ A

SimConfig ScenarioAConfig(bool lease, std::uint64_t seed) {
  SimConfig c = SeedDeployment(seed);
  SetPolicy(c, lease, lease ? 30 : 480);
  c.faults.d_crash = T(23);
  c.load.probe_from = kT0;
  c.load.probe_until = T(650);
  c.horizon = T(660);  // the seed's run ends at t = 660 s
  c.sample_every = 1s;
  return c;
}

FiguresA ComputeFiguresA(const SimResult& run) {
  FiguresA f;
  if (run.p_kv_left_full != core::kNever) f.kv_left_full_s = At(run.p_kv_left_full);
  if (run.p_kv_below_5 != core::kNever) f.kv_below_5_s = At(run.p_kv_below_5);
  if (!run.samples.empty()) f.kv_at_end_pct = run.samples.back().p_pct;
  f.kv_at_crash_plus_30_pct = PctAt(run, 53);
  for (const ProbeResult& p : run.probes) {
    if (std::abs(At(p.sent) - 10) < 1e-6) f.probe10_s = Latency(p);
    if (f.kv_below_5_s >= 0 && At(p.sent) >= f.kv_below_5_s && p.done != core::kNever) {
      const double l = Latency(p);
      f.later_probe_min_s = f.later_probe_min_s < 0 ? l : std::min(f.later_probe_min_s, l);
      f.later_probe_max_s = std::max(f.later_probe_max_s, l);
    }
  }
  f.requests_ok = run.Count(Outcome::kOk);
  return f;
}

ScenarioA RunScenarioA(std::uint64_t seed) {
  return {RunCluster(ScenarioAConfig(false, seed)), RunCluster(ScenarioAConfig(true, seed))};
}

std::string ReportA(const ScenarioA& a) {
  const FiguresA t = ComputeFiguresA(a.timeout);
  const FiguresA l = ComputeFiguresA(a.lease);
  std::string out;
  out += "A. D killed at t=23 s; 480 s timeout (no lease) vs 30 s lease\n";
  out += "   128 requests x 3,000-token prompts x 1,000 output tokens (2.4x D's KV); 512-token\n";
  out += "   probe straight to P every 10 s; run ends at t=660 s\n\n";
  out += fmt::format("   {:<40} {:>18} {:>18}\n", "figure", "480 s timeout", "30 s lease");
  out += fmt::format("   {:<40} {:>18} {:>18}\n",
                     "P's KV leaves >=95% at t=", Fmt(t.kv_left_full_s), Fmt(l.kv_left_full_s));
  out += fmt::format("   {:<40} {:>18} {:>18}\n", "P's KV below 5% at t=", Fmt(t.kv_below_5_s),
                     Fmt(l.kv_below_5_s));
  out += fmt::format("   {:<40} {:>17.1f}% {:>17.1f}%\n", "P's KV at t=53 s (crash + lease)",
                     t.kv_at_crash_plus_30_pct, l.kv_at_crash_plus_30_pct);
  out += fmt::format("   {:<40} {:>17.1f}% {:>17.1f}%\n", "P's KV at t=660 s", t.kv_at_end_pct,
                     l.kv_at_end_pct);
  out += fmt::format("   {:<40} {:>18} {:>18}\n", "latency of the probe sent at t=10 s",
                     Fmt(t.probe10_s), Fmt(l.probe10_s));
  auto later = [](const FiguresA& f) {
    if (f.later_probe_min_s < 0) return std::string("n/a");
    return fmt::format("{:.0f}-{:.0f} ms", f.later_probe_min_s * 1e3, f.later_probe_max_s * 1e3);
  };
  out +=
      fmt::format("   {:<40} {:>18} {:>18}\n", "probes sent once P's KV < 5%", later(t), later(l));
  out += fmt::format("   {:<40} {:>18} {:>18}\n", "requests that succeeded",
                     fmt::format("{}/128", t.requests_ok), fmt::format("{}/128", l.requests_ok));
  out += "\n   seed (vLLM, 2x A800):\n";
  out += "     unmodified main: P's KV stays at 99% until t~484 s; the probe sent at t~10 s\n";
  out += "                      takes 475.5 s; P is still at 37% KV when the run ends (660 s)\n";
  out += "     30 s lease:      P's KV is below 5% at t~103 s; that probe takes 61.3 s, later\n";
  out += "                      probes 36-46 ms\n";
  return out;
}

std::string TimelineA(const ScenarioA& a, double every_s, bool csv) {
  std::string out =
      csv ? "t_s,p_kv_pct_timeout,p_kv_pct_lease\n"
          : fmt::format("   {:>6}  {:>16}  {:>16}\n", "t (s)", "P KV % timeout", "P KV % lease");
  const std::size_t n = std::min(a.timeout.samples.size(), a.lease.samples.size());
  double next = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const KvSample& t = a.timeout.samples[i];
    if (t.t + 1e-9 < next) continue;
    next += every_s;
    const KvSample& l = a.lease.samples[i];
    out += csv ? fmt::format("{:.0f},{:.2f},{:.2f}\n", t.t, t.p_pct, l.p_pct)
               : fmt::format("   {:>6.0f}  {:>15.1f}%  {:>15.1f}%\n", t.t, t.p_pct, l.p_pct);
  }
  return out;
}

// ------------------------------------------------------------------------------------------ B

SimConfig ScenarioBConfig(bool lease, std::uint64_t seed) {
  SimConfig c = SeedDeployment(seed);
  SetPolicy(c, lease, 20);
  c.load.probe_from = kT0;
  c.load.probe_until = T(300);
  c.horizon = T(320);
  c.sample_every = 1s;
  return c;
}

FiguresB ComputeFiguresB(const SimResult& run) {
  FiguresB f;
  f.total = run.requests.size();
  f.ok = run.Count(Outcome::kOk);
  f.failed = run.Count(Outcome::kFailed);
  for (const RequestResult& r : run.requests) {
    if (r.d_admitted != core::kNever) {
      f.max_wait_on_d_s = std::max(f.max_wait_on_d_s, Secs(r.d_admitted - r.arrival));
    }
  }
  f.expired_on_p = run.hold_stats.released[core::ReleaseReason::kExpired];
  for (const KvSample& s : run.samples) {
    if (s.p_pct >= 95.0) f.p_full_s += 1.0;
  }
  for (const ProbeResult& p : run.probes) f.max_probe_s = std::max(f.max_probe_s, Latency(p));
  return f;
}

ScenarioB RunScenarioB(std::uint64_t seed) {
  return {RunCluster(ScenarioBConfig(false, seed)), RunCluster(ScenarioBConfig(true, seed))};
}

std::string ReportB(const ScenarioB& b) {
  const FiguresB t = ComputeFiguresB(b.timeout);
  const FiguresB l = ComputeFiguresB(b.lease);
  std::string out;
  out += "B. No crash, requests queue on D; 20 s timeout vs 20 s lease\n\n";
  out += fmt::format("   {:<40} {:>18} {:>18}\n", "figure", "20 s timeout", "20 s lease");
  out +=
      fmt::format("   {:<40} {:>18} {:>18}\n", "requests failed",
                  fmt::format("{}/{}", t.failed, t.total), fmt::format("{}/{}", l.failed, l.total));
  out += fmt::format("   {:<40} {:>18} {:>18}\n", "requests succeeded",
                     fmt::format("{}/{}", t.ok, t.total), fmt::format("{}/{}", l.ok, l.total));
  out += fmt::format("   {:<40} {:>18} {:>18}\n", "longest wait on D (arrival -> pull)",
                     Fmt(t.max_wait_on_d_s), Fmt(l.max_wait_on_d_s));
  out += fmt::format("   {:<40} {:>18} {:>18}\n", "holds expired on P", t.expired_on_p,
                     l.expired_on_p);
  out += fmt::format("   {:<40} {:>18} {:>18}\n", "time P's KV >= 95%", Fmt(t.p_full_s, "s", 0),
                     Fmt(l.p_full_s, "s", 0));
  out += fmt::format("   {:<40} {:>18} {:>18}\n", "slowest probe", Fmt(t.max_probe_s),
                     Fmt(l.max_probe_s));
  out +=
      "\n   seed: 79/128 fail with the 20 s timeout; 128/128 succeed with the lease and no lease\n";
  out +=
      "         expires; with the lease P sits at 99% for ~40 s and a probe waits 35 s (timeout:\n";
  out += "         probe 17 s); requests wait on D up to ~80 s\n";
  return out;
}

// ------------------------------------------------------------------------------------------ C

SimConfig ScenarioCConfig(bool old_logic, std::uint64_t seed) {
  SimConfig c;
  c.seed = seed;
  // Qwen3-32B as in seed 002: 64 layers, 8 KV heads of dim 128, bf16; block 16 tokens.
  c.model.block_tokens = 16;
  c.model.kv_heads = 8;
  c.model.kv_bytes_per_token_per_head = 2ull * 64 * 128 * 2;
  c.p.tp = 2;
  c.p.blocks = 40000;
  c.p.per_token = 40us;
  c.p.hold.abort_request_timeout = 480s;
  c.d.tp = 1;
  c.d.blocks = 6000;  // ~30 requests at once: D runs full, so freed blocks are reused at once
  c.d.pull_timeout = 600s;
  c.faults.p0_err_after_write = 0.05;
  c.faults.p1_write_delay = 500ms;
  // A replayed trace stand-in: Poisson arrivals at 4.5/s (a little above what D sustains, so
  // D always has a queue), coder-like prompts (log-uniform 500–8,000 tokens), 50–500 outputs.
  // The workload comes from its own generator so both variants replay the same trace.
  Rng trace(seed ^ 0x7472616365ull);
  double t = 0;
  for (int i = 0; i < 791; ++i) {
    t += -std::log(1 - trace.Real()) / 4.5;
    const double prompt = std::exp(std::log(500.0) + trace.Real() * std::log(16.0));
    c.load.requests.push_back({T(t), static_cast<std::uint32_t>(prompt),
                               static_cast<std::uint32_t>(trace.Between(50, 500)), core::kNever});
  }
  c.horizon = T(3600);
  if (old_logic) {
    c.variants.make_ledger = [] { return std::make_unique<LegacyLedger>(); };
  }
  return c;
}

FiguresC ComputeFiguresC(const SimResult& run) {
  FiguresC f;
  f.requests = run.requests.size();
  f.written_by_both = run.requests_written_by_all_peers;
  f.p0_failures = run.p0_injected_failures;
  f.p1_after_free = run.writes_after_free.size() > 1 ? run.writes_after_free[1] : 0;
  f.p1_after_realloc = run.writes_after_realloc.size() > 1 ? run.writes_after_realloc[1] : 0;
  f.failed = run.Count(Outcome::kFailed);
  return f;
}

ScenarioC RunScenarioC(std::uint64_t seed) {
  return {RunCluster(ScenarioCConfig(true, seed)), RunCluster(ScenarioCConfig(false, seed))};
}

std::string ReportC(const ScenarioC& c) {
  const FiguresC o = ComputeFiguresC(c.old_logic);
  const FiguresC f = ComputeFiguresC(c.fixed);
  std::string out;
  out += "C. Multi-peer write-after-free: P TP2 -> D TP1; P0 reports an error after a successful\n";
  out += "   WRITE for 5% of requests; P1 delays each WRITE by 0-500 ms\n\n";
  out += fmt::format("   {:<46} {:>10} {:>10} {:>10} {:>10}\n", "requests", "old logic", "fixed",
                     "seed old", "seed fix");
  out += fmt::format("   {:<46} {:>10} {:>10} {:>10} {:>10}\n", "total", o.requests, f.requests,
                     791, 791);
  out += fmt::format("   {:<46} {:>10} {:>10} {:>10} {:>10}\n", "  with WRITEs from both P peers",
                     o.written_by_both, f.written_by_both, 791, 791);
  out += fmt::format("   {:<46} {:>10} {:>10} {:>10} {:>10}\n", "P0 injected failures",
                     o.p0_failures, f.p0_failures, 33, 39);
  out += fmt::format("   {:<46} {:>10} {:>10} {:>10} {:>10}\n",
                     "P1 WRITE started after destination block free", o.p1_after_free,
                     f.p1_after_free, 21, 0);
  out += fmt::format("   {:<46} {:>10} {:>10} {:>10} {:>10}\n", "  of those, after reallocation",
                     o.p1_after_realloc, f.p1_after_realloc, 20, 0);
  out += fmt::format("   {:<46} {:>10} {:>10} {:>10} {:>10}\n", "requests failed (on D)", o.failed,
                     f.failed, "-", "-");
  return out;
}

// ------------------------------------------------------------------------------------------ D

SimConfig ScenarioDConfig(LatePullVariant variant, std::uint64_t seed) {
  SimConfig c = SeedDeployment(seed);
  c.load.requests.clear();
  c.load.probe_every = Duration{0};
  // Request 0 occupies all of D for ~30 s (3,000 + 1,450 tokens, 20.3 ms per step); request 1
  // arrives with it and waits on D, so its pull is sent only at ~30 s: after P freed its KV
  // (20 s) and while P still remembers the id (a tombstone lives abort_request_timeout, SPEC
  // §2.5). Until P's timer was driven by NextDeadline the simulator stopped P's passes once the
  // table was empty, so tombstones never expired and a pull at ~60 s still found one.
  c.proxy_jitter = Duration{0};
  c.load.requests.push_back({kT0, 3000, 1450, core::kNever});
  c.load.requests.push_back({T(0.001), 3000, 10, core::kNever});
  c.d.blocks = 400;
  switch (variant) {
    case LatePullVariant::kTimeout:
      SetPolicy(c, false, 20);
      break;
    case LatePullVariant::kLease:
      SetPolicy(c, true, 20);
      c.net.drop_renewals_from = kT0;  // every renewal is lost: P's lease runs out
      c.net.drop_renewals_until = T(1000);
      break;
    case LatePullVariant::kNoTombstones:
      SetPolicy(c, false, 20);
      c.p.hold.max_tombstones = 0;  // P forgets freed ids: a late pull looks like an early one
      break;
  }
  c.horizon = T(900);
  return c;
}

FiguresD ComputeFiguresD(const SimResult& run) {
  FiguresD f;
  if (run.requests.size() < 2) return f;
  const RequestResult& r = run.requests[1];
  if (r.d_admitted != core::kNever) f.pull_sent_s = At(r.d_admitted);
  f.failed = r.outcome == Outcome::kFailed;
  if (r.d_admitted != core::kNever && r.end != core::kNever) {
    f.time_to_fail_s = Secs(r.end - r.d_admitted);
  }
  f.error = r.error.ToString();
  return f;
}

ScenarioD RunScenarioD(std::uint64_t seed) {
  return {RunCluster(ScenarioDConfig(LatePullVariant::kTimeout, seed)),
          RunCluster(ScenarioDConfig(LatePullVariant::kLease, seed)),
          RunCluster(ScenarioDConfig(LatePullVariant::kNoTombstones, seed))};
}

std::string ReportD(const ScenarioD& d) {
  std::string out;
  out += "D. Late pull: D pulls a transfer P already freed (D was busy for ~30 s)\n\n";
  out += fmt::format("   {:<38} {:>10} {:>14}  {}\n", "variant", "pulled at", "time to fail",
                     "D's error");
  auto row = [&out](const char* name, const SimResult& run) {
    const FiguresD f = ComputeFiguresD(run);
    const std::string ttf = !f.failed ? std::string("did not fail")
                            : f.time_to_fail_s < 1
                                ? fmt::format("{:.3f} ms", f.time_to_fail_s * 1e3)
                                : fmt::format("{:.1f} s", f.time_to_fail_s);
    out += fmt::format("   {:<38} {:>10} {:>14}  {}\n", name, Fmt(f.pull_sent_s), ttf, f.error);
  };
  row("no lease, 20 s timeout (tombstone)", d.timeout);
  row("20 s lease, renewals lost (tombstone)", d.lease);
  row("no tombstones (pre-seed P), 20 s", d.no_tombstones);
  out +=
      "\n   seed: a pull for freed KV fails at once (milliseconds), with and without the lease,\n";
  out += "         instead of waiting out the timeout\n";
  return out;
}

// ------------------------------------------------------------------------------------------ E

SimConfig ScenarioEConfig(CancelPolicy policy, std::uint64_t seed) {
  SimConfig c = SeedDeployment(seed);
  SetPolicy(c, policy != CancelPolicy::kTimeout, policy == CancelPolicy::kTimeout ? 480 : 30);
  c.d.send_releases = policy == CancelPolicy::kLeaseAndRelease;
  Rng rng(seed ^ 0xe5e5e5e5ULL);  // the same cancellations under every policy
  for (std::size_t i = 0; i < c.load.requests.size(); ++i) {
    if (i % 10 < 3) c.load.requests[i].d_cancel_at = T(2) + rng.Span(Duration{0}, 38s);
  }
  c.load.probe_every = Duration{0};
  c.horizon = T(600);
  c.sample_every = 1s;
  return c;
}

ScenarioE RunScenarioE(std::uint64_t seed) {
  return {RunCluster(ScenarioEConfig(CancelPolicy::kTimeout, seed)),
          RunCluster(ScenarioEConfig(CancelPolicy::kLease, seed)),
          RunCluster(ScenarioEConfig(CancelPolicy::kLeaseAndRelease, seed))};
}

namespace {

// Integral of P's KV % over the run, in %·s: the KV held, whoever it was for.
double KvPercentSeconds(const SimResult& run) {
  double total = 0;
  for (std::size_t i = 1; i < run.samples.size(); ++i) {
    total += run.samples[i - 1].p_pct * (run.samples[i].t - run.samples[i - 1].t);
  }
  return total;
}

double LastEnd(const SimResult& run, Outcome outcome) {
  double t = -1;
  for (const RequestResult& r : run.requests) {
    if (r.outcome == outcome && r.end != core::kNever) t = std::max(t, At(r.end));
  }
  return t;
}

double FirstBelow(const SimResult& run, double pct, double after) {
  for (const KvSample& s : run.samples) {
    if (s.t > after && s.p_pct < pct) return s.t;
  }
  return -1;
}

}  // namespace

std::string ReportE(const ScenarioE& e) {
  const SimResult* runs[] = {&e.timeout, &e.lease, &e.release};
  std::string out;
  out += "E. 30% of clients leave D while their requests queue there; P is not told\n";
  out += "   (vLLM #50425). Same load as A without the crash; run ends at t=600 s\n\n";
  out += fmt::format("   {:<38} {:>16} {:>16} {:>16}\n", "figure", "480 s timeout", "30 s lease",
                     "lease + release");
  auto row = [&](const std::string& name, auto value) {
    out += fmt::format("   {:<38}", name);
    for (const SimResult* r : runs) out += fmt::format(" {:>16}", value(*r));
    out += "\n";
  };
  for (double t : {20.0, 45.0, 60.0, 120.0, 300.0}) {
    row(fmt::format("P's KV at t={:.0f} s", t),
        [t](const SimResult& r) { return fmt::format("{:.1f}%", PctAt(r, t)); });
  }
  row("P's KV below 5% (after t=5 s) at t=",
      [](const SimResult& r) { return Fmt(FirstBelow(r, 5, 5)); });
  row("P's KV held, %·s (whole run)",
      [](const SimResult& r) { return fmt::format("{:.0f}", KvPercentSeconds(r)); });
  row("requests ok / cancelled", [](const SimResult& r) {
    return fmt::format("{}/{}", r.Count(Outcome::kOk), r.Count(Outcome::kAborted));
  });
  row("last successful request ends at t=",
      [](const SimResult& r) { return Fmt(LastEnd(r, Outcome::kOk)); });
  out += "\n   Without a release, P keeps a cancelled request's KV until D's renewals have been\n";
  out += "   missing for a lease (or for the 480 s timeout without one); with it, P frees the KV\n";
  out += "   (or aborts the prefill) as soon as the Release arrives.\n";
  return out;
}

std::string TimelineE(const ScenarioE& e, double every_s, bool csv) {
  std::string out = csv ? "t_s,p_kv_pct_timeout,p_kv_pct_lease,p_kv_pct_lease_release\n"
                        : fmt::format("   {:>6}  {:>14}  {:>14}  {:>16}\n", "t (s)", "timeout",
                                      "lease", "lease + release");
  const std::size_t n =
      std::min({e.timeout.samples.size(), e.lease.samples.size(), e.release.samples.size()});
  double next = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double t = e.timeout.samples[i].t;
    if (t + 1e-9 < next) continue;
    next += every_s;
    const double a = e.timeout.samples[i].p_pct, b = e.lease.samples[i].p_pct,
                 c = e.release.samples[i].p_pct;
    out += csv ? fmt::format("{:.0f},{:.2f},{:.2f},{:.2f}\n", t, a, b, c)
               : fmt::format("   {:>6.0f}  {:>13.1f}%  {:>13.1f}%  {:>15.1f}%\n", t, a, b, c);
  }
  return out;
}

}  // namespace kvferry::sim
