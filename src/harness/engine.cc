#include "harness/engine.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>
#include <unordered_map>

#include "harness/engine_ranks.h"
#include "harness/metrics.h"
#include "harness/trace_file.h"
#include "kvferry/core/block_pool.h"

namespace kvferry::harness {

using Clock = std::chrono::steady_clock;
using core::BlockId;

// ---------------------------------------------------------------------------------------------
// RequestStream

void RequestStream::Push(StreamEvent event) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = event.kind != StreamEvent::Kind::kToken;
    events_.push_back(std::move(event));
  }
  cv_.notify_all();
}

std::vector<StreamEvent> RequestStream::Wait(Clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_until(lock, deadline, [&] { return !events_.empty(); });
  std::vector<StreamEvent> out;
  out.swap(events_);
  return out;
}

// ---------------------------------------------------------------------------------------------
// ServingEngine internals

namespace {

// The pool's trace lines (demo_trace.h reads them): one per allocation and free, with the
// block's new generation. Owners are request handles; the request id is "req-<handle>".
core::BlockPool::Observer PoolTrace(TraceFile* trace, std::string role) {
  if (trace == nullptr) return {};
  return [trace, role = std::move(role)](core::BlockId block, std::uint64_t generation,
                                         bool allocated, core::BlockPool::Owner owner) {
    trace->Line(fmt::format(
        R"({{"t_ns":{},"role":"{}","block":{},"generation":{},"event":"{}","request":"req-{}"}})",
        TraceFile::NowNs(), role, block, generation, allocated ? "alloc" : "free", owner));
  };
}

enum class Phase : std::uint8_t {
  kWaiting,    // queued for blocks
  kPrefill,    // running: prefill chunks
  kDecode,     // running: one token per step
  kWaitingKv,  // D: blocks allocated, receiving
  kKvReady,    // D: received and verified, waiting for a running slot
  kHeld,       // P: answered; the hold tables own the blocks
  kDraining,   // finished; blocks wait for the ledger (D quarantine) before going back
};

struct Request {
  std::uint64_t handle = 0;
  std::string id;  // "req-<handle>": D's request id on the wire, and the trace's request
  CompletionSpec spec;
  std::shared_ptr<RequestStream> stream;
  std::uint64_t seed = 0;
  Phase phase = Phase::kWaiting;
  std::vector<BlockId> blocks;
  std::uint32_t prefilled = 0;
  std::uint32_t generated = 0;
  bool answered = false;  // the stream got its terminal event
  // D remote prefill (what protocol::DecodeAdapter said of its load).
  bool load_started = false;
  Status load_status;     // LoadDone: OK or the first rank's failure
  bool reusable = false;  // BlocksReusable: no P writer can touch the blocks
  Clock::time_point load_start{};
};

struct HoldNote {
  std::uint32_t rank;
  core::HoldEvent event;
};
struct RecvNote {
  std::uint32_t rank;
  runtime::DecodeFinished finished;
};

struct Inbox {
  std::vector<std::unique_ptr<Request>> fresh;
  std::vector<std::uint64_t> aborts;
  std::vector<HoldNote> holds;
  std::vector<protocol::PrefillAdapterEvent> p_events;  // from an HTTP thread's driver pump
  std::vector<RecvNote> recvs;
  std::vector<runtime::RemoteSource> refusals;  // D: refused before tracking; release to P
  bool empty() const {
    return fresh.empty() && aborts.empty() && holds.empty() && p_events.empty() &&
           recvs.empty() && refusals.empty();
  }
};

// Gauges the engine thread publishes and counters anyone may bump; read by /metrics.
struct Stats {
  std::uint64_t blocks_used = 0;
  std::uint64_t waiting = 0;
  std::uint64_t running = 0;
  std::uint64_t waiting_kv = 0;
  // P: blocks by hold phase (placeholders hold none).
  core::EnumArray<core::HoldPhase, std::uint64_t, core::kAllHoldPhases.size()> held_blocks;
  std::uint64_t quarantined_blocks = 0;                    // D: blocks held back by the ledger
  std::map<std::string, std::uint64_t> requests_finished;  // by outcome
  std::map<std::string, std::uint64_t> failures;           // by stage
  std::map<std::string, std::uint64_t> receive_failures;   // D: by the first error's code
  std::uint64_t corrupt_blocks = 0;
  std::uint64_t verified_blocks = 0;
  std::uint64_t received_bytes = 0;
  std::uint64_t tokens_generated = 0;
  std::uint64_t steps = 0;
  std::uint64_t double_frees = 0;
  Histogram transfer_latency;  // D: StartLoad → every rank's receive settled
  Histogram write_latency;     // P: one WRITE batch, start → end
  Histogram queue_time;        // arrival → admission
};

std::string StatusReason(const Status& s) { return s.ToString(); }

}  // namespace

struct ServingEngine::Impl {
  explicit Impl(EngineOptions& o) : options(o) {}

  EngineOptions& options;
  std::uint64_t block_len = 0;
  std::unique_ptr<core::BlockPool> pool;  // engine thread only; owners are request handles
  // kvferry's runtime under this engine: per rank a data plane and a worker, and the drivers.
  std::unique_ptr<EngineRanks> ranks;
  // D: the glue between this engine and its ranks' workers (engine thread only): the
  // protocol::DecodeAdapter the simulator and the vLLM connector drive too. Null once stopped.
  runtime::DecodeDriver* driver = nullptr;
  // P: its twin over protocol::PrefillAdapter, under p_driver_mu: HTTP threads admit through it
  // (Submit answers a refusal at once), the engine thread hands off and frees through it. Null
  // once stopped (a call then changes nothing).
  std::mutex p_driver_mu;
  runtime::PrefillDriver* p_driver = nullptr;

  // Inbox and lifecycle.
  std::mutex mu;
  std::condition_variable cv;
  Inbox inbox;
  bool stopping = false;
  bool stopped = false;  // Shutdown finished
  std::atomic<std::uint64_t> next_handle{1};
  std::size_t queued = 0;  // requests submitted and not yet finished (under mu)

  std::mutex stats_mu;
  Stats stats;

  // ServingEngine thread state.
  std::unordered_map<std::uint64_t, std::unique_ptr<Request>> requests;
  std::unordered_map<std::string, std::uint64_t> by_id;  // D request id → handle
  std::deque<std::uint64_t> waiting;
  std::vector<std::uint64_t> running;  // kPrefill / kDecode, in admission order
  std::deque<std::uint64_t> ready;     // kKvReady
  std::thread thread;

  // ----- lifecycle
  Status StartRanks();
  void Loop();

  // ----- engine thread
  void Apply(Inbox& in);
  void AddRequest(std::unique_ptr<Request> r);
  void ApplyAbort(std::uint64_t handle);
  void ApplyHold(const HoldNote& note);
  // Runs `call` on P's driver and pumps it (under p_driver_mu); returns the events. Once the
  // ranks stopped, runs nothing and returns none.
  template <typename Call>
  std::vector<protocol::PrefillAdapterEvent> WithPrefillDriver(Call&& call) {
    std::lock_guard<std::mutex> lock(p_driver_mu);
    std::vector<protocol::PrefillAdapterEvent> events;
    if (p_driver == nullptr) return events;  // stopped
    call(*p_driver);
    for (std::vector<protocol::PrefillAdapterEvent> got = p_driver->Pump(); !got.empty();
         got = p_driver->Pump()) {
      for (auto& e : got) events.push_back(std::move(e));
    }
    return events;
  }
  // Events a pump on an HTTP thread produced for the engine thread.
  void ForwardPrefillEvents(std::vector<protocol::PrefillAdapterEvent> events) {
    if (events.empty()) return;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (auto& e : events) inbox.p_events.push_back(std::move(e));
    }
    cv.notify_all();
  }
  void OnPrefillEvent(const protocol::PrefillAdapterEvent& event);
  void ApplyRecv(RecvNote& note);
  void PumpAdapter();
  void OnAdapterEvent(const protocol::AdapterEvent& event);
  void OnReceiveDone(Request& r);
  void Schedule();
  void RunStep();
  void FinishPrefill(Request& r);
  void HandOver(Request& r);
  void Finish(Request& r, const Status& error, int http_status);
  void MaybeRelease(Request& r);
  void FreeBlocks(Request& r);
  void Erase(std::uint64_t handle);
  void Publish();
  void FailAll();
  Request* Find(std::uint64_t handle) {
    auto it = requests.find(handle);
    return it == requests.end() ? nullptr : it->second.get();
  }
  void CountFailure(const std::string& stage) {
    std::lock_guard<std::mutex> lock(stats_mu);
    ++stats.failures[stage];
  }
  void Log(std::string_view line) { spdlog::info("[{}] {}", options.engine_id, line); }
};

// ---------------------------------------------------------------------------------------------
// Start / stop

ServingEngine::ServingEngine(EngineOptions options) : options_(std::move(options)) {}

Result<std::unique_ptr<ServingEngine>> ServingEngine::Start(EngineOptions options) {
  Status geometry = options.geometry.Validate();
  if (!geometry.ok()) return tl::unexpected(geometry);
  if (options.num_blocks == 0 || options.costs.max_running == 0 ||
      options.costs.max_batch_tokens == 0) {
    return Err(ErrorCode::kInvalidArgument,
               "num_blocks, max_running and max_batch_tokens must be positive");
  }
  std::unique_ptr<ServingEngine> engine(new ServingEngine(std::move(options)));
  engine->impl_ = std::make_unique<Impl>(engine->options_);
  Impl& impl = *engine->impl_;
  impl.block_len = impl.options.geometry.block_len();
  impl.pool = std::make_unique<core::BlockPool>(
      impl.options.num_blocks, PoolTrace(impl.options.trace.get(), ToString(impl.options.role)));
  Status started = impl.StartRanks();
  if (!started.ok()) {
    engine->Shutdown();
    return tl::unexpected(started);
  }
  impl.thread = std::thread([&impl] { impl.Loop(); });
  return engine;
}

Status ServingEngine::Impl::StartRanks() {
  EngineRanks::Callbacks callbacks;
  // On kvferry's threads: hand the work to the engine thread, never block.
  callbacks.on_hold = [this](std::uint32_t rank, const core::HoldEvent& event) {
    {
      std::lock_guard<std::mutex> lock(mu);
      inbox.holds.push_back({rank, event});
    }
    cv.notify_all();
  };
  callbacks.on_write = [this](double seconds) {
    std::lock_guard<std::mutex> lock(stats_mu);
    stats.write_latency.Observe(seconds);
  };
  callbacks.on_finished = [this](std::uint32_t rank, runtime::DecodeFinished finished) {
    {
      std::lock_guard<std::mutex> lock(mu);
      inbox.recvs.push_back({rank, std::move(finished)});
    }
    cv.notify_all();
  };
  Result<std::unique_ptr<EngineRanks>> started = EngineRanks::Start(options, std::move(callbacks));
  if (!started) return started.error();
  ranks = std::move(*started);
  driver = ranks->decode_driver();
  std::lock_guard<std::mutex> lock(p_driver_mu);
  p_driver = ranks->prefill_driver();
  return Status::Ok();
}

ServingEngine::~ServingEngine() { Shutdown(); }

void ServingEngine::Shutdown() {
  if (!impl_) return;
  Impl& impl = *impl_;
  {
    std::lock_guard<std::mutex> lock(impl.mu);
    if (impl.stopped) return;
    impl.stopping = true;
  }
  impl.cv.notify_all();
  if (impl.thread.joinable()) impl.thread.join();
  if (impl.ranks) {
    {
      // HTTP threads still admitting find no driver from now on: nothing reaches a stopped rank.
      std::lock_guard<std::mutex> lock(impl.p_driver_mu);
      impl.p_driver = nullptr;
    }
    impl.driver = nullptr;
    impl.ranks->Stop();  // P's writes in flight drained, D's pullers joined
  }
  std::lock_guard<std::mutex> lock(impl.mu);
  impl.stopped = true;
}

// ---------------------------------------------------------------------------------------------
// Submit / Abort (HTTP threads)

Result<std::shared_ptr<RequestStream>> ServingEngine::Submit(const CompletionSpec& spec) {
  Result<std::shared_ptr<RequestStream>> queued = Enqueue(spec);
  if (!queued) Refused(spec, queued.error());
  return queued;
}

void ServingEngine::Refused(const CompletionSpec& spec, const Status& why) {
  if (spec.transfer_id.empty()) return;
  const ErrorCode code = why.code();
  if (options_.role == Role::kPrefill && spec.kind == RequestKind::kRemoteDecode) {
    // P will not prefill it: D's half must not wait abort_request_timeout for it. (An Admit
    // that found the transfer held or freed already changes nothing: Refuse leaves admitted
    // entries alone, and a tombstone stays a tombstone.) The transfer id is spent here: a
    // router retrying this P must use a new one, as vLLM's proxy does for every request. Not
    // while shutting down: the ranks are going away (and their KV with them).
    if (code == ErrorCode::kAlreadyExists || code == ErrorCode::kTombstoned ||
        code == ErrorCode::kUnavailable) {
      return;
    }
    const Status refusal(code, "the prefill instance refused the request: " + why.message());
    std::vector<protocol::PrefillAdapterEvent> events = impl_->WithPrefillDriver(
        [&](runtime::PrefillDriver& d) { d.Drop(spec.transfer_id, refusal); });
    impl_->ForwardPrefillEvents(std::move(events));
    return;
  }
  if (options_.role == Role::kDecode && spec.kind == RequestKind::kRemotePrefill &&
      code == ErrorCode::kInvalidArgument) {
    // This instance can never serve it as sent: P must not prefill it and hold its KV for
    // nobody. (A full queue or a shutdown is left alone: a router may retry another decoder
    // with the same transfer, whose KV P still holds.)
    {
      std::lock_guard<std::mutex> lock(impl_->mu);
      impl_->inbox.refusals.push_back(
          {spec.transfer_id, spec.remote_engine_id, spec.remote_bootstrap_addr});
    }
    impl_->cv.notify_all();
  }
}

Result<std::shared_ptr<RequestStream>> ServingEngine::Enqueue(const CompletionSpec& spec) {
  Impl& impl = *impl_;
  const EngineOptions& o = options_;
  const std::uint32_t bt = o.geometry.block_tokens;
  if (spec.prompt_tokens == 0 || spec.max_tokens == 0) {
    return Err(ErrorCode::kInvalidArgument, "prompt and max_tokens must be non-empty");
  }
  if (o.role == Role::kPrefill && spec.kind == RequestKind::kRemotePrefill) {
    return Err(ErrorCode::kInvalidArgument, "a prefill instance cannot do_remote_prefill");
  }
  if (o.role == Role::kDecode && spec.kind == RequestKind::kRemoteDecode) {
    return Err(ErrorCode::kInvalidArgument, "a decode instance cannot do_remote_decode");
  }
  const std::uint64_t tokens = spec.kind == RequestKind::kRemoteDecode
                                   ? spec.prompt_tokens
                                   : std::uint64_t{spec.prompt_tokens} + spec.max_tokens;
  if (BlocksFor(tokens, bt) > o.num_blocks) {
    return Err(ErrorCode::kInvalidArgument, fmt::format("request needs {} blocks, the pool has {}",
                                                        BlocksFor(tokens, bt), o.num_blocks));
  }
  auto r = std::make_unique<Request>();
  r->handle = impl.next_handle.fetch_add(1);
  r->id = fmt::format("req-{}", r->handle);
  r->spec = spec;
  r->stream = std::make_shared<RequestStream>(r->handle);
  r->seed = spec.kind == RequestKind::kLocal ? SeedOfLocalRequest(r->handle)
                                             : SeedOfTransfer(spec.transfer_id);
  r->load_start = Clock::now();  // arrival until admission; reset at StartLoad
  {
    std::lock_guard<std::mutex> lock(impl.mu);
    if (impl.stopping) return Err(ErrorCode::kUnavailable, "shutting down");
    if (impl.queued >= o.max_waiting) {
      return Err(ErrorCode::kResourceExhausted,
                 fmt::format("{} requests queued, the limit is {}", impl.queued, o.max_waiting));
    }
    ++impl.queued;
  }
  auto unqueue = [&] {
    std::lock_guard<std::mutex> lock(impl.mu);
    --impl.queued;
  };
  if (spec.kind == RequestKind::kRemoteDecode) {
    // Admit with every rank before the request can run, so a pull that arrives first finds the
    // entry, and a decoder that dies while the request queues aborts it (SPEC §4). The adapter
    // rolls back the ranks that admitted when another refused.
    // Stays so when the ranks stopped since the check above (a shutdown racing this request).
    Status first(ErrorCode::kUnavailable, "shutting down");
    std::vector<protocol::PrefillAdapterEvent> events =
        impl.WithPrefillDriver([&](runtime::PrefillDriver& d) {
          first = d.Admit(spec.transfer_id, r->handle);
        });
    std::erase_if(events, [&](const protocol::PrefillAdapterEvent& e) {
      const auto* refused = std::get_if<protocol::AdmitRefused>(&e);
      if (refused != nullptr && refused->transfer == spec.transfer_id && first.ok()) {
        first = refused->why;
      }
      return refused != nullptr || std::holds_alternative<protocol::Admitted>(e);
    });
    impl.ForwardPrefillEvents(std::move(events));
    if (!first.ok()) {
      {
        // Refused: this request will not be prefilled; the adapter forgets the transfer.
        std::lock_guard<std::mutex> lock(impl.p_driver_mu);
        if (impl.p_driver != nullptr && impl.p_driver->handle_of(spec.transfer_id) == r->handle) {
          impl.p_driver->Finish(spec.transfer_id);
        }
      }
      unqueue();
      impl.CountFailure("admit");
      return tl::unexpected(
          Status(first.code(), fmt::format("transfer {}: {}", spec.transfer_id, first.message())));
    }
  }
  std::shared_ptr<RequestStream> stream = r->stream;
  {
    std::lock_guard<std::mutex> lock(impl.mu);
    impl.inbox.fresh.push_back(std::move(r));
  }
  impl.cv.notify_all();
  return stream;
}

void ServingEngine::EngineDown(const std::string& engine_id, const Status& why) {
  for (auto& worker : impl_->ranks->decode_workers()) worker->EngineDown(engine_id, why);
}

void ServingEngine::ProcessGone(const std::string& engine_id, const std::string& incarnation,
                                const Status& why) {
  for (auto& worker : impl_->ranks->decode_workers()) {
    worker->ProcessGone(engine_id, incarnation, why);
  }
}

std::vector<control::WorkerRegistration> ServingEngine::Registrations() const {
  std::vector<control::WorkerRegistration> out;
  for (const auto& worker : impl_->ranks->prefill_workers()) out.push_back(worker->registration());
  return out;
}

void ServingEngine::Abort(std::uint64_t handle) {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->inbox.aborts.push_back(handle);
  }
  impl_->cv.notify_all();
}

// ---------------------------------------------------------------------------------------------
// The engine thread

void ServingEngine::Impl::Loop() {
  bool admitted = false;  // the last Schedule() took a request: the next may take another
  while (true) {
    Inbox in;
    bool stop = false;
    {
      std::unique_lock<std::mutex> lock(mu);
      // Idle: sleep until something arrives (bounded, so gauges stay fresh). Not idle while a
      // request runs or was just admitted: with --max-running 1 a queue of short requests
      // would otherwise wait 200 ms each.
      const bool idle = running.empty() && !admitted;
      const auto deadline =
          Clock::now() + (idle ? std::chrono::milliseconds(200) : std::chrono::milliseconds(0));
      cv.wait_until(lock, deadline, [&] { return stopping || !inbox.empty(); });
      std::swap(in, inbox);
      stop = stopping;
    }
    Apply(in);
    if (stop) {
      FailAll();
      // The workers' Stop releases what they still track; quarantined blocks stay registered
      // until the workers are destroyed.
      const protocol::DecodeAdapterStopReport left =
          driver ? driver->Stop() : protocol::DecodeAdapterStopReport{};
      if (left.loading + left.quarantined > 0) {
        spdlog::info("[{}] stopping with {} loads in flight and {} quarantined",
                     options.engine_id, left.loading, left.quarantined);
      }
      if (p_driver) {
        std::lock_guard<std::mutex> lock(p_driver_mu);
        if (const std::size_t held = p_driver->Stop(); held > 0) {
          // The workers' stop drains their writes, then the KV goes with the process.
          spdlog::info("[{}] stopping with {} transfers still held for decoders",
                       options.engine_id, held);
        }
      }
      Publish();
      return;
    }
    const std::size_t queued_before = waiting.size() + ready.size();
    Schedule();
    admitted = waiting.size() + ready.size() < queued_before;
    RunStep();
    Publish();
  }
}

void ServingEngine::Impl::Apply(Inbox& in) {
  // New requests first: a hold event or abort drained together with its request must find it.
  for (auto& r : in.fresh) AddRequest(std::move(r));
  for (const protocol::PrefillAdapterEvent& event : in.p_events) OnPrefillEvent(event);
  for (const HoldNote& note : in.holds) ApplyHold(note);
  for (RecvNote& note : in.recvs) ApplyRecv(note);
  for (const runtime::RemoteSource& source : in.refusals) driver->Refuse(source);
  if (driver) PumpAdapter();
  for (std::uint64_t handle : in.aborts) ApplyAbort(handle);
}

void ServingEngine::Impl::AddRequest(std::unique_ptr<Request> r) {
  const std::uint64_t handle = r->handle;
  by_id[r->id] = handle;
  requests[handle] = std::move(r);
  waiting.push_back(handle);
  if (const Request& req = *requests[handle]; req.spec.kind == RequestKind::kRemotePrefill) {
    // Renewals start while it queues for blocks.
    const runtime::RemoteSource source{req.spec.transfer_id, req.spec.remote_engine_id,
                                       req.spec.remote_bootstrap_addr};
    if (Status tracked = driver->Track(req.id, source); !tracked.ok()) {
      spdlog::error("[{}] request {}: {}", options.engine_id, req.id, tracked.ToString());
    }
  }
  Request& req = *requests[handle];
  if (req.spec.kind == RequestKind::kRemoteDecode) {
    // P's adapter may have aborted it before it reached this thread (Submit admits on the HTTP
    // thread, and the hold event that aborts it can overtake it here).
    bool aborted = false;
    {
      std::lock_guard<std::mutex> lock(p_driver_mu);
      aborted = p_driver != nullptr && p_driver->handle_of(req.spec.transfer_id) == handle &&
                p_driver->abort_told(req.spec.transfer_id);
    }
    if (aborted) {
      CountFailure("prefill_abort");
      Finish(req, Status(ErrorCode::kCancelled, "the prefill hold aborted the request"), 503);
    }
  }
}

void ServingEngine::Impl::ApplyAbort(std::uint64_t handle) {
  Request* r = Find(handle);
  if (r == nullptr || r->answered) return;
  {
    std::lock_guard<std::mutex> lock(stats_mu);
    ++stats.requests_finished["client_abort"];
  }
  Finish(*r, Status(ErrorCode::kCancelled, "client disconnected"), 499);
}

void ServingEngine::Impl::ApplyHold(const HoldNote& note) {
  for (const protocol::PrefillAdapterEvent& event : WithPrefillDriver(
           [&](runtime::PrefillDriver& d) { d.OnHoldEvent(note.rank, note.event); })) {
    OnPrefillEvent(event);
  }
}

// What P's adapter decided, for the request it names (by handle).
void ServingEngine::Impl::OnPrefillEvent(const protocol::PrefillAdapterEvent& event) {
  if (const auto* freed = std::get_if<protocol::FreeBlocks>(&event)) {
    Request* r = Find(freed->handle);
    if (r == nullptr || r->phase != Phase::kHeld) {
      spdlog::warn("[{}] P's adapter freed transfer {}, which no held request owns",
                   options.engine_id, freed->transfer);
      return;
    }
    FreeBlocks(*r);
    Erase(r->handle);
    return;
  }
  const auto* abort = std::get_if<protocol::AbortPrefill>(&event);
  if (abort == nullptr) return;  // admission events are the admitting thread's; HandOver's own
  // A rank will not send the transfer (dead decoder, wait timeout): stop the request.
  CountFailure("prefill_abort");
  Request* r = Find(abort->handle);
  // Not here yet: the event overtook its request on the way into the engine (Submit admits
  // before it queues); AddRequest asks the adapter. Or finished already: nothing to stop.
  if (r == nullptr) return;
  if (r->phase == Phase::kHeld) return;  // handed off meanwhile: its hand-off failed instead
  Finish(*r,
         Status(ErrorCode::kCancelled, fmt::format("transfer {} aborted by the prefill hold ({})",
                                                   abort->transfer, core::ToString(abort->reason))),
         503);
}

void ServingEngine::Impl::ApplyRecv(RecvNote& note) {
  driver->OnFinished(note.rank, note.finished);
  PumpAdapter();
}

// Carries out what the adapter decided (rank calls onto the workers) and acts on its events.
// Requests are looked up by id for every event: one event may finish and erase a request.
void ServingEngine::Impl::PumpAdapter() {
  for (std::vector<protocol::AdapterEvent> events = driver->Pump(); !events.empty();
       events = driver->Pump()) {
    for (const protocol::AdapterEvent& event : events) OnAdapterEvent(event);
  }
}

void ServingEngine::Impl::OnAdapterEvent(const protocol::AdapterEvent& event) {
  const core::RequestId& id =
      std::visit([](const auto& e) -> const core::RequestId& { return e.request; }, event);
  auto it = by_id.find(id);
  Request* r = it == by_id.end() ? nullptr : Find(it->second);
  if (r == nullptr) {
    spdlog::warn("[{}] the engine adapter named unknown request {}", options.engine_id, id);
    return;
  }
  if (const auto* done = std::get_if<protocol::LoadDone>(&event)) {
    r->load_status = done->status;
    OnReceiveDone(*r);
  } else if (std::holds_alternative<protocol::BlocksReusable>(event)) {
    r->reusable = true;
    MaybeRelease(*r);
  } else if (const auto* dropped = std::get_if<protocol::TransferDropped>(&event)) {
    // P dropped the transfer while the request queued here: fail it now with P's reason
    // instead of pulling late.
    if (r->answered || r->load_started) return;
    CountFailure("prefill_aborted");
    Finish(*r,
           Status(dropped->why.code(),
                  "KV transfer aborted by the prefill instance: " + dropped->why.message()),
           503);
  }
}

void ServingEngine::Impl::OnReceiveDone(Request& r) {
  const bool ok = r.load_status.ok();
  const std::uint32_t kv_blocks = BlocksFor(r.spec.prompt_tokens, options.geometry.block_tokens);
  {
    std::lock_guard<std::mutex> lock(stats_mu);
    stats.transfer_latency.Observe(
        std::chrono::duration<double>(Clock::now() - r.load_start).count());
    if (ok) stats.received_bytes += std::uint64_t{kv_blocks} * block_len * ranks->size();
  }
  if (r.answered) {  // aborted while receiving: only the blocks are left to settle
    MaybeRelease(r);
    return;
  }
  if (!ok) {
    CountFailure("receive");
    {
      std::lock_guard<std::mutex> lock(stats_mu);
      ++stats.receive_failures[std::string(ToString(r.load_status.code()))];
    }
    Finish(r, Status(r.load_status.code(), "KV transfer failed: " + r.load_status.message()),
           503);
    return;
  }
  // Verify every received block on every rank: the right transfer's bytes at the right heads.
  std::uint32_t corrupt = 0;
  for (std::uint32_t i = 0; i < kv_blocks; ++i) {
    bool good = true;
    for (std::uint32_t rank = 0; rank < ranks->size() && good; ++rank) {
      good = VerifyBlock(ranks->kv(rank) + std::uint64_t{r.blocks[i]} * block_len,
                         options.geometry, rank, r.seed, i);
    }
    if (!good) ++corrupt;
  }
  {
    std::lock_guard<std::mutex> lock(stats_mu);
    stats.verified_blocks += kv_blocks;
    stats.corrupt_blocks += corrupt;
  }
  if (corrupt > 0) {
    CountFailure("verify");
    spdlog::error("[{}] request {} (transfer {}): {} of {} received blocks corrupt",
                  options.engine_id, r.id, r.spec.transfer_id, corrupt, kv_blocks);
    Finish(r,
           Status(ErrorCode::kInternal,
                  fmt::format("received KV is corrupt: {} of {} blocks", corrupt, kv_blocks)),
           500);
    return;
  }
  r.phase = Phase::kKvReady;
  ready.push_back(r.handle);
}

void ServingEngine::Impl::Schedule() {
  const EngineCosts& c = options.costs;
  // Received requests first: their blocks are already allocated.
  while (!ready.empty() && running.size() < c.max_running) {
    Request* r = Find(ready.front());
    ready.pop_front();
    if (r == nullptr || r->phase != Phase::kKvReady) continue;
    r->phase = Phase::kDecode;
    running.push_back(r->handle);
  }
  // FCFS with head-of-line blocking, like vLLM's scheduler without preemption.
  while (!waiting.empty() && running.size() < c.max_running) {
    Request* r = Find(waiting.front());
    if (r == nullptr || r->phase != Phase::kWaiting) {
      waiting.pop_front();
      continue;
    }
    const std::uint32_t bt = options.geometry.block_tokens;
    const std::uint64_t tokens = r->spec.kind == RequestKind::kRemoteDecode
                                     ? r->spec.prompt_tokens
                                     : std::uint64_t{r->spec.prompt_tokens} + r->spec.max_tokens;
    auto blocks = pool->Allocate(BlocksFor(tokens, bt), r->handle);
    if (!blocks) break;
    waiting.pop_front();
    r->blocks = std::move(*blocks);
    {
      std::lock_guard<std::mutex> lock(stats_mu);
      stats.queue_time.Observe(std::chrono::duration<double>(Clock::now() - r->load_start).count());
    }
    if (r->spec.kind == RequestKind::kRemotePrefill) {
      r->phase = Phase::kWaitingKv;
      r->load_started = true;
      r->load_start = Clock::now();
      const std::uint32_t kv_blocks = BlocksFor(r->spec.prompt_tokens, bt);
      std::vector<BlockId> dst(r->blocks.begin(), r->blocks.begin() + kv_blocks);
      runtime::RemoteSource source{r->spec.transfer_id, r->spec.remote_engine_id,
                                   r->spec.remote_bootstrap_addr};
      if (Status started = driver->StartLoad(r->id, source, std::move(dst)); !started.ok()) {
        r->load_started = false;  // nothing was started: the blocks are this engine's alone
        CountFailure("receive");
        Finish(*r, started, 500);
        continue;
      }
      PumpAdapter();
    } else {
      r->phase = Phase::kPrefill;
      running.push_back(r->handle);
    }
  }
}

void ServingEngine::Impl::RunStep() {
  if (running.empty()) return;
  const EngineCosts& c = options.costs;
  std::uint32_t budget = c.max_batch_tokens;
  std::vector<std::uint64_t> decodes;
  std::vector<std::pair<std::uint64_t, std::uint32_t>> chunks;
  std::uint64_t prefill_tokens = 0;
  for (std::uint64_t h : running) {
    Request* r = Find(h);
    if (r != nullptr && r->phase == Phase::kDecode && budget > 0) {
      decodes.push_back(h);
      --budget;
    }
  }
  for (std::uint64_t h : running) {
    Request* r = Find(h);
    if (r == nullptr || r->phase != Phase::kPrefill || budget == 0) continue;
    const std::uint32_t chunk = std::min(r->spec.prompt_tokens - r->prefilled, budget);
    chunks.emplace_back(h, chunk);
    budget -= chunk;
    prefill_tokens += chunk;
  }
  std::uint64_t cost_us = 0;
  if (!chunks.empty()) cost_us += c.prefill_us_per_batch + c.prefill_us_per_token * prefill_tokens;
  if (!decodes.empty()) cost_us += c.decode_us_per_step;
  {
    // The model "runs": sleep the step's cost, waking only for shutdown.
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_until(lock, Clock::now() + std::chrono::microseconds(cost_us),
                  [&] { return stopping; });
    if (stopping) return;  // the step is lost; FailAll answers everyone
  }
  {
    std::lock_guard<std::mutex> lock(stats_mu);
    ++stats.steps;
  }
  for (auto [h, chunk] : chunks) {
    Request* r = Find(h);
    if (r == nullptr || r->phase != Phase::kPrefill) continue;
    r->prefilled += chunk;
    if (r->prefilled == r->spec.prompt_tokens) FinishPrefill(*r);
  }
  for (std::uint64_t h : decodes) {
    Request* r = Find(h);
    if (r == nullptr || r->phase != Phase::kDecode) continue;
    const bool last = r->generated + 1 >= r->spec.max_tokens;
    r->stream->Push({StreamEvent::Kind::kToken,
                     TokenAt(r->seed, r->spec.prompt_tokens + r->generated),
                     0,
                     {},
                     last ? "length" : ""});
    ++r->generated;
    if (r->generated >= r->spec.max_tokens) Finish(*r, Status::Ok(), 200);
  }
  std::lock_guard<std::mutex> lock(stats_mu);
  stats.tokens_generated += decodes.size();
}

void ServingEngine::Impl::FinishPrefill(Request& r) {
  // The KV of the prompt, as every rank holds it.
  const std::uint32_t kv_blocks = BlocksFor(r.spec.prompt_tokens, options.geometry.block_tokens);
  for (std::uint32_t rank = 0; rank < options.geometry.tp; ++rank) {
    std::byte* kv = ranks->kv(rank);
    for (std::uint32_t i = 0; i < kv_blocks; ++i) {
      FillBlock(kv + std::uint64_t{r.blocks[i]} * block_len, options.geometry, rank, r.seed, i);
    }
  }
  // The prefill step yields the first token.
  const bool last = r.spec.kind == RequestKind::kRemoteDecode || r.spec.max_tokens == 1;
  r.stream->Push({StreamEvent::Kind::kToken,
                  TokenAt(r.seed, r.spec.prompt_tokens),
                  0,
                  {},
                  last ? "length" : ""});
  r.generated = 1;
  {
    std::lock_guard<std::mutex> lock(stats_mu);
    ++stats.tokens_generated;
  }
  if (r.spec.kind == RequestKind::kRemoteDecode) {
    HandOver(r);
    return;
  }
  if (r.generated >= r.spec.max_tokens) {
    Finish(r, Status::Ok(), 200);
  } else {
    r.phase = Phase::kDecode;
  }
}

void ServingEngine::Impl::HandOver(Request& r) {
  running.erase(std::find(running.begin(), running.end(), r.handle));
  const std::vector<BlockId> kv(
      r.blocks.begin(),
      r.blocks.begin() + BlocksFor(r.spec.prompt_tokens, options.geometry.block_tokens));
  r.phase = Phase::kHeld;
  r.answered = true;
  // Every rank holds it for the decoder, or the adapter says why not (HandOffFailed) and lets
  // the others go; FreeBlocks gives the blocks back once no rank holds them.
  const std::uint64_t handle = r.handle;
  const core::TransferId transfer = r.spec.transfer_id;
  Status first;
  std::vector<protocol::PrefillAdapterEvent> events =
      WithPrefillDriver([&](runtime::PrefillDriver& d) { first = d.PrefillDone(transfer, kv); });
  for (const protocol::PrefillAdapterEvent& e : events) {
    const auto* failed = std::get_if<protocol::HandOffFailed>(&e);
    if (failed != nullptr && failed->handle == handle && first.ok()) first = failed->why;
  }
  if (!first.ok()) {
    CountFailure("prefill_done");
    r.stream->Push({StreamEvent::Kind::kError,
                    0,
                    503,
                    fmt::format("transfer {}: {}", transfer, StatusReason(first)),
                    {}});
  } else {
    r.stream->Push({StreamEvent::Kind::kFinished, 0, 0, {}, "length"});
  }
  {
    std::lock_guard<std::mutex> lock(stats_mu);
    ++stats.requests_finished[first.ok() ? "ok" : "error"];
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    --queued;
  }
  for (const protocol::PrefillAdapterEvent& e : events) OnPrefillEvent(e);  // may free r now
}

void ServingEngine::Impl::Finish(Request& r, const Status& error, int http_status) {
  if (!r.answered) {
    r.answered = true;
    if (error.ok()) {
      r.stream->Push({StreamEvent::Kind::kFinished, 0, 0, {}, "length"});
    } else {
      r.stream->Push({StreamEvent::Kind::kError, 0, http_status, StatusReason(error), {}});
    }
    {
      std::lock_guard<std::mutex> lock(stats_mu);
      if (http_status != 499) ++stats.requests_finished[error.ok() ? "ok" : "error"];
    }
    std::lock_guard<std::mutex> lock(mu);
    --queued;
  }
  auto drop = [](auto& list, std::uint64_t h) {
    auto it = std::find(list.begin(), list.end(), h);
    if (it != list.end()) list.erase(it);
  };
  drop(running, r.handle);
  drop(ready, r.handle);
  drop(waiting, r.handle);
  if (r.spec.kind == RequestKind::kRemoteDecode && r.phase != Phase::kHeld) {
    // Before PrefillDone the engine owns the blocks; the hold entries just go.
    for (const protocol::PrefillAdapterEvent& e :
         WithPrefillDriver([&](runtime::PrefillDriver& d) { d.Finish(r.spec.transfer_id); })) {
      OnPrefillEvent(e);
    }
  }
  if (r.spec.kind == RequestKind::kRemotePrefill) {
    driver->Finish(r.id);  // every rank stops renewing and releases the transfer to P
    PumpAdapter();
  }
  if (r.phase == Phase::kHeld) return;  // the hold tables own the blocks
  r.phase = Phase::kDraining;
  MaybeRelease(r);
}

void ServingEngine::Impl::MaybeRelease(Request& r) {
  if (r.phase != Phase::kDraining) return;
  // D: not before the adapter says no P writer can touch the blocks (quarantine).
  if (r.load_started && !r.reusable) return;
  FreeBlocks(r);
  Erase(r.handle);
}

void ServingEngine::Impl::FreeBlocks(Request& r) {
  if (r.blocks.empty()) return;
  (void)pool->Free(r.blocks, r.handle);  // a block it does not hold is counted, not freed
  r.blocks.clear();
}

void ServingEngine::Impl::Erase(std::uint64_t handle) {
  auto it = requests.find(handle);
  if (it == requests.end()) return;
  by_id.erase(it->second->id);
  requests.erase(it);
}

void ServingEngine::Impl::Publish() {
  Stats gauges;
  gauges.blocks_used = pool->used();
  gauges.waiting = waiting.size();
  gauges.running = running.size();
  for (const auto& [h, r] : requests) {
    if (r->phase == Phase::kWaitingKv) ++gauges.waiting_kv;
    if (r->spec.kind == RequestKind::kRemoteDecode) {
      if (r->phase == Phase::kPrefill) {
        gauges.held_blocks[core::HoldPhase::kPrefilling] += r->blocks.size();
      }
      if (r->phase == Phase::kHeld) gauges.held_blocks[core::HoldPhase::kReady] += r->blocks.size();
    }
    if (r->phase == Phase::kDraining && r->load_started) {
      gauges.quarantined_blocks += r->blocks.size();
    }
  }
  std::lock_guard<std::mutex> lock(stats_mu);
  stats.blocks_used = gauges.blocks_used;
  stats.waiting = gauges.waiting;
  stats.running = gauges.running;
  stats.waiting_kv = gauges.waiting_kv;
  stats.held_blocks = gauges.held_blocks;
  stats.quarantined_blocks = gauges.quarantined_blocks;
  stats.double_frees = pool->double_frees();
}

void ServingEngine::Impl::FailAll() {
  std::vector<std::uint64_t> handles;
  for (const auto& [h, r] : requests) handles.push_back(h);
  for (std::uint64_t h : handles) {
    Request* r = Find(h);
    if (r != nullptr && !r->answered) {
      Finish(*r, Status(ErrorCode::kUnavailable, "the server is shutting down"), 503);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Metrics: RenderMetrics gathers a snapshot (under the locks it needs); the functions below only
// render it, one per concern.

namespace {

// What every engine shows, whatever its role.
void RenderEngineMetrics(PromWriter& w, const EngineOptions& o, const Stats& s) {
  w.Single("kvferry_kv_blocks_total", "gauge", "KV blocks in the pool (per rank region)",
           o.num_blocks);
  w.Single("kvferry_kv_blocks_used", "gauge", "KV blocks allocated",
           static_cast<double>(s.blocks_used));
  w.Single("kvferry_kv_usage_ratio", "gauge", "kvferry_kv_blocks_used / kvferry_kv_blocks_total",
           static_cast<double>(s.blocks_used) / o.num_blocks);
  w.Single("kvferry_requests_waiting", "gauge", "Requests queued for blocks",
           static_cast<double>(s.waiting));
  w.Single("kvferry_requests_running", "gauge", "Requests prefilling or decoding",
           static_cast<double>(s.running));
  w.Single("kvferry_requests_waiting_for_kv", "gauge", "D: requests with blocks, receiving KV",
           static_cast<double>(s.waiting_kv));
  w.Family("kvferry_requests_finished_total", "counter", "Requests answered, by outcome");
  for (const char* outcome : {"ok", "error", "client_abort"}) {
    auto it = s.requests_finished.find(outcome);
    w.Sample("kvferry_requests_finished_total",
             it == s.requests_finished.end() ? 0.0 : static_cast<double>(it->second),
             {{"outcome", outcome}});
  }
  w.Single("kvferry_tokens_generated_total", "counter", "Tokens produced",
           static_cast<double>(s.tokens_generated));
  w.Single("kvferry_engine_steps_total", "counter", "Scheduler steps run",
           static_cast<double>(s.steps));
  w.Family("kvferry_queue_time_seconds", "histogram", "Arrival to block admission");
  w.Histo("kvferry_queue_time_seconds", s.queue_time);
  w.Family("kvferry_failures_total", "counter", "Failures by stage");
  for (const auto& [stage, n] : s.failures) {
    w.Sample("kvferry_failures_total", static_cast<double>(n), {{"stage", stage}});
  }
  w.Single("kvferry_block_double_frees_total", "counter", "Frees of a free block (a bug)",
           static_cast<double>(s.double_frees));
}

// P's hold table, summed over ranks (its rows and families, core/hold_table.h), and the blocks
// and bytes P's engine holds by hold state.
void RenderHoldMetrics(PromWriter& w, const core::HoldStats& hold, const Stats& s,
                       std::uint64_t rank_bytes) {
  w.EnumFamily(hold, core::kHoldEntriesFamily);
  w.Fields<core::HoldStats>(hold, core::kHoldStatFields);
  w.EnumFamily(hold, core::kHoldReleasedFamily);
  // A view of three of kvferry_hold_released_total's reasons under their own name, which
  // dashboards of lease expiries scrape (docs/operations.md).
  w.Family("kvferry_hold_expiries_total", "counter",
           "Hold entries that timed out (lease/timeout, dead decoder, wait timeout)");
  for (core::ReleaseReason reason : {core::ReleaseReason::kExpired,
                                     core::ReleaseReason::kDeadDecoder,
                                     core::ReleaseReason::kWaitTimeout}) {
    w.Sample("kvferry_hold_expiries_total", static_cast<double>(hold.released[reason]),
             {{"reason", core::ToString(reason)}});
  }
  w.Family("kvferry_held_blocks", "gauge", "P blocks of transfers by hold state");
  for (core::HoldPhase phase : core::kAllHoldPhases) {
    w.Sample("kvferry_held_blocks", static_cast<double>(s.held_blocks[phase]),
             {{"state", core::ToString(phase)}});
  }
  w.Family("kvferry_held_bytes", "gauge", "P KV bytes of transfers by hold state (all ranks)");
  for (core::HoldPhase phase : core::kAllHoldPhases) {
    w.Sample("kvferry_held_bytes", static_cast<double>(s.held_blocks[phase] * rank_bytes),
             {{"state", core::ToString(phase)}});
  }
}

// P: its sessions' and sockets' counters (summed over ranks), its hold table and its writes.
void RenderPrefillMetrics(PromWriter& w, const EngineOptions& o, const Stats& s,
                          const control::ListenerStats& ls, std::uint64_t bytes_sent,
                          std::uint64_t rank_bytes) {
  w.Fields<protocol::PrefillStats>(ls, protocol::kPrefillStatFields);
  w.Fields<control::ListenerStats>(ls, control::kListenerStatFields);
  RenderHoldMetrics(w, ls.hold, s, rank_bytes);
  if (o.bootstrap_auth_refusals) {
    w.Single("kvferry_bootstrap_auth_refusals_total", "counter",
             "Registrations the embedded bootstrap service refused with 401 (unsigned, forged "
             "or stale)",
             static_cast<double>(o.bootstrap_auth_refusals()));
  }
  w.Family("kvferry_transfer_bytes_total", "counter", "KV bytes sent (P) or received (D)");
  w.Sample("kvferry_transfer_bytes_total", static_cast<double>(bytes_sent),
           {{"direction", "sent"}});
  w.Family("kvferry_write_latency_seconds", "histogram", "P: one KV WRITE batch, start to end");
  w.Histo("kvferry_write_latency_seconds", s.write_latency);
}

// D: its sessions' counters (summed over ranks), its quarantine, receives and their failures.
void RenderDecodeMetrics(PromWriter& w, const Stats& s, const runtime::DecodeWorkerStats& d) {
  w.Fields<protocol::DecodeStats>(d, protocol::kDecodeStatFields);
  w.Single("kvferry_blocks_awaiting_release", "gauge",
           "D blocks of finished requests not yet back in the pool",
           static_cast<double>(s.quarantined_blocks));
  w.Family("kvferry_receive_failures_total", "counter",
           "D: requests whose receive failed, by the first error's code");
  for (const auto& [code, n] : s.receive_failures) {
    w.Sample("kvferry_receive_failures_total", static_cast<double>(n), {{"code", code}});
  }
  w.Single("kvferry_corrupt_blocks_total", "counter", "Received blocks whose bytes were wrong",
           static_cast<double>(s.corrupt_blocks));
  w.Single("kvferry_verified_blocks_total", "counter", "Received blocks verified",
           static_cast<double>(s.verified_blocks));
  w.Family("kvferry_transfer_bytes_total", "counter", "KV bytes sent (P) or received (D)");
  w.Sample("kvferry_transfer_bytes_total", static_cast<double>(s.received_bytes),
           {{"direction", "received"}});
  w.Family("kvferry_transfer_latency_seconds", "histogram",
           "D: StartLoad to every rank's receive settled");
  w.Histo("kvferry_transfer_latency_seconds", s.transfer_latency);
}

}  // namespace

std::string ServingEngine::RenderMetrics() {
  Impl& impl = *impl_;
  const EngineOptions& o = options_;
  Stats s;
  {
    std::lock_guard<std::mutex> lock(impl.stats_mu);
    s = impl.stats;
  }
  PromWriter w;
  RenderEngineMetrics(w, o, s);
  if (o.role == Role::kPrefill) {
    control::ListenerStats ls;  // summed over ranks
    std::uint64_t bytes = 0;
    for (auto& worker : impl.ranks->prefill_workers()) {
      const control::ListenerStats x = worker->listener().Stats(std::chrono::milliseconds(200));
      core::AddStats<protocol::PrefillStats>(ls, x, protocol::kPrefillStatFields);
      core::AddStats<control::ListenerStats>(ls, x, control::kListenerStatFields);
      ls.hold += x.hold;
      bytes += worker->writer().bytes_written();
    }
    RenderPrefillMetrics(w, o, s, ls, bytes, impl.block_len * o.geometry.tp);
  } else {
    runtime::DecodeWorkerStats d;  // summed over ranks
    for (auto& worker : impl.ranks->decode_workers()) {
      core::AddStats<protocol::DecodeStats>(d, worker->Stats(), protocol::kDecodeStatFields);
    }
    RenderDecodeMetrics(w, s, d);
  }
  return w.Take();
}

}  // namespace kvferry::harness
