#include "cluster.h"

#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <map>
#include <memory>
#include <unordered_map>
#include <unordered_set>

#include "kvferry/core/renewal_scheduler.h"
#include "kvferry/core/tp_plan.h"
#include "rng.h"

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
  kRenewTick,
  kPullTimeout,
  kDCrash,
  kPCrash,
  kPDetect,
  kAbortP,
  kAbortD,
  kSample,
};

constexpr std::int64_t kFree = -1;

// A fixed-capacity block pool. Every free and every allocation bumps the block's generation, so
// a WRITE that remembers the generation it was aimed at can tell whether the block changed hands
// since. Free blocks are reused oldest first, like vLLM's free-block queue.
class BlockPool {
 public:
  explicit BlockPool(std::uint32_t n) : gen_(n, 0), owner_(n, kFree) {
    for (BlockId b = 0; b < n; ++b) free_.push_back(b);
  }
  std::uint32_t capacity() const { return static_cast<std::uint32_t>(gen_.size()); }
  std::uint32_t used() const { return capacity() - static_cast<std::uint32_t>(free_.size()); }
  bool CanAlloc(std::uint32_t n) const { return free_.size() >= n; }
  std::vector<BlockId> Alloc(std::uint32_t n, std::int64_t owner) {
    std::vector<BlockId> out;
    out.reserve(n);
    for (std::uint32_t i = 0; i < n; ++i) {
      const BlockId b = free_.front();
      free_.pop_front();
      ++gen_[b];
      owner_[b] = owner;
      out.push_back(b);
    }
    return out;
  }
  // False (and nothing changed for that block) when `owner` does not own it: a double free.
  bool Free(const std::vector<BlockId>& blocks, std::int64_t owner) {
    bool ok = true;
    for (BlockId b : blocks) {
      if (owner_[b] != owner) {
        ok = false;
        continue;
      }
      owner_[b] = kFree;
      ++gen_[b];
      free_.push_back(b);
    }
    return ok;
  }
  std::uint64_t gen(BlockId b) const { return gen_[b]; }
  std::int64_t owner(BlockId b) const { return owner_[b]; }

 private:
  std::vector<std::uint64_t> gen_;
  std::vector<std::int64_t> owner_;
  std::deque<BlockId> free_;
};

std::uint32_t BlocksFor(std::uint64_t tokens, std::uint32_t block_tokens) {
  return static_cast<std::uint32_t>((tokens + block_tokens - 1) / block_tokens);
}

struct Msg {
  enum class Type : std::uint8_t { kPull, kResponse, kRenewal, kRenewalReply };
  enum class Answer : std::uint8_t { kOk, kErr, kError, kFinishOnly };
  Type type;
  std::uint32_t d_rank = 0;
  std::uint32_t p_rank = 0;
  int req = -1;
  // Pull.
  std::vector<BlockId> blocks;
  std::vector<std::uint64_t> gens;  // simulator-only shadow: the generations the pull aimed at
  std::uint32_t epoch = 0;          // simulator-only shadow: D's endpoint epoch for this peer
  std::optional<Duration> d_lease;
  std::uint32_t need_send = 1;
  // Every pull carries an id unique per D rank. A P worker drops a pull whose id it has seen: a
  // transport duplicate must not be answered, because D cannot tell the answer to a duplicate
  // ("already sending": err) from a failure of the original, would settle the entry and free
  // the blocks while the original WRITE is still in flight (found by exploration; see
  // tests/sim/core_composition_test.cc).
  std::uint64_t pull_id = 0;
  // Response.
  Answer answer = Answer::kOk;
  Status status;
  // Renewal and its reply.
  std::vector<core::Fingerprint> fps;
  bool rejected = false;

  std::uint64_t Bytes() const { return 64 + 4 * blocks.size() + 7 * fps.size(); }
};
using MsgPtr = std::shared_ptr<const Msg>;

struct PendingPull {
  int req;
  std::uint32_t d_rank;
  std::vector<BlockId> blocks;
  std::vector<std::uint64_t> gens;
  std::uint32_t epoch;
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

struct PRank {
  std::unique_ptr<Hold> hold;
  std::unordered_set<std::uint64_t> seen_pulls;
  std::map<int, std::vector<PendingPull>> waiting;
  std::map<int, Mirror> mirror;
  bool pass_armed = false;
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
  std::uint32_t ranks_holding = 0;
  std::vector<int> inflight;  // WRITEs in flight, per P rank
  bool free_pending = false;
};

struct DReq {
  enum class St : std::uint8_t { kUnseen, kQueued, kReceiving, kDecoding, kDone };
  St st = St::kUnseen;
  std::vector<BlockId> blocks;      // all blocks (prompt + output)
  std::vector<BlockId> dest;        // the prompt's blocks, which P writes
  std::vector<std::uint64_t> gens;  // generations of `dest` at allocation
  std::uint32_t ranks_completed = 0;
  std::uint32_t ranks_released = 0;
  bool recv_failed = false;
  Status error;
  std::uint32_t decoded = 0;
  bool freed = false;
  std::uint32_t peers_written = 0;
};

struct Write {
  int req;
  std::uint32_t p_rank;
  std::uint32_t d_rank;
  std::vector<BlockId> dest;
  std::vector<std::uint64_t> gens;
  std::uint32_t epoch;
  bool fenced = false;
  bool err_after = false;  // scenario C's injected P0 failure
};

class Sim {
 public:
  explicit Sim(const SimConfig& c)
      : c_(c), rng_(c.seed), p_pool_(c.p.blocks), d_pool_(c.d.blocks), renew_(c.d.lease) {
    const std::size_t n = c.load.requests.size();
    res_.requests.resize(n);
    preqs_.resize(n);
    dreqs_.resize(n);
    res_.writes_after_free.assign(c.p.tp, 0);
    res_.writes_after_realloc.assign(c.p.tp, 0);
    for (std::uint32_t r = 0; r < c.p.tp; ++r) {
      p_ranks_.push_back({c.variants.NewHold(c.p.hold), {}, {}, {}, false});
    }
    for (std::uint32_t r = 0; r < c.d.tp; ++r) {
      d_ledgers_.push_back(c.variants.NewLedger());
      d_epoch_.emplace_back(c.p.tp, 0);
      auto targets = core::PullTargets(r, c.d.tp, c.p.tp);
      if (!targets) Violation("bad TP pair: " + targets.error().ToString());
      targets_.push_back(targets ? *targets : std::vector<std::uint32_t>{});
    }
    for (std::uint32_t r = 0; r < c.p.tp; ++r) {
      auto paired = core::PairedDecoderRanks(r, c.p.tp, c.d.tp);
      need_send_.push_back(paired ? static_cast<std::uint32_t>(paired->size()) : 1);
    }
    p_layout_ = {c.p.tp, c.model.kv_heads, BlockLen(c.p.tp)};
    d_layout_ = {c.d.tp, c.model.kv_heads, BlockLen(c.d.tp)};
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
      loop_.Schedule(spec.arrival + to_p, kArriveP, i, [this, idx] { ArriveP(idx); });
      loop_.Schedule(spec.arrival + to_d, kArriveD, i, [this, idx] { ArriveD(idx); });
      if (spec.abort_at != kNever) {
        loop_.Schedule(spec.abort_at + c_.proxy_latency, kAbortP, i, [this, idx] { AbortP(idx); });
        loop_.Schedule(spec.abort_at + c_.proxy_latency, kAbortD, i, [this, idx] { AbortD(idx); });
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
    res_.hold_stats = p_ranks_[0].hold->stats();
    return std::move(res_);
  }

 private:
  // ---------------------------------------------------------------- helpers

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

  // ---------------------------------------------------------------- control network

  // Link ids: direction · 2^20 + d_rank · 2^10 + p_rank.
  void Send(bool to_p, std::uint32_t d_rank, std::uint32_t p_rank, MsgPtr m) {
    const NetConfig& n = c_.net;
    if (rng_.Chance(n.loss)) {
      loop_.Note(0x1055, static_cast<std::uint64_t>(m->type));
      return;
    }
    const int copies = 1 + (rng_.Chance(n.duplicate) ? 1 : 0);
    const std::uint64_t link = (to_p ? 1u << 20 : 0u) | (d_rank << 10) | p_rank;
    for (int i = 0; i < copies; ++i) {
      TimePoint t = now() + n.latency + TransmitTime(m->Bytes(), n.bytes_per_s);
      if (n.jitter.count() > 0) t += rng_.Span(Duration{0}, n.jitter);
      if (rng_.Chance(n.delay_prob)) t += rng_.Span(Duration{0}, n.delay_max);
      if (!rng_.Chance(n.reorder)) {
        TimePoint& last = link_last_[link];
        t = std::max(t, last);
        last = t;
      }
      loop_.Schedule(t, kDeliver, link, [this, to_p, m] {
        if (to_p) {
          DeliverToP(*m);
        } else {
          DeliverToD(*m);
        }
      });
    }
  }

  void Respond(const PendingPull& pull, std::uint32_t p_rank, Msg::Answer answer, Status status) {
    auto m = std::make_shared<Msg>();
    m->type = Msg::Type::kResponse;
    m->d_rank = pull.d_rank;
    m->p_rank = p_rank;
    m->req = pull.req;
    m->answer = answer;
    m->status = std::move(status);
    Send(false, pull.d_rank, p_rank, std::move(m));
  }

  // ---------------------------------------------------------------- P engine

  void ArriveP(int idx) {
    if (p_dead_) return;
    queue_p_.push_back(idx);
    KickP();
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
    loop_.After(Duration{0}, kPStep, 0, [this] { PStep(); });
  }

  void PStep() {
    p_step_armed_ = false;
    if (p_dead_) return;
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
      if (!p_pool_.CanAlloc(need)) break;
      queue_p_.pop_front();
      if (!p.probe && !AdmitOnRanks(id)) {
        p.st = PReq::St::kGone;  // D already gave up on this transfer: spend nothing on it
        continue;
      }
      p.blocks = p_pool_.Alloc(need, id);
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
    loop_.After(cost, kPStepEnd, tokens, [this, batch] { PStepEnd(batch); });
  }

  bool AdmitOnRanks(int id) {
    PReq& p = preqs_[id];
    std::vector<std::uint32_t> admitted;
    bool ok = true;
    for (std::uint32_t r = 0; r < c_.p.tp; ++r) {
      Status s = p_ranks_[r].hold->Admit(p.xfer, static_cast<std::uint64_t>(id), now());
      if (!s.ok()) {
        ok = false;
        break;
      }
      admitted.push_back(r);
      p_ranks_[r].mirror[id];  // keeps what a placeholder already recorded
      ArmPass(r);
    }
    if (!ok) {
      for (std::uint32_t r : admitted) {
        p_ranks_[r].hold->EngineFinished(p.xfer, now());
        SyncMirror(r, id);
      }
    }
    for (std::uint32_t r = 0; r < c_.p.tp; ++r) DrainP(r);
    return ok;
  }

  void PStepEnd(const std::vector<std::pair<int, std::uint32_t>>& batch) {
    p_step_armed_ = false;
    if (p_dead_) return;
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
      const auto num_blocks = static_cast<std::uint32_t>(p.blocks.size());
      for (std::uint32_t r = 0; r < c_.p.tp; ++r) {
        PRank& rank = p_ranks_[r];
        if (rank.hold->PrefillDone(p.xfer, num_blocks, now()).ok()) {
          ++p.ranks_holding;
          Mirror& m = rank.mirror[id];
          m.ready = true;
          m.ready_at = now();
          m.wait_deadline = kNever;
        }
      }
      loop_.Note(0xd0e, static_cast<std::uint64_t>(id));
      if (p.ranks_holding == 0) {
        p.st = PReq::St::kGone;
        FreePBlocks(id);
      }
      for (std::uint32_t r = 0; r < c_.p.tp; ++r) DrainP(r);
    }
    KickP();
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
    if (!p_pool_.Free(p.blocks, id)) Violation(fmt::format("P freed {} twice", p.xfer));
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
      // kFreeBlocks releases them once no WRITE reads them, and the last one frees them here.
      for (std::uint32_t r = 0; r < c_.p.tp; ++r) {
        p_ranks_[r].hold->EngineFinished(p.xfer, now());
        SyncMirror(r, id);
      }
      for (std::uint32_t r = 0; r < c_.p.tp; ++r) DrainP(r);
      return;
    }
    if (p.st == PReq::St::kRunning) {
      running_p_.erase(std::find(running_p_.begin(), running_p_.end(), id));
    }
    const bool had_blocks = p.st == PReq::St::kRunning || p.st == PReq::St::kHeld;
    p.st = PReq::St::kGone;
    p.ranks_holding = 0;
    for (std::uint32_t r = 0; r < c_.p.tp; ++r) {
      p_ranks_[r].hold->EngineFinished(p.xfer, now());
      SyncMirror(r, id);
    }
    if (had_blocks) FreePBlocks(id);
    for (std::uint32_t r = 0; r < c_.p.tp; ++r) DrainP(r);
  }

  void DrainP(std::uint32_t r) {
    while (true) {
      std::vector<core::HoldEvent> events = p_ranks_[r].hold->TakeEvents();
      if (events.empty()) break;
      for (core::HoldEvent& ev : events) {
        HandleHoldEvent(r, ev);
        auto it = fp_to_req_.find(core::FingerprintOf(ev.id));
        if (it != fp_to_req_.end()) SyncMirror(r, it->second);
      }
    }
  }

  void HandleHoldEvent(std::uint32_t r, const core::HoldEvent& ev) {
    PRank& rank = p_ranks_[r];
    auto it = fp_to_req_.find(core::FingerprintOf(ev.id));
    if (it == fp_to_req_.end()) return;
    const int id = it->second;
    PReq& p = preqs_[id];
    loop_.Note(0xe0 + static_cast<std::uint64_t>(ev.kind), static_cast<std::uint64_t>(id));
    switch (ev.kind) {
      case core::HoldEvent::Kind::kFreeBlocks:
        if (p.inflight[r] > 0) {
          Violation(fmt::format("P rank {} released {} while its WRITE was in flight", r, p.xfer));
        }
        if (p.st == PReq::St::kHeld && p.ranks_holding > 0 && --p.ranks_holding == 0) {
          p.st = PReq::St::kGone;
          FreePBlocks(id);
        }
        break;
      case core::HoldEvent::Kind::kAbortPrefill:
        if (p.st == PReq::St::kRunning) StopOnP(id);
        break;
      case core::HoldEvent::Kind::kPullsReady: {
        std::vector<PendingPull> pulls = std::move(rank.waiting[id]);
        rank.waiting.erase(id);
        for (PendingPull& pull : pulls) StartSend(r, std::move(pull));
        break;
      }
      case core::HoldEvent::Kind::kPullsFailed: {
        std::vector<PendingPull> pulls = std::move(rank.waiting[id]);
        rank.waiting.erase(id);
        for (PendingPull& pull : pulls) Respond(pull, r, Msg::Answer::kErr, ev.status);
        break;
      }
    }
  }

  // Forgets the simulator's record of an entry the table no longer holds (any call may release
  // one), so a later entry of the same id starts from a clean record.
  void SyncMirror(std::uint32_t r, int id) {
    PRank& rank = p_ranks_[r];
    if (!rank.hold->Contains(preqs_[id].xfer)) rank.mirror.erase(id);
  }

  void ArmPass(std::uint32_t r) {
    PRank& rank = p_ranks_[r];
    if (rank.pass_armed || p_dead_) return;
    rank.pass_armed = true;
    // Passes run on a fixed grid (every expiry_pass), like a worker's periodic scan.
    const auto period = c_.p.expiry_pass.count();
    const auto since = (now() - kT0).count();
    const TimePoint next = kT0 + Duration((since / period + 1) * period);
    loop_.Schedule(next, kPPass, r, [this, r] { Pass(r); });
  }

  void Pass(std::uint32_t r) {
    PRank& rank = p_ranks_[r];
    rank.pass_armed = false;
    if (p_dead_) return;
    rank.hold->Expire(now());
    DrainP(r);
    CheckHoldBound(r);
    if (rank.hold->size() > 0) ArmPass(r);
  }

  // Invariant: after an expiry pass, no entry is held past its deadline as the lease rules
  // define it (SPEC §2) — computed here from what the simulator fed the table, not read from it.
  // This is what catches an expiry pass that strands entries (vLLM #58222), and it bounds how
  // long P keeps a dead decoder's KV: lease after its last renewal, plus one pass.
  void CheckHoldBound(std::uint32_t r) {
    PRank& rank = p_ranks_[r];
    const core::HoldConfig& hc = rank.hold->config();
    for (auto it = rank.mirror.begin(); it != rank.mirror.end();) {
      const PReq& p = preqs_[it->first];
      if (!rank.hold->Contains(p.xfer)) {
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

  void DeliverToP(const Msg& m) {
    if (p_dead_) return;
    const std::uint32_t r = m.p_rank;
    PRank& rank = p_ranks_[r];
    if (m.type == Msg::Type::kRenewal) {
      auto result = rank.hold->Renew(m.fps, now());
      if (result) {
        for (core::Fingerprint fp : m.fps) {
          auto it = fp_to_req_.find(fp);
          if (it == fp_to_req_.end() || !rank.hold->Contains(preqs_[it->second].xfer)) continue;
          Mirror& mir = rank.mirror[it->second];
          mir.last_renew = now();
          if (mir.ready) mir.renewed_when_ready = now();
        }
      }
      auto reply = std::make_shared<Msg>();
      reply->type = Msg::Type::kRenewalReply;
      reply->d_rank = m.d_rank;
      reply->p_rank = r;
      reply->rejected = !result;
      Send(false, m.d_rank, r, std::move(reply));
      return;
    }
    if (m.type != Msg::Type::kPull) return;
    if (!rank.seen_pulls.insert(m.pull_id).second) {
      loop_.Note(0xd00b, m.pull_id);  // a transport duplicate: the original gets the answer
      return;
    }
    const PReq& p = preqs_[m.req];
    PendingPull pull{m.req, m.d_rank, m.blocks, m.gens, m.epoch};
    if (rng_.Chance(c_.faults.peer_msg_error)) {
      Respond(pull, r, Msg::Answer::kError,
              Status(ErrorCode::kInternal, fmt::format("injected: P rank {} failed the pull", r)));
      return;
    }
    core::PullAdmission a = rank.hold->AdmitPull(p.xfer, m.d_rank, m.need_send, m.d_lease, now());
    switch (a.verdict) {
      case core::PullAdmission::Verdict::kReady:
        StartSend(r, std::move(pull));
        break;
      case core::PullAdmission::Verdict::kWait:
        rank.mirror[m.req].wait_deadline = a.wait_until;
        rank.waiting[m.req].push_back(std::move(pull));
        ArmPass(r);
        break;
      case core::PullAdmission::Verdict::kFail:
        Respond(pull, r, Msg::Answer::kErr, a.error);
        SyncMirror(r, m.req);
        break;
    }
    DrainP(r);
  }

  void StartSend(std::uint32_t r, PendingPull pull) {
    PRank& rank = p_ranks_[r];
    PReq& p = preqs_[pull.req];
    if (rng_.Chance(c_.faults.peer_err)) {
      Respond(
          pull, r, Msg::Answer::kErr,
          Status(ErrorCode::kInternal, fmt::format("injected: P rank {} failed {}", r, p.xfer)));
      return;
    }
    if (rng_.Chance(c_.faults.peer_omit)) {
      Respond(pull, r, Msg::Answer::kFinishOnly, {});
      return;
    }
    if (Status s = rank.hold->BeginSend(p.xfer, pull.d_rank, now()); !s.ok()) {
      Respond(pull, r, Msg::Answer::kErr, s);
      DrainP(r);
      return;
    }
    ++rank.mirror[pull.req].sending;
    auto slice = core::PlanSlice(r, p_layout_, pull.d_rank, d_layout_);
    std::uint64_t bytes = 0;
    if (slice) {
      auto ops =
          core::PlanWrites(p.blocks, pull.blocks, *slice, p_layout_.block_len, d_layout_.block_len);
      if (ops) {
        for (const core::WriteOp& op : *ops) bytes += op.length;
      } else {
        Violation("PlanWrites: " + ops.error().ToString());
      }
    } else {
      Violation("PlanSlice: " + slice.error().ToString());
    }
    Write w{pull.req, r, pull.d_rank, pull.blocks, pull.gens, pull.epoch, false, false};
    if (r == 0 && rng_.Chance(c_.faults.p0_err_after_write)) w.err_after = true;
    Duration delay{0};
    if (r == 1 && c_.faults.p1_write_delay.count() > 0) {
      delay += rng_.Span(Duration{0}, c_.faults.p1_write_delay);
    }
    if (rng_.Chance(c_.faults.slow_write)) delay += rng_.Span(Duration{0}, c_.faults.slow_max);
    const std::uint64_t wid = next_write_++;
    ++p.inflight[r];
    if (slice && !slice->should_write) {
      // Replicated KV written by a lower P rank: answer ok without a WRITE (SPEC §5).
      writes_[wid] = std::move(w);
      loop_.After(delay, kWriteEnd, wid, [this, wid] { WriteEnd(wid, false); });
      return;
    }
    const Duration duration = c_.dp.latency + TransmitTime(bytes, c_.dp.bytes_per_s);
    writes_[wid] = std::move(w);
    loop_.After(delay, kWriteStart, wid, [this, wid, duration] {
      if (WriteStart(wid)) {
        loop_.After(duration, kWriteEnd, wid, [this, wid] { WriteEnd(wid, true); });
      }
    });
  }

  // Whether the WRITE's destination blocks are still the ones its pull aimed at; counts and
  // flags the ones that are not (freed, or freed and handed to another request).
  bool DestinationIntact(const Write& w, bool at_start) {
    bool freed = false;
    bool reallocated = false;
    for (std::size_t i = 0; i < w.dest.size(); ++i) {
      if (d_pool_.gen(w.dest[i]) != w.gens[i]) {
        freed = true;
        if (d_pool_.owner(w.dest[i]) != kFree) reallocated = true;
      }
    }
    if (!freed) return true;
    if (at_start) {
      ++res_.writes_after_free[w.p_rank];
      if (reallocated) ++res_.writes_after_realloc[w.p_rank];
    }
    Violation(fmt::format("WRITE of P rank {} for req-{} {} after D {} its destination block",
                          w.p_rank, w.req, at_start ? "starts" : "lands",
                          reallocated ? "reallocated" : "freed"));
    return false;
  }

  // Returns false when the WRITE cannot start (it is then finished as failed).
  bool WriteStart(std::uint64_t wid) {
    if (p_dead_) return false;
    Write& w = writes_[wid];
    bool ok = !d_dead_ && !w.fenced && w.epoch == d_epoch_[w.d_rank][w.p_rank];
    if (ok) {
      ++res_.writes;
      DestinationIntact(w, true);
      loop_.Note(0x5a, wid);
    }
    if (!ok) WriteEnd(wid, false);
    return ok;
  }

  void WriteEnd(std::uint64_t wid, bool started) {
    if (p_dead_) return;
    Write w = std::move(writes_[wid]);
    writes_.erase(wid);
    PRank& rank = p_ranks_[w.p_rank];
    PReq& p = preqs_[w.req];
    --p.inflight[w.p_rank];
    bool ok = !d_dead_ && !w.fenced && w.epoch == d_epoch_[w.d_rank][w.p_rank];
    if (started && ok) {
      DestinationIntact(w, false);
      ++dreqs_[w.req].peers_written;
      if (dreqs_[w.req].peers_written == c_.p.tp) ++res_.requests_written_by_all_peers;
    }
    Status s = rank.hold->EndSend(p.xfer, w.d_rank, ok, now());
    (void)s;  // the entry may be gone (engine abort during the send): nothing more to do
    auto mit = rank.mirror.find(w.req);
    if (mit != rank.mirror.end()) {
      --mit->second.sending;
      mit->second.last_send_end = now();
    }
    SyncMirror(w.p_rank, w.req);
    PendingPull pull{w.req, w.d_rank, {}, {}, w.epoch};
    if (!ok) {
      Respond(pull, w.p_rank, Msg::Answer::kErr,
              Status(ErrorCode::kUnavailable, "WRITE failed: decoder endpoint closed"));
    } else if (w.err_after) {
      ++res_.p0_injected_failures;
      Respond(pull, w.p_rank, Msg::Answer::kErr,
              Status(ErrorCode::kInternal, "injected: P0 reports an error after its WRITE"));
    } else {
      Respond(pull, w.p_rank, Msg::Answer::kOk, {});
    }
    DrainP(w.p_rank);
    if (p.free_pending) FreePBlocks(w.req);
  }

  void AbortP(int idx) {
    if (p_dead_) return;
    PReq& p = preqs_[idx];
    if (p.st == PReq::St::kQueued) {
      p.st = PReq::St::kGone;  // skipped when it reaches the head of the queue
      for (std::uint32_t r = 0; r < c_.p.tp; ++r) {
        p_ranks_[r].hold->EngineFinished(p.xfer, now());  // fails waiting pulls at once
        SyncMirror(r, idx);
        DrainP(r);
      }
      return;
    }
    if (p.st == PReq::St::kRunning || p.st == PReq::St::kHeld) StopOnP(idx);
  }

  void CrashP() {
    p_dead_ = true;
    loop_.Note(0xdead, 1);
    loop_.After(c_.d.peer_dead_detect, kPDetect, 0, [this] {
      if (d_dead_) return;
      p_known_dead_ = true;
      for (std::uint32_t d = 0; d < c_.d.tp; ++d) {
        for (std::uint32_t p = 0; p < c_.p.tp; ++p) Fence(d, p);
      }
    });
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
    renew_.Track(preqs_[idx].xfer, "P");  // on_new_request: renew while still queued
    ArmRenew();
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
      if (!d_pool_.CanAlloc(need)) break;  // D admits only with room: requests queue on D
      queue_d_.pop_front();
      d.blocks = d_pool_.Alloc(need, idx);
      const std::uint32_t prompt_blocks = BlocksFor(spec.prompt, c_.model.block_tokens);
      d.dest.assign(d.blocks.begin(), d.blocks.begin() + prompt_blocks);
      for (BlockId b : d.dest) d.gens.push_back(d_pool_.gen(b));
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
        MaybeFreeD(idx);
      } else {
        still.push_back(idx);
      }
    }
    decoding_ = std::move(still);
    KickD();
  }

  void StartReceive(int idx) {
    DReq& d = dreqs_[idx];
    const core::RequestId name = RequestName(idx);
    for (std::uint32_t r = 0; r < c_.d.tp; ++r) {
      Ledger& ledger = *d_ledgers_[r];
      if (p_known_dead_) {
        // The bootstrap cannot resolve a dead P: no peer to pull from (SPEC §3 rule 4).
        (void)ledger.Begin(name, d.dest, {},
                           Status(ErrorCode::kUnavailable, "prefill engine P is down"));
        DrainD(r);
        continue;
      }
      std::vector<core::PeerId> peers(targets_[r].begin(), targets_[r].end());
      if (Status s = ledger.Begin(name, d.dest, peers, {}); !s.ok()) {
        Violation("ledger Begin: " + s.ToString());
      }
      for (std::uint32_t p : targets_[r]) {
        auto m = std::make_shared<Msg>();
        m->type = Msg::Type::kPull;
        m->d_rank = r;
        m->p_rank = p;
        m->req = idx;
        m->blocks = d.dest;
        m->gens = d.gens;
        m->epoch = d_epoch_[r][p];
        if (c_.d.send_lease) m->d_lease = c_.d.lease;
        m->need_send = need_send_[p];
        m->pull_id = next_pull_++;
        Send(true, r, p, std::move(m));
        loop_.After(c_.d.pull_timeout, kPullTimeout, static_cast<std::uint64_t>(idx),
                    [this, r, p, idx] { PullTimeout(r, p, idx); });
      }
      DrainD(r);
    }
  }

  void DrainD(std::uint32_t r) {
    while (true) {
      std::vector<core::LedgerEvent> events = d_ledgers_[r]->TakeEvents();
      if (events.empty()) break;
      for (core::LedgerEvent& ev : events) {
        const int idx = RequestIndex(ev.request);
        DReq& d = dreqs_[idx];
        if (ev.kind == core::LedgerEvent::Kind::kCompleted) {
          if (++d.ranks_completed > c_.d.tp) {
            Violation(fmt::format("req-{}: receive completed twice on D rank {}", idx, r));
          }
          if (!ev.ok && !d.recv_failed) {
            d.recv_failed = true;
            d.error = ev.error;
          }
          if (ev.quarantined) {
            ++res_.quarantined_completions;
          } else {
            ++d.ranks_released;
          }
          if (d.ranks_completed == c_.d.tp) ReceiveDone(idx);
        } else {
          ++d.ranks_released;
        }
        MaybeFreeD(idx);
      }
    }
  }

  void ReceiveDone(int idx) {
    DReq& d = dreqs_[idx];
    --receiving_;
    renew_.Untrack(preqs_[idx].xfer);          // finished_recving
    if (d.st != DReq::St::kReceiving) return;  // aborted meanwhile: only the blocks remain
    if (d.recv_failed) {
      d.st = DReq::St::kDone;
      End(idx, Outcome::kFailed, d.error);
      return;
    }
    d.st = DReq::St::kDecoding;
    decoding_.push_back(idx);
    KickD();
  }

  // D's blocks go back to the pool only when every rank's receive settled and released them
  // (quarantine) and the request no longer decodes.
  void MaybeFreeD(int idx) {
    DReq& d = dreqs_[idx];
    if (d.freed || d.blocks.empty() || d_dead_) return;
    if (d.ranks_completed < c_.d.tp || d.ranks_released < c_.d.tp) return;
    if (d.st == DReq::St::kDecoding || d.st == DReq::St::kReceiving) return;
    d.freed = true;
    if (!d_pool_.Free(d.blocks, idx)) Violation(fmt::format("D freed req-{}'s blocks twice", idx));
    KickD();
  }

  void DeliverToD(const Msg& m) {
    if (d_dead_) return;
    if (m.type == Msg::Type::kRenewalReply) {
      if (m.rejected && renew_.NoteRejected("P")) ++res_.renewal_warnings;
      return;
    }
    core::Settle how = core::Settle::kOk;
    switch (m.answer) {
      case Msg::Answer::kOk:
        how = core::Settle::kOk;
        break;
      case Msg::Answer::kErr:
        how = core::Settle::kErr;
        break;
      case Msg::Answer::kError:
        how = core::Settle::kMessageError;
        break;
      case Msg::Answer::kFinishOnly:
        how = core::Settle::kFinished;
        break;
    }
    Status reason = m.status;
    if (how == core::Settle::kFinished) {
      reason =
          Status(ErrorCode::kUnavailable,
                 fmt::format("prefill rank {} finished without reporting the request", m.p_rank));
    }
    d_ledgers_[m.d_rank]->Settle(RequestName(m.req), m.p_rank, how, reason);
    DrainD(m.d_rank);
  }

  void PullTimeout(std::uint32_t r, std::uint32_t p, int idx) {
    if (d_dead_) return;
    Ledger& ledger = *d_ledgers_[r];
    if (!ledger.IsPending(RequestName(idx), p)) return;
    ledger.Settle(
        RequestName(idx), p, core::Settle::kTimeout,
        Status(ErrorCode::kTimeout, fmt::format("no answer from prefill rank {} within {}s", p,
                                                core::ToSeconds(c_.d.pull_timeout))));
    DrainD(r);
    // A timeout does not prove the peer stopped writing: close the data-plane endpoint to it
    // (in-flight and future WRITEs of older pulls fail) before anything leaves quarantine.
    Fence(r, p);
  }

  // D rank `d` closes its data-plane endpoint to P rank `p`: WRITEs aimed through it fail from
  // now on. Only then is the peer known quiesced.
  void Fence(std::uint32_t d, std::uint32_t p) {
    ++d_epoch_[d][p];
    for (auto& [wid, w] : writes_) {
      if (w.d_rank == d && w.p_rank == p) w.fenced = true;
    }
    loop_.Note(0xfe, (d << 8) | p);
    d_ledgers_[d]->PeerQuiesced(p);
    DrainD(d);
  }

  void AbortD(int idx) {
    if (d_dead_ || Ended(idx)) return;
    DReq& d = dreqs_[idx];
    renew_.Untrack(preqs_[idx].xfer);  // request_finished
    const DReq::St st = d.st;
    End(idx, Outcome::kAborted, Status(ErrorCode::kCancelled, "aborted by the client"));
    if (st == DReq::St::kReceiving) {
      d.st = DReq::St::kDone;
      return;  // the blocks wait for every peer to settle (ReceiveDone, then MaybeFreeD)
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

  void ArmRenew() {
    if (d_dead_ || renew_armed_ || renew_.tracked() == 0) return;
    renew_armed_ = true;
    loop_.Schedule(renew_.NextDue(), kRenewTick, 0, [this] { RenewTick(); });
  }

  void RenewTick() {
    renew_armed_ = false;
    if (d_dead_) return;
    const bool drop = now() >= c_.net.drop_renewals_from && now() < c_.net.drop_renewals_until;
    for (core::RenewalBatch& batch : renew_.Poll(now())) {
      for (std::uint32_t r = 0; r < c_.d.tp; ++r) {
        for (std::uint32_t p : targets_[r]) {
          ++res_.renewals_sent;
          if (drop) continue;
          auto m = std::make_shared<Msg>();
          m->type = Msg::Type::kRenewal;
          m->d_rank = r;
          m->p_rank = p;
          m->fps = batch.ids;
          Send(true, r, p, std::move(m));
        }
      }
    }
    ArmRenew();
  }

  // ---------------------------------------------------------------- observation

  void OnPPoolChange() {
    if (c_.faults.d_crash == kNever || now() < c_.faults.d_crash) return;
    const double pct = 100.0 * p_pool_.used() / p_pool_.capacity();
    if (pct >= 95.0) p_was_full_ = true;
    if (p_was_full_ && pct < 95.0 && res_.p_kv_left_full == kNever) res_.p_kv_left_full = now();
    if (pct < 5.0 && res_.p_kv_below_5 == kNever) res_.p_kv_below_5 = now();
  }

  void Sample() {
    res_.samples.push_back({At(now()), 100.0 * p_pool_.used() / p_pool_.capacity(),
                            d_dead_ ? 0.0 : 100.0 * d_pool_.used() / d_pool_.capacity()});
    if (now() + c_.sample_every <= c_.horizon) {
      loop_.After(c_.sample_every, kSample, 0, [this] { Sample(); });
    }
  }

  // Invariants once the run is over: every request ended exactly once, and (if the system went
  // quiet) nothing is still held anywhere.
  void FinalChecks() {
    for (std::size_t i = 0; i < res_.requests.size(); ++i) {
      if (res_.requests[i].ends == 0) {
        Violation(
            fmt::format("req-{} never ended (D state {})", i, static_cast<int>(dreqs_[i].st)));
      }
    }
    if (c_.sample_every.count() > 0) return;  // scenario runs stop at a horizon, not at quiet
    if (!res_.quiet) {
      Violation("the system did not go quiet before the horizon");
    }
    if (!p_dead_) {
      for (std::uint32_t r = 0; r < c_.p.tp; ++r) {
        if (p_ranks_[r].hold->size() != 0) {
          Violation(
              fmt::format("leak: P rank {} still holds {} entries", r, p_ranks_[r].hold->size()));
        }
      }
      if (p_pool_.used() != 0) {
        Violation(fmt::format("leak: {} P blocks still allocated", p_pool_.used()));
      }
    }
    if (!d_dead_) {
      if (d_pool_.used() != 0) {
        Violation(fmt::format("leak: {} D blocks still allocated", d_pool_.used()));
      }
      for (std::uint32_t r = 0; r < c_.d.tp; ++r) {
        if (d_ledgers_[r]->active() != 0) {
          Violation(fmt::format("leak: D rank {} ledger still has {} receives", r,
                                d_ledgers_[r]->active()));
        }
      }
      if (renew_.tracked() != 0) {
        Violation(fmt::format("leak: D still renews {} transfers", renew_.tracked()));
      }
    }
  }

  const SimConfig& c_;
  EventLoop loop_;
  Rng rng_;
  SimResult res_;
  core::TpLayout p_layout_;
  core::TpLayout d_layout_;

  // P engine.
  BlockPool p_pool_;
  std::vector<PRank> p_ranks_;
  std::vector<PReq> preqs_;  // transfers [0, n), then probes
  std::deque<int> queue_p_;
  std::vector<int> running_p_;
  bool p_step_armed_ = false;
  bool p_dead_ = false;
  bool p_was_full_ = false;
  std::vector<std::uint32_t> need_send_;
  std::unordered_map<core::Fingerprint, int> fp_to_req_;

  // D engine.
  BlockPool d_pool_;
  core::RenewalScheduler renew_;
  bool renew_armed_ = false;
  std::vector<std::unique_ptr<Ledger>> d_ledgers_;
  std::vector<std::vector<std::uint32_t>> d_epoch_;  // [d_rank][p_rank]
  std::vector<std::vector<std::uint32_t>> targets_;  // PullTargets per D rank
  std::vector<DReq> dreqs_;
  std::deque<int> queue_d_;
  std::vector<int> decoding_;
  std::size_t receiving_ = 0;
  bool d_step_armed_ = false;
  bool d_dead_ = false;
  bool p_known_dead_ = false;

  // Network and data plane.
  std::unordered_map<std::uint64_t, TimePoint> link_last_;
  std::map<std::uint64_t, Write> writes_;
  std::uint64_t next_write_ = 0;
  std::uint64_t next_pull_ = 0;
};

}  // namespace

SimResult RunCluster(const SimConfig& config) { return Sim(config).Run(); }

}  // namespace kvferry::sim
