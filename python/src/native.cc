// kvferry._native: the Python binding of kvferry's runtime (one P or D rank, and P's bootstrap
// service), for serving engines written in Python (kvferry.vllm.KvferryConnector).
//
// Contracts, on top of the C++ ones (runtime/prefill_worker.h, runtime/decode_worker.h):
//  - KV memory is the engine's own tensors, passed as planes (address, bytes), all in one
//    `memory`: "host", or "cuda" (GPU-direct), which the UCX data plane registers only where its
//    UCX has CUDA support and itself sees device memory at each plane; otherwise the worker's
//    construction raises INVALID_ARGUMENT with the reason (Debian's UCX has no CUDA). The
//    memory must outlive the worker: the Python classes keep no reference to the tensors, so
//    the caller holds them until stop() returned.
//  - No Python runs on a kvferry thread: P's hold events and D's results are queued in C++ and
//    taken by the caller (take_events / take_finished / wait_finished).
//  - Every call that may wait (start, the P engine calls, wait_finished, stop) releases the GIL.
//  - A failed Status raises kvferry._native.KvferryError (a RuntimeError) whose `code` is the
//    ErrorCode's name (e.g. "INVALID_ARGUMENT") and whose message is the Status message.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "control/bootstrap_server.h"
#include "control/cluster_auth.h"
#include "control/load_failure_service.h"
#include "kvferry/core/stat_fields.h"
#include "kvferry/status.h"
#include "kvferry/transport/inprocess.h"
#include "kvferry/transport/ucx.h"
#include "runtime/connector_config.h"
#include "runtime/decode_driver.h"
#include "runtime/prefill_driver.h"
#include "runtime/decode_worker.h"
#include "runtime/prefill_worker.h"

namespace py = pybind11;

namespace kvferry::python {
namespace {

// kvferry._native.KvferryError, created at import.
py::object& ErrorType() {
  static py::object* type = nullptr;
  if (type == nullptr) type = new py::object();  // lives as long as the interpreter
  return *type;
}

[[noreturn]] void Raise(const Status& status) {
  py::object error = ErrorType()(status.message());
  error.attr("code") = std::string(ToString(status.code()));
  PyErr_SetObject(ErrorType().ptr(), error.ptr());
  throw py::error_already_set();
}

void Check(const Status& status) {
  if (!status.ok()) Raise(status);
}

template <typename T>
T Take(Result<T> result) {
  if (!result) Raise(result.error());
  return std::move(*result);
}

// Planes from Python: (address, bytes) pairs, as torch's tensor.data_ptr() and
// tensor.untyped_storage().nbytes() (or numel() × element_size()) give them.
std::vector<runtime::KvPlane> Planes(const std::vector<std::pair<std::uintptr_t, std::size_t>>& in,
                                     transport::MemoryKind kind) {
  std::vector<runtime::KvPlane> out;
  out.reserve(in.size());
  for (const auto& [address, bytes] : in) {
    out.push_back({reinterpret_cast<std::byte*>(address), bytes, kind});
  }
  return out;
}

// "host" or "cuda" (raises otherwise).
transport::MemoryKind Memory(const std::string& memory) {
  if (memory == "host") return transport::MemoryKind::kHost;
  if (memory == "cuda") return transport::MemoryKind::kCuda;
  Raise(Status(ErrorCode::kInvalidArgument, "memory must be 'host' or 'cuda', not '" + memory + "'"));
}

std::shared_ptr<const control::ClusterSecret> Secret(const std::optional<std::string>& file) {
  if (!file || file->empty()) return nullptr;
  return std::make_shared<const control::ClusterSecret>(Take(control::LoadClusterSecret(*file)));
}

// The data plane of one rank: "ucx" (the default), or "inprocess" for tests within one process
// (every engine made by this module shares one fabric). Called without the GIL.
Result<std::shared_ptr<transport::Engine>> MakeEngine(const std::string& data_plane,
                                                      const std::string& name, bool fence_writes) {
  if (data_plane == "ucx") {
    transport::UcxOptions options;
    options.name = name;
    options.fence_writes = fence_writes;
    auto engine = transport::MakeUcxEngine(options);
    if (!engine) return tl::unexpected(engine.error());
    return std::shared_ptr<transport::Engine>(std::move(*engine));
  }
  if (data_plane == "inprocess") {
    static std::shared_ptr<transport::InProcessFabric> fabric = transport::MakeInProcessFabric();
    auto engine = transport::MakeInProcessEngine(fabric, {name, false, fence_writes});
    if (!engine) return tl::unexpected(engine.error());
    return std::shared_ptr<transport::Engine>(std::move(*engine));
  }
  return Err(ErrorCode::kInvalidArgument,
             "data_plane must be 'ucx' or 'inprocess', not '" + data_plane + "'");
}

// A stats table's rows as a dict's entries (kvferry/core/stat_fields.h: one declaration per
// counter, the same that /metrics reads).
template <class Stats>
void AddToDict(py::dict& d, const Stats& stats, std::span<const core::StatField<Stats>> fields) {
  core::ForEachStat<Stats>(stats, fields, [&](std::string_view key, std::uint64_t value) {
    d[py::str(key.data(), key.size())] = value;
  });
}
// A per-enumerator family as d[key] = {ToString(enumerator): value}.
template <class Stats, class Enum, std::size_t N>
void AddFamilyToDict(py::dict& d, const Stats& stats,
                     const core::StatFamily<Stats, Enum, N>& family) {
  py::dict values;
  core::ForEachInFamily(stats, family, [&](std::string_view name, std::uint64_t value) {
    values[py::str(name.data(), name.size())] = value;
  });
  d[py::str(family.key.data(), family.key.size())] = values;
}
template <class Stats>
py::dict StatsDict(const Stats& stats, std::span<const core::StatField<Stats>> fields) {
  py::dict d;
  AddToDict<Stats>(d, stats, fields);
  return d;
}

std::chrono::milliseconds Millis(double seconds, const char* what) {
  if (!(seconds >= 0) || seconds > 1e7) {
    Raise(Status(ErrorCode::kInvalidArgument,
                 std::string(what) + " must be a number of seconds in [0, 1e7]"));
  }
  return std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000));
}

// Drops a worker (stopping it if this was the last reference) without holding the GIL: a P's
// writes may take a while to drain, and the runtime's threads never need the GIL. While the
// interpreter finalizes, the GIL is kept (releasing it then is not allowed).
template <typename Worker>
void StopQuietly(std::shared_ptr<Worker> worker) {
  if (!worker) return;
  if (_Py_IsFinalizing() || !PyGILState_Check()) {
    worker.reset();
    return;
  }
  py::gil_scoped_release release;
  worker.reset();
}

// What every rank takes, P or D.
struct RankConfig {
  std::string engine_id;
  std::uint32_t tp_size = 1;
  std::uint32_t tp_rank = 0;
  std::uint64_t block_len = 0;
  std::uint32_t num_blocks = 0;
  std::vector<std::pair<std::uintptr_t, std::size_t>> planes;
  transport::MemoryKind memory = transport::MemoryKind::kHost;  // of every plane
  double lease_s = 0;
  double abort_request_timeout_s = 480;
  std::string data_plane = "ucx";
  std::optional<std::string> cluster_secret_file;
  bool head_slices = true;  // the layout keeps a KV head's bytes together within a block
  // D: its data plane fences writers (transport::UcxOptions::fence_writes): pulls carry write
  // keys and D's fences release quarantined blocks, at the cost of the one-sided put path.
  bool fence_writes = false;
};

// The options every rank shares, P's or D's, from its Python arguments (raises on a bad one).
template <typename Options>
void FillRank(Options& o, const RankConfig& c) {
  o.engine_id = c.engine_id;
  o.tp_size = c.tp_size;
  o.tp_rank = c.tp_rank;
  o.block_len = c.block_len;
  o.num_blocks = c.num_blocks;
  o.planes = Planes(c.planes, c.memory);
  o.head_slices = c.head_slices;
  o.cluster_secret = Secret(c.cluster_secret_file);
}

// Makes the rank's data plane and starts the worker with `start`, both without the GIL (UCX's
// start and P's registration take a while); raises the first error.
template <typename StartFn>
auto StartWithoutGil(const RankConfig& c, const char* role, StartFn start) {
  using Started = decltype(start(std::shared_ptr<transport::Engine>()));
  Started worker = Err(ErrorCode::kInternal, "not started");
  {
    py::gil_scoped_release release;
    auto engine = MakeEngine(c.data_plane, c.engine_id + role + std::to_string(c.tp_rank),
                             c.fence_writes);
    worker = engine ? start(std::move(*engine)) : Started(tl::unexpected(engine.error()));
  }
  return Take(std::move(worker));
}

// ---- P ----

// One P rank. The engine admits a request (with its transfer id), reports its prefill done with
// the block ids holding its KV, and learns from take_events() when those blocks may be freed
// ("free") or the request should stop ("abort").
class PyPrefillWorker {
 public:
  struct Config : RankConfig {
    std::uint32_t dp_rank = 0;
    std::uint32_t kv_heads = 0;
    std::string bootstrap_address;
    std::string side_channel_host = "127.0.0.1";
    std::string incarnation;
  };

  explicit PyPrefillWorker(const Config& c)
      : state_(std::make_shared<State>()),
        num_blocks_(c.num_blocks),
        num_planes_(static_cast<std::uint32_t>(c.planes.size())) {
    runtime::PrefillWorkerOptions o;
    FillRank(o, c);
    o.dp_rank = c.dp_rank;
    o.kv_heads = c.kv_heads;
    o.hold.lease = Millis(c.lease_s, "lease_s");
    o.hold.abort_request_timeout = Millis(c.abort_request_timeout_s, "abort_request_timeout_s");
    o.bootstrap_address = c.bootstrap_address;
    o.side_channel_endpoint = "tcp://" + c.side_channel_host + ":0";
    o.incarnation = c.incarnation;
    std::shared_ptr<State> state = state_;
    auto on_hold = [state](const core::HoldEvent& event) {
      // The listener thread: queue for take_events, never call into Python.
      if (event.kind != core::HoldEvent::Kind::kFreeBlocks &&
          event.kind != core::HoldEvent::Kind::kAbortPrefill) {
        return;
      }
      std::lock_guard<std::mutex> lock(state->mu);
      state->holds.push_back(event);
    };
    worker_ = StartWithoutGil(c, "-p", [&](std::shared_ptr<transport::Engine> engine) {
      return runtime::PrefillWorker::Start(std::move(o), std::move(engine), std::move(on_hold));
    });
    driver_ = std::make_unique<runtime::PrefillDriver>(std::vector{worker_.get()});
  }

  // The engine calls go through protocol::PrefillAdapter (runtime::PrefillDriver over this one
  // rank), the glue `kvferry serve` and the simulator run too. The driver waits for the
  // worker's acknowledgements, so it runs without the GIL, under driver_mu_.

  // A request the engine will prefill; `handle` is the engine's cookie for it (unique while
  // the request lives). Raises ALREADY_EXISTS for a transfer id in use, TOMBSTONED for one P
  // already freed or D released: its prefill_done then frees at once ("free" event).
  void Admit(const std::string& transfer_id, std::uint64_t handle) {
    std::optional<Status> refused;
    Check(WithDriver([&](runtime::PrefillDriver& d) { return d.Admit(transfer_id, handle); },
                     [&](const protocol::PrefillAdapterEvent& e) {
                       const auto* r = std::get_if<protocol::AdmitRefused>(&e);
                       if (r != nullptr && r->transfer == transfer_id) refused = r->why;
                     }));
    if (refused) Raise(*refused);
  }

  // Its prefill is done and its KV sits in `block_ids` (in order); pulls may be served now.
  // `handle`, when given, must be the one the transfer was admitted with: a caller that mixes
  // up two requests gets ALREADY_EXISTS instead of lending one request's blocks to the other.
  // A transfer dropped meanwhile (refused, released by D, its lease lapsed) is answered by a
  // "free" event at once.
  void PrefillDone(const std::string& transfer_id, std::vector<core::BlockId> block_ids,
                   std::optional<std::uint64_t> expected_handle) {
    CheckBlocks(block_ids);
    Check(WithDriver([&](runtime::PrefillDriver& d) -> Status {
      const std::optional<std::uint64_t> handle = d.handle_of(transfer_id);
      if (!handle) {
        return Status(ErrorCode::kNotFound, "transfer " + transfer_id + " was not admitted");
      }
      if (expected_handle && *expected_handle != *handle) {
        return Status(ErrorCode::kAlreadyExists,
                      "transfer " + transfer_id + " is admitted for another request");
      }
      return d.PrefillDone(transfer_id, std::move(block_ids));
    }));
  }

  // Planes `planes` (indexes into the registered planes) of a request still prefilling are
  // final in `block_ids`: the step that completes its prompt computed those layers. Pulls that
  // already wait for the transfer get them written now, so less is left when prefill_done
  // comes (protocol::PrefillSession::LayersReady). A hint, not waited for: returns whether it
  // was passed on — false for a transfer not admitted for `handle` on every rank or handed off
  // already (protocol::PrefillAdapter::LayersReady). Raises OUT_OF_RANGE for a block or plane
  // outside what is registered.
  bool LayersReady(const std::string& transfer_id, std::vector<core::BlockId> block_ids,
                   std::vector<std::uint32_t> planes, std::uint64_t handle) {
    CheckBlocks(block_ids);
    for (std::uint32_t p : planes) {
      if (p >= num_planes_) {
        Raise(Status(ErrorCode::kOutOfRange, "plane " + std::to_string(p) + " outside the " +
                                                 std::to_string(num_planes_) +
                                                 " planes registered"));
      }
    }
    bool passed = false;
    Check(WithDriver([&](runtime::PrefillDriver& d) {
      passed = d.LayersReady(transfer_id, handle, block_ids, planes);
      return Status::Ok();
    }));
    return passed;
  }

  // The engine finished or aborted the request: if nobody pulled it yet, it goes now.
  void EngineFinished(const std::string& transfer_id) {
    Check(WithDriver([&](runtime::PrefillDriver& d) {
      d.Finish(transfer_id);
      return Status::Ok();
    }));
  }

  // The engine dropped the request before admitting it: D's pulls fail with `why`.
  void Refuse(const std::string& transfer_id, const std::string& why) {
    Check(WithDriver([&](runtime::PrefillDriver& d) {
      d.Drop(transfer_id, Status(ErrorCode::kRejected, why));
      return Status::Ok();
    }));
  }

  // [(kind, transfer_id, reason)]: kind "free" (return the request's blocks to the pool) or
  // "abort" (stop prefilling it: nobody will pull it), each once per transfer.
  std::vector<std::tuple<std::string, std::string, std::string>> TakeEvents() {
    Check(WithDriver([&](runtime::PrefillDriver& d) {
      std::deque<core::HoldEvent> holds;
      {
        std::lock_guard<std::mutex> lock(state_->mu);
        holds.swap(state_->holds);
      }
      for (const core::HoldEvent& e : holds) d.OnHoldEvent(0, e);
      return Status::Ok();
    }));
    std::lock_guard<std::mutex> lock(driver_mu_);
    return std::exchange(events_, {});
  }

  py::dict Stats() {
    std::shared_ptr<runtime::PrefillWorker> live = Live();
    runtime::PrefillWorker& worker = *live;
    control::ListenerStats s;
    {
      py::gil_scoped_release release;
      s = worker.listener().Stats();
    }
    py::dict d = StatsDict<protocol::PrefillStats>(s, protocol::kPrefillStatFields);
    AddToDict<control::ListenerStats>(d, s, control::kListenerStatFields);
    AddToDict<core::HoldStats>(d, s.hold, core::kHoldStatFields);
    AddFamilyToDict(d, s.hold, core::kHoldEntriesFamily);
    AddFamilyToDict(d, s.hold, core::kHoldReleasedFamily);
    d["bytes_written"] = worker.writer().bytes_written();
    std::uint64_t held = 0;
    for (core::HoldPhase phase : core::kAllHoldPhases) held += s.hold.entries[phase];
    d["held_transfers"] = held;
    {
      std::lock_guard<std::mutex> lock(driver_mu_);
      // Admitted and not yet freed (or finished before the hand-off).
      d["admitted_transfers"] = driver_ ? driver_->stats().transfers : 0;
    }
    return d;
  }

  std::string side_channel() { return Live()->side_channel(); }

  // Stops serving: in-flight writes drain, then the planes are deregistered. Idempotent, and
  // safe from several threads: the first caller takes the worker (under the GIL), and a call
  // still inside the worker on another thread keeps it alive until it returns.
  void Stop() {
    std::shared_ptr<runtime::PrefillWorker> worker = std::move(worker_);
    if (!worker) return;
    Status stopped;
    {
      py::gil_scoped_release release;
      {
        std::lock_guard<std::mutex> lock(driver_mu_);  // a driver call in flight ends first
        driver_.reset();
      }
      stopped = worker->Stop();
      worker.reset();
    }
    Check(stopped);
  }

  // A worker collected without stop() stops here, without holding the GIL while its writes
  // drain (unless the interpreter is shutting down).
  ~PyPrefillWorker() {
    driver_.reset();
    StopQuietly(std::move(worker_));
  }

 private:
  struct State {
    std::mutex mu;
    std::deque<core::HoldEvent> holds;  // from the listener thread, for take_events
  };
  std::shared_ptr<runtime::PrefillWorker> Live() {
    if (!worker_) Raise(Status(ErrorCode::kCancelled, "the prefill worker is stopped"));
    return worker_;
  }
  // Runs `call` on the driver and pumps it, without the GIL, under driver_mu_; `seen` sees each
  // event first (still under the lock). "free" and "abort" events are kept for take_events.
  template <typename Call, typename Seen = void (*)(const protocol::PrefillAdapterEvent&)>
  Status WithDriver(Call&& call, Seen&& seen = [](const protocol::PrefillAdapterEvent&) {}) {
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(driver_mu_);
    if (driver_ == nullptr) return Status(ErrorCode::kCancelled, "the prefill worker is stopped");
    const Status status = call(*driver_);
    for (std::vector<protocol::PrefillAdapterEvent> got = driver_->Pump(); !got.empty();
         got = driver_->Pump()) {
      for (const protocol::PrefillAdapterEvent& e : got) {
        seen(e);
        if (const auto* freed = std::get_if<protocol::FreeBlocks>(&e)) {
          events_.emplace_back("free", freed->transfer, std::string(core::ToString(freed->reason)));
        } else if (const auto* abort = std::get_if<protocol::AbortPrefill>(&e)) {
          events_.emplace_back("abort", abort->transfer, std::string(core::ToString(abort->reason)));
        }
      }
    }
    return status;
  }

  std::shared_ptr<State> state_;
  std::shared_ptr<runtime::PrefillWorker> worker_;
  std::mutex driver_mu_;
  std::unique_ptr<runtime::PrefillDriver> driver_;  // over worker_; null once stopped
  std::vector<std::tuple<std::string, std::string, std::string>> events_;  // under driver_mu_
  // Raises OUT_OF_RANGE for a block id outside the registered blocks.
  void CheckBlocks(const std::vector<core::BlockId>& block_ids) const {
    for (core::BlockId b : block_ids) {
      if (b >= num_blocks_) {
        Raise(Status(ErrorCode::kOutOfRange, "block " + std::to_string(b) + " outside the " +
                                                 std::to_string(num_blocks_) +
                                                 " blocks registered"));
      }
    }
  }

  std::uint32_t num_blocks_ = 0;
  std::uint32_t num_planes_ = 0;
};

// ---- D ----

runtime::RemoteSource Source(const py::dict& d) {
  auto get = [&](const char* key) -> std::string {
    if (!d.contains(key)) {
      Raise(Status(ErrorCode::kInvalidArgument, std::string("source lacks '") + key + "'"));
    }
    return py::str(d[key]);
  };
  return {get("transfer_id"), get("engine_id"), get("bootstrap_address")};
}

class PyDecodeWorker {
 public:
  struct Config : RankConfig {
    bool send_releases = true;
  };

  explicit PyDecodeWorker(const Config& c) {
    runtime::DecodeWorkerOptions o;
    FillRank(o, c);
    o.lease = Millis(c.lease_s, "lease_s");
    o.abort_request_timeout = Millis(c.abort_request_timeout_s, "abort_request_timeout_s");
    // P answers every pull within abort_request_timeout + its write bound (DecodeWorkerOptions).
    o.pull_timeout = o.abort_request_timeout + o.write_bound + std::chrono::seconds(30);
    o.send_releases = c.send_releases;
    worker_ = StartWithoutGil(c, "-d", [&](std::shared_ptr<transport::Engine> engine) {
      return runtime::DecodeWorker::Start(std::move(o), std::move(engine));
    });
    driver_ = std::make_unique<runtime::DecodeDriver>(std::vector{worker_.get()});
  }

  // The engine calls go through protocol::DecodeAdapter (runtime::DecodeDriver over this one
  // rank), the glue `kvferry serve` and the simulator run too. The driver is touched only
  // with the GIL held; it lives while worker_ does (Stop drops it first).
  void OnNewRequest(const std::string& request, const py::dict& source) {
    runtime::RemoteSource s = Source(source);
    Check(Driver().Track(request, s));
    Pump();
  }
  void StartLoad(const std::string& request, const py::dict& source,
                 std::vector<core::BlockId> blocks) {
    runtime::RemoteSource s = Source(source);
    Check(Driver().StartLoad(request, s, std::move(blocks)));
    Pump();
  }
  void RequestFinished(const std::string& request) {
    Driver().Finish(request);
    Pump();
  }
  void ReleaseTransfer(const py::dict& source) {
    runtime::RemoteSource s = Source(source);
    Driver().Refuse(s);
    Pump();
  }

  // The adapter's events since the last call (protocol/decode_adapter.h), each once:
  // {"loaded": [(request, ok, error, quarantined)], "reusable": [(request, after_quarantine)],
  //  "dropped": [(request, why)]}
  py::dict TakeFinished() {
    runtime::DecodeDriver& driver = Driver();
    driver.OnFinished(0, Live()->TakeFinished());
    Pump();
    return TakeEvents();
  }
  // As TakeFinished, first waiting (without the GIL) until the worker reports something or
  // `timeout_s` passes; at once if events are already waiting.
  py::dict WaitFinished(double timeout_s) {
    const auto deadline = core::Clock::now() + Millis(timeout_s, "timeout_s");
    runtime::DecodeFinished f;
    if (events_.empty()) {
      std::shared_ptr<runtime::DecodeWorker> worker = Live();  // alive until this returns
      py::gil_scoped_release release;
      f = worker->WaitFinished(deadline);
      worker.reset();  // if stop() came meanwhile, the worker stops here, without the GIL
    }
    if (driver_ == nullptr) return TakeEvents();  // stopped meanwhile
    driver_->OnFinished(0, f);
    Pump();
    return TakeEvents();
  }

  py::dict Stats() {
    const runtime::DecodeWorkerStats s = Live()->Stats();
    return StatsDict<protocol::DecodeStats>(s, protocol::kDecodeStatFields);
  }

  // Releases what it tracks to P, stops the threads, then deregisters the planes (a
  // quarantined pull's P may write until then); returns only once all of that is done, also
  // while another thread waits in wait_finished (found by review: stop() returned while a
  // waiter kept the worker running, so a caller freeing its tensors got writes into freed
  // memory). Idempotent, and safe from several threads.
  void Stop() {
    std::shared_ptr<runtime::DecodeWorker> worker = worker_;
    if (!worker) return;
    if (driver_ != nullptr) (void)driver_->Stop();
    driver_.reset();
    {
      py::gil_scoped_release release;
      worker->Stop();
    }
    worker_.reset();
    StopQuietly(std::move(worker));
  }
  ~PyDecodeWorker() {
    driver_.reset();
    StopQuietly(std::move(worker_));
  }

 private:
  void Pump() {
    for (std::vector<protocol::AdapterEvent> got = driver_->Pump(); !got.empty();
         got = driver_->Pump()) {
      for (protocol::AdapterEvent& e : got) events_.push_back(std::move(e));
    }
  }
  py::dict TakeEvents() {
    py::list loaded;
    py::list reusable;
    py::list dropped;
    for (const protocol::AdapterEvent& e : std::exchange(events_, {})) {
      if (const auto* done = std::get_if<protocol::LoadDone>(&e)) {
        loaded.append(py::make_tuple(done->request, done->status.ok(),
                                     done->status.ok() ? "" : done->status.ToString(),
                                     done->quarantined));
      } else if (const auto* r = std::get_if<protocol::BlocksReusable>(&e)) {
        reusable.append(py::make_tuple(r->request, r->after_quarantine));
      } else if (const auto* d = std::get_if<protocol::TransferDropped>(&e)) {
        dropped.append(py::make_tuple(d->request, d->why.ToString()));
      }
    }
    py::dict d;
    d["loaded"] = loaded;
    d["reusable"] = reusable;
    d["dropped"] = dropped;
    return d;
  }
  std::shared_ptr<runtime::DecodeWorker> Live() {
    if (!worker_) Raise(Status(ErrorCode::kCancelled, "the decode worker is stopped"));
    return worker_;
  }
  runtime::DecodeDriver& Driver() {
    if (driver_ == nullptr) Raise(Status(ErrorCode::kCancelled, "the decode worker is stopped"));
    return *driver_;
  }

  std::shared_ptr<runtime::DecodeWorker> worker_;
  std::unique_ptr<runtime::DecodeDriver> driver_;  // over worker_; null once stopped
  std::vector<protocol::AdapterEvent> events_;     // not yet taken
};

void SetRank(RankConfig& c, std::string engine_id, std::uint32_t tp_size, std::uint32_t tp_rank,
             std::uint64_t block_len, std::uint32_t num_blocks,
             std::vector<std::pair<std::uintptr_t, std::size_t>> planes, double lease_s,
             double abort_request_timeout_s, std::string data_plane,
             std::optional<std::string> cluster_secret_file, bool head_slices,
             const std::string& memory) {
  c.head_slices = head_slices;
  c.memory = Memory(memory);
  c.engine_id = std::move(engine_id);
  c.tp_size = tp_size;
  c.tp_rank = tp_rank;
  c.block_len = block_len;
  c.num_blocks = num_blocks;
  c.planes = std::move(planes);
  c.lease_s = lease_s;
  c.abort_request_timeout_s = abort_request_timeout_s;
  c.data_plane = std::move(data_plane);
  c.cluster_secret_file = std::move(cluster_secret_file);
}

// ---- D's load-failure service (control/load_failure_service.h): why a KV load failed, for a
// router to tell the client ----

class PyLoadFailureService {
 public:
  PyLoadFailureService(const std::string& host, int port) {
    Result<int> started = Err(ErrorCode::kInternal, "not started");
    {
      py::gil_scoped_release release;
      started = service_.Start(host, port);
    }
    port_ = Take(std::move(started));
  }
  int port() const { return port_; }
  void Record(const std::string& transfer_id, const std::string& reason) {
    service_.Record(transfer_id, reason);
  }
  std::optional<std::string> Find(const std::string& transfer_id) const {
    return service_.Find(transfer_id);
  }
  void Stop() {
    py::gil_scoped_release release;
    service_.Stop();
  }

 private:
  control::LoadFailureService service_;
  int port_ = 0;
};

// ---- the bootstrap service (P's scheduler process runs one, as vLLM's Mooncake P does) ----

class PyBootstrapServer {
 public:
  PyBootstrapServer(const std::string& host, int port,
                    const std::optional<std::string>& cluster_secret_file,
                    const std::optional<std::string>& engine_id,
                    const std::optional<std::string>& incarnation) {
    control::BootstrapServerOptions o;
    o.cluster_secret = Secret(cluster_secret_file);
    // Embedded in P: no other incarnation of the engine it serves may register while it runs
    // (BootstrapRegistry rule 2), so one POST /register cannot take the engine's traffic over.
    if (engine_id.has_value() != incarnation.has_value()) {
      Raise(Status(ErrorCode::kInvalidArgument,
                   "engine_id and incarnation go together: the engine this bootstrap's process "
                   "serves"));
    }
    if (engine_id) o.own_engine = control::EngineIncarnation{*engine_id, *incarnation};
    server_ = std::make_unique<control::BootstrapServer>(o);
    Result<int> started = Err(ErrorCode::kInternal, "not started");
    {
      py::gil_scoped_release release;
      started = server_->Start(host, port);
    }
    port_ = Take(std::move(started));
  }
  int port() const { return port_; }
  void Stop() {
    py::gil_scoped_release release;
    server_->Stop();
  }

 private:
  std::unique_ptr<control::BootstrapServer> server_;
  int port_ = 0;
};

// kvferry's keys of kv_connector_extra_config, read by runtime::ParseConnectorConfig (the parser
// `kvferry serve` uses) and handed to Python as a dict of python/kvferry/vllm/config.py's
// ConnectorSettings names: durations in seconds, absent values None.
py::dict ParseConnectorConfig(const std::string& extra_json,
                              const std::unordered_map<std::string, std::string>& env,
                              const std::vector<std::string>& unused_here) {
  const std::vector<std::string_view> unused(unused_here.begin(), unused_here.end());
  const runtime::EnvLookup lookup = [&env](std::string_view name) -> std::optional<std::string> {
    auto it = env.find(std::string(name));
    if (it == env.end()) return std::nullopt;
    return it->second;
  };
  const runtime::ConnectorConfig c =
      Take(runtime::ParseConnectorConfig(extra_json, lookup, unused));
  const auto none_if_empty = [](const std::string& s) -> py::object {
    return s.empty() ? py::none() : py::cast(s);
  };
  py::dict d;
  d["kv_lease_duration"] = core::ToSeconds(c.lease);
  d["abort_request_timeout"] = core::ToSeconds(c.abort_request_timeout);
  d["bootstrap_port"] = c.bootstrap_port;
  d["bootstrap_server_address"] = none_if_empty(c.bootstrap_server_address);
  d["kv_release"] = c.release;
  d["fence_writes"] = c.fence_writes;
  d["layer_writes"] = c.layer_writes;
  d["load_failure_port"] = c.load_failure_port;
  d["kv_staging"] = std::string(runtime::ToString(c.staging));
  d["kv_staging_blocks"] = c.staging_blocks;
  d["cluster_secret_file"] = none_if_empty(c.cluster_secret_file);
  d["etcd_endpoints"] = c.etcd_endpoints;
  d["etcd_prefix"] = c.etcd_prefix;
  d["etcd_lease_ttl"] = c.etcd_lease_ttl.count();
  d["ignored_keys"] = py::tuple(py::cast(c.ignored_keys));
  return d;
}

}  // namespace
}  // namespace kvferry::python

PYBIND11_MODULE(_native, m) {
  using namespace kvferry::python;
  using kvferry::python::PyDecodeWorker;
  using kvferry::python::PyPrefillWorker;
  m.doc() = "kvferry's runtime: P and D ranks and P's bootstrap service (see kvferry.vllm)";
  ErrorType() = py::reinterpret_steal<py::object>(
      PyErr_NewExceptionWithDoc("kvferry._native.KvferryError",
                                "A kvferry Status that is not OK; `code` names its ErrorCode.",
                                PyExc_RuntimeError, nullptr));
  m.attr("KvferryError") = ErrorType();
  m.def("ucx_version", &kvferry::transport::UcxLibraryVersion,
        "The version of the UCX library this process loaded (transport/ucx.h), e.g. '1.22.0'.");
  m.def("parse_connector_config", &ParseConnectorConfig, py::arg("extra_json"), py::arg("env"),
        py::arg("unused_here"),
        "kvferry's keys of kv_connector_extra_config (a JSON object's text) as a dict, parsed by "
        "the C++ parser kvferry serve uses (runtime/connector_config.h); `env`: the environment "
        "fallbacks by name; `unused_here`: known keys the caller ignores (listed in "
        "ignored_keys). Raises KvferryError (INVALID_ARGUMENT) naming a bad key.");

  py::class_<PyPrefillWorker>(m, "PrefillWorker")
      .def(py::init([](std::string engine_id, std::uint32_t tp_size, std::uint32_t tp_rank,
                       std::uint32_t dp_rank, std::uint32_t kv_heads, std::uint64_t block_len,
                       std::uint32_t num_blocks,
                       std::vector<std::pair<std::uintptr_t, std::size_t>> planes,
                       double lease_s, double abort_request_timeout_s,
                       std::string bootstrap_address, std::string side_channel_host,
                       std::string incarnation, std::string data_plane,
                       std::optional<std::string> cluster_secret_file, bool head_slices,
                       const std::string& memory) {
             PyPrefillWorker::Config c;
             SetRank(c, std::move(engine_id), tp_size, tp_rank, block_len, num_blocks,
                     std::move(planes), lease_s, abort_request_timeout_s, std::move(data_plane),
                     std::move(cluster_secret_file), head_slices, memory);
             c.dp_rank = dp_rank;
             c.kv_heads = kv_heads;
             c.bootstrap_address = std::move(bootstrap_address);
             c.side_channel_host = std::move(side_channel_host);
             c.incarnation = std::move(incarnation);
             return std::make_unique<PyPrefillWorker>(c);
           }),
           py::kw_only(), py::arg("engine_id"), py::arg("tp_size") = 1, py::arg("tp_rank") = 0,
           py::arg("dp_rank") = 0, py::arg("kv_heads") = 0, py::arg("block_len"),
           py::arg("num_blocks"), py::arg("planes"), py::arg("lease_s") = 0.0,
           py::arg("abort_request_timeout_s") = 480.0, py::arg("bootstrap_address") = "",
           py::arg("side_channel_host") = "127.0.0.1", py::arg("incarnation"),
           py::arg("data_plane") = "ucx", py::arg("cluster_secret_file") = py::none(),
           py::arg("head_slices") = true, py::arg("memory") = "host")
      .def("admit", &PyPrefillWorker::Admit, py::arg("transfer_id"), py::arg("handle"))
      .def("prefill_done", &PyPrefillWorker::PrefillDone, py::arg("transfer_id"),
           py::arg("block_ids"), py::arg("handle") = py::none())
      .def("layers_ready", &PyPrefillWorker::LayersReady, py::arg("transfer_id"),
           py::arg("block_ids"), py::arg("planes"), py::arg("handle"))
      .def("engine_finished", &PyPrefillWorker::EngineFinished, py::arg("transfer_id"))
      .def("refuse", &PyPrefillWorker::Refuse, py::arg("transfer_id"), py::arg("why"))
      .def("take_events", &PyPrefillWorker::TakeEvents)
      .def("stats", &PyPrefillWorker::Stats)
      .def_property_readonly("side_channel", &PyPrefillWorker::side_channel)
      .def("stop", &PyPrefillWorker::Stop);

  py::class_<PyDecodeWorker>(m, "DecodeWorker")
      .def(py::init([](std::string engine_id, std::uint32_t tp_size, std::uint32_t tp_rank,
                       std::uint64_t block_len, std::uint32_t num_blocks,
                       std::vector<std::pair<std::uintptr_t, std::size_t>> planes,
                       double lease_s, double abort_request_timeout_s, std::string data_plane,
                       std::optional<std::string> cluster_secret_file, bool send_releases,
                       bool head_slices, bool fence_writes, const std::string& memory) {
             PyDecodeWorker::Config c;
             SetRank(c, std::move(engine_id), tp_size, tp_rank, block_len, num_blocks,
                     std::move(planes), lease_s, abort_request_timeout_s, std::move(data_plane),
                     std::move(cluster_secret_file), head_slices, memory);
             c.send_releases = send_releases;
             c.fence_writes = fence_writes;
             return std::make_unique<PyDecodeWorker>(c);
           }),
           py::kw_only(), py::arg("engine_id"), py::arg("tp_size") = 1, py::arg("tp_rank") = 0,
           py::arg("block_len"), py::arg("num_blocks"), py::arg("planes"),
           py::arg("lease_s") = 0.0, py::arg("abort_request_timeout_s") = 480.0,
           py::arg("data_plane") = "ucx", py::arg("cluster_secret_file") = py::none(),
           py::arg("send_releases") = true, py::arg("head_slices") = true,
           py::arg("fence_writes") = false, py::arg("memory") = "host")
      .def("on_new_request", &PyDecodeWorker::OnNewRequest, py::arg("request_id"),
           py::arg("source"))
      .def("start_load", &PyDecodeWorker::StartLoad, py::arg("request_id"), py::arg("source"),
           py::arg("block_ids"))
      .def("request_finished", &PyDecodeWorker::RequestFinished, py::arg("request_id"))
      .def("release_transfer", &PyDecodeWorker::ReleaseTransfer, py::arg("source"))
      .def("take_finished", &PyDecodeWorker::TakeFinished)
      .def("wait_finished", &PyDecodeWorker::WaitFinished, py::arg("timeout_s"))
      .def("stats", &PyDecodeWorker::Stats)
      .def("stop", &PyDecodeWorker::Stop);

  py::class_<PyLoadFailureService>(m, "LoadFailureService")
      .def(py::init<const std::string&, int>(), py::kw_only(), py::arg("host") = "127.0.0.1",
           py::arg("port") = 0)
      .def_property_readonly("port", &PyLoadFailureService::port)
      .def("record", &PyLoadFailureService::Record, py::arg("transfer_id"), py::arg("reason"))
      .def("find", &PyLoadFailureService::Find, py::arg("transfer_id"))
      .def("stop", &PyLoadFailureService::Stop);

  py::class_<PyBootstrapServer>(m, "BootstrapServer")
      .def(py::init<const std::string&, int, const std::optional<std::string>&,
                    const std::optional<std::string>&, const std::optional<std::string>&>(),
           py::kw_only(), py::arg("host") = "127.0.0.1", py::arg("port") = 0,
           py::arg("cluster_secret_file") = py::none(), py::arg("engine_id") = py::none(),
           py::arg("incarnation") = py::none())
      .def_property_readonly("port", &PyBootstrapServer::port)
      .def("stop", &PyBootstrapServer::Stop);
}
