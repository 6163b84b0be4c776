#include "demo_runner.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include "client_http.h"
#include "client_load.h"
#include "client_probe.h"
#include "demo_process.h"
#include "demo_trace.h"

namespace kvferry::harness {

namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// ---------------------------------------------------------------------------------------------
// Parameters of each case. Times are demo (wall) seconds; the seed's are `scale` times larger.

struct ParamsA {
  int requests, prompt, max_tokens, block_tokens = 16;
  int p_blocks, d_blocks;
  int prefill_us_per_token, prefill_us_per_batch, decode_us_per_step;
  double timeout_s, lease_s, kill_at_s, run_end_s, probe_every_s;
  int probe_tokens;
  double sample_s;
};

struct ParamsC {
  int requests, batch, prompt, max_tokens, block_tokens = 16;
  int p_blocks, d_blocks;
  int prefill_us_per_token, decode_us_per_step;
  double err_fraction;
  int write_delay_ms;
};

struct ParamsD {
  double hold_s;  // the timeout (no lease) and the lease
  int prompt;
};

int BlocksFor(int tokens, int block_tokens) { return (tokens + block_tokens - 1) / block_tokens; }

ParamsA FullA(double scale) {
  ParamsA p{};
  // Seed: 128 x 3,000-token prompts x 1,000 output tokens, 2.4x D's KV; DeepSeek-MoE-16B on
  // A800 (the simulator's calibration: P pool 13,250 blocks, 70 us/token + 4 ms/step prefill,
  // ~36 ms per decode step). Output tokens are cut 10x (each step keeps its seed cost, so a
  // decode wave takes seed/10 time) to keep the number of SSE events small on 2 cores.
  p.requests = 128;
  p.prompt = 3000;
  p.max_tokens = 100;
  p.p_blocks = 13250;
  p.d_blocks = static_cast<int>(128.0 * BlocksFor(p.prompt + p.max_tokens, 16) / 2.4);
  p.prefill_us_per_token = static_cast<int>(std::lround(70 / scale));
  p.prefill_us_per_batch = static_cast<int>(std::lround(4000 / scale));
  p.decode_us_per_step = static_cast<int>(std::lround(36000 * (1000.0 / p.max_tokens) / scale));
  p.timeout_s = 480 / scale;
  p.lease_s = 30 / scale;
  p.kill_at_s = 23 / scale;
  p.run_end_s = 660 / scale;
  p.probe_every_s = 10 / scale;
  p.probe_tokens = 512;
  p.sample_s = 1 / scale;
  return p;
}

ParamsA QuickA() {
  ParamsA p{};
  p.requests = 24;
  p.prompt = 1024;
  p.max_tokens = 16;
  p.p_blocks = 14 * BlocksFor(1024, 16) + 8;  // ~14 held prompts fill P
  p.d_blocks = static_cast<int>(24.0 * BlocksFor(1024 + 16, 16) / 2.4);
  p.prefill_us_per_token = 20;
  p.prefill_us_per_batch = 1000;
  p.decode_us_per_step = 100000;  // 1.6 s per decode wave
  p.timeout_s = 5;
  p.lease_s = 1;
  p.kill_at_s = 1.0;
  p.run_end_s = 7;
  p.probe_every_s = 0.5;
  p.probe_tokens = 128;
  p.sample_s = 0.1;
  return p;
}

ParamsA FullB(double scale) {
  ParamsA p = FullA(scale);
  p.timeout_s = 20 / scale;
  p.lease_s = 20 / scale;
  return p;
}

ParamsA QuickB() {
  ParamsA p = QuickA();
  p.timeout_s = 1;
  p.lease_s = 1;
  return p;
}

ParamsC FullC(double scale) {
  ParamsC p{};
  p.requests = 791;
  p.batch = 128;
  p.prompt = 1024;
  p.max_tokens = 16;
  p.p_blocks = 2 * p.batch * BlocksFor(p.prompt, 16);
  p.d_blocks = 30 * BlocksFor(p.prompt + p.max_tokens, 16);  // ~30 requests: D runs full
  p.prefill_us_per_token = 2;
  p.decode_us_per_step = 10000;
  p.err_fraction = 0.05;
  p.write_delay_ms = static_cast<int>(std::lround(500 / scale));
  return p;
}

ParamsC QuickC() {
  ParamsC p{};
  p.requests = 60;
  p.batch = 60;
  p.prompt = 512;
  p.max_tokens = 4;
  p.p_blocks = 2 * p.batch * BlocksFor(p.prompt, 16);
  p.d_blocks = 10 * BlocksFor(p.prompt + p.max_tokens, 16);
  p.prefill_us_per_token = 2;
  p.decode_us_per_step = 10000;
  p.err_fraction = 0.10;
  p.write_delay_ms = 20;
  return p;
}

// ---------------------------------------------------------------------------------------------
// The environment: where logs go, which binary to run, what to check.

struct Env {
  DemoOptions o;
  std::string bin;
  std::string logs;
  std::string run_tag;
  std::vector<std::string> failed_checks;
  std::vector<std::string> passed_checks;
  std::string gnuplot_note;

  void Check(bool ok, const std::string& what) {
    (ok ? passed_checks : failed_checks).push_back(what);
    std::printf("   check: %-4s %s\n", ok ? "ok" : "FAIL", what.c_str());
    std::fflush(stdout);
  }
  void Note(const std::string& line) const { std::fprintf(stderr, "[demo] %s\n", line.c_str()); }
};

std::string Fixed(double v, int digits = 1) {
  if (v < 0) return "n/a";
  return fmt::format("{:.{}f}", v, digits);
}

// A `kvferry serve` instance (or the proxy) started by the demo.
struct Instance {
  std::string name;
  std::unique_ptr<ChildProcess> proc;
  std::string url;
  std::string bootstrap;  // P: host:port
  std::string engine_id;
  std::string trace;
};

std::map<std::string, std::string> ChildEnv(const Env& env) {
  std::map<std::string, std::string> e{{"KVFERRY_DEMO_RUN", env.run_tag}};
  if (std::getenv("UCX_NET_DEVICES") == nullptr) e["UCX_NET_DEVICES"] = "lo";
  return e;
}

std::optional<Instance> StartServe(Env& env, const std::string& name, bool prefill, int tp,
                                   json extra, const std::vector<std::string>& args, bool trace,
                                   std::string* error) {
  Instance inst;
  inst.name = name;
  inst.engine_id = name;
  const std::string ready = env.logs + "/" + name + ".ready.json";
  const std::string log = env.logs + "/" + name + ".log";
  std::error_code ec;
  fs::remove(ready, ec);
  if (prefill) extra["bootstrap_port"] = 0;
  if (!env.o.etcd_endpoints.empty()) extra["etcd_endpoints"] = env.o.etcd_endpoints;
  const DemoHost& host = prefill ? env.o.p_host : env.o.d_host;
  const json config = {{"kv_connector", "kvferry"},
                       {"kv_role", prefill ? "kv_producer" : "kv_consumer"},
                       {"engine_id", name},
                       {"kv_load_failure_policy", "fail"},
                       {"kv_connector_extra_config", extra}};
  std::vector<std::string> argv;
  if (!host.netns.empty()) argv = {"ip", "netns", "exec", host.netns};
  const std::vector<std::string> serve = {env.bin,
                                   "serve",
                                   "--role",
                                   prefill ? "prefill" : "decode",
                                   "--host",
                                   host.address,
                                   "--port",
                                   "0",
                                   "--tp",
                                   std::to_string(tp),
                                   "--kv-transfer-config",
                                   config.dump(),
                                   "--ready-file",
                                   ready};
  argv.insert(argv.end(), serve.begin(), serve.end());
  argv.insert(argv.end(), args.begin(), args.end());
  if (trace) {
    inst.trace = env.logs + "/" + name + ".trace.jsonl";
    fs::remove(inst.trace, ec);
    argv.push_back("--trace-file");
    argv.push_back(inst.trace);
  }
  {
    std::ofstream(log, std::ios::app) << "\n# " << fmt::format("{}", fmt::join(argv, " ")) << "\n";
  }
  inst.proc = ChildProcess::Spawn(argv, log, ChildEnv(env), error);
  if (!inst.proc) return std::nullopt;
  json info;
  const bool ready_ok = WaitFor(
      [&] {
        std::ifstream in(ready);
        if (!in) return false;
        std::stringstream ss;
        ss << in.rdbuf();
        info = json::parse(ss.str(), nullptr, false);
        return !info.is_discarded() && info.contains("port");
      },
      60, 0.05, [&] { return inst.proc->Running(); });
  if (!ready_ok) {
    if (error) {
      *error =
          fmt::format("{} did not become ready (see {}):\n{}", name, log, inst.proc->LogTail(1500));
    }
    inst.proc->Stop(2);
    return std::nullopt;
  }
  inst.url = fmt::format("http://{}:{}", host.address, info["port"].get<int>());
  if (prefill) {
    inst.bootstrap = fmt::format("{}:{}", host.address, info.value("bootstrap_port", 0));
  }
  inst.engine_id = info.value("engine_id", name);
  if (!WaitFor([&] { return HttpGet(inst.url, "/health", 1).has_value(); }, 15, 0.05,
               [&] { return inst.proc->Running(); })) {
    if (error) *error = fmt::format("{} never answered /health (see {})", name, log);
    inst.proc->Stop(2);
    return std::nullopt;
  }
  return inst;
}

std::optional<Instance> StartProxy(Env& env, const std::string& name, const Instance& p,
                                   const Instance& d, std::string* error) {
  const std::string log = env.logs + "/" + name + ".log";
  for (int attempt = 0; attempt < 5; ++attempt) {
    const int port = FreePort();
    Instance inst;
    inst.name = name;
    inst.url = fmt::format("http://127.0.0.1:{}", port);
    const std::vector<std::string> argv = {env.bin,
                                           "proxy",
                                           "--port",
                                           std::to_string(port),
                                           "--prefill",
                                           p.url,
                                           "--prefill-bootstrap",
                                           p.bootstrap,
                                           "--prefill-engine-id",
                                           p.engine_id,
                                           "--decode",
                                           d.url};
    inst.proc = ChildProcess::Spawn(argv, log, ChildEnv(env), error);
    if (!inst.proc) return std::nullopt;
    if (WaitFor([&] { return HttpGet(inst.url, "/health", 1).has_value(); }, 10, 0.05,
                [&] { return inst.proc->Running(); })) {
      return inst;
    }
    inst.proc->Stop(2);  // most likely the port was taken in between: try another
  }
  if (error) *error = "the proxy did not start (see " + log + ")";
  return std::nullopt;
}

// One /metrics value of an instance; -1 when it cannot be read.
double MetricOf(const Instance& inst, const char* name) {
  const auto text = HttpGet(inst.url, "/metrics", 2);
  if (!text) return -1;
  const auto m = ParsePrometheus(*text);
  const auto it = m.find(name);
  return it == m.end() ? 0.0 : it->second;
}

// How an instance ended: its pool back to empty (no leaked block) and, on D, no corrupt block.
struct EndState {
  bool checked = false;
  double blocks_used = -1;
  double corrupt = -1;  // D only
  bool drained() const { return blocks_used == 0 && corrupt <= 0; }
  std::string Text() const {
    return corrupt < 0 ? fmt::format("{} blocks in use", blocks_used)
                       : fmt::format("{} blocks in use, {} corrupt", blocks_used, corrupt);
  }
};

// Waits up to `timeout_s` for the instance's pool to drain.
EndState WaitDrained(const Instance& inst, bool decode, double timeout_s) {
  EndState e;
  e.checked = true;
  (void)WaitFor([&] { return MetricOf(inst, "kvferry_kv_blocks_used") == 0; }, timeout_s, 0.05);
  e.blocks_used = MetricOf(inst, "kvferry_kv_blocks_used");
  if (decode) e.corrupt = MetricOf(inst, "kvferry_corrupt_blocks_total");
  return e;
}

std::vector<std::string> EngineArgs(int blocks, int block_tokens, int prefill_us_per_token,
                                    int prefill_us_per_batch, int decode_us_per_step,
                                    int max_model_len) {
  return {"--num-blocks",           std::to_string(blocks),
          "--block-tokens",         std::to_string(block_tokens),
          "--prefill-us-per-token", std::to_string(prefill_us_per_token),
          "--prefill-us-per-batch", std::to_string(prefill_us_per_batch),
          "--decode-us-per-step",   std::to_string(decode_us_per_step),
          "--max-model-len",        std::to_string(max_model_len)};
}

// Samples an instance's /metrics every `period` seconds.
struct Sample {
  double t = 0;
  bool ok = false;
  std::map<std::string, double> m;
  double Get(const std::string& k) const {
    const auto it = m.find(k);
    return it == m.end() ? 0 : it->second;
  }
  double UsedPct() const {
    const double total = Get("kvferry_kv_blocks_total");
    return total > 0 ? 100.0 * Get("kvferry_kv_blocks_used") / total : 0;
  }
};

class Sampler {
 public:
  Sampler(std::string url, double period, SteadyClock::time_point t0)
      : url_(std::move(url)), period_(period), t0_(t0) {
    thread_ = std::thread([this] { Loop(); });
  }
  ~Sampler() { Stop(); }
  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  std::vector<Sample> samples() const {
    std::lock_guard<std::mutex> lock(mu_);
    return samples_;
  }
  std::optional<Sample> Last() const {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = samples_.rbegin(); it != samples_.rend(); ++it) {
      if (it->ok) return *it;
    }
    return std::nullopt;
  }

 private:
  void Loop() {
    for (int i = 0;; ++i) {
      const auto due = t0_ + std::chrono::duration_cast<SteadyClock::duration>(
                                 std::chrono::duration<double>(period_ * i));
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (cv_.wait_until(lock, due, [&] { return stop_; })) return;
      }
      Sample s;
      s.t = SecondsSince(t0_);
      const auto text = HttpGet(url_, "/metrics", std::max(period_ * 5, 1.0));
      if (text) {
        s.ok = true;
        s.m = ParsePrometheus(*text);
      }
      std::lock_guard<std::mutex> lock(mu_);
      samples_.push_back(std::move(s));
    }
  }
  std::string url_;
  double period_;
  SteadyClock::time_point t0_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::vector<Sample> samples_;
  std::thread thread_;
};

// P's KV % at time t (the latest good sample at or before t; -1 when none).
double PctAt(const std::vector<Sample>& samples, double t) {
  double v = -1;
  for (const auto& s : samples) {
    if (s.t > t + 0.02) break;  // a sample is taken a few ms after its grid point
    if (s.ok) v = s.UsedPct();
  }
  return v;
}

void SleepUntil(SteadyClock::time_point t) { std::this_thread::sleep_until(t); }

SteadyClock::time_point At(SteadyClock::time_point t0, double s) {
  return t0 + std::chrono::duration_cast<SteadyClock::duration>(std::chrono::duration<double>(s));
}

// ---------------------------------------------------------------------------------------------
// A. D crash, and B. D overload: the same deployment, P TP1 and D TP1 behind the proxy.

struct PolicyRun {
  bool lease = false;
  bool started = false;
  std::string error;
  double kill_t = -1;  // A only
  double end_t = 0;
  std::int64_t t0_ns = 0;  // steady clock at t = 0 (the traces' clock)
  std::string p_trace;     // P's --trace-file (A)
  std::vector<Sample> samples;
  std::vector<ProbeRecord> probes;
  LoadResult load;
  EndState p_end, d_end;  // pools at the end (not waited for where a hold outlives the run)
};

json HoldConfig(bool lease, double timeout_s, double lease_s) {
  json extra = {{"abort_request_timeout", timeout_s}};
  if (lease) extra["kv_lease_duration"] = lease_s;
  return extra;
}

PolicyRun RunDeployment(Env& env, const std::string& tag, const ParamsA& p, bool lease, bool kill_d,
                        double abort_timeout_s, bool trace_p) {
  PolicyRun run;
  run.lease = lease;
  const json extra = HoldConfig(lease, abort_timeout_s, p.lease_s);
  const int max_len = p.prompt + p.max_tokens + 64;
  std::string err;
  env.Note(fmt::format("{}: starting P, D and the proxy", tag));
  auto P = StartServe(env, tag + "-P", true, 1, extra,
                      EngineArgs(p.p_blocks, p.block_tokens, p.prefill_us_per_token,
                                 p.prefill_us_per_batch, p.decode_us_per_step, max_len),
                      trace_p, &err);
  if (!P) {
    run.error = err;
    return run;
  }
  auto D = StartServe(env, tag + "-D", false, 1, extra,
                      EngineArgs(p.d_blocks, p.block_tokens, p.prefill_us_per_token,
                                 p.prefill_us_per_batch, p.decode_us_per_step, max_len),
                      false, &err);
  if (!D) {
    run.error = err;
    return run;
  }
  auto X = StartProxy(env, tag + "-proxy", *P, *D, &err);
  if (!X) {
    run.error = err;
    return run;
  }
  run.started = true;
  run.p_trace = P->trace;

  const auto t0 = SteadyClock::now();
  run.t0_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(t0.time_since_epoch()).count();
  Sampler sampler(P->url, p.sample_s, t0);
  ProbeOptions po;
  po.url = P->url;
  po.every_s = p.probe_every_s;
  po.prompt_tokens = p.probe_tokens;
  po.max_tokens = 1;
  po.duration_s = p.run_end_s;
  po.timeout_s = p.run_end_s + 30;
  Prober prober(po);
  prober.Start(t0);
  if (env.o.verbose) {
    prober.OnProbe([tag](const ProbeRecord& r) {
      std::fprintf(stderr, "[%s] %s\n", tag.c_str(), FormatProbeRecord(r).c_str());
    });
  }
  LoadOptions lo;
  lo.url = X->url;
  lo.requests = p.requests;
  lo.prompt_tokens = p.prompt;
  lo.max_tokens = p.max_tokens;
  lo.ignore_eos = true;
  lo.timeout_s = p.run_end_s + 60;
  lo.label = tag + " load";
  lo.progress_every_s = env.o.verbose ? 1.0 : 0.0;
  CancelGroup cancel;
  std::atomic<bool> load_done{false};
  std::thread load_thread([&] {
    run.load = RunLoad(lo, &cancel);
    load_done = true;
  });

  if (kill_d) {
    SleepUntil(At(t0, p.kill_at_s));
    D->proc->Kill();
    run.kill_t = SecondsSince(t0);
    env.Note(fmt::format("{}: D SIGKILLed (process group) at t={:.2f} s", tag, run.kill_t));
  }
  // A runs until the run's end (with --quick, earlier once nothing is left to see: the load is
  // over, P's KV is below 5%, and every probe has answered, at least two after the drop).
  const auto end = At(t0, kill_d ? p.run_end_s : p.run_end_s * 3);
  while (SteadyClock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (!P->proc->Running()) {
      run.error = "P exited during the run:\n" + P->proc->LogTail(1500);
      break;
    }
    if (!load_done) continue;
    if (!kill_d) break;          // B: the run is the load
    if (!env.o.quick) continue;  // A runs to the seed's (scaled) end, as the seed did
    const auto samples = sampler.samples();
    double below_t = -1;
    for (const auto& s : samples) {
      if (s.ok && s.t > run.kill_t && s.UsedPct() < 5) {
        below_t = s.t;
        break;
      }
    }
    if (below_t < 0) continue;
    const auto probes = prober.Records();
    const bool all_done =
        std::all_of(probes.begin(), probes.end(), [](const ProbeRecord& r) { return r.finished; });
    const auto after = std::count_if(probes.begin(), probes.end(), [&](const ProbeRecord& r) {
      return r.sent_s > below_t && r.finished;
    });
    if (all_done && after >= 2) break;
  }
  run.end_t = SecondsSince(t0);
  prober.Stop(0);
  cancel.CancelAll();
  load_thread.join();
  sampler.Stop();
  run.samples = sampler.samples();
  run.probes = prober.Records();
  // The end state. Without a lease after D's crash, P holds the dead decoder's KV for the whole
  // (scaled) 480 s by design, which outlives the run: that pool is not waited for.
  if (lease || !kill_d) run.p_end = WaitDrained(*P, false, p.lease_s * 2 + 5);
  if (!kill_d) run.d_end = WaitDrained(*D, true, 10);
  X->proc->Stop(5);
  P->proc->Stop(10);
  D->proc->Stop(10);
  env.Note(fmt::format("{}: done at t={:.1f} s ({} ok / {} failed)", tag, run.end_t,
                       run.load.summary.succeeded, run.load.summary.failed));
  return run;
}

struct FiguresA {
  double left_full_s = -1, below5_s = -1, pct_kill_plus_lease = -1, pct_end = -1;
  double probe1_s = -1;  // latency of the probe sent at t ~ seed 10 s (index 1)
  bool probe1_finished = false;
  double probe1_sent = -1;
  double later_min = -1, later_max = -1;
  int later_n = 0;
  double last_renewal_s = -1;
  double renewals = 0;
  // From P's trace: the KV blocks P held at `held_at_s` (D's last renewal; the kill without a
  // lease) and when the last of them was freed.
  double held_at_s = -1;
  std::uint64_t held_blocks = 0, held_never_freed = 0;
  double held_freed_s = -1;
  bool trace_ok = false;
};

FiguresA ComputeA(const PolicyRun& r, const ParamsA& p) {
  FiguresA f;
  double prev_renewals = -1;
  for (const auto& s : r.samples) {
    if (!s.ok) continue;
    const double ren = s.Get("kvferry_renewals_accepted_total");
    if (prev_renewals >= 0 && ren > prev_renewals) f.last_renewal_s = s.t;
    prev_renewals = ren;
    f.renewals = ren;
    if (s.t <= r.kill_t) continue;
    if (f.left_full_s < 0 && s.UsedPct() < 95) f.left_full_s = s.t;
    if (f.below5_s < 0 && s.UsedPct() < 5) f.below5_s = s.t;
  }
  f.pct_kill_plus_lease = PctAt(r.samples, r.kill_t + p.lease_s);
  f.held_at_s = r.lease && f.last_renewal_s >= 0 ? f.last_renewal_s : r.kill_t;
  ParsedTraces traces;
  if (!r.p_trace.empty() && ParseTraceFile(r.p_trace, traces) && !traces.p_blocks.empty()) {
    f.trace_ok = true;
    const HeldRelease h = ReleaseOfBlocksHeldAt(
        traces.p_blocks, r.t0_ns + static_cast<std::int64_t>(f.held_at_s * 1e9));
    f.held_blocks = h.held;
    f.held_never_freed = h.never_freed;
    if (h.held > 0 && h.never_freed == 0) {
      f.held_freed_s = static_cast<double>(h.last_free_ns - r.t0_ns) / 1e9;
    }
  }
  f.pct_end = PctAt(r.samples, r.end_t);
  for (const auto& pr : r.probes) {
    if (pr.index == 1) {
      f.probe1_sent = pr.sent_s;
      f.probe1_finished = pr.finished && pr.outcome.ok;
      f.probe1_s = pr.finished ? pr.outcome.latency_s : r.end_t - pr.sent_s;
    }
    if (f.below5_s >= 0 && pr.sent_s > f.below5_s && pr.finished && pr.outcome.ok) {
      f.later_min =
          f.later_n == 0 ? pr.outcome.latency_s : std::min(f.later_min, pr.outcome.latency_s);
      f.later_max = std::max(f.later_max, pr.outcome.latency_s);
      ++f.later_n;
    }
  }
  return f;
}

std::string SeedTime(double demo_s, double scale) {
  if (demo_s < 0) return "";
  return fmt::format(" (x{:g}: {:.0f} s)", scale, demo_s * scale);
}

void WriteTimeline(Env& env, const PolicyRun& timeout, const PolicyRun& lease, const ParamsA& p,
                   double scale) {
  const std::string csv = env.o.out_dir + "/case_a_timeline.csv";
  std::ofstream out(csv);
  out << "t_s,t_seed_s,p_kv_pct_timeout,p_kv_pct_lease\n";
  const double end = std::max(timeout.end_t, lease.end_t);
  for (double t = 0; t <= end + 1e-9; t += p.sample_s) {
    const double a = t <= timeout.end_t ? PctAt(timeout.samples, t) : -1;
    const double b = t <= lease.end_t ? PctAt(lease.samples, t) : -1;
    out << fmt::format("{:.2f},{:.1f},{},{}\n", t, t * scale, a < 0 ? "" : Fixed(a, 2),
                       b < 0 ? "" : Fixed(b, 2));
  }
  out.close();
  std::printf("   wrote %s\n", csv.c_str());
  const std::string gp = env.o.out_dir + "/case_a.gp";
  const std::string png = env.o.out_dir + "/case_a.png";
  std::ofstream g(gp);
  g << "# generated by `kvferry demo`: P's KV usage in case A (D SIGKILLed), timeout vs lease\n"
    << "set terminal pngcairo size 1000,560 noenhanced\n"
    << "set output '" << png << "'\n"
    << "set datafile separator ','\n"
    << "set datafile missing ''\n"
    << fmt::format(
           "set title 'Case A: D killed at t={:.1f} s; P KV usage, {:g} s timeout vs "
           "{:g} s lease (demo time; seed time = {:g}x)'\n",
           lease.kill_t, p.timeout_s, p.lease_s, scale)
    << "set xlabel 't (s, demo)'\nset ylabel \"P's KV blocks used (%)\"\n"
    << "set yrange [0:105]\nset grid\nset key center right\n"
    << fmt::format("set arrow from {0},0 to {0},105 nohead dt 2 lc rgb 'red'\n", lease.kill_t)
    << fmt::format("set label 'D killed' at {},50 left offset 0.5,0 tc rgb 'red'\n", lease.kill_t)
    << "plot '" << csv
    << "' every ::1 using 1:3 with lines lw 2 title 'abort_request_timeout (no lease)', \\\n"
    << "     '' every ::1 using 1:4 with lines lw 2 title 'lease'\n";
  g.close();
  std::printf("   wrote %s\n", gp.c_str());
  if (::access("/usr/bin/gnuplot", X_OK) == 0) {
    // gnuplot's pngcairo may be missing in gnuplot-nox builds: fall back to the png terminal.
    const std::string cmd =
        fmt::format("/usr/bin/gnuplot '{}' > '{}/gnuplot.log' 2>&1", gp, env.logs);
    int rc = std::system(cmd.c_str());
    if (rc != 0) {
      std::string text;
      {
        std::ifstream in(gp);
        std::stringstream ss;
        ss << in.rdbuf();
        text = ss.str();
      }
      const auto pos = text.find("pngcairo size 1000,560");
      if (pos != std::string::npos) text.replace(pos, 22, "png size 1000,560");
      std::ofstream(gp) << text;
      rc = std::system(cmd.c_str());
    }
    if (rc == 0) {
      std::printf("   wrote %s\n", png.c_str());
    } else {
      std::printf("   gnuplot failed (see %s/gnuplot.log); the CSV and .gp are there\n",
                  env.logs.c_str());
    }
  } else {
    std::printf(
        "   gnuplot not installed (apt-get install gnuplot-nox): no PNG; run "
        "`gnuplot %s` later\n",
        gp.c_str());
  }
}

void ScenarioA(Env& env) {
  const double scale = env.o.quick ? 0 : env.o.scale;
  const ParamsA p = env.o.quick ? QuickA() : FullA(env.o.scale);
  std::printf("\nA. D killed at t=%.2f s; %g s timeout (no lease) vs %g s lease%s\n", p.kill_at_s,
              p.timeout_s, p.lease_s,
              env.o.quick ? " [--quick: a shorter run, not to the seed's scale]" : "");
  std::printf(
      "   %d requests x %d-token prompts x %d output tokens through the proxy; "
      "P %d blocks, D %d blocks (%.1fx D's KV); %d-token probe straight to P every "
      "%g s; run ends at t=%g s\n",
      p.requests, p.prompt, p.max_tokens, p.p_blocks, p.d_blocks,
      static_cast<double>(p.requests) * BlocksFor(p.prompt + p.max_tokens, 16) / p.d_blocks,
      p.probe_tokens, p.probe_every_s, p.run_end_s);
  std::fflush(stdout);
  const PolicyRun t = RunDeployment(env, "A-timeout", p, false, true, p.timeout_s, true);
  const PolicyRun l = RunDeployment(env, "A-lease", p, true, true, p.timeout_s, true);
  if (!t.started || !l.started || !t.error.empty() || !l.error.empty()) {
    std::printf("   could not run: %s\n", (!t.error.empty() ? t.error : l.error).c_str());
    env.Check(false, "A ran");
    return;
  }
  const FiguresA ft = ComputeA(t, p), fl = ComputeA(l, p);
  auto time_cell = [&](double v) {
    if (v < 0) return std::string("never");
    return fmt::format("{:.2f} s{}", v, env.o.quick ? "" : SeedTime(v, scale));
  };
  auto probe_cell = [&](const FiguresA& f) {
    if (f.probe1_sent < 0) return std::string("n/a");
    return fmt::format("{}{:.2f} s{}", f.probe1_finished ? "" : ">", f.probe1_s,
                       env.o.quick ? "" : SeedTime(f.probe1_s, scale));
  };
  auto later_cell = [](const FiguresA& f) {
    if (f.later_n == 0) return std::string("n/a");
    return fmt::format("{:.0f}-{:.0f} ms ({})", f.later_min * 1000, f.later_max * 1000, f.later_n);
  };
  std::printf("\n   %-44s %24s %24s\n", "figure (demo time; seed-equivalent x scale)",
              fmt::format("{:g} s timeout", p.timeout_s).c_str(),
              fmt::format("{:g} s lease", p.lease_s).c_str());
  auto row = [](const std::string& name, const std::string& a, const std::string& b) {
    std::printf("   %-44s %24s %24s\n", name.c_str(), a.c_str(), b.c_str());
  };
  row("D SIGKILLed at t=", time_cell(t.kill_t), time_cell(l.kill_t));
  row("P's KV leaves >=95% at t=", time_cell(ft.left_full_s), time_cell(fl.left_full_s));
  row("P's KV below 5% at t=", time_cell(ft.below5_s), time_cell(fl.below5_s));
  row(fmt::format("P's KV at t=kill+{:g} s (crash + lease)", p.lease_s),
      Fixed(ft.pct_kill_plus_lease) + "%", Fixed(fl.pct_kill_plus_lease) + "%");
  row("P's KV when the run ended (t=end)", Fixed(ft.pct_end) + "% (t=" + Fixed(t.end_t) + ")",
      Fixed(fl.pct_end) + "% (t=" + Fixed(l.end_t) + ")");
  row(fmt::format("latency of the probe sent at t={:g} s", p.probe_every_s), probe_cell(ft),
      probe_cell(fl));
  row("probes sent once P's KV < 5%", later_cell(ft), later_cell(fl));
  row("requests that succeeded",
      fmt::format("{}/{}", t.load.summary.succeeded, t.load.summary.total),
      fmt::format("{}/{}", l.load.summary.succeeded, l.load.summary.total));
  row("renewals P accepted (last at t=)", fmt::format("{:.0f}", ft.renewals),
      fmt::format("{:.0f} ({})", fl.renewals, time_cell(fl.last_renewal_s)));
  auto held_cell = [&](const FiguresA& f) {
    if (!f.trace_ok) return std::string("no trace");
    return fmt::format("{} blocks, t={:.2f}", f.held_blocks, f.held_at_s);
  };
  row("P's KV at the kill / at D's last renewal", held_cell(ft), held_cell(fl));
  row("  ... all of it freed at t=",
      ft.held_never_freed > 0 ? fmt::format("never ({} left)", ft.held_never_freed)
                              : time_cell(ft.held_freed_s),
      fl.held_never_freed > 0 ? fmt::format("never ({} left)", fl.held_never_freed)
                              : time_cell(fl.held_freed_s));
  std::printf(
      "\n   seed (vLLM, 2x A800, real time):\n"
      "     unmodified main: P's KV stays at 99%% until t~484 s; the probe sent at t~10 s\n"
      "                      takes 475.5 s; P is still at 37%% KV when the run ends (660 s)\n"
      "     30 s lease:      P's KV is below 5%% at t~103 s; that probe takes 61.3 s, later\n"
      "                      probes 36-46 ms\n");
  if (!env.o.quick) {
    std::printf("   (time scale 1/%g: every demo time x%g is the seed-equivalent in brackets)\n",
                scale, scale);
  }
  std::printf("\n   P's KV usage over time:\n   %8s %10s %18s %18s\n", "t (s)", "seed t",
              "P KV % timeout", "P KV % lease");
  const double step = env.o.quick ? 1.0 : 20 / scale;
  const double end = std::max(t.end_t, l.end_t);
  for (double x = 0; x <= end + 1e-9; x += step) {
    const double a = x <= t.end_t ? PctAt(t.samples, x) : -1;
    const double b = x <= l.end_t ? PctAt(l.samples, x) : -1;
    std::printf("   %8.1f %10s %18s %18s\n", x,
                env.o.quick ? "-" : fmt::format("{:.0f}", x * scale).c_str(),
                a < 0 ? "-" : (Fixed(a) + "%").c_str(), b < 0 ? "-" : (Fixed(b) + "%").c_str());
  }
  WriteTimeline(env, t, l, p, env.o.quick ? 1 : scale);

  // The lease's claim: P frees the dead decoder's KV within one lease of D's last renewal, plus
  // one expiry pass (the listener runs one at every deadline, at most 1 s late). "Last renewal"
  // is the first /metrics sample in which P's accepted-renewal count no longer grew, an upper
  // bound (D renews every lease/6). Requests still queued on P when D died are prefilled
  // afterwards and held for one lease from their prefill end (the seed: "the lease holds each
  // for one 30 s lease"); P stops starting them one lease after the last renewal (dead-decoder
  // abort), so all of P's KV is gone within two leases plus a pass. A prompt P had admitted but
  // not finished prefilling at the last renewal gets its lease from its prefill end: the pass
  // allowance absorbs that (in the full run the last such block went ~0.8 s after renewal +
  // lease); serve's trace has no prefill-done event that would make this exact.
  const double last = fl.held_at_s;
  const double bound1 = last + p.lease_s + 1.0;
  env.Check(
      fl.trace_ok && fl.held_blocks > 0 && fl.held_never_freed == 0 && fl.held_freed_s <= bound1,
      fmt::format("A/lease: the {} KV blocks P held at D's last renewal (t<={:.2f} s) were "
                  "all freed at t={} <= renewal + lease {:g} s + one expiry pass (<= 1 s) "
                  "= {:.2f} s",
                  fl.held_blocks, last, Fixed(fl.held_freed_s, 2), p.lease_s, bound1));
  const double bound2 = last + 2 * p.lease_s + 1.0 + 2 * p.sample_s;
  env.Check(fl.below5_s >= 0 && fl.below5_s <= bound2,
            fmt::format("A/lease: P's KV below 5% at t={} <= renewal + 2 leases (KV prefilled "
                        "after the crash) + pass + 2 samples = {:.2f} s",
                        Fixed(fl.below5_s, 2), bound2));
  const double held = PctAt(t.samples, t.kill_t + p.lease_s + 1.0 + 2 * p.sample_s);
  env.Check(held >= 90,
            fmt::format("A/timeout: without the lease P still holds the dead decoder's KV one "
                        "lease after the crash ({}% >= 90%)",
                        Fixed(held)));
  env.Check(l.p_end.drained(),
            fmt::format("A/lease: P's pool back to empty at the end ({})", l.p_end.Text()));
}

void ScenarioB(Env& env) {
  const ParamsA p = env.o.quick ? QuickB() : FullB(env.o.scale);
  std::printf("\nB. No crash, requests queue on D; %g s timeout vs %g s lease%s\n", p.timeout_s,
              p.lease_s, env.o.quick ? " [--quick]" : "");
  std::printf(
      "   the deployment and load of A (%d x %d-token prompts x %d tokens, %.1fx D's "
      "KV), nothing killed\n",
      p.requests, p.prompt, p.max_tokens,
      static_cast<double>(p.requests) * BlocksFor(p.prompt + p.max_tokens, 16) / p.d_blocks);
  std::fflush(stdout);
  // The baseline sets abort_request_timeout (the seed: VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT=20
  // on both sides); the lease run keeps the default-scaled timeout.
  const PolicyRun t = RunDeployment(env, "B-timeout", p, false, false, p.timeout_s, false);
  const PolicyRun l =
      RunDeployment(env, "B-lease", p, true, false, env.o.quick ? 30 : 480 / env.o.scale, false);
  if (!t.started || !l.started || !t.error.empty() || !l.error.empty()) {
    std::printf("   could not run: %s\n", (!t.error.empty() ? t.error : l.error).c_str());
    env.Check(false, "B ran");
    return;
  }
  struct FB {
    double expired = 0, full_s = 0, max_probe = 0, max_ttft = -1;
  };
  auto figures = [&](const PolicyRun& r) {
    FB f;
    double prev_t = 0;
    for (const auto& s : r.samples) {
      if (!s.ok) continue;
      f.expired = s.Get("kvferry_hold_expiries_total");
      if (s.UsedPct() >= 95) f.full_s += s.t - prev_t;
      prev_t = s.t;
    }
    for (const auto& pr : r.probes) {
      f.max_probe = std::max(f.max_probe, pr.finished ? pr.outcome.latency_s : r.end_t - pr.sent_s);
    }
    f.max_ttft = r.load.summary.ttft_max;
    return f;
  };
  const FB ft = figures(t), fl = figures(l);
  auto row = [](const std::string& name, const std::string& a, const std::string& b) {
    std::printf("   %-44s %24s %24s\n", name.c_str(), a.c_str(), b.c_str());
  };
  std::printf("\n   %-44s %24s %24s\n", "figure (demo time)",
              fmt::format("{:g} s timeout", p.timeout_s).c_str(),
              fmt::format("{:g} s lease", p.lease_s).c_str());
  row("requests failed", fmt::format("{}/{}", t.load.summary.failed, t.load.summary.total),
      fmt::format("{}/{}", l.load.summary.failed, l.load.summary.total));
  row("requests succeeded", fmt::format("{}/{}", t.load.summary.succeeded, t.load.summary.total),
      fmt::format("{}/{}", l.load.summary.succeeded, l.load.summary.total));
  row("slowest time to first token (~wait on D)", Fixed(ft.max_ttft, 2) + " s",
      Fixed(fl.max_ttft, 2) + " s");
  row("holds expired on P", fmt::format("{:.0f}", ft.expired), fmt::format("{:.0f}", fl.expired));
  row("time P's KV >= 95%", Fixed(ft.full_s, 1) + " s", Fixed(fl.full_s, 1) + " s");
  row("slowest probe", Fixed(ft.max_probe, 2) + " s", Fixed(fl.max_probe, 2) + " s");
  row("load wall time", Fixed(t.load.summary.wall_s, 1) + " s",
      Fixed(l.load.summary.wall_s, 1) + " s");
  for (const auto& [reason, n] : t.load.summary.failure_reasons) {
    std::printf("   timeout run: %d x %s\n", n, reason.c_str());
  }
  for (const auto& [reason, n] : l.load.summary.failure_reasons) {
    std::printf("   lease run:   %d x %s\n", n, reason.c_str());
  }
  std::printf(
      "\n   seed: 79/128 fail with the 20 s timeout; 128/128 succeed with the lease and no lease\n"
      "         expires; with the lease P sits at 99%% for ~40 s and a probe waits 35 s (timeout:\n"
      "         probe 17 s); requests wait on D up to ~80 s\n");
  env.Check(l.load.summary.succeeded == l.load.summary.total && l.load.summary.total == p.requests,
            fmt::format("B/lease: every request succeeded ({}/{})", l.load.summary.succeeded,
                        p.requests));
  for (const PolicyRun* r : {&t, &l}) {
    const char* name = r == &l ? "lease" : "timeout";
    env.Check(r->p_end.drained() && r->d_end.drained(),
              fmt::format("B/{}: both pools back to empty, nothing corrupt (P: {}; D: {})", name,
                          r->p_end.Text(), r->d_end.Text()));
  }
}

// ---------------------------------------------------------------------------------------------
// C. Multi-peer write-after-free: P TP2 -> D TP1 with faults, traced.

void ScenarioC(Env& env) {
  const ParamsC p = env.o.quick ? QuickC() : FullC(env.o.scale);
  std::printf(
      "\nC. Multi-peer write-after-free: P TP2 -> D TP1; P ranks report an error after a "
      "successful WRITE\n   for %.0f%% of WRITEs and delay each WRITE by 0-%d ms%s\n",
      p.err_fraction * 100, p.write_delay_ms, env.o.quick ? " [--quick]" : "");
  std::printf(
      "   %d requests (batches of %d sent at once) x %d-token prompts x %d tokens; D %d "
      "blocks (~%d requests) so freed blocks are reused at once\n",
      p.requests, p.batch, p.prompt, p.max_tokens, p.d_blocks,
      p.d_blocks / BlocksFor(p.prompt + p.max_tokens, 16));
  std::fflush(stdout);
  const int max_len = p.prompt + p.max_tokens + 64;
  std::string err;
  std::vector<std::string> p_args = EngineArgs(p.p_blocks, p.block_tokens, p.prefill_us_per_token,
                                               1000, p.decode_us_per_step, max_len);
  for (const std::string& a :
       {std::string("--fault-err-after-write"), fmt::format("{}", p.err_fraction),
        std::string("--fault-write-delay-ms"), std::to_string(p.write_delay_ms),
        // As the seed: P0 reports an error after a successful WRITE, P1 delays its WRITEs.
        std::string("--fault-err-ranks"), std::string("0"), std::string("--fault-delay-ranks"),
        std::string("1")}) {
    p_args.push_back(a);
  }
  env.Note("C: starting P (TP2, faults on), D (TP1) and the proxy, with traces");
  auto P = StartServe(env, "C-P", true, 2, json::object(), p_args, true, &err);
  std::optional<Instance> D, X;
  if (P) {
    D = StartServe(env, "C-D", false, 1, json::object(),
                   EngineArgs(p.d_blocks, p.block_tokens, p.prefill_us_per_token, 1000,
                              p.decode_us_per_step, max_len),
                   true, &err);
  }
  if (D) X = StartProxy(env, "C-proxy", *P, *D, &err);
  if (!P || !D || !X) {
    std::printf("   could not run: %s\n", err.c_str());
    env.Check(false, "C ran");
    return;
  }
  LoadSummary total;
  std::vector<LoadRecord> records;
  const auto t0 = SteadyClock::now();
  for (int sent = 0; sent < p.requests; sent += p.batch) {
    LoadOptions lo;
    lo.url = X->url;
    lo.requests = std::min(p.batch, p.requests - sent);
    lo.prompt_tokens = p.prompt;
    lo.max_tokens = p.max_tokens;
    lo.timeout_s = 120;
    lo.label = "C load";
    lo.progress_every_s = env.o.verbose ? 1.0 : 0.0;
    LoadResult r = RunLoad(lo);
    records.insert(records.end(), r.records.begin(), r.records.end());
    env.Note(fmt::format("C: {} / {} requests done", sent + lo.requests, p.requests));
  }
  total = Summarize(records, SecondsSince(t0));
  const auto d_metrics = HttpGet(D->url, "/metrics", 5);
  const auto dm = d_metrics ? ParsePrometheus(*d_metrics) : std::map<std::string, double>{};
  auto metric = [&](const char* k) {
    const auto it = dm.find(k);
    return it == dm.end() ? 0.0 : it->second;
  };
  // A failed send does not count as sent, so without a lease P would keep the KV of a request
  // whose WRITE it reported as failed until its abort_request_timeout (as the seed's P does).
  // D releases a request whose receive failed (wire::Release), so P frees those too: its
  // pool ends empty.
  (void)WaitFor([&] { return MetricOf(*P, "kvferry_kv_blocks_used") == 0; }, 10);
  EndState c_p_end;
  c_p_end.checked = true;
  c_p_end.blocks_used = MetricOf(*P, "kvferry_kv_blocks_used");
  const EndState c_d_end = WaitDrained(*D, true, 10);
  X->proc->Stop(5);
  P->proc->Stop(10);
  D->proc->Stop(10);

  ParsedTraces traces;
  const bool read_ok = ParseTraceFile(P->trace, traces) && ParseTraceFile(D->trace, traces);
  const WriteAfterFree w0 = CountWritesAfterFree(traces, 0);
  const WriteAfterFree w1 = CountWritesAfterFree(traces, 1);
  const auto both = RequestsWrittenByAll(traces, {0, 1});
  const FreeOrder order = CheckFreeAfterWrites(traces);
  std::printf("\n   %-52s %10s %10s %10s\n", "requests", "this run", "seed old", "seed fix");
  auto row = [](const std::string& name, const std::string& a, const char* so, const char* sf) {
    std::printf("   %-52s %10s %10s %10s\n", name.c_str(), a.c_str(), so, sf);
  };
  row("total", std::to_string(total.total), "791", "791");
  row("  with WRITEs from both P peers", std::to_string(both.size()), "791", "791");
  row("  failed on D (injected P errors)", std::to_string(total.failed), "33", "39");
  row("P1 WRITE started after destination block free",
      std::to_string(w1.requests_after_free.size()), "21", "0");
  row("  of those, after reallocation", std::to_string(w1.requests_after_realloc.size()), "20",
      "0");
  row("P0 WRITE started after destination block free",
      std::to_string(w0.requests_after_free.size()), "-", "-");
  std::printf(
      "\n   trace: %zu lines (%zu unreadable), %zu D block events, WRITE starts P0 %llu / "
      "P1 %llu (%llu / %llu without a matching D allocation)\n",
      traces.lines, traces.bad_lines, traces.d_blocks.size(),
      static_cast<unsigned long long>(w0.write_starts),
      static_cast<unsigned long long>(w1.write_starts),
      static_cast<unsigned long long>(w0.unmatched), static_cast<unsigned long long>(w1.unmatched));
  std::printf(
      "   D freed a written request's blocks only after the last WRITE into it ended: "
      "%llu/%llu requests (smallest margin %.2f ms)\n",
      static_cast<unsigned long long>(order.requests - order.freed_too_early),
      static_cast<unsigned long long>(order.requests), order.min_margin_ms);
  std::printf("   D: %.0f blocks verified, %.0f corrupt, %.0f quarantined at the end\n",
              metric("kvferry_verified_blocks_total"), metric("kvferry_corrupt_blocks_total"),
              metric("kvferry_quarantined_blocks"));
  for (const auto& [reason, n] : total.failure_reasons) {
    std::printf("   failed: %d x %s\n", n, reason.c_str());
  }
  std::printf(
      "   The real runtime has only the fixed ledger (core::ReceiveLedger): there is no \"old\n"
      "   logic\" to run here. `kvferry sim --scenario C` replays the seed's old ledger against\n"
      "   the fixed one in virtual time. As in the seed, P0 errs after a successful WRITE and P1\n"
      "   delays its WRITEs; P0's WRITEs are counted too.\n");
  env.Check(read_ok && w0.write_starts > 0 && w1.write_starts > 0 && !both.empty(),
            fmt::format("C: both P ranks WROTE ({} / {} WRITE starts, {} requests from both)",
                        w0.write_starts, w1.write_starts, both.size()));
  env.Check(
      w1.after_free == 0 && w0.after_free == 0 && w0.after_realloc == 0 && w1.after_realloc == 0,
      fmt::format("C: 0 WRITEs started after their destination block was freed (P1 {}, "
                  "P0 {})",
                  w1.after_free, w0.after_free));
  env.Check(order.requests > 0 && order.freed_too_early == 0,
            fmt::format("C: D freed no block before every WRITE into its request had ended "
                        "({} requests)",
                        order.requests));
  env.Check(metric("kvferry_corrupt_blocks_total") == 0 && d_metrics.has_value(),
            "C: D verified every received block (0 corrupt)");
  env.Check(total.failed > 0,
            fmt::format("C: the injected errors reached D ({} requests failed)", total.failed));
  env.Check(c_p_end.blocks_used == 0 && c_d_end.drained(),
            fmt::format("C: D's pool back to empty, nothing corrupt ({}); P's too, also the {} "
                        "requests whose WRITE failed: D released them ({})",
                        c_d_end.Text(), total.failed, c_p_end.Text()));
}

// ---------------------------------------------------------------------------------------------
// D. Late pull: D asks for a transfer that P already freed.

struct LatePull {
  bool ran = false;
  std::string error_run;
  double held_s = -1;     // P's prefill answer -> its hold was released
  double pulled_at = -1;  // P's prefill answer -> D's request
  CompletionOutcome d;
  double late_pulls_rejected = 0;
  EndState p_end, d_end;
};

LatePull RunLatePull(Env& env, const std::string& tag, bool lease, const ParamsD& p) {
  LatePull out;
  json extra = {{"abort_request_timeout", lease ? p.hold_s * 24 : p.hold_s}};
  if (lease) extra["kv_lease_duration"] = p.hold_s;
  const std::vector<std::string> args = EngineArgs(256, 16, 2, 1000, 2000, p.prompt + 64);
  std::string err;
  auto P = StartServe(env, tag + "-P", true, 1, extra, args, false, &err);
  std::optional<Instance> D;
  if (P) D = StartServe(env, tag + "-D", false, 1, extra, args, false, &err);
  if (!P || !D) {
    out.error_run = err;
    return out;
  }
  std::mt19937_64 rng(7);
  const std::vector<int> prompt = RandomPrompt(rng, p.prompt);
  const std::string transfer_id = "xfer-" + RandomUuid();
  json pb = json::parse(CompletionBody(prompt, 1, false, true));
  pb["kv_transfer_params"] = {
      {"do_remote_decode", true}, {"do_remote_prefill", false}, {"transfer_id", transfer_id}};
  const CompletionOutcome pr = PostCompletion({P->url, pb.dump(), false, 30, nullptr});
  const auto t_prefilled = SteadyClock::now();
  if (!pr.ok) {
    out.error_run = "P's prefill failed: " + pr.error;
    return out;
  }
  // Wait until P released the hold (its expiry pass freed it and remembered the id).
  auto p_metric = [&](const char* k) {
    const auto text = HttpGet(P->url, "/metrics", 2);
    if (!text) return -1.0;
    const auto m = ParsePrometheus(*text);
    const auto it = m.find(k);
    return it == m.end() ? 0.0 : it->second;
  };
  const bool released = WaitFor(
      [&] {
        return p_metric("kvferry_kv_blocks_used") == 0 && p_metric("kvferry_tombstones") >= 1;
      },
      p.hold_s * 3 + 10, 0.05);
  out.held_s = SecondsSince(t_prefilled);
  if (!released) {
    out.error_run = "P never released the transfer";
    return out;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  out.pulled_at = SecondsSince(t_prefilled);
  json db = json::parse(CompletionBody(prompt, 8, true, true));
  db["kv_transfer_params"] = {{"do_remote_decode", false},
                              {"do_remote_prefill", true},
                              {"remote_engine_id", P->engine_id},
                              {"remote_bootstrap_addr", "http://" + P->bootstrap},
                              {"transfer_id", transfer_id}};
  out.d = PostCompletion({D->url, db.dump(), true, p.hold_s * 24 + 30, nullptr});
  out.late_pulls_rejected = p_metric("kvferry_late_pulls_rejected_total");
  out.ran = true;
  out.p_end = WaitDrained(*P, false, 5);
  out.d_end = WaitDrained(*D, true, 5);
  P->proc->Stop(10);
  D->proc->Stop(10);
  return out;
}

void ScenarioD(Env& env) {
  ParamsD p{env.o.quick ? 1.0 : 20 / env.o.scale, 512};
  std::printf("\nD. Late pull: D pulls a transfer P already freed (%g s hold%s)\n", p.hold_s,
              env.o.quick ? ", --quick" : "");
  std::printf(
      "   P prefills a transfer that no D asked for; once P's hold ran out (timeout or "
      "lease) and P freed it,\n   D is sent the request for that transfer_id (standing "
      "in for a D that was busy for longer)\n");
  std::fflush(stdout);
  const LatePull t = RunLatePull(env, "D-timeout", false, p);
  const LatePull l = RunLatePull(env, "D-lease", true, p);
  std::printf("\n   %-36s %9s %9s %12s  %s\n", "variant", "P freed", "pulled at", "time to fail",
              "D's error");
  auto row = [&](const std::string& name, const LatePull& r) {
    if (!r.ran) {
      std::printf("   %-36s could not run: %s\n", name.c_str(), r.error_run.c_str());
      return;
    }
    std::string e = r.d.ok ? "(none: the request succeeded)" : r.d.error;
    if (e.size() > 90) e = e.substr(0, 87) + "...";
    std::printf("   %-36s %8.2fs %8.2fs %9.1f ms  %s\n", name.c_str(), r.held_s, r.pulled_at,
                r.d.latency_s * 1000, e.c_str());
  };
  row(fmt::format("no lease, {:g} s timeout (tombstone)", p.hold_s), t);
  row(fmt::format("{:g} s lease, never renewed (tombstone)", p.hold_s), l);
  std::printf(
      "\n   seed: a pull for freed KV fails at once (milliseconds), with and without the "
      "lease,\n         instead of waiting out the timeout\n");
  for (const auto* r : {&t, &l}) {
    const bool lease = r == &l;
    env.Check(
        r->ran && !r->d.ok && r->d.latency_s < 1.0 && r->late_pulls_rejected >= 1,
        fmt::format("D/{}: the late pull failed in {:.1f} ms (< 1 s; P counted {:.0f} late "
                    "pull(s) rejected)",
                    lease ? "lease" : "timeout", r->d.latency_s * 1000, r->late_pulls_rejected));
    env.Check(r->p_end.drained() && r->d_end.drained(),
              fmt::format("D/{}: both pools back to empty (P: {}; D: {})",
                          lease ? "lease" : "timeout", r->p_end.Text(), r->d_end.Text()));
  }
}

}  // namespace

int RunDemo(const DemoOptions& options) {
  Env env;
  env.o = options;
  std::string sel = options.scenarios;
  if (sel == "all") sel = "ABCD";
  for (char& c : sel) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (sel.empty() || sel.find_first_not_of("ABCD") != std::string::npos) {
    std::fprintf(stderr, "demo: --scenario takes A, B, C, D (or several, e.g. AB) or all\n");
    return 2;
  }
  if (options.scale < 1) {
    std::fprintf(stderr, "demo: --scale must be >= 1\n");
    return 2;
  }
  env.bin = options.kvferry_bin;
  if (env.bin.empty()) {
    std::error_code ec;
    env.bin = fs::read_symlink("/proc/self/exe", ec).string();
  }
  if (::access(env.bin.c_str(), X_OK) != 0) {
    std::fprintf(stderr, "demo: cannot run %s\n", env.bin.c_str());
    return 2;
  }
  env.logs = options.out_dir + "/logs";
  std::error_code ec;
  fs::create_directories(env.logs, ec);
  if (ec) {
    std::fprintf(stderr, "demo: cannot create %s: %s\n", env.logs.c_str(), ec.message().c_str());
    return 2;
  }
  env.run_tag = fmt::format("{}-{}", ::getpid(), RandomUuid().substr(0, 8));
  const auto t0 = SteadyClock::now();
  if (options.p_host.netns.empty() && options.d_host.netns.empty()) {
    std::printf("kvferry demo: the seed experiments (SPEC §8) in real processes on 127.0.0.1\n");
  } else {
    const std::string etcd =
        options.etcd_endpoints.empty()
            ? std::string()
            : fmt::format("; etcd at {}", fmt::join(options.etcd_endpoints, ", "));
    std::printf(
        "kvferry demo: the seed experiments (SPEC §8) in real processes across test hosts: P on "
        "%s (%s), D on %s (%s), proxy and clients here; UCX over tcp between hosts%s\n",
        options.p_host.netns.c_str(), options.p_host.address.c_str(),
        options.d_host.netns.c_str(), options.d_host.address.c_str(), etcd.c_str());
  }
  if (options.quick) {
    std::printf("--quick: short runs with small loads; times are NOT the seed's scaled times\n");
  } else {
    const double s = options.scale;
    std::printf(
        "time scale 1/%g: 480 s timeout -> %g s, 30 s lease -> %g s, 20 s timeout/lease "
        "-> %g s,\n  D killed at 23 s -> %g s, probe every 10 s -> %g s, 660 s run -> "
        "%g s, P/D /metrics sampled every %g s;\n  prefill 70 us/token -> %g us; 1,000 "
        "output tokens at ~36 ms/step (36 s) -> 100 tokens at %g ms (%g s);\n  "
        "C: P1's WRITE delay 0-500 ms -> 0-%g ms\n",
        s, 480 / s, 30 / s, 20 / s, 23 / s, 10 / s, 660 / s, 1 / s, 70 / s, 360 / s, 36 / s,
        500 / s);
  }
  std::printf("processes: %s serve / proxy; logs and traces in %s\n", env.bin.c_str(),
              env.logs.c_str());
  std::fflush(stdout);
  for (char c : sel) {
    switch (c) {
      case 'A':
        ScenarioA(env);
        break;
      case 'B':
        ScenarioB(env);
        break;
      case 'C':
        ScenarioC(env);
        break;
      case 'D':
        ScenarioD(env);
        break;
      default:
        break;
    }
    std::fflush(stdout);
  }
  std::printf("\n%zu checks passed, %zu failed; demo wall time %.1f s\n", env.passed_checks.size(),
              env.failed_checks.size(), SecondsSince(t0));
  for (const auto& f : env.failed_checks) std::printf("  FAILED: %s\n", f.c_str());
  return env.failed_checks.empty() ? 0 : 1;
}

}  // namespace kvferry::harness
