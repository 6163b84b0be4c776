#include "cluster.h"

#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <variant>

#include "kvferry/core/block_pool.h"
#include "kvferry/core/tp_plan.h"
#include "protocol/decode_adapter.h"
#include "protocol/decode_session.h"
#include "protocol/prefill_adapter.h"
#include "protocol/prefill_session.h"
#include "protocol/pull_reply.h"
#include "control_network.h"
#include "data_plane.h"
#include "leak_audit.h"
#include "registry.h"
#include "rng.h"
#include "wire/messages.h"

namespace kvferry::sim {

const char* ToString(Outcome outcome) {
  switch (outcome) {
    case Outcome::kPending:
      return "pending";
    case Outcome::kOk:
      return "ok";
    case Outcome::kFailed:
      return "failed";
    case Outcome::kAborted:
      return "aborted";
  }
  return "unknown";
}

std::size_t SimResult::Count(Outcome o) const {
  return static_cast<std::size_t>(std::count_if(
      requests.begin(), requests.end(), [o](const RequestResult& r) { return r.outcome == o; }));
}

namespace {

using core::BlockId;
using core::kNever;

// Event kinds, folded into the trace hash.
enum Kind : std::uint32_t {
  kArriveP = 1,
  kArriveD,
  kProbe,
  kPStep,
  kPStepEnd,
  kPPass,
  kDeliver,
  kWriteStart,
  kWriteEnd,
  kDStep,
  kDStepEnd,
  kLookup,
  kDTimer,
  kFence,
  kHostile,
  kDCrash,
  kPCrash,
  kPDetect,
  kAbortP,
  kAbortD,
  kSample,
  kPDeclaredDown,
  kUnsent,
  kWriteGiveUp,
  kPRestart,
  kPLayer,
};

// Pools of P and D: core::BlockPool, whose generations tell a WRITE whether its destination
// changed hands (the same class `kvferry serve` uses). Owners are request indexes.
using core::BlockPool;
using Owner = BlockPool::Owner;

std::uint32_t BlocksFor(std::uint64_t tokens, std::uint32_t block_tokens) {
  return static_cast<std::uint32_t>((tokens + block_tokens - 1) / block_tokens);
}


// What the simulator knows of a pull beyond its wire form (never sent): whom it was for and the
// block generations it aimed at, to judge the writes it causes.
struct PullShadow {
  int req = -1;
  std::uint32_t d_rank = 0;
  std::uint32_t p_rank = 0;
  std::vector<std::uint64_t> gens;
};

// The simulator's own account of one hold entry, to check HoldTable's deadlines from outside.
struct Mirror {
  bool ready = false;
  TimePoint ready_at = kT0;
  TimePoint renewed_when_ready = kNever;
  TimePoint last_renew = kNever;
  TimePoint wait_deadline = kNever;
  TimePoint last_send_end = kT0;
  int sending = 0;
};

// One P worker: the real protocol session (it owns the HoldTable), and the simulator's oracle.
struct PRank {
  std::unique_ptr<protocol::PrefillSession> session;
  std::map<int, Mirror> mirror;
  TimePoint timer_at = core::kNever;  // the session's wake-up that is armed (kNever: none)
  // Fault model. A P fails a whole message (injected ERROR) only the first time it sees it, as a
  // real P's message handling runs after its duplicate check; and it never serves a copy of a
  // message it failed.
  std::set<std::pair<std::uint32_t, std::uint64_t>> delivered_pulls;  // (D rank, pull id)
  std::set<std::pair<std::uint32_t, std::uint64_t>> errored_pulls;
};

struct PReq {
  enum class St : std::uint8_t { kQueued, kRunning, kHeld, kGone };
  bool probe = false;
  int index = 0;  // request index, or probe index
  core::TransferId xfer;
  std::uint32_t prompt = 0;
  std::uint32_t done_tokens = 0;
  std::vector<BlockId> blocks;
  St st = St::kQueued;
  std::vector<int> inflight;  // WRITEs in flight, per P rank
  bool free_pending = false;
  bool arrived = false;   // P's engine got it (a restarted P lost it: kGone)
  std::uint32_t p_gen = 0;  // the P process it arrived at
};

struct DReq {
  enum class St : std::uint8_t { kUnseen, kQueued, kReceiving, kDecoding, kDone };
  St st = St::kUnseen;
  std::vector<BlockId> blocks;      // all blocks (prompt + output)
  std::vector<BlockId> dest;        // the prompt's blocks, which P writes
  std::vector<std::uint64_t> gens;  // generations of `dest` at allocation
  std::uint32_t ranks_completed = 0;  // oracle: ranks whose receive ended (CheckLeaseKept)
  bool load_done = false;  // the adapter's LoadDone: every rank's receive ended
  bool reusable = false;   // the adapter's BlocksReusable: no P writer can touch `dest`
  std::uint32_t decoded = 0;
  bool freed = false;
  std::uint32_t peers_written = 0;
  // [d_rank]: its pulls that found no live P process (sent to a dead one); empty: none.
  std::vector<std::uint32_t> unsent_pulls;
};

class Sim {
 public:
  explicit Sim(const SimConfig& c)
      : c_(c),
        rng_(c.seed),
        p_pool_(c.p.blocks),
        p_adapter_({.ranks = std::max<std::uint32_t>(1, c.p.tp)}),
        d_pool_(c.d.blocks),
        d_adapter_({.ranks = std::max<std::uint32_t>(1, c.d.tp)}) {
    const std::size_t n = c.load.requests.size();
    res_.requests.resize(n);
    preqs_.resize(n);
    dreqs_.resize(n);
    res_.writes_after_free.assign(c.p.tp, 0);
    res_.writes_after_realloc.assign(c.p.tp, 0);
    p_layout_ = {c.p.tp, c.model.kv_heads, BlockLen(c.p.tp)};
    d_layout_ = {c.d.tp, c.model.kv_heads, BlockLen(c.d.tp)};
    for (std::uint32_t r = 0; r < c.p.tp; ++r) p_ranks_.push_back(NewPRank(r));
    p_up_at_.push_back(kT0);
    for (std::uint32_t r = 0; r < c.d.tp; ++r) {
      protocol::DecodeSessionOptions options;
      options.engine_id = "D";
      options.tp_size = c.d.tp;
      options.tp_rank = r;
      options.block_len = d_layout_.block_len;
      options.num_blocks = c.d.blocks;
      options.region_descriptor = {static_cast<std::uint8_t>(r)};
      options.lease = c.d.lease;
      options.abort_request_timeout = c.p.hold.abort_request_timeout;
      options.write_bound = c.d.write_bound;
      options.pull_timeout = c.d.pull_timeout;
      options.send_releases = c.d.send_releases;
      options.max_idle_endpoints = c.d.max_idle_endpoints;
      options.max_endpoints = c.d.max_endpoints;
      // D's data plane fences by write key, as the runtime's does (transport::WriteKey).
      options.write_key_base = (std::uint64_t{r} + 1) << 40;
      if (Status valid = protocol::DecodeSession::ValidateOptions(options); !valid.ok()) {
        Violation("D's options: " + valid.ToString());
        options.pull_timeout = options.abort_request_timeout + options.write_bound + 1s;
      }
      d_sessions_.push_back(std::make_unique<protocol::DecodeSession>(
          options, [&c] { return c.variants.NewLedger(); }));
      d_sockets_.emplace_back();
      d_timer_at_.push_back(kNever);
    }
  }

  SimResult Run() {
    for (std::size_t i = 0; i < c_.load.requests.size(); ++i) {
      const RequestSpec& spec = c_.load.requests[i];
      const int idx = static_cast<int>(i);
      res_.requests[i].arrival = spec.arrival;
      PReq& p = preqs_[i];
      p.index = idx;
      p.xfer = fmt::format("xfer-{}", i);
      p.prompt = spec.prompt;
      p.inflight.assign(c_.p.tp, 0);
      fp_to_req_[core::FingerprintOf(p.xfer)] = idx;
      // The proxy sends to P and D at the same moment.
      const Duration to_p = c_.proxy_latency + rng_.Span(Duration{0}, c_.proxy_jitter);
      const Duration to_d = c_.proxy_latency + rng_.Span(Duration{0}, c_.proxy_jitter);
      const TimePoint reaches_p = spec.arrival + to_p;
      loop_.Schedule(reaches_p, kArriveP, i, [this, idx] { ArriveP(idx); });
      loop_.Schedule(spec.arrival + to_d, kArriveD, i, [this, idx] { ArriveD(idx); });
      // P's engine hears of an abort no earlier than of the request (at the same instant the
      // arrival, scheduled first, runs first): the client's abort travels the request's own
      // connection, and an engine can only fail a prefill it has. An abort that overtook its
      // request would make the engine skip a request it admits on arrival without ever ending
      // it in the hold tables, which no real engine does (ArriveP).
      if (spec.abort_at != kNever) {
        loop_.Schedule(std::max(spec.abort_at + c_.proxy_latency, reaches_p), kAbortP, i,
                       [this, idx] { AbortP(idx); });
        loop_.Schedule(spec.abort_at + c_.proxy_latency, kAbortD, i, [this, idx] { AbortD(idx); });
      }
      if (spec.d_cancel_at != kNever) {
        loop_.Schedule(spec.d_cancel_at, kAbortD, i, [this, idx] { AbortD(idx); });
      }
      if (spec.p_abort_at != kNever) {
        loop_.Schedule(std::max(spec.p_abort_at, reaches_p), kAbortP, i,
                       [this, idx] { AbortP(idx); });
      }
    }
    if (c_.load.probe_every.count() > 0) {
      for (TimePoint t = c_.load.probe_from; t <= c_.load.probe_until; t += c_.load.probe_every) {
        const int pi = static_cast<int>(res_.probes.size());
        res_.probes.push_back({t, kNever});
        loop_.Schedule(t + c_.proxy_latency, kProbe, static_cast<std::uint64_t>(pi),
                       [this, pi] { ArriveProbe(pi); });
      }
    }
    if (c_.faults.d_crash != kNever) {
      loop_.Schedule(c_.faults.d_crash, kDCrash, 0, [this] { CrashD(); });
    }
    if (c_.faults.p_crash != kNever) {
      loop_.Schedule(c_.faults.p_crash, kPCrash, 0, [this] { CrashP(); });
    }
    if (c_.faults.p_declared_down != kNever) {
      loop_.Schedule(c_.faults.p_declared_down, kPDeclaredDown, 0, [this] { DeclarePDown(); });
    }
    for (std::uint32_t i = 0; i < c_.faults.hostile_pulls; ++i) {
      loop_.Schedule(kT0 + rng_.Span(Duration{0}, 10s), kHostile, i, [this, i] { Hostile(i); });
    }
    if (c_.sample_every.count() > 0) {
      loop_.Schedule(kT0, kSample, 0, [this] { Sample(); });
    }
    while (loop_.Step(c_.horizon)) {
    }
    res_.quiet = loop_.empty();
    res_.end = loop_.now();
    FinalChecks();
    res_.trace_hash = loop_.trace_hash();
    res_.events = loop_.events_fired();
    res_.hold_stats = p_ranks_[0].session->hold().stats();
    for (const auto& session : d_sessions_) {
      const protocol::DecodeStats stats = session->stats();
      res_.pull_timeouts += stats.pull_timeouts;
      res_.late_replies += stats.late_replies;
      res_.fences += stats.fences_requested;
    }
    for (const PRank& rank : p_ranks_) {
      res_.duplicate_pulls_dropped += rank.session->stats().pulls_duplicate;
    }
    return std::move(res_);
  }

 private:
  // ---------------------------------------------------------------- helpers

  PRank NewPRank(std::uint32_t r) const {
    protocol::PrefillSessionOptions options;
    options.engine_id = "P";  // what D's requests name (SourceOf)
    options.hold = c_.p.hold;
    options.p_tp_size = c_.p.tp;
    options.p_tp_rank = r;
    options.kv_heads = p_layout_.kv_heads;
    options.block_len = p_layout_.block_len;
    options.num_blocks = c_.p.blocks;
    options.num_planes = c_.p.layer_planes;
    PRank rank;
    rank.session = std::make_unique<protocol::PrefillSession>(
        options, [this](const core::HoldConfig& hc) { return c_.variants.NewHold(hc); });
    return rank;
  }

  TimePoint now() const { return loop_.now(); }
  std::uint64_t BlockLen(std::uint32_t tp) const {
    const std::uint32_t heads = std::max<std::uint32_t>(1, c_.model.kv_heads / tp);
    return c_.model.kv_bytes_per_token_per_head * heads * c_.model.block_tokens;
  }
  static core::RequestId RequestName(int idx) { return fmt::format("req-{}", idx); }
  static int RequestIndex(const core::RequestId& id) { return std::stoi(id.substr(4)); }
  void Violation(std::string what) {
    // Cap the list: one broken invariant can repeat thousands of times in a long run.
    if (res_.violations.size() < 64) {
      res_.violations.push_back(fmt::format("t={:.6f}s {}", At(now()), std::move(what)));
    }
  }
  Duration TransmitTime(std::uint64_t bytes, double bytes_per_s) const {
    return core::Seconds(static_cast<double>(bytes) / bytes_per_s);
  }

  // ---------------------------------------------------------------- P engine

  // P knows a transfer from the moment its request arrives (as `kvferry serve` does), not only
  // once the scheduler gives it blocks: renewals of a queued request extend it, and a dead
  // decoder's queued requests are dropped before they cost any compute (SPEC §4).
  void ArriveP(int idx) {
    preqs_[idx].arrived = true;
    preqs_[idx].p_gen = p_gen_;
    if (p_dead_) {
      preqs_[idx].st = PReq::St::kGone;  // lost: nobody listens
      return;
    }
    if (preqs_[idx].st != PReq::St::kQueued) {
      // The engine already dropped it. Admitted now, it would never be prefilled nor finished:
      // an admitted id ends only by PrefillDone or EngineFinished (a prefilling entry that no D
      // pulled or renewed has no deadline in the hold table), so P would hold it forever.
      Violation(fmt::format("P's engine received {} after it had dropped it", preqs_[idx].xfer));
      return;
    }
    // Every rank admits it, or none does (HandlePAdapterEvent: queued, or dropped when D
    // already gave up on this transfer, spending nothing).
    if (Status s = p_adapter_.Admit(preqs_[idx].xfer, static_cast<std::uint64_t>(idx)); !s.ok()) {
      Violation("P's Admit: " + s.ToString());
      return;
    }
    PumpP();
  }

  void ArriveProbe(int pi) {
    if (p_dead_) return;
    PReq p;
    p.probe = true;
    p.index = pi;
    p.prompt = c_.load.probe_tokens;
    p.inflight.assign(c_.p.tp, 0);
    preqs_.push_back(std::move(p));
    queue_p_.push_back(static_cast<int>(preqs_.size() - 1));
    KickP();
  }

  void KickP() {
    if (p_dead_ || p_step_armed_) return;
    p_step_armed_ = true;
    loop_.After(Duration{0}, kPStep, 0, [this, gen = p_gen_] {
      if (PAlive(gen)) PStep();
    });
  }

  void PStep() {
    p_step_armed_ = false;
    // Admission, FIFO with head-of-line blocking (as vLLM's scheduler): a request that does not
    // fit in the pool stops the queue, so a probe waits behind it.
    std::uint64_t pending_tokens = 0;
    for (int id : running_p_) pending_tokens += preqs_[id].prompt - preqs_[id].done_tokens;
    while (!queue_p_.empty() && pending_tokens < c_.p.max_batch_tokens) {
      const int id = queue_p_.front();
      PReq& p = preqs_[id];
      if (p.st != PReq::St::kQueued) {  // aborted while queued
        queue_p_.pop_front();
        continue;
      }
      const std::uint32_t need = BlocksFor(p.prompt, c_.model.block_tokens);
      if (!p_pool_.CanAllocate(need)) break;
      queue_p_.pop_front();
      p.blocks = *p_pool_.Allocate(need, static_cast<Owner>(id));
      OnPPoolChange();
      p.st = PReq::St::kRunning;
      running_p_.push_back(id);
      pending_tokens += p.prompt;
    }
    // One continuous-batching step over the running prefills (chunked by the token budget).
    std::vector<std::pair<int, std::uint32_t>> batch;
    std::uint32_t budget = c_.p.max_batch_tokens;
    for (int id : running_p_) {
      if (budget == 0) break;
      const PReq& p = preqs_[id];
      const std::uint32_t take = std::min(budget, p.prompt - p.done_tokens);
      batch.emplace_back(id, take);
      budget -= take;
    }
    if (batch.empty()) return;
    const std::uint32_t tokens = c_.p.max_batch_tokens - budget;
    double scale = 1.0;
    if (c_.p.jitter > 0) scale += c_.p.jitter * (2 * rng_.Real() - 1);
    const Duration cost =
        c_.p.step_overhead + std::chrono::duration_cast<Duration>(c_.p.per_token * tokens * scale);
    p_step_armed_ = true;
    // Layer writes: the prompts this step completes have their planes computed one by one.
    for (const auto& [id, take] : batch) {
      const PReq& p = preqs_[id];
      if (c_.p.layer_planes == 0 || p.probe || p.done_tokens + take < p.prompt) continue;
      for (std::uint32_t k = 0; k + 1 < c_.p.layer_planes; ++k) {
        loop_.After(cost * (k + 1) / c_.p.layer_planes, kPLayer, static_cast<std::uint64_t>(id),
                    [this, id = id, k, gen = p_gen_] {
                      if (PAlive(gen)) PLayerReady(id, k);
                    });
      }
    }
    loop_.After(cost, kPStepEnd, tokens, [this, batch, gen = p_gen_] {
      if (PAlive(gen)) PStepEnd(batch);
    });
  }

  // Plane `plane` of request `id`'s KV is computed, before its prefill ends.
  void PLayerReady(int id, std::uint32_t plane) {
    const PReq& p = preqs_[id];
    if (p.st != PReq::St::kRunning) return;  // aborted during the step
    if (p_adapter_.LayersReady(p.xfer, static_cast<std::uint64_t>(id), p.blocks, {plane})) {
      PumpP();
    }
  }

  void PStepEnd(const std::vector<std::pair<int, std::uint32_t>>& batch) {
    p_step_armed_ = false;
    for (const auto& [id, tokens] : batch) {
      PReq& p = preqs_[id];
      if (p.st != PReq::St::kRunning) continue;  // aborted during the step
      p.done_tokens += tokens;
      if (p.done_tokens < p.prompt) continue;
      running_p_.erase(std::find(running_p_.begin(), running_p_.end(), id));
      if (p.probe) {
        res_.probes[static_cast<std::size_t>(p.index)].done = now();
        p.st = PReq::St::kGone;
        FreePBlocks(id);
        continue;
      }
      p.st = PReq::St::kHeld;
      loop_.Note(0xd0e, static_cast<std::uint64_t>(id));
      // The hold tables own the blocks from here; FreeBlocks gives them back.
      if (Status s = p_adapter_.PrefillDone(p.xfer, p.blocks); !s.ok()) {
        Violation("P's PrefillDone: " + s.ToString());
      }
      PumpP();
    }
    KickP();
  }

  // Carries out what P's engine adapter decided (protocol::PrefillAdapter, the glue the vLLM
  // connector and `kvferry serve` run): rank calls onto the sessions, with their answers fed
  // back, and events onto the engine; until it has nothing more to say.
  void PumpP() {
    while (!p_dead_) {
      std::vector<protocol::PrefillRankCall> calls = p_adapter_.TakeCommands();
      std::vector<protocol::PrefillAdapterEvent> events = p_adapter_.TakeEvents();
      if (calls.empty() && events.empty()) break;
      for (const protocol::PrefillRankCall& call : calls) {
        const std::uint32_t r = call.rank;
        protocol::PrefillSession& session = *p_ranks_[r].session;
        const auto found = fp_to_req_.find(core::FingerprintOf(call.transfer));
        const int id = found == fp_to_req_.end() ? -1 : found->second;
        switch (call.kind) {
          case protocol::PrefillRankCall::Kind::kAdmit: {
            const Status s = session.Admit(call.transfer, call.handle, now());
            if (s.ok() && id >= 0) {
              p_ranks_[r].mirror[id];  // keeps what a placeholder already recorded
              ArmPass(r);
            }
            p_adapter_.OnAdmitted(r, call.transfer, s);
            break;
          }
          case protocol::PrefillRankCall::Kind::kPrefillDone: {
            const Status s = session.PrefillDone(call.transfer, call.blocks, now());
            if (s.ok() && id >= 0) {
              Mirror& m = p_ranks_[r].mirror[id];
              m.ready = true;
              m.ready_at = now();
              m.wait_deadline = kNever;
            }
            p_adapter_.OnPrefillDone(r, call.transfer, s);
            break;
          }
          case protocol::PrefillRankCall::Kind::kEngineFinished:
            session.EngineFinished(call.transfer, now());
            break;
          case protocol::PrefillRankCall::Kind::kRefuse:
            (void)session.Refuse(call.transfer, call.why, now());
            break;
          case protocol::PrefillRankCall::Kind::kLayersReady:
            if (Status s = session.LayersReady(call.transfer, call.blocks, call.planes, now());
                !s.ok()) {
              Violation("P's LayersReady: " + s.ToString());
            }
            break;
        }
        if (id >= 0) SyncMirror(r, id);
        DrainP(r);
      }
      for (const protocol::PrefillAdapterEvent& event : events) HandlePAdapterEvent(event);
    }
  }

  void HandlePAdapterEvent(const protocol::PrefillAdapterEvent& event) {
    if (const auto* admitted = std::get_if<protocol::Admitted>(&event)) {
      queue_p_.push_back(static_cast<int>(admitted->handle));
      KickP();
    } else if (const auto* refused = std::get_if<protocol::AdmitRefused>(&event)) {
      preqs_[refused->handle].st = PReq::St::kGone;  // D already gave up on it: spend nothing
      p_adapter_.Finish(refused->transfer);
    } else if (const auto* abort = std::get_if<protocol::AbortPrefill>(&event)) {
      const int id = static_cast<int>(abort->handle);
      if (preqs_[id].st == PReq::St::kRunning) StopOnP(id);
      if (preqs_[id].st == PReq::St::kQueued) DropQueued(id);
    } else if (const auto* freed = std::get_if<protocol::FreeBlocks>(&event)) {
      const int id = static_cast<int>(freed->handle);
      preqs_[id].st = PReq::St::kGone;
      FreePBlocks(id);
    }
    // HandOffFailed: the ranks that hold it let go (FreeBlocks follows); P's engine has no
    // client to tell here (the simulated proxy does not wait for P's answer).
  }

  // Returns a request's blocks to P's pool, once no WRITE still reads them.
  void FreePBlocks(int id) {
    PReq& p = preqs_[id];
    if (p.blocks.empty()) return;
    for (int n : p.inflight) {
      if (n > 0) {
        p.free_pending = true;
        return;
      }
    }
    if (!p_pool_.Free(p.blocks, static_cast<Owner>(id))) {
      Violation(fmt::format("P freed {} twice", p.xfer));
    }
    p.blocks.clear();
    p.free_pending = false;
    OnPPoolChange();
    KickP();
  }

  // The engine stops a request (abort, or the hold table said nobody will pull it).
  void StopOnP(int id) {
    PReq& p = preqs_[id];
    if (p.st == PReq::St::kHeld) {
      // From kReady on the hold tables own the blocks (as vLLM's delay-free): each rank's
      // kFreeBlocks releases them once no WRITE reads them, and the adapter's FreeBlocks
      // frees them here.
      p_adapter_.Finish(p.xfer);
      PumpP();
      return;
    }
    if (p.st == PReq::St::kRunning) {
      running_p_.erase(std::find(running_p_.begin(), running_p_.end(), id));
    }
    const bool had_blocks = p.st == PReq::St::kRunning;
    p.st = PReq::St::kGone;
    p_adapter_.Finish(p.xfer);
    PumpP();
    if (had_blocks) FreePBlocks(id);
  }

  // Carries out what P rank `r`'s session decided: replies onto the network, writes onto the
  // data plane, hold events to the engine. Until it has nothing more to say.
  void DrainP(std::uint32_t r) {
    protocol::PrefillSession& session = *p_ranks_[r].session;
    while (true) {
      std::vector<protocol::Outgoing> out = session.TakeOutgoing();
      std::vector<protocol::WriteJob> writes = session.TakeWrites();
      std::vector<core::HoldEvent> events = session.TakeEngineEvents();
      if (out.empty() && writes.empty() && events.empty()) break;
      for (protocol::Outgoing& o : out) SendFromP(r, std::move(o));
      for (protocol::WriteJob& job : writes) StartWrite(r, std::move(job));
      for (core::HoldEvent& ev : events) {
        HandleHoldEvent(r, ev);
        auto it = fp_to_req_.find(core::FingerprintOf(ev.id));
        if (it != fp_to_req_.end()) SyncMirror(r, it->second);
      }
    }
    ArmPass(r);  // any call may have brought the session's next deadline forward
  }

  void SendFromP(std::uint32_t r, protocol::Outgoing o) {
    if (o.peer == kHostilePeer) {
      const auto* response = std::get_if<wire::PullResponse>(&o.message);
      if (response != nullptr && response->status != wire::PullStatus::kContinue) {
        ++res_.hostile_pulls_answered;
      }
      return;
    }
    // The peer is D's socket (PeerOf): P answers on the connection the message came by.
    const auto [d_rank, d_endpoint] = SocketOf(o.peer);
    std::visit([&](auto& m) { net_.Send(false, {d_rank, r, p_gen_, d_endpoint}, std::move(m)); },
               o.message);
  }

  void HandleHoldEvent(std::uint32_t r, const core::HoldEvent& ev) {
    auto it = fp_to_req_.find(core::FingerprintOf(ev.id));
    if (it == fp_to_req_.end()) return;
    const int id = it->second;
    PReq& p = preqs_[id];
    loop_.Note(0xe0 + static_cast<std::uint64_t>(ev.kind), static_cast<std::uint64_t>(id));
    switch (ev.kind) {
      case core::HoldEvent::Kind::kFreeBlocks:
        CheckLeaseKept(r, id, ev.reason);
        if (p.inflight[r] > 0) {
          Violation(fmt::format("P rank {} released {} while its WRITE was in flight", r, p.xfer));
        }
        p_adapter_.OnHoldEvent(r, ev);
        PumpP();
        break;
      case core::HoldEvent::Kind::kAbortPrefill:
        CheckLeaseKept(r, id, ev.reason);
        p_adapter_.OnHoldEvent(r, ev);
        PumpP();
        break;
      case core::HoldEvent::Kind::kPullsReady:
      case core::HoldEvent::Kind::kPullsFailed:
      case core::HoldEvent::Kind::kReleased:
        break;  // the session answers its parked pulls and tells D itself
    }
  }

  // Invariant (SPEC §2, the lease's promise): while D is alive and renews a transfer — it saw
  // the request and no rank's receive has completed — P never lets its lease run out, whatever
  // other P engines do. Checked where renewals cannot be lost or held up (a lossless network
  // with no extra delays, and the same lease on both sides).
  void CheckLeaseKept(std::uint32_t r, int idx, core::ReleaseReason reason) {
    if (reason != core::ReleaseReason::kExpired && reason != core::ReleaseReason::kDeadDecoder) {
      return;
    }
    const NetConfig& n = c_.net;
    const bool promise = c_.d.lease.count() > 0 && c_.d.lease == c_.p.hold.lease && n.loss == 0 &&
                         n.delay_prob == 0 && n.drop_renewals_from == kNever &&
                         n.jitter <= c_.d.lease / 60;
    // A restarted P never heard of the requests its predecessor had: no promise covers them.
    if (!promise || d_dead_ || preqs_[idx].probe || preqs_[idx].p_gen != p_gen_) return;
    // Nor can a decoder keep leases once its side channels ran out (max_endpoints, all in use:
    // exploration draws caps as low as 1): renewals it cannot send are counted, not sent.
    for (const auto& session : d_sessions_) {
      if (session->stats().endpoints_exhausted > 0) return;
    }
    // Nor does it cover what D renews before it can know of the new process: a D rank renews at
    // the old addresses until one of its messages fails unsent (connect_wait after its first one
    // since the restart), then looks P up (lookup_timeout); the new process may drop a transfer
    // D tracks one lease later. (The vLLM connector's lease, 30 s, is far above the 3 s wait.)
    // Each D rank learns on its own: one that sent nothing since the restart still holds the
    // old view when its next request comes, however long ago another rank learned (seed
    // 124098: D rank 1 learned 1.9 s after the restart, D rank 0 sent nothing for 8 s, then
    // renewed a new request of P rank 0 at the dead address for 3 s, past P's 1.09 s lease).
    // So the window is each renewing D rank's own, and closes once any of them has had it.
    if (p_up_at_.size() > 1 && RenewalsMayMissTheNewProcess(r)) return;
    const DReq& d = dreqs_[idx];
    const bool renewed = (d.st == DReq::St::kQueued || d.st == DReq::St::kReceiving) &&
                         d.ranks_completed == 0 && !Ended(idx);
    if (!renewed) return;
    Violation(fmt::format("P rank {} let {} expire ({}) while a live D renews it", r,
                          preqs_[idx].xfer, core::ToString(reason)));
  }

  // Whether every D rank that renews at P rank `p_rank` may still hold the view of the process
  // before the last restart: P keeps a lease renewed by any of them, so one that has had the
  // time to hear a message of its own fail, look P up and renew the new process (from its first
  // message since the restart, or from the restart if it sent none) keeps the promise whole.
  // Learning is per D rank: a failed message marks its whole view of the engine stale, and the
  // lookup names every P rank.
  bool RenewalsMayMissTheNewProcess(std::uint32_t p_rank) const {
    const Duration learn = c_.d.connect_wait + d_sessions_.front()->options().lookup_timeout +
                           c_.p.hold.lease + std::chrono::seconds(1);
    auto paired = core::PairedDecoderRanks(p_rank, c_.p.tp, c_.d.tp);
    if (!paired) return true;  // no D rank renews there
    for (std::uint32_t d : *paired) {
      const TimePoint first = d < d_first_sent_since_up_.size() ? d_first_sent_since_up_[d] : kNever;
      const TimePoint from = first == kNever ? p_up_at_.back() : first;
      if (now() >= from + learn) return false;
    }
    return true;
  }

  // Forgets the simulator's record of an entry the table no longer holds (any call may release
  // one), so a later entry of the same id starts from a clean record.
  void SyncMirror(std::uint32_t r, int id) {
    PRank& rank = p_ranks_[r];
    if (!rank.session->hold().Contains(preqs_[id].xfer)) rank.mirror.erase(id);
  }

  // Each P rank's session wakes at its NextDeadline (expiry passes), as the runtime's listener
  // does, up to timer_late_max late.
  void ArmPass(std::uint32_t r) {
    if (p_dead_) return;
    PRank& rank = p_ranks_[r];
    const TimePoint next = rank.session->NextDeadline();
    if (next == kNever || next >= rank.timer_at) return;
    rank.timer_at = next;
    const Duration late = c_.p.timer_late_max.count() > 0
                              ? rng_.Span(Duration{0}, c_.p.timer_late_max)
                              : Duration{0};
    loop_.Schedule(std::max(next, now()) + late, kPPass, r, [this, r, next, gen = p_gen_] {
      if (!PAlive(gen)) return;
      PRank& armed = p_ranks_[r];
      if (armed.timer_at == next) armed.timer_at = kNever;
      Pass(r);
    });
  }

  void Pass(std::uint32_t r) {
    PRank& rank = p_ranks_[r];
    rank.session->OnTimeout(now());
    DrainP(r);
    CheckHoldBound(r);
    // A pass that leaves its own deadline due would wake P's thread again at once, forever.
    if (rank.session->NextDeadline() <= now()) {
      Violation(fmt::format("P rank {}'s NextDeadline is still due after its pass", r));
      return;
    }
    ArmPass(r);
  }

  // Invariant: after an expiry pass, no entry is held past its deadline as the lease rules
  // define it (SPEC §2) — computed here from what the simulator fed the table, not read from it.
  // This is what catches an expiry pass that strands entries (vLLM #58222), and it bounds how
  // long P keeps a dead decoder's KV: lease after its last renewal, plus one pass.
  void CheckHoldBound(std::uint32_t r) {
    PRank& rank = p_ranks_[r];
    const core::HoldConfig& hc = rank.session->hold().config();
    for (auto it = rank.mirror.begin(); it != rank.mirror.end();) {
      const PReq& p = preqs_[it->first];
      if (!rank.session->hold().Contains(p.xfer)) {
        it = rank.mirror.erase(it);
        continue;
      }
      const Mirror& m = it->second;
      TimePoint deadline = kNever;
      if (m.ready) {
        if (m.sending == 0) {
          if (hc.lease_enabled()) {
            deadline = m.ready_at + hc.lease;
            if (m.renewed_when_ready != kNever) {
              deadline = std::max(deadline, m.renewed_when_ready + hc.renewal_extension());
            }
          } else {
            deadline = m.ready_at + hc.abort_request_timeout;
          }
          deadline = std::max(deadline, m.last_send_end);
        }
      } else {
        deadline = m.wait_deadline;
        if (hc.lease_enabled() && m.last_renew != kNever) {
          deadline = std::min(deadline, m.last_renew + hc.lease);
        }
      }
      if (deadline <= now()) {
        Violation(fmt::format(
            "P rank {} still holds {} {:.3f}s past its deadline (ready={}, last renewal {})", r,
            p.xfer, core::ToSeconds(now() - deadline), m.ready,
            m.last_renew == kNever ? std::string("never")
                                   : fmt::format("t={:.3f}s", At(m.last_renew))));
      }
      ++it;
    }
  }

  // A message reaches P rank `m.p_rank`: its session decides everything (through the codec).
  void DeliverToP(const Msg& m) {
    // A message to a process that died is lost with its connection, even when a new process
    // binds the same address.
    if (!PAlive(m.p_gen)) return;
    const std::uint32_t r = m.p_rank;
    PRank& rank = p_ranks_[r];
    protocol::PrefillSession& session = *rank.session;
    const protocol::PeerAddress peer = PeerOf(m);
    if (const auto* pull = std::get_if<wire::Pull>(&m.body)) {
      if (rank.errored_pulls.count({m.d_rank, pull->id}) != 0) return;  // a copy of a failed one
      const bool first_delivery = rank.delivered_pulls.insert({m.d_rank, pull->id}).second;
      if (first_delivery && rng_.Chance(c_.faults.late_pull)) {
        // Fault: P stalls on this pull past D's deadline, then serves it.
        auto late = std::make_shared<Msg>(m);
        loop_.After(c_.d.pull_timeout + rng_.Span(Duration{0}, 5s), kDeliver, r, [this, late] {
          if (!PAlive(late->p_gen)) return;
          const auto& late_pull = std::get<wire::Pull>(late->body);
          Hand(*p_ranks_[late->p_rank].session, PeerOf(*late), late_pull);
          NoteWaits(late->p_rank, late_pull);
          DrainP(late->p_rank);
          ArmPass(late->p_rank);
        });
        return;
      }
      if (first_delivery && rng_.Chance(c_.faults.peer_msg_error)) {
        // Fault: this P fails the whole message (never reaching its protocol code).
        rank.errored_pulls.insert({m.d_rank, pull->id});
        wire::PullResponse error;
        error.id = pull->id;
        error.status = wire::PullStatus::kError;
        error.code = ErrorCode::kInternal;
        error.message = fmt::format("injected: P rank {} failed the pull", r);
        net_.Send(false, {m.d_rank, r, m.p_gen, m.d_endpoint}, std::move(error));
        return;
      }
      Hand(session, peer, *pull);
      NoteWaits(r, *pull);
      if (m.p_gen > 0) ++res_.pulls_to_restarted;
    } else if (const auto* release = std::get_if<wire::Release>(&m.body)) {
      ++res_.releases_delivered;
      Hand(session, peer, *release);
    } else if (const auto* renewal = std::get_if<wire::Renewal>(&m.body)) {
      Hand(session, peer, *renewal);
      if (session.hold().config().lease_enabled()) {
        for (core::Fingerprint fp : renewal->fingerprints) {
          auto it = fp_to_req_.find(fp);
          if (it == fp_to_req_.end() || !session.hold().Contains(preqs_[it->second].xfer)) continue;
          Mirror& mir = rank.mirror[it->second];
          mir.last_renew = now();
          if (mir.ready) mir.renewed_when_ready = now();
        }
      }
    }
    DrainP(r);
    ArmPass(r);
  }

  // The oracle: a pull that now waits for an unfinished prefill starts the wait deadline.
  void NoteWaits(std::uint32_t r, const wire::Pull& pull) {
    PRank& rank = p_ranks_[r];
    for (const wire::PullRequest& request : pull.requests) {
      auto it = fp_to_req_.find(core::FingerprintOf(request.transfer_id));
      if (it == fp_to_req_.end()) continue;
      const std::optional<core::HoldPhase> phase =
          rank.session->hold().PhaseOf(request.transfer_id);
      if (!phase || *phase == core::HoldPhase::kReady) continue;
      Mirror& mir = rank.mirror[it->second];
      if (mir.wait_deadline == kNever) {
        mir.wait_deadline = now() + rank.session->hold().config().abort_request_timeout;
      }
    }
  }

  // A hostile D peer's pull (Faults::hostile_pulls), straight into a P rank's session.
  static constexpr const char* kHostilePeer = "hostile";
  void Hostile(std::uint32_t i) {
    if (p_dead_) return;
    const auto r = static_cast<std::uint32_t>(rng_.Between(0, c_.p.tp - 1));
    wire::Pull pull;
    pull.id = i + 1;
    pull.d_engine_id = "intruder";
    pull.region_descriptor = std::vector<std::uint8_t>{0xee};
    pull.block_len = d_layout_.block_len;
    pull.num_blocks = c_.d.blocks;
    const std::string xfer = fmt::format("nobody-admits-{}", i % 3);
    pull.requests.push_back({fmt::format("intruder-{}", i), xfer, {0}});
    switch (i % 3) {
      case 0:  // a pairing computation of 2^31 ranks
        pull.d_tp_size = 1u << 31;
        break;
      case 1:  // a rank no P rank pairs with: P TP * 2 ranks can only pair half of them with r
        pull.d_tp_size = c_.p.tp * 2;
        pull.d_tp_rank = (2 * r + 2) % (c_.p.tp * 2);
        break;
      default:  // repeated waits of one rank for a transfer nobody admits
        break;
    }
    ++res_.hostile_pulls_sent;
    Hand(*p_ranks_[r].session, kHostilePeer, pull);
    DrainP(r);
    ArmPass(r);
  }

  // Gives P's session a message: as bytes through the real codec, or as the struct.
  template <typename Message>
  void Hand(protocol::PrefillSession& session, const protocol::PeerAddress& peer,
            const Message& message) {
    if (c_.net.codec) {
      session.OnMessage(peer, wire::Encode(message), now());
    } else if constexpr (std::is_same_v<Message, wire::Pull>) {
      session.OnPull(peer, message, now());
    } else if constexpr (std::is_same_v<Message, wire::Release>) {
      session.OnRelease(peer, message, now());
    } else {
      session.OnRenewal(peer, message, now());
    }
  }

  // The data plane runs a write job of P rank `r`'s session (with the faults configured).
  void StartWrite(std::uint32_t r, protocol::WriteJob job) {
    PRank& rank = p_ranks_[r];
    auto shadow = pulls_.find({job.context->d_tp_rank, r, job.pull_id});
    if (shadow == pulls_.end()) {
      Violation(fmt::format("P rank {} writes for pull {}, which D never sent", r, job.pull_id));
      rank.session->OnWriteDone(
          job.ticket, protocol::WriteOutcome::Failed(Status(ErrorCode::kInternal, "?")), now());
      return;
    }
    const PullShadow& pull = shadow->second;
    PReq& p = preqs_[pull.req];
    if (rng_.Chance(c_.faults.peer_err)) {
      rank.session->OnWriteDone(
          job.ticket,
          protocol::WriteOutcome::Failed(Status(
              ErrorCode::kInternal, fmt::format("injected: P rank {} failed {}", r, p.xfer))),
          now());
      return;
    }
    ++rank.mirror[pull.req].sending;
    const std::uint32_t d_rank = job.context->d_tp_rank;
    // The session planned the write (WriteJob::writes); the data plane only moves the bytes.
    std::uint64_t bytes = 0;
    for (const core::BlockWrite& op : job.writes) bytes += op.length;
    if (!job.planes.empty()) bytes = bytes * job.planes.size() / c_.p.layer_planes;
    Write w{pull.req,
            r,
            d_rank,
            std::move(job.dst_block_ids),
            pull.gens,
            job.context->write_key,
            false,
            false,
            job.ticket};
    w.p_gen = p_gen_;
    w.ahead = job.ahead;
    if (job.ahead) ++res_.layer_writes;
    if (r == 0 && rng_.Chance(c_.faults.p0_err_after_write)) w.err_after = true;
    if (rng_.Chance(c_.faults.unsettled_write)) w.give_up = true;
    Duration delay{0};
    if (r == 1 && c_.faults.p1_write_delay.count() > 0) {
      delay += rng_.Span(Duration{0}, c_.faults.p1_write_delay);
    }
    if (rng_.Chance(c_.faults.slow_write)) delay += rng_.Span(Duration{0}, c_.faults.slow_max);
    ++p.inflight[r];
    data_.Start(std::move(w), bytes, delay);
  }

  // The data plane's hooks (DataPlane::Hooks): what a WRITE's end means to P's session.
  void WriteGivenUp(const Write& w) {
    PRank& rank = p_ranks_[w.p_rank];
    --preqs_[w.req].inflight[w.p_rank];
    auto mit = rank.mirror.find(w.req);
    if (mit != rank.mirror.end()) {
      --mit->second.sending;
      mit->second.last_send_end = now();
    }
    rank.session->OnWriteDone(
        w.ticket,
        protocol::WriteOutcome::Unsettled(Status(
            ErrorCode::kTimeout, "injected: the sender gave up with the WRITE's bytes in flight")),
        now());
    const int req = w.req;
    const std::uint32_t p_rank = w.p_rank;
    SyncMirror(p_rank, req);
    DrainP(p_rank);
    if (preqs_[req].free_pending) FreePBlocks(req);
  }

  void WriteLanded(const Write& w) {
    if (w.ahead) return;  // the request's own write follows
    ++dreqs_[w.req].peers_written;
    if (dreqs_[w.req].peers_written == c_.p.tp) ++res_.requests_written_by_all_peers;
  }

  void WriteSettled(const Write& w, bool ok) {
    PRank& rank = p_ranks_[w.p_rank];
    PReq& p = preqs_[w.req];
    --p.inflight[w.p_rank];
    auto mit = rank.mirror.find(w.req);
    if (mit != rank.mirror.end()) {
      --mit->second.sending;
      mit->second.last_send_end = now();
    }
    protocol::WriteOutcome outcome;
    if (!ok) {
      outcome = protocol::WriteOutcome::Failed(
          Status(ErrorCode::kUnavailable, "WRITE failed: decoder endpoint closed"));
    } else if (w.err_after) {
      ++res_.p0_injected_failures;
      outcome = protocol::WriteOutcome::Failed(
          Status(ErrorCode::kInternal, "injected: P0 reports an error after its WRITE"));
    }
    rank.session->OnWriteDone(w.ticket, outcome, now());
    SyncMirror(w.p_rank, w.req);
    DrainP(w.p_rank);
    if (p.free_pending) FreePBlocks(w.req);
  }

  void AbortP(int idx) {
    if (p_dead_) return;
    PReq& p = preqs_[idx];
    if (p.st == PReq::St::kQueued) {
      DropQueued(idx);
      return;
    }
    if (p.st == PReq::St::kRunning || p.st == PReq::St::kHeld) StopOnP(idx);
  }

  // A request still queued on P goes (client abort, or its decoder stopped renewing): skipped when
  // it reaches the head of the queue, and forgotten by every rank (waiting pulls fail at once).
  void DropQueued(int idx) {
    PReq& p = preqs_[idx];
    p.st = PReq::St::kGone;
    p_adapter_.Finish(p.xfer);
    PumpP();
  }

  void CrashP() {
    if (p_dead_) return;
    p_dead_ = true;
    p_down_at_.push_back(now());
    loop_.Note(0xdead, 1);
    // A liveness source (e.g. the registry) tells D after a while; D's sessions fence P's
    // workers and fail what waits for them. If a new process registered first, it says only
    // that the old process went.
    if (c_.d.liveness) {
      loop_.After(c_.d.peer_dead_detect, kPDetect, 0, [this, gen = p_gen_] {
        if (d_dead_) return;
        for (std::uint32_t r = 0; r < c_.d.tp; ++r) {
          if (p_dead_ && p_gen_ == gen) {
            d_sessions_[r]->OnEngineDown("P", Status(ErrorCode::kUnavailable, "P died"), now());
          } else {
            d_sessions_[r]->OnProcessGone(
                "P", Incarnation(gen), Status(ErrorCode::kUnavailable, "P's old process died"),
                now());
          }
          DrainD(r);
        }
      });
    }
    if (res_.p_restarts < c_.faults.p_restarts) {
      loop_.After(c_.faults.p_down_for, kPRestart, 0, [this] { RestartP(); });
    }
  }

  // A new P process (Faults::p_restarts): nothing of the old one survives, neither its requests
  // (lost: D's pulls for them find nobody who knows them) nor anything scheduled for it (every
  // P-side event checks the process it was for: PAlive).
  void RestartP() {
    ++p_gen_;
    p_dead_ = false;
    ++res_.p_restarts;
    p_up_at_.push_back(now());
    d_first_sent_since_up_.assign(c_.d.tp, kNever);
    loop_.Note(0x4e5, p_gen_);
    for (PReq& p : preqs_) {
      if (p.arrived) p.st = PReq::St::kGone;
      p.blocks.clear();
      std::fill(p.inflight.begin(), p.inflight.end(), 0);
      p.free_pending = false;
    }
    queue_p_.clear();
    running_p_.clear();
    p_step_armed_ = false;
    data_.ForgetWrites();  // an old process's writes died with it
    p_pool_ = BlockPool(c_.p.blocks);
    p_adapter_ = protocol::PrefillAdapter({.ranks = std::max<std::uint32_t>(1, c_.p.tp)});
    p_ranks_.clear();
    for (std::uint32_t r = 0; r < c_.p.tp; ++r) p_ranks_.push_back(NewPRank(r));
    if (res_.p_restarts < c_.faults.p_restarts) {
      loop_.After(c_.faults.p_up_for, kPCrash, 0, [this] { CrashP(); });
    }
  }

  // The liveness source is wrong (etcd's word is advisory: a partition, a lost lease): D is
  // told P is down while P lives on and keeps writing. D must fail what waits without freeing
  // a block P may still write; P's later answers release the quarantine.
  void DeclarePDown() {
    if (d_dead_) return;
    for (std::uint32_t r = 0; r < c_.d.tp; ++r) {
      d_sessions_[r]->OnEngineDown("P", Status(ErrorCode::kUnavailable, "P's lease lapsed"),
                                   now());
      DrainD(r);
    }
  }

  // ---------------------------------------------------------------- D engine

  void End(int idx, Outcome outcome, Status error) {
    RequestResult& r = res_.requests[static_cast<std::size_t>(idx)];
    if (++r.ends > 1) {
      Violation(fmt::format("req-{} ended twice ({} then {})", idx, ToString(r.outcome),
                            ToString(outcome)));
      return;
    }
    if (outcome == Outcome::kFailed && error.message().empty()) {
      Violation(fmt::format("req-{} failed without a reason", idx));
    }
    r.outcome = outcome;
    r.error = std::move(error);
    r.end = now();
    if (!d_dead_) {
      // The requests D tracked for the silent engines alongside this one end with it.
      for (std::uint32_t rank = 0; rank < c_.d.tp && c_.faults.silent_engines > 0; ++rank) {
        for (std::uint32_t g = 0; g < c_.faults.silent_engines; ++g) {
          d_sessions_[rank]->RequestFinished(GhostName(idx, g), now());
        }
        DrainD(rank);
      }
    }
    loop_.Note(0xe4d, (static_cast<std::uint64_t>(idx) << 8) | static_cast<std::uint64_t>(outcome));
  }

  bool Ended(int idx) const { return res_.requests[static_cast<std::size_t>(idx)].ends > 0; }

  void ArriveD(int idx) {
    if (Ended(idx)) return;  // aborted before it reached D
    if (d_dead_) {
      End(idx, Outcome::kFailed, Status(ErrorCode::kUnavailable, "decoder is down"));
      return;
    }
    DReq& d = dreqs_[idx];
    d.st = DReq::St::kQueued;
    // on_new_request: renew while still queued.
    if (Status s = d_adapter_.Track(RequestName(idx), SourceOf(idx)); !s.ok()) {
      Violation("Track: " + s.ToString());
    }
    PumpAdapter();
    for (std::uint32_t r = 0; r < c_.d.tp; ++r) {
      for (std::uint32_t g = 0; g < c_.faults.silent_engines; ++g) {
        d_sessions_[r]->OnNewRequest(
            GhostName(idx, g), {fmt::format("ghost-xfer-{}-{}", idx, g), GhostEngine(g), "ghost"},
            now());
      }
      DrainD(r);
    }
    queue_d_.push_back(idx);
    KickD();
  }

  void KickD() {
    if (d_dead_ || d_step_armed_) return;
    d_step_armed_ = true;
    loop_.After(Duration{0}, kDStep, 0, [this] { DStep(); });
  }

  void DStep() {
    d_step_armed_ = false;
    if (d_dead_) return;
    while (!queue_d_.empty() && decoding_.size() + receiving_ < c_.d.max_running) {
      const int idx = queue_d_.front();
      DReq& d = dreqs_[idx];
      if (d.st != DReq::St::kQueued) {
        queue_d_.pop_front();
        continue;
      }
      const RequestSpec& spec = c_.load.requests[static_cast<std::size_t>(idx)];
      const std::uint32_t need = BlocksFor(spec.prompt + spec.output, c_.model.block_tokens);
      if (!d_pool_.CanAllocate(need)) break;  // D admits only with room: requests queue on D
      queue_d_.pop_front();
      d.blocks = *d_pool_.Allocate(need, static_cast<Owner>(idx));
      const std::uint32_t prompt_blocks = BlocksFor(spec.prompt, c_.model.block_tokens);
      d.dest.assign(d.blocks.begin(), d.blocks.begin() + prompt_blocks);
      for (BlockId b : d.dest) d.gens.push_back(d_pool_.generation(b));
      d.st = DReq::St::kReceiving;
      ++receiving_;
      res_.requests[static_cast<std::size_t>(idx)].d_admitted = now();
      StartReceive(idx);
    }
    if (decoding_.empty()) return;
    const Duration cost = c_.d.step_base + c_.d.per_seq * static_cast<int>(decoding_.size());
    d_step_armed_ = true;
    loop_.After(cost, kDStepEnd, decoding_.size(), [this] { DStepEnd(); });
  }

  void DStepEnd() {
    d_step_armed_ = false;
    if (d_dead_) return;
    std::vector<int> still;
    for (int idx : decoding_) {
      DReq& d = dreqs_[idx];
      if (d.st != DReq::St::kDecoding) continue;
      if (++d.decoded >= c_.load.requests[static_cast<std::size_t>(idx)].output) {
        d.st = DReq::St::kDone;
        End(idx, Outcome::kOk, {});
        d_adapter_.Finish(RequestName(idx));
        PumpAdapter();
        MaybeFreeD(idx);
      } else {
        still.push_back(idx);
      }
    }
    decoding_ = std::move(still);
    KickD();
  }

  protocol::RemoteSource SourceOf(int idx) const { return {preqs_[idx].xfer, "P", "bootstrap"}; }

  void StartReceive(int idx) {
    if (Status s = d_adapter_.StartLoad(RequestName(idx), SourceOf(idx), dreqs_[idx].dest);
        !s.ok()) {
      Violation("the adapter's StartLoad: " + s.ToString());
    }
    PumpAdapter();
  }

  // Carries out what D's engine adapter decided (the same protocol::DecodeAdapter that
  // `kvferry serve` and the vLLM connector run): rank calls onto the sessions, events onto the
  // engine; until it has nothing more to say.
  void PumpAdapter() {
    while (!d_dead_) {
      std::vector<protocol::DecodeRankCall> calls = d_adapter_.TakeCommands();
      std::vector<protocol::AdapterEvent> events = d_adapter_.TakeEvents();
      if (calls.empty() && events.empty()) break;
      for (const protocol::DecodeRankCall& call : calls) {
        protocol::DecodeSession& session = *d_sessions_[call.rank];
        switch (call.kind) {
          case protocol::DecodeRankCall::Kind::kTrack:
            session.OnNewRequest(call.request, call.source, now());
            break;
          case protocol::DecodeRankCall::Kind::kStartLoad:
            if (Status s = session.StartLoad(call.request, call.source, call.blocks, now());
                !s.ok()) {
              Violation("StartLoad: " + s.ToString());
              d_adapter_.OnStartFailed(call.rank, call.request, s);
            }
            break;
          case protocol::DecodeRankCall::Kind::kFinish:
            session.RequestFinished(call.request, now());
            break;
          case protocol::DecodeRankCall::Kind::kRelease:
            session.ReleaseTransfer(call.source, now());
            break;
        }
        DrainD(call.rank);
      }
      for (protocol::AdapterEvent& event : events) HandleAdapterEvent(event);
    }
  }

  void HandleAdapterEvent(protocol::AdapterEvent& event) {
    if (auto* done = std::get_if<protocol::LoadDone>(&event)) {
      const int idx = RequestIndex(done->request);
      dreqs_[idx].load_done = true;
      ReceiveDone(idx, done->status);
      return;
    }
    if (auto* reusable = std::get_if<protocol::BlocksReusable>(&event)) {
      const int idx = RequestIndex(reusable->request);
      dreqs_[idx].reusable = true;
      MaybeFreeD(idx);
      return;
    }
    // P dropped the transfer while the request queued here: the engine fails it at once.
    auto& dropped = std::get<protocol::TransferDropped>(event);
    const int idx = RequestIndex(dropped.request);
    DReq& d = dreqs_[idx];
    if (d.st != DReq::St::kQueued || Ended(idx)) return;
    ++res_.failed_by_notice;
    d.st = DReq::St::kDone;
    d_adapter_.Finish(dropped.request);  // request_finished
    End(idx, Outcome::kFailed, dropped.why);
  }

  // Carries out what D rank `r`'s session decided, until it has nothing more to say; then arms
  // its timer.
  void DrainD(std::uint32_t r) {
    protocol::DecodeSession& session = *d_sessions_[r];
    while (!d_dead_) {
      std::vector<protocol::LookupRequest> lookups = session.TakeLookups();
      std::vector<protocol::Transmit> messages = session.TakeMessages();
      std::vector<protocol::FenceRequest> fences = session.TakeFences();
      std::vector<protocol::DecodeEvent> events = session.TakeEvents();
      if (lookups.empty() && messages.empty() && fences.empty() && events.empty()) break;
      for (const protocol::LookupRequest& lookup : lookups) registry_.Lookup(r, lookup);
      for (protocol::Transmit& t : messages) SendFromD(r, std::move(t));
      for (const protocol::FenceRequest& fence : fences) PerformFence(r, fence);
      for (protocol::DecodeEvent& ev : events) HandleDecodeEvent(r, ev);
    }
    if (d_dead_) return;
    // (An endpoint that never sent had no socket: erasing it is a no-op.)
    for (protocol::EndpointId closed : session.TakeClosedEndpoints()) d_sockets_[r].erase(closed);
    // Invariant: the sockets D holds stay within max_endpoints, whatever the churn of P
    // addresses (every P restart binds new ones).
    if (d_sockets_[r].size() > c_.d.max_endpoints) {
      Violation(fmt::format("D rank {} holds {} sockets, over max_endpoints {}", r,
                            d_sockets_[r].size(), c_.d.max_endpoints));
    }
    ArmD(r);
  }

  // The data plane carries out a fence D's session asked for, after fence_latency.
  void PerformFence(std::uint32_t r, const protocol::FenceRequest& fence) {
    loop_.After(c_.dp.fence_latency, kFence, r, [this, r, fence] {
      if (d_dead_) return;
      if (c_.faults.fence_unsupported && FencesALiveWriter(r, fence)) {
        NoteSharedKeys(r, fence);
        d_sessions_[r]->OnFenceDone(
            fence.id, Status(ErrorCode::kRejected, "the data plane cannot fence a live peer"),
            now());
      } else {
        // WRITEs stamped with the fence's keys fail from now on (unless the variant lies).
        if (!c_.variants.lying_fence) data_.Fence(r, PRankOf(fence.address), fence.write_keys);
        d_sessions_[r]->OnFenceDone(fence.id, Status::Ok(), now());
      }
      DrainD(r);
    });
  }

  // Whether a fence would cover writes of the P process that runs now (Faults::fence_unsupported
  // refuses it then; an old process's death is the proof that it can no longer write).
  bool FencesALiveWriter(std::uint32_t r, const protocol::FenceRequest& fence) const {
    if (p_dead_) return false;
    if (fence.write_keys.empty()) return registry_.GenOf(fence.address) == p_gen_;
    return std::any_of(fence.write_keys.begin(), fence.write_keys.end(),
                       [&](std::uint64_t key) { return data_.KeyMayReach(r, key, p_gen_); });
  }

  // Records the known limit (SimResult::shared_key_quarantine): a refused fence whose key the
  // live process shares with pulls sent to a process that died.
  void NoteSharedKeys(std::uint32_t r, const protocol::FenceRequest& fence) {
    for (std::uint64_t key : fence.write_keys) {
      if (data_.KeySharedBeyond(r, key, p_gen_)) res_.shared_key_quarantine = true;
    }
  }


  static core::RequestId GhostName(int idx, std::uint32_t g) {
    return fmt::format("ghost-{}-{}", idx, g);
  }

  // Whether P process `gen` is the one running.
  bool PAlive(std::uint32_t gen) const { return !p_dead_ && gen == p_gen_; }

  void SendFromD(std::uint32_t r, protocol::Transmit t) {
    if (t.address.starts_with("g")) {  // a silent engine's worker: nothing ever answers
      ++res_.messages_to_silent_engines;
      return;
    }
    const std::uint32_t p = PRankOf(t.address);
    const std::uint32_t gen = registry_.GenOf(t.address);
    d_sockets_[r].insert(t.endpoint);  // the runtime opens a socket for an endpoint's first message
    if (r < d_first_sent_since_up_.size() && d_first_sent_since_up_[r] == kNever) {
      d_first_sent_since_up_[r] = now();
    }
    if (!p_dead_ && p_gen_ > 0 && now() >= FindableFrom(p_gen_)) {
      if (first_send_findable_.size() <= p_gen_) {
        first_send_findable_.resize(p_gen_ + 1, std::vector<TimePoint>(c_.d.tp, kNever));
      }
      TimePoint& first = first_send_findable_[p_gen_][r];
      if (first == kNever) first = now();
    }
    if (!PAlive(gen)) {
      // No connection to a process that is gone: the message never leaves, and D's pump
      // reports it unsent after its connect wait (what runtime::DecodeWorker does).
      ++res_.messages_unsent;
      const std::uint64_t wire_id = std::visit([](const auto& m) { return m.id; }, t.message);
      if (const auto* pull = std::get_if<wire::Pull>(&t.message); pull && !pull->requests.empty()) {
        std::vector<std::uint32_t>& unsent =
            dreqs_[RequestIndex(pull->requests.front().d_req_id)].unsent_pulls;
        unsent.resize(c_.d.tp, 0);
        ++unsent[r];
      }
      loop_.After(c_.d.connect_wait, kUnsent, r, [this, r, endpoint = t.endpoint, wire_id] {
        if (d_dead_) return;
        d_sessions_[r]->OnSendFailed(
            endpoint, wire_id,
            Status(ErrorCode::kUnavailable, "no connection to the prefill worker"), now());
        DrainD(r);
      });
      return;
    }
    // It leaves (a connection is up), as the runtime tells the session.
    d_sessions_[r]->OnSent(t.endpoint, std::visit([](const auto& m) { return m.id; }, t.message),
                           now());
    if (auto* pull = std::get_if<wire::Pull>(&t.message)) {
      data_.NotePull(r, pull->write_key, gen);
      const int idx = RequestIndex(pull->requests.at(0).d_req_id);
      pulls_[{r, p, pull->id}] = {idx, r, p, dreqs_[idx].gens};
    } else if (std::holds_alternative<wire::Release>(t.message)) {
      ++res_.releases_sent;
    } else {
      ++res_.renewals_sent;
      if (now() >= c_.net.drop_renewals_from && now() < c_.net.drop_renewals_until) return;
    }
    std::visit([&](auto& m) { net_.Send(true, {r, p, gen, t.endpoint}, std::move(m)); }, t.message);
  }

  void HandleDecodeEvent(std::uint32_t r, protocol::DecodeEvent& event) {
    if (auto* w = std::get_if<protocol::Warning>(&event)) {
      if (w->kind == protocol::Warning::Kind::kNoLease) ++res_.renewal_warnings;
      return;
    }
    if (auto* released = std::get_if<protocol::BlocksReleased>(&event)) {
      d_adapter_.OnReleased(r, released->request);
    } else if (auto* aborted = std::get_if<protocol::TransferAborted>(&event)) {
      d_adapter_.OnTransferAborted(r, aborted->request, aborted->error);
    } else {
      auto& done = std::get<protocol::ReceiveDone>(event);
      if (done.quarantined) ++res_.quarantined_completions;
      ++dreqs_[RequestIndex(done.request)].ranks_completed;
      d_adapter_.OnReceiveDone(r, done.request, done.ok, done.error, done.quarantined);
    }
    PumpAdapter();
  }

  // Each D rank's session wakes at its NextDeadline (pull deadlines, renewal passes, lookups).
  void ArmD(std::uint32_t r) {
    if (d_dead_) return;
    const TimePoint next = d_sessions_[r]->NextDeadline();
    if (next == kNever || next >= d_timer_at_[r]) return;
    d_timer_at_[r] = next;
    loop_.Schedule(std::max(next, now()), kDTimer, r, [this, r, next] {
      if (d_timer_at_[r] == next) d_timer_at_[r] = kNever;
      if (d_dead_) return;
      d_sessions_[r]->OnTimeout(now());
      DrainD(r);
    });
  }

  void ReceiveDone(int idx, const Status& status) {
    DReq& d = dreqs_[idx];
    --receiving_;                              // the sessions stopped renewing it
    if (d.st != DReq::St::kReceiving) return;  // aborted meanwhile: only the blocks remain
    if (!status.ok()) {
      d.st = DReq::St::kDone;
      End(idx, Outcome::kFailed, status);
      d_adapter_.Finish(RequestName(idx));
      return;
    }
    d.st = DReq::St::kDecoding;
    decoding_.push_back(idx);
    KickD();
  }

  // D's blocks go back to the pool only when the adapter says no P writer can touch them
  // (every rank's receive ended and released its quarantine) and the request no longer decodes.
  void MaybeFreeD(int idx) {
    DReq& d = dreqs_[idx];
    if (d.freed || d.blocks.empty() || d_dead_) return;
    if (!d.reusable) return;
    if (d.st == DReq::St::kDecoding || d.st == DReq::St::kReceiving) return;
    d.freed = true;
    if (!d_pool_.Free(d.blocks, static_cast<Owner>(idx))) {
      Violation(fmt::format("D freed req-{}'s blocks twice", idx));
    }
    KickD();
  }

  void DeliverToD(const Msg& m) {
    if (d_dead_) return;
    if (d_sockets_[m.d_rank].count(m.d_endpoint) == 0) {
      // The session closed that socket (an idle endpoint): what was on its way is lost.
      ++res_.replies_to_closed;
      return;
    }
    protocol::DecodeSession& session = *d_sessions_[m.d_rank];
    if (std::holds_alternative<wire::AbortNotice>(m.body)) ++res_.notices_delivered;
    if (c_.net.codec) {
      // Through the real codec and D's own dispatch.
      const std::vector<std::uint8_t> bytes =
          std::visit([](const auto& body) { return wire::Encode(body); }, m.body);
      const std::uint64_t before = session.stats().undecodable;
      session.OnMessage(m.d_endpoint, bytes, now());
      if (session.stats().undecodable != before) {
        Violation(
            fmt::format("P rank {} sent D rank {} an undecodable message", m.p_rank, m.d_rank));
      }
    } else if (const auto* reply = std::get_if<wire::RenewalReply>(&m.body)) {
      session.OnRenewalReply(m.d_endpoint, *reply, now());
    } else if (const auto* rreply = std::get_if<wire::ReleaseReply>(&m.body)) {
      session.OnReleaseReply(m.d_endpoint, *rreply, now());
    } else if (const auto* notice = std::get_if<wire::AbortNotice>(&m.body)) {
      session.OnAbortNotice(m.d_endpoint, *notice, now());
    } else {
      session.OnPullResponse(m.d_endpoint, std::get<wire::PullResponse>(m.body), now());
    }
    DrainD(m.d_rank);
  }

  // D rank `d`'s data plane revokes `keys` (what its session asked for, of P rank `p`'s pulls):
  // WRITEs stamped with them fail from now on, those in flight included (the runtime's fence
  // waits for or cuts them: transport::Engine::RevokeWriteKeys).
  void AbortD(int idx) {
    if (d_dead_ || Ended(idx)) return;
    DReq& d = dreqs_[idx];
    d_adapter_.Finish(RequestName(idx));  // request_finished: releases go to P
    PumpAdapter();
    const DReq::St st = d.st;
    End(idx, Outcome::kAborted, Status(ErrorCode::kCancelled, "aborted by the client"));
    if (st == DReq::St::kReceiving) {
      d.st = DReq::St::kDone;
      return;  // the blocks wait for every peer to settle (BlocksReusable, then MaybeFreeD)
    }
    if (st == DReq::St::kDecoding) {
      decoding_.erase(std::find(decoding_.begin(), decoding_.end(), idx));
    }
    d.st = DReq::St::kDone;
    MaybeFreeD(idx);
  }

  void CrashD() {
    d_dead_ = true;
    loop_.Note(0xdead, 2);
    for (std::size_t i = 0; i < res_.requests.size(); ++i) {
      const int idx = static_cast<int>(i);
      if (!Ended(idx) && dreqs_[idx].st != DReq::St::kUnseen) {
        End(idx, Outcome::kFailed, Status(ErrorCode::kUnavailable, "decoder died"));
      }
    }
  }

  // ---------------------------------------------------------------- observation

  void OnPPoolChange() {
    if (c_.faults.d_crash == kNever || now() < c_.faults.d_crash) return;
    const double pct = 100.0 * p_pool_.used() / p_pool_.total();
    if (pct >= 95.0) p_was_full_ = true;
    if (p_was_full_ && pct < 95.0 && res_.p_kv_left_full == kNever) res_.p_kv_left_full = now();
    if (pct < 5.0 && res_.p_kv_below_5 == kNever) res_.p_kv_below_5 = now();
  }

  void Sample() {
    res_.samples.push_back({At(now()), 100.0 * p_pool_.used() / p_pool_.total(),
                            d_dead_ ? 0.0 : 100.0 * d_pool_.used() / d_pool_.total()});
    if (now() + c_.sample_every <= c_.horizon) {
      loop_.After(c_.sample_every, kSample, 0, [this] { Sample(); });
    }
  }

  // When D can find P process `gen` (> 0): it believes a failed lookup for lookup_failure_ttl
  // after the process came up, or after the liveness source said its predecessor went.
  TimePoint FindableFrom(std::uint32_t gen) const {
    TimePoint from = p_up_at_[gen];
    if (c_.d.liveness) from = std::max(from, p_down_at_[gen - 1] + c_.d.peer_dead_detect);
    return from + d_sessions_.front()->options().lookup_failure_ttl;
  }

  // Invariant: a P that restarted (a new incarnation, on the same addresses or new ones) gets
  // traffic again within a bound, with or without a liveness source. D believes a failed lookup
  // for lookup_failure_ttl after P came back (or after the liveness source said P went, if
  // later); D's first message to P after that goes to the process D knew, or to one a fresh
  // lookup found; if the process it knew is gone, that message fails unsent within
  // connect_wait and marks every view of the address stale. From then on (plus a second for
  // the messages in between), no load may send to a dead process while the new one lives:
  // every later lookup finds it.
  void CheckRestartsFound() {
    const Duration settle = c_.d.connect_wait + std::chrono::seconds(1);
    for (std::size_t g = 1; g < first_send_findable_.size(); ++g) {
      const TimePoint down = g < p_down_at_.size() ? p_down_at_[g] : kNever;
      // Per D rank: each rank's session keeps its own views.
      for (std::uint32_t r = 0; r < c_.d.tp; ++r) {
        const TimePoint first = first_send_findable_[g][r];
        if (first == kNever) continue;
        for (std::size_t i = 0; i < res_.requests.size(); ++i) {
          // Loads that start once the rank's first message since then had time to fail
          // unsent, and that have connect_wait to send while process g lives and D does.
          const TimePoint start = res_.requests[i].d_admitted;
          const std::vector<std::uint32_t>& unsent = dreqs_[i].unsent_pulls;
          if (start == kNever || start < first + settle || start + settle >= down ||
              start + settle >= c_.faults.d_crash || unsent.empty() || unsent[r] == 0) {
            continue;
          }
          Violation(fmt::format(
              "req-{} (loaded at t={:.3f}s) sent {} pulls from D rank {} to a dead P process, "
              "{:.3f}s after the rank's first message that could find P process {} (restarted "
              "at t={:.3f}s)",
              i, At(start), unsent[r], r, core::ToSeconds(start - first), g, At(p_up_at_[g])));
        }
      }
    }
  }

  // Invariants once the run is over: every request ended exactly once, and (if the system went
  // quiet) nothing is still held anywhere.
  void FinalChecks() {
    // Once D starts loading a request, it ends — loaded, or failed with the reason the user
    // hears — within D's own deadlines, whatever P does and even when its blocks must stay
    // quarantined: a lookup (lookup_timeout), a pull that cannot leave (connect_wait), once
    // more after a fresh lookup (a load whose only pull never left is retried once), then the
    // pull's deadline (pull_timeout), plus a second for the messages in between.
    const Duration load_bound = 2 * (d_sessions_.front()->options().lookup_timeout +
                                     c_.d.connect_wait) +
                                c_.d.pull_timeout + std::chrono::seconds(1);
    for (std::size_t i = 0; i < res_.requests.size(); ++i) {
      const RequestResult& r = res_.requests[i];
      // Under the shared-write-key limit D's pool may stay full of quarantined blocks: requests
      // queued on D then wait for blocks for as long as the new P process lives.
      const bool starved =
          res_.shared_key_quarantine && dreqs_[i].st == DReq::St::kQueued && !d_dead_;
      if (r.ends == 0 && !starved) {
        Violation(
            fmt::format("req-{} never ended (D state {})", i, static_cast<int>(dreqs_[i].st)));
      } else if (r.d_admitted != core::kNever && r.end - r.d_admitted > load_bound) {
        Violation(fmt::format("req-{} ended {:.1f} s after D began loading it, beyond the {:.1f} s "
                              "bound",
                              i, core::ToSeconds(r.end - r.d_admitted), core::ToSeconds(load_bound)));
      }
    }
    CheckRestartsFound();
    if (c_.sample_every.count() > 0) return;  // scenario runs stop at a horizon, not at quiet
    if (!p_dead_ && res_.p_restarts == 0 &&
        res_.hostile_pulls_answered != res_.hostile_pulls_sent) {
      Violation(fmt::format("P answered {} of {} hostile pulls", res_.hostile_pulls_answered,
                            res_.hostile_pulls_sent));
    }
    if (!res_.quiet) {
      Violation("the system did not go quiet before the horizon");
    }
    const Violations violation = [this](std::string what) { Violation(std::move(what)); };
    if (!p_dead_) {
      PrefillSide p{{}, p_pool_, p_adapter_};
      for (const PRank& rank : p_ranks_) p.ranks.push_back(rank.session.get());
      AuditPrefillSide(p, violation);
    }
    if (!d_dead_ && !res_.shared_key_quarantine) {
      DecodeSide d{{}, d_sockets_, c_.d.max_idle_endpoints, d_pool_, d_adapter_};
      for (const auto& session : d_sessions_) d.ranks.push_back(session.get());
      AuditDecodeSide(d, violation);
    }
  }

  const SimConfig& c_;
  EventLoop loop_;
  Rng rng_;
  SimResult res_;
  ControlNetwork net_{c_.net, rng_, loop_, kDeliver, [this](bool to_p, const Msg& m) {
                        if (to_p) {
                          DeliverToP(m);
                        } else {
                          DeliverToD(m);
                        }
                      }};
  core::TpLayout p_layout_;
  core::TpLayout d_layout_;

  // P engine.
  BlockPool p_pool_;
  protocol::PrefillAdapter p_adapter_;  // the engine's glue to its ranks' sessions
  std::vector<PRank> p_ranks_;
  std::vector<PReq> preqs_;  // transfers [0, n), then probes
  std::deque<int> queue_p_;
  std::vector<int> running_p_;
  bool p_step_armed_ = false;
  bool p_dead_ = false;
  std::uint32_t p_gen_ = 0;             // the P process running, or the last one (p_dead_)
  std::vector<TimePoint> p_up_at_;      // [gen]: when P process gen started
  std::vector<TimePoint> p_down_at_;    // [gen]: when it died
  // [d_rank]: the D rank's first message to any P rank (at any address) since P last restarted;
  // empty before the first restart.
  std::vector<TimePoint> d_first_sent_since_up_;
  // [gen][d_rank]: the rank's first message to P once it could find P process gen.
  std::vector<std::vector<TimePoint>> first_send_findable_;
  bool p_was_full_ = false;
  std::unordered_map<core::Fingerprint, int> fp_to_req_;

  // D engine.
  BlockPool d_pool_;
  protocol::DecodeAdapter d_adapter_;  // the engine's glue to its ranks' sessions
  std::vector<std::unique_ptr<protocol::DecodeSession>> d_sessions_;  // per D rank
  std::vector<TimePoint> d_timer_at_;  // each session's armed wake-up (kNever: none)
  // [d_rank]: the sockets D's pump holds: opened by a message to an endpoint, closed when the
  // session says so (TakeClosedEndpoints), as runtime::DecodeWorker does.
  std::vector<std::set<protocol::EndpointId>> d_sockets_;
  std::vector<DReq> dreqs_;
  std::deque<int> queue_d_;
  std::vector<int> decoding_;
  std::size_t receiving_ = 0;
  bool d_step_armed_ = false;
  bool d_dead_ = false;

  // The bootstrap D looks P up in.
  Registry registry_{c_, loop_, kLookup,
                     {.p_dead = [this] { return p_dead_; },
                      .p_gen = [this] { return p_gen_; },
                      .d_alive = [this] { return !d_dead_; },
                      .found =
                          [this](std::uint32_t r, const protocol::PeerEngine& engine,
                                 std::uint64_t id) {
                            d_sessions_[r]->OnLookup(engine, now(), id);
                            DrainD(r);
                          },
                      .failed =
                          [this](std::uint32_t r, const core::EngineId& engine, const Status& why,
                                 std::uint64_t id) {
                            d_sessions_[r]->OnLookupFailed(engine, why, now(), id);
                            DrainD(r);
                          }}};

  // Data plane.
  DataPlane data_{c_.dp,
                  c_.d.tp,
                  d_pool_,
                  rng_,
                  loop_,
                  {.start = kWriteStart, .end = kWriteEnd, .give_up = kWriteGiveUp},
                  res_,
                  {.p_alive = [this](std::uint32_t gen) { return PAlive(gen); },
                   .d_alive = [this] { return !d_dead_; },
                   .violation = [this](std::string what) { Violation(std::move(what)); },
                   .landed = [this](const Write& w) { WriteLanded(w); },
                   .settled = [this](const Write& w, bool ok) { WriteSettled(w, ok); },
                   .given_up = [this](const Write& w) { WriteGivenUp(w); }}};
  // What the simulator knows of each pull beyond its wire form, by (D rank, P rank, wire id):
  // ids are per D session and endpoint.
  std::map<std::tuple<std::uint32_t, std::uint32_t, std::uint64_t>, PullShadow> pulls_;
};

}  // namespace

SimResult RunCluster(const SimConfig& config) { return Sim(config).Run(); }

}  // namespace kvferry::sim
