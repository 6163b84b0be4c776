// The simulated cluster: one P engine and one D engine (each with `tp` ranks), the proxy, the
// control network and the data plane, in virtual time (SPEC §6, "deterministic simulator").
//
// RunCluster(config) is a pure function of `config` (its seed included): the same config gives
// the same run, event for event (SimResult::trace_hash). The protocol is not modelled here but
// runs for real: every P rank is a protocol::PrefillSession (pairing, parking, waves, write
// planning, replies, renewals, expiry; it owns the core::HoldTable) fed through the wire codec,
// every D rank a protocol::DecodeSession (lookups, pulls, renewals, releases, fences, its
// ReceiveLedger), and each engine's glue is the production protocol::PrefillAdapter /
// DecodeAdapter. What the simulator adds is everything around them: schedulers, block pools
// with generation counters, a lossy control network, D's sockets, a data plane with WRITE
// start/end times, P restarts, faults (in the network and the data plane only), and invariant
// checks (docs/simulation.md lists what is and is not modelled).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "event_loop.h"
#include "kvferry/core/hold_table.h"
#include "seams.h"

namespace kvferry::sim {

using namespace std::chrono_literals;

// Side-channel messages (pulls, renewals, renewal replies, pull responses).
struct NetConfig {
  Duration latency = 50us;      // one way
  double bytes_per_s = 1.25e9;  // 10 Gb/s
  Duration jitter{0};           // uniform extra delay in [0, jitter]
  double loss = 0;              // a message is dropped
  double duplicate = 0;         // a message is delivered twice
  double delay_prob = 0;        // a message is held up by U[0, delay_max]
  Duration delay_max{0};
  // Links are FIFO (one TCP connection per D rank/P rank pair), except a message picked with
  // probability `reorder`, which ignores the order and may overtake or be overtaken.
  double reorder = 0;
  // Messages go through the wire codec: P's session reads the encoded bytes and D decodes P's
  // answers, as in real processes. Off: the structs are handed over as they are.
  bool codec = true;
  // Renewals sent by D in [drop_renewals_from, drop_renewals_until) are lost (scenario D).
  TimePoint drop_renewals_from = core::kNever;
  TimePoint drop_renewals_until = core::kNever;
  // A Release (D -> P) or AbortNotice (P -> D) is lost with this probability, on top of `loss`:
  // both are best effort, so losing them must change only timing.
  double release_loss = 0;
};

// The data plane: a WRITE lasts latency + bytes / bandwidth; concurrent WRITEs do not share it.
struct DataPlaneConfig {
  Duration latency = 10us;
  double bytes_per_s = 25e9;     // 200 Gb/s
  Duration fence_latency = 1ms;  // from D's fence request until it holds (and is reported)
};

struct ModelConfig {
  std::uint32_t block_tokens = 16;
  std::uint32_t kv_heads = 16;                        // 1: MLA (KV replicated over ranks)
  std::uint64_t kv_bytes_per_token_per_head = 14336;  // 2 (K,V) · layers · head_dim · dtype
};

struct PrefillConfig {
  std::uint32_t tp = 1;
  std::uint32_t blocks = 13250;  // KV capacity of the engine (block ids shared by its ranks)
  std::uint32_t max_batch_tokens = 8192;
  Duration step_overhead = 4ms;
  Duration per_token = 70us;
  double jitter = 0.1;  // each step's compute time is scaled by U[1-jitter, 1+jitter]
  core::HoldConfig hold;
  // 0: off. Otherwise the KV's planes, and layer writes are on: as the step that completes a
  // prompt computes plane k (at (k+1)/planes of the step), P's engine says so (LayersReady),
  // and pulls already waiting get it written before the prefill ends; PrefillDone covers the
  // last plane.
  std::uint32_t layer_planes = 0;
  // Each P rank's timer wakes at its session's NextDeadline, as the runtime's listener does,
  // up to this much late (U[0, timer_late_max]: a busy worker thread). Below the session's 1 s
  // stall threshold: a later wake is a freeze, which PrefillSession answers differently.
  Duration timer_late_max = 1s;
};

struct DecodeConfig {
  std::uint32_t tp = 1;
  std::uint32_t blocks = 13333;
  std::uint32_t max_running = 256;
  Duration step_base = 20ms;  // one decode step costs step_base + per_seq · batch
  Duration per_seq = 300us;
  Duration lease{0};             // the lease D believes in; renews every lease/6 when > 0
  bool send_lease = true;        // declare the lease with every pull (SPEC §4); false: an old D
  bool send_releases = true;     // release what it gives up (wire::Release); false: an old D
  Duration pull_timeout = 600s;  // D's deadline for each peer's answer to a pull
  // How long a P write may take until it is fenced (D requires pull_timeout to exceed P's
  // abort_request_timeout plus this).
  Duration write_bound = 70s;
  // A liveness source (etcd's watch of P's registration) tells D that P's processes went
  // (OnEngineDown), or, when a new process of P replaced the dead one first, that the old one
  // went (OnProcessGone), peer_dead_detect after the crash. Off (a bootstrap server, no etcd):
  // nothing tells D; only its own sends that cannot leave and its deadlines do.
  bool liveness = true;
  Duration peer_dead_detect = 2s;  // how long until the liveness source tells D
  // A message to a P whose process is gone never leaves (no connection: the runtime hands
  // ZeroMQ a message only while one is up, ZMQ_IMMEDIATE) and is reported unsent after this
  // (runtime::DecodeWorker's kConnectWait): OnSendFailed, a plain failure.
  Duration connect_wait = 3s;
  // DecodeSessionOptions of the same names: the side channels D keeps open while idle, and in
  // all (SimResult checks the sockets D holds against them under churn of P addresses).
  std::size_t max_idle_endpoints = 256;
  std::size_t max_endpoints = 4096;
};

struct Faults {
  TimePoint d_crash = core::kNever;  // D (all ranks) killed
  TimePoint p_crash = core::kNever;  // P (all ranks) killed
  // P restarts: a new process starts p_down_for after each crash, `p_restarts` times, and all
  // but the last crash again p_up_for after they start. A new process knows nothing of the old
  // one (a new incarnation; empty pool, queue and hold tables: the requests the old one had are
  // lost). It binds the old side-channel addresses (p_same_address), or new ones, as a process
  // that binds port 0 does. D must find it again within a bound (SimResult checks it).
  std::uint32_t p_restarts = 0;
  Duration p_down_for = 5s;
  Duration p_up_for = 20s;
  bool p_same_address = false;
  // A liveness source wrongly tells D that P is gone while P lives on (advisory liveness).
  TimePoint p_declared_down = core::kNever;
  // Scenario C: P rank 0 lists a request in `err` after its WRITE succeeded.
  double p0_err_after_write = 0;
  // Scenario C: P rank 1 waits U[0, p1_write_delay] before each WRITE.
  Duration p1_write_delay{0};
  // Exploration: any P rank, per pull: fail its write (the data plane's error: P answers err),
  // fail the whole message before P's session reads it (ERROR), or delay its WRITE by
  // U[0, slow_max]. Faults are injected in the network and the data plane only, never by
  // editing what a session answers.
  double peer_err = 0;
  double peer_msg_error = 0;
  double slow_write = 0;
  Duration slow_max{0};
  // The data plane cannot fence a live P from D's side (as UCX one-sided put over shared memory
  // cannot): D's fences fail while P lives, so quarantined blocks wait for P's late replies.
  // A dead P is always fenced (its death is the proof). Only meaningful on a lossless channel:
  // a lost pull or reply would then leave its blocks quarantined for good.
  bool fence_unsupported = false;
  // The sender gives up on a started WRITE before it ends (a timeout, a cancel, a peer it
  // declared dead) while its bytes are still on their way: P's session hears kUnsettled at
  // U[0, 0.9 × duration) and the bytes land U[0, 2 s] after the WRITE's end all the same,
  // unless D fenced the writer by then. D must keep the blocks until a fence holds (protocol.md §3.4). Never
  // with fence_unsupported: D then keeps them quarantined for good (a known limit).
  double unsettled_write = 0;
  // A P that serves a pull only after D's deadline for it passed (stalled, overloaded): the pull
  // reaches P's session pull_timeout + U[0, 5 s] late, so its WRITE and reply come after D
  // gave up on them (SPEC §3.6: D must still not reuse the blocks).
  double late_pull = 0;
  // P engines beside the real one that D also renews transfers with (each arriving request
  // brings one transfer per such engine) but that never answer: even-numbered ones have a
  // bootstrap that never answers, odd-numbered ones workers that never reply. They must cost the
  // live P's transfers nothing (SPEC §2: a live D's KV never expires while it renews).
  std::uint32_t silent_engines = 0;
  // A hostile (or broken) D peer sends this many pulls at random times in the first 10 s, to
  // random P ranks: a d_tp_size of 2^31, an unpaired rank, and repeated waits of one rank for
  // transfers nobody admits. None may crash P, stay unanswered or touch a real transfer.
  std::uint32_t hostile_pulls = 0;
};

struct RequestSpec {
  TimePoint arrival = kT0;
  std::uint32_t prompt = 3000;
  std::uint32_t output = 1000;
  TimePoint abort_at = core::kNever;  // the client aborts (proxy tells P and D)
  // One side only: the client leaves D and nobody tells P (vLLM #50425: only a Release can),
  // or P's engine aborts it alone (a prefill failure: only an AbortNotice tells a queued D).
  TimePoint d_cancel_at = core::kNever;
  TimePoint p_abort_at = core::kNever;
};

struct Workload {
  std::vector<RequestSpec> requests;
  // Probes: prompt-only requests sent straight to P (no transfer), to measure P's queueing.
  Duration probe_every{0};
  TimePoint probe_from = kT0;
  TimePoint probe_until = kT0;
  std::uint32_t probe_tokens = 512;
};

struct SimConfig {
  std::uint64_t seed = 1;
  ModelConfig model;
  PrefillConfig p;
  DecodeConfig d;
  NetConfig net;
  DataPlaneConfig dp;
  Faults faults;
  Workload load;
  Duration proxy_latency = 1ms;  // proxy → P and proxy → D (reliable HTTP)
  // Each hop also takes U[0, proxy_jitter], drawn independently for P and D: requests sent "at
  // once" reach P and D in different orders, as concurrent HTTP requests do.
  Duration proxy_jitter{0};
  TimePoint horizon = kT0 + 3600s;
  Duration sample_every{0};  // > 0: record KV usage every so often (and run to the horizon)
  Variants variants;         // which hold / ledger implementations to drive
};

enum class Outcome : std::uint8_t { kPending, kOk, kFailed, kAborted };
const char* ToString(Outcome outcome);

struct RequestResult {
  Outcome outcome = Outcome::kPending;
  int ends = 0;  // how many times the request ended (the invariant says exactly 1)
  Status error;
  TimePoint arrival = kT0;
  TimePoint end = core::kNever;
  TimePoint d_admitted = core::kNever;  // D allocated blocks and pulled
};

struct ProbeResult {
  TimePoint sent = kT0;
  TimePoint done = core::kNever;
};

struct KvSample {
  double t;
  double p_pct;
  double d_pct;
};

struct SimResult {
  std::vector<RequestResult> requests;
  std::vector<ProbeResult> probes;
  std::vector<KvSample> samples;
  // Data plane, per P rank (index) and in total. "Start" counts WRITEs that started after a
  // destination block was freed (generation changed) / reallocated (and owned again).
  std::uint64_t writes = 0;
  std::vector<std::uint64_t> writes_after_free;
  std::vector<std::uint64_t> writes_after_realloc;
  std::uint64_t p0_injected_failures = 0;
  std::uint64_t requests_written_by_all_peers = 0;
  std::uint64_t renewals_sent = 0;
  std::uint64_t renewal_warnings = 0;
  std::uint64_t releases_sent = 0;       // D sessions' Release messages
  std::uint64_t releases_delivered = 0;  // ... that reached a P session
  std::uint64_t notices_delivered = 0;   // P sessions' AbortNotices that reached a D session
  std::uint64_t failed_by_notice = 0;    // requests D failed on an AbortNotice
  std::uint64_t quarantined_completions = 0;
  // Faults::unsettled_write: WRITEs P's session heard as kUnsettled, and those whose bytes then
  // landed (into blocks D must still have held).
  std::uint64_t unsettled_writes = 0;
  std::uint64_t unsettled_writes_landed = 0;
  // D's sessions, summed over ranks: the paths exploration must reach, not only the happy one.
  std::uint64_t pull_timeouts = 0;
  std::uint64_t late_replies = 0;
  std::uint64_t fences = 0;
  std::uint64_t duplicate_pulls_dropped = 0;  // P's sessions
  std::uint64_t layer_writes = 0;  // WRITEs of layers before their prefill ended (started)
  std::uint64_t messages_to_silent_engines = 0;
  std::uint64_t messages_unsent = 0;  // to a dead P: reported unsent after connect_wait
  std::uint64_t p_restarts = 0;       // new P processes started (Faults::p_restarts)
  std::uint64_t pulls_to_restarted = 0;  // pulls that reached a P process after a restart
  std::uint64_t replies_to_closed = 0;   // P's answers that found D's socket closed
  // A known limit reached (docs/simulation.md): with a data plane that cannot fence a live
  // writer (Faults::fence_unsupported) and a P restarted on the same addresses, D sent pulls
  // under its view of the dead process that reached the new one; they share a write key with
  // pulls the dead process never answered, so that key's fence is refused while the new process
  // lives, and those blocks stay quarantined until it is gone (and requests queued on D behind
  // them wait as long). The run's D-side leak checks, and the end of requests still queued on
  // D, are then not checked (its other invariants still hold).
  bool shared_key_quarantine = false;
  std::uint64_t hostile_pulls_sent = 0;
  std::uint64_t hostile_pulls_answered = 0;  // pulls answered (ERROR, or every request listed)
  core::HoldStats hold_stats;                // P rank 0
  // Invariant violations, in order of detection (empty: every invariant held).
  std::vector<std::string> violations;
  std::uint64_t trace_hash = 0;
  std::uint64_t events = 0;
  TimePoint end = kT0;
  bool quiet = false;  // the event queue drained before the horizon
  // After faults.d_crash: when P's KV first reached >= 95% and later fell below it, and when
  // it first fell below 5%.
  TimePoint p_kv_left_full = core::kNever;
  TimePoint p_kv_below_5 = core::kNever;

  std::size_t Count(Outcome o) const;
};

SimResult RunCluster(const SimConfig& config);

}  // namespace kvferry::sim
