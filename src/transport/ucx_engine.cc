// UCX (ucp) backend. See include/kvferry/transport/ucx.h for the contract and
// docs/transport.md for the design notes and measurements.
//
// Threading model: one progress thread owns the ucp worker and makes every UCX call (UCX's
// single-threaded worker mode is its fastest, and no UCX lock is ever contended). API calls
// validate what they can under `mu_` on the caller's thread (so range errors come back at once,
// before anything is posted) and hand the rest to the progress thread as commands. The progress
// thread spins while it has UCX work in flight and otherwise sleeps on the worker's event fd
// plus an eventfd that commands poke.
//
// The protocol between engines (active messages, their headers): ucx_am_protocol.h.
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "descriptor.h"
#include "inbound_tally.h"
#include "kvferry/core/thread_name.h"
#include "kvferry/transport/ucx.h"
#include "sender_table.h"
#include "stall_watch.h"
#include "ucx_am_protocol.h"
#include "ucx_settings.h"
#include "write_fence.h"

namespace kvferry::transport {
namespace {

using namespace ucx_am;

ErrorCode CodeOf(ucs_status_t s) {
  switch (s) {
    case UCS_OK:
      return ErrorCode::kOk;
    case UCS_ERR_CANCELED:
      return ErrorCode::kCancelled;
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_IO_ERROR:
    case UCS_ERR_TIMED_OUT:
      return ErrorCode::kUnavailable;
    default:
      return ErrorCode::kInternal;
  }
}

// UCX's name for a memory type (ucs_memory_type_names, without linking libucs for it).
const char* MemoryTypeName(ucs_memory_type_t t) {
  switch (t) {
    case UCS_MEMORY_TYPE_HOST:
      return "host";
    case UCS_MEMORY_TYPE_CUDA:
      return "cuda";
    case UCS_MEMORY_TYPE_CUDA_MANAGED:
      return "cuda-managed";
    case UCS_MEMORY_TYPE_ROCM:
      return "rocm";
    case UCS_MEMORY_TYPE_ROCM_MANAGED:
      return "rocm-managed";
    default:
      return "unknown";
  }
}

Status FromUcs(ucs_status_t s, const std::string& what) {
  if (s == UCS_OK) return Status::Ok();
  return Status(CodeOf(s), what + ": " + ucs_status_string(s));
}

}  // namespace

class UcxEngine final : public Engine {
 public:
  explicit UcxEngine(const UcxOptions& options)
      : options_(options), uid_(internal::RandomUid()), fence_(options.fence_writes) {
    if (std::getenv("KVFERRY_UCX_BUSY_POLL") != nullptr) options_.busy_poll = true;
  }

  ~UcxEngine() override { Shutdown(); }

  Status Init();

  // A phase of the progress loop this long is logged (WarnIfBlocked): far above any healthy
  // phase (a forced close, the longest, takes milliseconds), far below the 30 s write bound.
  static constexpr Duration kBlockedWarning = std::chrono::seconds(1);
  // A phase still running this long is described while it blocks (StallWatch).
  static constexpr Duration kStallReport = std::chrono::seconds(5);
  // A batch whose sends all completed and whose ACK has not come this long is asked after
  // (QUERY, ucx_am_protocol.h), and again at this interval: far above a healthy ACK's delay (a
  // round trip after the last op lands: milliseconds even on a loaded 2-core machine), far
  // below the 30 s write bound, so a lost ACK costs seconds.
  static constexpr Duration kAckQueryAfter = std::chrono::seconds(2);
  // How many verdicts a receiver remembers for QUERYs: about a minute of batches at the tier's
  // rates and more than any sender keeps in flight; 4,096 x ~60 bytes.
  static constexpr std::size_t kAckMemory = 4096;
  // A receiver logs at most one QUERY per this interval (the rest are counted): the query's
  // fields are the peer's words.
  static constexpr Duration kQueryLogInterval = std::chrono::seconds(1);

  std::string_view backend() const override { return "ucx"; }
  Result<Region> RegisterMemory(void* base, std::size_t length, MemoryKind kind) override;
  Result<Region> AllocateRegion(std::size_t length) override;
  Status DeregisterMemory(RegionId id, TimePoint deadline) override;
  Result<std::vector<std::byte>> ExportDescriptor(std::span<const RegionId> ids) override;
  Result<ConnectionId> Connect(std::span<const std::byte> descriptor, TimePoint deadline) override;
  Result<BatchId> SubmitWrites(ConnectionId peer, std::span<const WriteOp> ops, WriteKey key,
                               CompletionFn done) override;
  Status ClosePeer(ConnectionId peer, TimePoint deadline) override;
  Result<PeerInfo> DescribePeer(ConnectionId peer) override;
  bool fences_writes() const override { return options_.fence_writes; }
  Status RevokeWriteKeys(std::span<const WriteKey> keys, TimePoint deadline) override;

 private:
  struct LocalRegion {
    Region region;
    ucp_mem_h memh = nullptr;
    bool ucx_allocated = false;
    std::vector<std::byte> rkey;
    int out_in_flight = 0;  // accepted batches that read from it
    int in_in_flight = 0;   // inbound am writes being received into it (progress thread)
  };

  enum class PeerState { kConnecting, kOpen, kClosing, kDead, kClosed };

  struct Peer {
    UcxEngine* engine = nullptr;
    ConnectionId id = 0;
    internal::Descriptor desc;
    // Guarded by mu_:
    PeerState state = PeerState::kConnecting;
    Status error;  // why it is dead
    std::optional<Status> connect_result;
    bool abandoned = false;              // Connect gave up waiting
    std::optional<Status> close_result;  // set when ClosePeer's work is finished
    int batches = 0;                     // accepted, not completed
    bool use_put = false;
    std::string transports;
    // Progress thread only:
    ucp_ep_h ep = nullptr;
    std::vector<ucp_rkey_h> rkeys;  // parallel to desc.regions
    bool rkeys_ok = false;
    TimePoint close_deadline = TimePoint::max();
    TimePoint bye_sent_at{};
    ucp_ep_h closing_ep = nullptr;
    bool close_started = false;
    bool close_timed_out = false;
  };

  struct Op {
    const std::byte* local;
    ucp_mem_h memh;
    std::uint64_t remote_addr;  // put: absolute address in the peer
    std::size_t remote_index;   // index of the remote region in the peer's descriptor
    std::size_t length;
    bool device = false;  // the local region is device memory: sent alone, never in an iov
  };

  struct Batch {
    BatchId id = 0;
    WriteKey key = kNoWriteKey;
    std::shared_ptr<Peer> peer;
    std::vector<WriteOp> ops;
    std::vector<Op> resolved;          // parallel to ops
    std::vector<WriteHeader> headers;  // am: must outlive the sends
    struct Packed {
      std::vector<std::byte> header;  // WriteVHeader + extents
      std::vector<ucp_dt_iov_t> iov;
    };
    std::vector<Packed> packed;  // am: must outlive the sends
    CompletionFn done;
    int outstanding = 1;  // guard held while posting
    bool awaiting_ack = false;
    TimePoint sends_done_at{};   // am: when only the ACK was left to wait for
    TimePoint last_query{};      // am: when its ACK was last asked for (QUERY)
    std::uint32_t queries = 0;   // QUERYs sent for it
    Status status;
    void Fail(Status s) {
      if (status.ok()) status = std::move(s);
    }
  };

  // Inbound side (progress thread only).
  struct RecvContext {
    UcxEngine* engine;
    std::uint64_t sender_uid;
    std::uint64_t batch_id;
    WriteKey key;
    RegionId region;
    std::uint32_t op_count;
    std::uint32_t ops = 1;          // ops this message carries
    std::vector<ucp_dt_iov_t> iov;  // WRITEV rendezvous: destinations, alive until completion
  };

  // --- command plumbing ---
  void Post(std::function<void()> fn);
  void Wake();
  bool OnProgressThread() const { return std::this_thread::get_id() == thread_id_; }
  static Status CallbackMisuse(const char* what) {
    return Status(ErrorCode::kInvalidArgument,
                  std::string(what) + " must not be called from a completion callback");
  }
  // Runs `fn` on the progress thread and waits for it (UCX calls that are quick and local).
  template <typename T>
  T RunSync(std::function<T()> fn);

  void Loop();
  void WarnIfBlocked(const char* phase, Duration took);
  static Duration CoarseNow();
  void Shutdown();

  // --- progress-thread work ---
  void StartConnect(const std::shared_ptr<Peer>& peer);
  void FinishConnect(const std::shared_ptr<Peer>& peer, Status status);
  void PostBatch(Batch* b);
  void OpDone(Batch* b, ucs_status_t status);
  void MaybeComplete(Batch* b);
  void PeerFailed(Peer* peer, ucs_status_t status);
  void DriveCloses();
  void ForceCloseEp(ucp_ep_h ep);
  // `flags`: UCP_AM_SEND_FLAG_* beside EAGER (a QUERY asks for a reply endpoint: REPLY).
  template <typename H>
  void SendSmall(ucp_ep_h ep, unsigned id, const H& header, std::uint32_t flags = 0);
  void InboundOpLanded(std::uint64_t sender_uid, std::uint64_t batch_id, std::uint32_t op_count,
                       ErrorCode code, std::uint32_t ops = 1);
  void RecvFinished(RecvContext* c, ucs_status_t status);
  // An inbound write into region `id` stamped with `key` stopped landing (copied or failed).
  void RegionReleased(RegionId id, WriteKey key);
  // Under mu_: may a write stamped with `key` land? (Always, unless this engine fences.)
  bool KeyAdmitted(WriteKey key) const { return fence_.Admitted(key); }
  // A sender forgotten (its last BYE, or its endpoint back failed): `ep` closes, and what of its
  // batches was still landing is dropped.
  void SenderGone(std::uint64_t uid, ucp_ep_h ep);
  void BackEndpointFailed(ucp_ep_h ep, ucs_status_t status);
  // Sends a QUERY for every batch whose ACK is kAckQueryAfter late (sender side).
  void QueryLateAcks(TimePoint now);
  std::string DescribeLanes(ucp_ep_h ep, bool* rma_ok);

  static ucs_status_t OnHello(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnHelloAck(void* arg, const void* header, size_t header_length, void* data,
                                 size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnWrite(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnWriteV(void* arg, const void* header, size_t header_length, void* data,
                               size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnAck(void* arg, const void* header, size_t header_length, void* data,
                            size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnBye(void* arg, const void* header, size_t header_length, void* data,
                            size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnQuery(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param);

  UcxOptions options_;
  const std::uint64_t uid_;

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  // The receiver's endpoints back to its senders (acks, HELLO_ACKs) live on a worker of their
  // own. UCX pairs endpoints that two workers create to each other (by sequence number), so an
  // endpoint back created on worker_ became the far end of one of the sender's connections, and
  // the sender closing that connection reset it while its other connections were open: every
  // later ack to that sender was lost (reproduced with tcp: two connections, the first closed,
  // the second's writes all landed and none was acknowledged once the reset arrived, 1-2 s
  // later; UcxTest.ClosingEitherOfTwoConnectionsLeavesTheOtherOneAcknowledged). Endpoints of
  // another worker never pair with the sender's, so only the sender's worker going away fails
  // them.
  ucp_worker_h ack_worker_ = nullptr;
  std::vector<std::byte> worker_address_;
  int worker_fd_ = -1;
  int ack_worker_fd_ = -1;
  int wake_fd_ = -1;
  std::thread thread_;
  std::thread::id thread_id_;
  std::atomic<bool> sleeping_{false};
  std::atomic<bool> stop_{false};

  mutable std::mutex mu_;
  std::condition_variable cv_;  // signalled on every state change callers wait for
  std::deque<std::function<void()>> commands_;
  std::map<RegionId, LocalRegion> regions_;
  std::map<ConnectionId, std::shared_ptr<Peer>> peers_;
  // Receiver-side fencing (write_fence.h): which keys may land, and which still land.
  internal::WriteFence fence_;
  RegionId next_region_ = 1;
  ConnectionId next_peer_ = 1;
  BatchId next_batch_ = 1;

  // Progress thread only.
  std::unordered_map<BatchId, Batch*> batches_;
  std::vector<std::shared_ptr<Peer>> closing_;
  std::vector<std::shared_ptr<Peer>> graveyard_;  // every peer ever connected (err-handler args)
  // Receiver side: the engines writing here, their connections and endpoints back.
  SenderTable<ucp_ep_h> senders_;
  internal::InboundTally inbound_;  // how much of each inbound batch landed (bounded)
  AckMemory acks_sent_{kAckMemory};  // verdicts sent lately, for QUERYs
  TimePoint next_query_log_{};
  std::uint64_t queries_unlogged_ = 0;
  TimePoint next_ack_check_{};  // sender side: when QueryLateAcks runs next
  std::vector<ucp_ep_h> eps_to_close_;
  std::vector<void*> close_requests_;
  int ucx_work_ = 0;             // UCX requests in flight that need progress (spin while > 0)
  std::uint64_t blocked_warnings_ = 0;  // phases of the loop that took kBlockedWarning or more
  std::uint64_t unacked_batches_ = 0;   // inbound batches that landed with no sender to ack
  std::uint64_t hellos_refused_ = 0;    // HELLOs over SenderTable's bounds
  // Says what the progress thread waits in while a phase blocks (stall_watch.h); outlives it.
  std::unique_ptr<StallWatch> stall_watch_;
  bool pack_small_ops_ = false;  // am path: WRITEV for runs of small ops (see Init)
  // The memory types this UCX can register (ucp_context_query; a bit per ucs_memory_type_t).
  std::uint64_t memory_types_ = UCS_BIT(UCS_MEMORY_TYPE_HOST);
};

// ---------------------------------------------------------------------------------------------
// Setup and teardown

Status UcxEngine::Init() {
  auto plan = internal::PlanUcxSettings(options_, [](const char* name) { return std::getenv(name); });
  if (!plan) return plan.error();
  {
    // Only where the user has not chosen (setenv without overwrite), once per variable, and
    // serialized: engines of one process may start on several threads.
    static std::mutex env_mu;
    std::lock_guard<std::mutex> lock(env_mu);
    for (const auto& [name, value] : plan->environment) setenv(name.c_str(), value.c_str(), 0);
  }
  pack_small_ops_ = plan->pack_small_ops;
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return FromUcs(s, "ucp_config_read");
  for (const auto& [name, value] : plan->defaults) {
    (void)ucp_config_modify(config, name.c_str(), value.c_str());
  }
  if (plan->receiver_drives_rendezvous &&
      ucp_config_modify(config, "RNDV_SCHEME", "get_zcopy") != UCS_OK) {
    ucp_config_release(config);
    return Status(ErrorCode::kUnavailable,
                  "fence_writes: this UCX cannot make the receiver drive every rendezvous "
                  "(RNDV_SCHEME=get_zcopy)");
  }
  for (const auto& [name, value] : plan->config) {
    s = ucp_config_modify(config, name.c_str(), value.c_str());
    if (s != UCS_OK) {
      ucp_config_release(config);
      return Status(ErrorCode::kInvalidArgument, "bad UCX config " + name + "=" + value);
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
  params.name = options_.name.c_str();
  s = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (s != UCS_OK) return FromUcs(s, "ucp_init");
  ucp_context_attr_t context_attr{};
  context_attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(context_, &context_attr) == UCS_OK) {
    memory_types_ = context_attr.memory_types;
  }

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the progress thread touches the worker
  s = ucp_worker_create(context_, &wp, &worker_);
  if (s != UCS_OK) return FromUcs(s, "ucp_worker_create");
  ucp_address_t* address = nullptr;
  size_t address_length = 0;
  s = ucp_worker_get_address(worker_, &address, &address_length);
  if (s != UCS_OK) return FromUcs(s, "ucp_worker_get_address");
  const auto* a = reinterpret_cast<const std::byte*>(address);
  worker_address_.assign(a, a + address_length);
  ucp_worker_release_address(worker_, address);
  s = ucp_worker_get_efd(worker_, &worker_fd_);
  if (s != UCS_OK) return FromUcs(s, "ucp_worker_get_efd");
  s = ucp_worker_create(context_, &wp, &ack_worker_);
  if (s != UCS_OK) return FromUcs(s, "ucp_worker_create (endpoints back)");
  s = ucp_worker_get_efd(ack_worker_, &ack_worker_fd_);
  if (s != UCS_OK) return FromUcs(s, "ucp_worker_get_efd (endpoints back)");
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) return Status(ErrorCode::kInternal, "eventfd failed");

  struct Handler {
    unsigned id;
    ucp_am_recv_callback_t cb;
  };
  for (Handler h :
       {Handler{kHello, &OnHello}, Handler{kHelloAck, &OnHelloAck}, Handler{kWrite, &OnWrite},
        Handler{kWriteV, &OnWriteV}, Handler{kAck, &OnAck}, Handler{kBye, &OnBye},
        Handler{kQuery, &OnQuery}}) {
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    hp.id = h.id;
    hp.cb = h.cb;
    hp.arg = this;
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    s = ucp_worker_set_am_recv_handler(worker_, &hp);
    if (s != UCS_OK) return FromUcs(s, "ucp_worker_set_am_recv_handler");
  }
  stall_watch_ = std::make_unique<StallWatch>(kStallReport, [this](const std::string& what) {
    spdlog::warn("kvferry UCX engine {}: the progress thread is blocked in {}", options_.name,
                 what);
  });
  thread_ = std::thread([this] {
    core::NameThisThread("kvf-ucx");
    stall_watch_->Attach();
    Loop();
  });
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return thread_id_ != std::thread::id(); });
  return Status::Ok();
}

void UcxEngine::Shutdown() {
  if (thread_.joinable()) {
    // Close every peer (draining up to shutdown_drain), then stop the loop.
    std::vector<ConnectionId> ids;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [id, p] : peers_) ids.push_back(id);
    }
    TimePoint deadline = Clock::now() + options_.shutdown_drain;
    for (ConnectionId id : ids) (void)ClosePeer(id, deadline);
    stop_.store(true);
    Wake();
    thread_.join();
  }
  stall_watch_.reset();
  for (auto& [id, r] : regions_) {
    if (r.memh != nullptr) ucp_mem_unmap(context_, r.memh);
  }
  regions_.clear();
  if (wake_fd_ >= 0) close(wake_fd_);
  if (ack_worker_ != nullptr) ucp_worker_destroy(ack_worker_);
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (context_ != nullptr) ucp_cleanup(context_);
}

void UcxEngine::Post(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    commands_.push_back(std::move(fn));
  }
  Wake();
}

void UcxEngine::Wake() {
  // Only a sleeping loop needs the syscall; the loop sets `sleeping_` before its last look at
  // the command queue, so a command pushed after that look always sees sleeping_ == true.
  if (sleeping_.load()) {
    std::uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
  }
}

template <typename T>
T UcxEngine::RunSync(std::function<T()> fn) {
  if (OnProgressThread()) return fn();
  auto done = std::make_shared<std::optional<T>>();
  Post([this, fn = std::move(fn), done] {
    T value = fn();
    std::lock_guard<std::mutex> lock(mu_);
    done->emplace(std::move(value));
    cv_.notify_all();
  });
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return done->has_value(); });
  return std::move(**done);
}

Duration UcxEngine::CoarseNow() {
  timespec ts{};
  (void)clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec);
}

void UcxEngine::WarnIfBlocked(const char* phase, Duration took) {
  // Everything this engine does (connects, writes, acks, closes) waits on this thread, so a long
  // phase stalls every peer at once; it is logged where it happened, on either side of a pair,
  // to tell a stalled progress thread from a message UCX lost.
  if (took < kBlockedWarning) return;
  ++blocked_warnings_;
  spdlog::warn("kvferry UCX engine {}: the progress thread was blocked {} ms in {}", options_.name,
               std::chrono::duration_cast<std::chrono::milliseconds>(took).count(), phase);
}

void UcxEngine::Loop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    thread_id_ = std::this_thread::get_id();
    cv_.notify_all();
  }
  std::deque<std::function<void()>> cmds;
  TimePoint stop_at = TimePoint::max();
  TimePoint last_busy = Clock::now();
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      cmds.swap(commands_);
    }
    // Phases timed with the coarse clock (a few ms of resolution, a few ns per read: this loop
    // spins while busy, and three precise reads per turn showed in profiles).
    const Duration t0 = CoarseNow();
    stall_watch_->Enter("commands", StallWatch::Clock::time_point(t0));
    for (auto& c : cmds) c();
    cmds.clear();
    const Duration t1 = CoarseNow();
    stall_watch_->Enter("ucp_worker_progress", StallWatch::Clock::time_point(t1));
    unsigned progressed = ucp_worker_progress(worker_);
    progressed += ucp_worker_progress(ack_worker_);
    const Duration t2 = CoarseNow();
    stall_watch_->Enter("closing endpoints", StallWatch::Clock::time_point(t2));
    DriveCloses();
    const Duration t3 = CoarseNow();
    stall_watch_->Leave();
    WarnIfBlocked("commands", t1 - t0);
    WarnIfBlocked("ucp_worker_progress", t2 - t1);
    WarnIfBlocked("closing endpoints", t3 - t2);
    TimePoint now = Clock::now();
    if (!batches_.empty() && now >= next_ack_check_) {
      QueryLateAcks(now);
      next_ack_check_ = now + std::chrono::milliseconds(100);
    }
    if (stop_.load()) {
      if (stop_at == TimePoint::max()) stop_at = now + std::chrono::seconds(2);
      if ((closing_.empty() && close_requests_.empty() && ucx_work_ == 0) || now > stop_at) break;
    }
    bool busy = progressed != 0 || ucx_work_ > 0 || !batches_.empty() || !closing_.empty() ||
                !close_requests_.empty() || !eps_to_close_.empty();
    if (busy) last_busy = now;
    // Keep spinning a little after the last activity: back-to-back messages then cost no
    // wakeup, and an idle engine still sleeps. The spin does not yield, although yielding cut
    // a 4 KiB handoff from 0.5-0.6 ms to 0.1-0.3 ms on 2 cores: with it, the cross-namespace
    // ctest (`hosts_p_d_across_namespaces`) left writes stuck in 2 of 22 runs, without it in 0
    // of 30 (docs/performance.md).
    if (busy || options_.busy_poll || now - last_busy < std::chrono::microseconds(200)) continue;
    // Idle: sleep until UCX or a command wakes us, or 100 ms pass (UCX's keepalive runs from
    // progress, so an idle engine still notices dead peers).
    sleeping_.store(true);
    bool have_cmds;
    {
      std::lock_guard<std::mutex> lock(mu_);
      have_cmds = !commands_.empty();
    }
    if (have_cmds || stop_.load() || ucp_worker_arm(worker_) == UCS_ERR_BUSY ||
        ucp_worker_arm(ack_worker_) == UCS_ERR_BUSY) {
      sleeping_.store(false);
      continue;
    }
    pollfd fds[3] = {{worker_fd_, POLLIN, 0}, {ack_worker_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    (void)poll(fds, 3, 100);
    sleeping_.store(false);
    std::uint64_t drained;
    (void)!read(wake_fd_, &drained, sizeof(drained));
  }
  // Final cleanup of endpoints still open (receiver-side back endpoints, failed ones).
  for (ucp_ep_h ep : senders_.Clear()) eps_to_close_.push_back(ep);
  DriveCloses();
  auto until = Clock::now() + std::chrono::seconds(2);
  while (!close_requests_.empty() && Clock::now() < until) {
    ucp_worker_progress(worker_);
    ucp_worker_progress(ack_worker_);
    DriveCloses();
  }
}

// ---------------------------------------------------------------------------------------------
// Regions

Result<Region> UcxEngine::RegisterMemory(void* base, std::size_t length, MemoryKind kind) {
  if (base == nullptr || length == 0) return Err(ErrorCode::kInvalidArgument, "empty region");
  if (kind == MemoryKind::kCuda) {
    if (options_.fence_writes) {
      return Err(ErrorCode::kInvalidArgument,
                 "CUDA memory with fence_writes: a fencing engine copies every write it "
                 "receives with the CPU; stage the KV through host memory, or turn fence_writes "
                 "off");
    }
    if ((memory_types_ & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) == 0) {
      return Err(ErrorCode::kInvalidArgument,
                 "CUDA memory: this UCX has no CUDA memory support here (built without CUDA, "
                 "or its CUDA modules did not load: no driver); stage the KV through host "
                 "memory, or use a UCX built with CUDA on a machine with a GPU");
    }
  }
  if (OnProgressThread()) return tl::unexpected(CallbackMisuse("RegisterMemory"));
  return RunSync<Result<Region>>([&]() -> Result<Region> {
    // The memory type is not declared: UCX detects it, and the caller's kind must match what
    // UCX sees (a UCX with CUDA took memory_type=CUDA for a host pointer when told so).
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = base;
    mp.length = length;
    ucp_mem_h memh = nullptr;
    ucs_status_t s = ucp_mem_map(context_, &mp, &memh);
    if (s != UCS_OK) return tl::unexpected(FromUcs(s, "ucp_mem_map"));
    ucp_mem_attr_t mem_attr{};
    mem_attr.field_mask = UCP_MEM_ATTR_FIELD_MEM_TYPE;
    s = ucp_mem_query(memh, &mem_attr);
    const ucs_memory_type_t seen = s == UCS_OK ? mem_attr.mem_type : UCS_MEMORY_TYPE_UNKNOWN;
    // Host memory may read "unknown" where UCX has no memory-type detection at all.
    const bool matches = kind == MemoryKind::kCuda
                             ? seen == UCS_MEMORY_TYPE_CUDA
                             : seen == UCS_MEMORY_TYPE_HOST || seen == UCS_MEMORY_TYPE_UNKNOWN;
    if (!matches) {
      ucp_mem_unmap(context_, memh);
      return Err(ErrorCode::kInvalidArgument,
                 fmt::format("region at {} declared {} memory, but UCX sees {} memory there",
                             base, kind == MemoryKind::kCuda ? "CUDA" : "host",
                             MemoryTypeName(seen)));
    }
    void* rkey = nullptr;
    size_t rkey_size = 0;
    s = ucp_rkey_pack(context_, memh, &rkey, &rkey_size);
    if (s != UCS_OK) {
      ucp_mem_unmap(context_, memh);
      return tl::unexpected(FromUcs(s, "ucp_rkey_pack"));
    }
    LocalRegion r;
    r.memh = memh;
    r.rkey.assign(static_cast<std::byte*>(rkey), static_cast<std::byte*>(rkey) + rkey_size);
    ucp_rkey_buffer_release(rkey);
    std::lock_guard<std::mutex> lock(mu_);
    r.region = Region{next_region_++, static_cast<std::byte*>(base), length, kind};
    Region out = r.region;
    regions_[out.id] = std::move(r);
    return out;
  });
}

Result<Region> UcxEngine::AllocateRegion(std::size_t length) {
  if (length == 0) return Err(ErrorCode::kInvalidArgument, "empty region");
  if (OnProgressThread()) return tl::unexpected(CallbackMisuse("AllocateRegion"));
  auto region = RunSync<Result<Region>>([&]() -> Result<Region> {
    // UCX allocates from its shared-memory allocators first (UCX_ALLOC_PRIO: sysv, posix, ...),
    // which is what lets posix/sysv transports put into the region with a single copy.
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                    UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.address = nullptr;
    mp.length = length;
    mp.flags = UCP_MEM_MAP_ALLOCATE;
    ucp_mem_h memh = nullptr;
    ucs_status_t s = ucp_mem_map(context_, &mp, &memh);
    if (s != UCS_OK) return tl::unexpected(FromUcs(s, "ucp_mem_map(allocate)"));
    ucp_mem_attr_t attr{};
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    s = ucp_mem_query(memh, &attr);
    void* rkey = nullptr;
    size_t rkey_size = 0;
    if (s == UCS_OK) s = ucp_rkey_pack(context_, memh, &rkey, &rkey_size);
    if (s != UCS_OK) {
      ucp_mem_unmap(context_, memh);
      return tl::unexpected(FromUcs(s, "ucp_rkey_pack"));
    }
    LocalRegion r;
    r.memh = memh;
    r.ucx_allocated = true;
    r.rkey.assign(static_cast<std::byte*>(rkey), static_cast<std::byte*>(rkey) + rkey_size);
    ucp_rkey_buffer_release(rkey);
    std::lock_guard<std::mutex> lock(mu_);
    r.region =
        Region{next_region_++, static_cast<std::byte*>(attr.address), length, MemoryKind::kHost};
    Region out = r.region;
    regions_[out.id] = std::move(r);
    return out;
  });
  if (region) {
    // Pre-fault and zero every page now (MAP_POPULATE's effect: first-touch faults during a
    // transfer cost ~10x in copy bandwidth). Done on the caller's thread, outside UCX.
    std::memset(region->base, 0, region->length);
  }
  return region;
}

Status UcxEngine::DeregisterMemory(RegionId id, TimePoint deadline) {
  if (OnProgressThread()) return CallbackMisuse("DeregisterMemory");
  ucp_mem_h memh = nullptr;
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = regions_.find(id);
    if (it == regions_.end()) return Status(ErrorCode::kNotFound, "unknown region");
    bool idle = cv_.wait_until(lock, deadline, [&] {
      auto i = regions_.find(id);
      return i == regions_.end() || (i->second.out_in_flight == 0 && i->second.in_in_flight == 0);
    });
    it = regions_.find(id);
    if (it == regions_.end()) return Status(ErrorCode::kNotFound, "region deregistered meanwhile");
    if (!idle) return Status(ErrorCode::kTimeout, "region still used by in-flight writes");
    memh = it->second.memh;
    regions_.erase(it);  // from here on, inbound writes to it are refused
  }
  return RunSync<Status>([&] {
    ucp_mem_unmap(context_, memh);
    return Status::Ok();
  });
}

Result<std::vector<std::byte>> UcxEngine::ExportDescriptor(std::span<const RegionId> ids) {
  internal::Descriptor d;
  d.backend = "ucx";
  d.engine_uid = uid_;
  d.address = worker_address_;
  std::lock_guard<std::mutex> lock(mu_);
  Status listed = internal::AddRegions(d, regions_, ids, [&](const LocalRegion& r) {
    // A fencing receiver hands out no remote keys: every write into it must come through its
    // own active-message handlers, where it can be refused.
    return internal::DescriptorRegion{
        RemoteRegion{r.region.id, reinterpret_cast<std::uint64_t>(r.region.base), r.region.length,
                     r.region.kind},
        options_.fence_writes ? std::vector<std::byte>{} : r.rkey};
  });
  if (!listed.ok()) return tl::unexpected(listed);
  return internal::EncodeDescriptor(d);
}

// ---------------------------------------------------------------------------------------------
// Connect

Result<ConnectionId> UcxEngine::Connect(std::span<const std::byte> descriptor, TimePoint deadline) {
  if (OnProgressThread()) return tl::unexpected(CallbackMisuse("Connect"));
  auto d = internal::DecodeDescriptor(descriptor);
  if (!d) return tl::unexpected(d.error());
  if (d->backend != "ucx") return Err(ErrorCode::kProtocol, "descriptor of another backend");
  auto peer = std::make_shared<Peer>();
  peer->engine = this;
  peer->desc = std::move(*d);
  {
    std::lock_guard<std::mutex> lock(mu_);
    peer->id = next_peer_++;
    peers_[peer->id] = peer;
  }
  Post([this, peer] { StartConnect(peer); });
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_until(lock, deadline, [&] { return peer->connect_result.has_value(); });
  if (!peer->connect_result) {
    peer->abandoned = true;
    peer->connect_result = Status(ErrorCode::kTimeout, "peer did not answer before the deadline");
  }
  Status result = *peer->connect_result;
  if (!result.ok()) {
    peers_.erase(peer->id);
    // The endpoint (if any) is torn down by the progress thread.
    lock.unlock();
    Post([this, peer] {
      if (peer->ep != nullptr) {
        for (ucp_rkey_h k : peer->rkeys) {
          if (k != nullptr) ucp_rkey_destroy(k);
        }
        peer->rkeys.clear();
        eps_to_close_.push_back(peer->ep);
        peer->ep = nullptr;
      }
    });
    return tl::unexpected(result);
  }
  return peer->id;
}

void UcxEngine::StartConnect(const std::shared_ptr<Peer>& peer) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (peer->abandoned) return;
  }
  graveyard_.push_back(peer);  // keeps the err-handler argument alive until shutdown
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.address = reinterpret_cast<const ucp_address_t*>(peer->desc.address.data());
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = [](void* arg, ucp_ep_h, ucs_status_t status) {
    auto* p = static_cast<Peer*>(arg);
    p->engine->PeerFailed(p, status);
  };
  ep.err_handler.arg = peer.get();
  ucs_status_t s = ucp_ep_create(worker_, &ep, &peer->ep);
  if (s != UCS_OK) {
    peer->ep = nullptr;
    FinishConnect(peer, Status(ErrorCode::kUnavailable,
                               std::string("cannot reach peer: ") + ucs_status_string(s)));
    return;
  }
  peer->rkeys_ok = true;
  for (const auto& r : peer->desc.regions) {
    ucp_rkey_h k = nullptr;
    if (r.rkey.empty() || ucp_ep_rkey_unpack(peer->ep, r.rkey.data(), &k) != UCS_OK) {
      peer->rkeys_ok = false;
      k = nullptr;
    }
    peer->rkeys.push_back(k);
  }
  struct Ctx {
    UcxEngine* engine;
    std::shared_ptr<Peer> peer;
    HelloHeader header;
  };
  auto* ctx = new Ctx{this, peer, HelloHeader{uid_, peer->id}};
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  rp.user_data = ctx;
  rp.cb.send = [](void* request, ucs_status_t status, void* user_data) {
    auto* c = static_cast<Ctx*>(user_data);
    --c->engine->ucx_work_;
    if (status != UCS_OK) c->engine->FinishConnect(c->peer, FromUcs(status, "hello"));
    ucp_request_free(request);
    delete c;
  };
  ucs_status_ptr_t sp = ucp_am_send_nbx(peer->ep, kHello, &ctx->header, sizeof(ctx->header),
                                        worker_address_.data(), worker_address_.size(), &rp);
  if (sp == nullptr) {
    delete ctx;
  } else if (UCS_PTR_IS_ERR(sp)) {
    FinishConnect(peer, FromUcs(UCS_PTR_STATUS(sp), "hello"));
    delete ctx;
  } else {
    ++ucx_work_;
  }
}

void UcxEngine::FinishConnect(const std::shared_ptr<Peer>& peer, Status status) {
  std::lock_guard<std::mutex> lock(mu_);
  if (peer->connect_result) return;
  if (status.ok()) peer->state = PeerState::kOpen;
  peer->connect_result = std::move(status);
  cv_.notify_all();
}

std::string UcxEngine::DescribeLanes(ucp_ep_h ep, bool* rma_ok) {
  char* text = nullptr;
  size_t size = 0;
  FILE* f = open_memstream(&text, &size);
  if (f == nullptr) return "";
  ucp_ep_print_info(ep, f);
  fclose(f);
  std::string info(text, size);
  free(text);
  if (std::getenv("KVFERRY_UCX_DEBUG") != nullptr) std::fprintf(stderr, "%s\n", info.c_str());
  internal::Lanes lanes = internal::ReadLanes(info);
  *rma_ok = lanes.rma_ok;
  return std::move(lanes.transports);
}

ucs_status_t UcxEngine::OnHello(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxEngine*>(arg);
  HelloHeader h;
  if (!ReadHeader(header, header_length, &h) || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ||
      length == 0) {
    return UCS_OK;  // malformed: ignore (the sender's Connect times out)
  }
  const SenderTable<ucp_ep_h>::HelloResult hello = self->senders_.Hello(h.sender_uid, h.nonce);
  if (hello == SenderTable<ucp_ep_h>::HelloResult::kRefused) {
    // Over a bound (a sender's connections, or the senders): unanswered, so the sender's Connect
    // times out; said here (at 1, 2, 4, ... refusals: the uids are the peer's words), so the
    // receiver's operator sees why.
    if (std::has_single_bit(++self->hellos_refused_)) {
      spdlog::warn("kvferry UCX engine {}: HELLO of sender {:x} refused ({} so far): over {} "
                   "connections for it or {} senders (sender_table.h)",
                   self->options_.name, h.sender_uid, self->hellos_refused_,
                   SenderTable<ucp_ep_h>::kMaxConnections, SenderTable<ucp_ep_h>::kMaxSenders);
    }
    return UCS_OK;
  }
  if (hello == SenderTable<ucp_ep_h>::HelloResult::kOpenEndpoint) {
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = static_cast<const ucp_address_t*>(data);
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    // The engine, not the Sender, is the handler's argument: a Sender forgotten meanwhile (a
    // Bye, an earlier failure) is destroyed while UCX may still report its endpoint failing
    // (found by the real-vLLM tier: SIGFPE in SenderFailed through a dangling Sender).
    ep.err_handler.cb = [](void* a, ucp_ep_h failed, ucs_status_t status) {
      static_cast<UcxEngine*>(a)->BackEndpointFailed(failed, status);
    };
    ep.err_handler.arg = self;
    ucp_ep_h back = nullptr;
    if (ucp_ep_create(self->ack_worker_, &ep, &back) != UCS_OK) {
      (void)self->senders_.Forget(h.sender_uid);  // it had no endpoint: nothing to close
      return UCS_OK;
    }
    self->senders_.SetEndpoint(h.sender_uid, back);
  }
  self->SendSmall(self->senders_.Endpoint(h.sender_uid), kHelloAck,
                  HelloAckHeader{h.nonce, self->uid_});
  return UCS_OK;
}

ucs_status_t UcxEngine::OnHelloAck(void* arg, const void* header, size_t header_length, void*,
                                   size_t, const ucp_am_recv_param_t*) {
  auto* self = static_cast<UcxEngine*>(arg);
  HelloAckHeader h;
  if (!ReadHeader(header, header_length, &h)) return UCS_OK;
  std::shared_ptr<Peer> peer;
  {
    std::lock_guard<std::mutex> lock(self->mu_);
    auto it = self->peers_.find(h.nonce);
    if (it == self->peers_.end()) return UCS_OK;
    peer = it->second;
  }
  if (peer->ep == nullptr) return UCS_OK;
  if (h.receiver_uid != peer->desc.engine_uid) {
    self->FinishConnect(peer, Status(ErrorCode::kUnavailable,
                                     "the engine at that address is not the descriptor's"));
    return UCS_OK;
  }
  bool rma_ok = false;
  std::string tls = self->DescribeLanes(peer->ep, &rma_ok);
  // UCX 1.22 prints no put lines for shared memory (it picks put protocols per remote key, later),
  // so by the lanes alone a shared-memory peer would stay on active messages there. A remote key
  // UCX maps directly (ucp_rkey_ptr: posix, sysv, xpmem) is the same proof on every version: a put
  // into it is a one-sided copy. Measured with the libucx-cu13 wheel: without this, the
  // posix,sysv,self endpoints of the transport tests took the am path; forced to put, all 7 of
  // their tests passed.
  // Every region must map: UCX maps the shared-memory segments it allocated (AllocateRegion),
  // not caller memory (RegisterMemory), and one connection carries the puts to all of them.
  if (!rma_ok && peer->rkeys_ok && !peer->rkeys.empty() && tls.find("tcp") == std::string::npos) {
    rma_ok = true;
    for (std::size_t i = 0; rma_ok && i < peer->rkeys.size(); ++i) {
      void* mapped = nullptr;
      rma_ok = ucp_rkey_ptr(peer->rkeys[i], peer->desc.regions[i].info.base, &mapped) == UCS_OK;
    }
  }
  bool use_put = false;
  switch (self->options_.mode) {
    case UcxMode::kPut:
      if (!peer->rkeys_ok) {
        self->FinishConnect(peer, Status(ErrorCode::kUnavailable,
                                         "put mode, but the peer's remote keys are unusable"));
        return UCS_OK;
      }
      use_put = true;
      break;
    case UcxMode::kAm:
      use_put = false;
      break;
    case UcxMode::kAuto:
      use_put = rma_ok && peer->rkeys_ok;
      break;
  }
  {
    std::lock_guard<std::mutex> lock(self->mu_);
    peer->use_put = use_put;
    peer->transports = tls;
  }
  self->FinishConnect(peer, Status::Ok());
  return UCS_OK;
}

template <typename H>
void UcxEngine::SendSmall(ucp_ep_h ep, unsigned id, const H& header, std::uint32_t flags) {
  struct Ctx {
    UcxEngine* engine;
    H header;
  };
  auto* ctx = new Ctx{this, header};
  ucp_request_param_t rp{};
  rp.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  rp.flags = UCP_AM_SEND_FLAG_EAGER | flags;
  rp.user_data = ctx;
  rp.cb.send = [](void* request, ucs_status_t, void* user_data) {
    auto* c = static_cast<Ctx*>(user_data);
    --c->engine->ucx_work_;
    ucp_request_free(request);
    delete c;
  };
  ucs_status_ptr_t sp = ucp_am_send_nbx(ep, id, &ctx->header, sizeof(H), nullptr, 0, &rp);
  if (sp == nullptr || UCS_PTR_IS_ERR(sp)) {
    delete ctx;
  } else {
    ++ucx_work_;
  }
}

// ---------------------------------------------------------------------------------------------
// Writes: sender side

Result<BatchId> UcxEngine::SubmitWrites(ConnectionId peer_id, std::span<const WriteOp> ops,
                                        WriteKey key, CompletionFn done) {
  if (ops.empty()) return Err(ErrorCode::kInvalidArgument, "empty batch");
  auto b = std::make_unique<Batch>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto pit = peers_.find(peer_id);
    if (pit == peers_.end()) return Err(ErrorCode::kNotFound, "unknown peer");
    Peer& p = *pit->second;
    if (p.state == PeerState::kDead) return tl::unexpected(p.error);
    if (p.state != PeerState::kOpen) return Err(ErrorCode::kCancelled, "peer is being closed");
    b->ops.reserve(ops.size());
    for (const WriteOp& op : ops) {
      if (op.length == 0) return Err(ErrorCode::kInvalidArgument, "zero-length write");
      auto lit = regions_.find(op.local_region);
      if (lit == regions_.end()) return Err(ErrorCode::kNotFound, "unknown local region");
      const Region& lr = lit->second.region;
      if (!internal::RangeFits(op.local_offset, op.length, lr.length)) {
        return Err(ErrorCode::kOutOfRange, "write outside the local region");
      }
      std::size_t idx = 0;
      while (idx < p.desc.regions.size() && p.desc.regions[idx].info.id != op.remote_region) ++idx;
      if (idx == p.desc.regions.size()) {
        return Err(ErrorCode::kOutOfRange, "remote region not in the peer's descriptor");
      }
      const RemoteRegion& rr = p.desc.regions[idx].info;
      if (!internal::RangeFits(op.remote_offset, op.length, rr.length)) {
        return Err(ErrorCode::kOutOfRange, "write outside the remote region");
      }
      if (!p.use_put && rr.kind != MemoryKind::kHost) {
        // The receiver's handlers would copy the bytes into it with the CPU.
        return Err(ErrorCode::kInvalidArgument,
                   fmt::format("remote region {} is CUDA memory, and this connection has no "
                               "RMA lane to write it with ({}): the receiver's handlers copy "
                               "with the CPU",
                               rr.id, p.transports));
      }
      b->ops.push_back(op);
      b->resolved.push_back(Op{lr.base + op.local_offset, lit->second.memh,
                               rr.base + op.remote_offset, idx, op.length,
                               lr.kind != MemoryKind::kHost});
    }
    for (const WriteOp& op : ops) ++regions_[op.local_region].out_in_flight;
    ++p.batches;
    b->id = next_batch_++;
    b->peer = pit->second;
  }
  b->done = std::move(done);
  b->key = key;
  BatchId id = b->id;
  Post([this, raw = b.release()] { PostBatch(raw); });
  return id;
}

void UcxEngine::PostBatch(Batch* b) {
  Peer& p = *b->peer;
  batches_[b->id] = b;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (p.state == PeerState::kDead) b->Fail(p.error);
  }
  if (p.ep == nullptr) b->Fail(Status(ErrorCode::kUnavailable, "peer endpoint is closed"));
  if (!b->status.ok()) {
    --b->outstanding;
    MaybeComplete(b);
    return;
  }
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  rp.user_data = b;
  rp.cb.send = [](void* request, ucs_status_t status, void* user_data) {
    auto* batch = static_cast<Batch*>(user_data);
    ucp_request_free(request);
    batch->peer->engine->OpDone(batch, status);
  };
  auto track = [&](ucs_status_ptr_t sp, const char* what) {
    if (sp == nullptr) return;
    if (UCS_PTR_IS_ERR(sp)) {
      b->Fail(FromUcs(UCS_PTR_STATUS(sp), what));
      return;
    }
    ++b->outstanding;
  };
  if (p.use_put) {
    for (const Op& op : b->resolved) {
      ucp_request_param_t op_rp = rp;
      op_rp.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      op_rp.memh = op.memh;
      track(
          ucp_put_nbx(p.ep, op.local, op.length, op.remote_addr, p.rkeys[op.remote_index], &op_rp),
          "put");
    }
    // Puts complete locally; the flush completes when they are complete at the peer.
    if (b->status.ok()) track(ucp_ep_flush_nbx(p.ep, &rp), "flush");
  } else {
    b->headers.resize(b->ops.size());
    b->packed.reserve(b->ops.size());
    b->awaiting_ack = true;
    ++b->outstanding;
    const auto n_ops = static_cast<std::uint32_t>(b->ops.size());
    for (std::size_t i = 0; i < b->ops.size();) {
      // Gather consecutive small ops into the same remote region into one WRITEV.
      std::size_t j = i;
      std::size_t bytes = 0;
      while (pack_small_ops_ && j < b->ops.size() && j - i < kPackMaxOps &&
             b->ops[j].length <= kPackMaxOp && !b->resolved[j].device &&
             b->ops[j].remote_region == b->ops[i].remote_region &&
             bytes + b->ops[j].length <= kPackMaxBytes) {
        bytes += b->ops[j].length;
        ++j;
      }
      if (j - i >= 2) {
        Batch::Packed& pk = b->packed.emplace_back();
        pk.header.resize(sizeof(WriteVHeader) + (j - i) * sizeof(WriteExtent));
        WriteVHeader vh{uid_,  b->id, b->key, b->ops[i].remote_region,
                        n_ops, static_cast<std::uint32_t>(j - i), 0};
        std::memcpy(pk.header.data(), &vh, sizeof(vh));
        pk.iov.resize(j - i);
        for (std::size_t k = i; k < j; ++k) {
          WriteExtent e{b->ops[k].remote_offset, b->ops[k].length};
          std::memcpy(pk.header.data() + sizeof(vh) + (k - i) * sizeof(e), &e, sizeof(e));
          pk.iov[k - i] =
              ucp_dt_iov_t{const_cast<std::byte*>(b->resolved[k].local), b->resolved[k].length};
        }
        ucp_request_param_t op_rp = rp;
        op_rp.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
        op_rp.datatype = ucp_dt_make_iov();
        track(ucp_am_send_nbx(p.ep, kWriteV, pk.header.data(), pk.header.size(), pk.iov.data(),
                              pk.iov.size(), &op_rp),
              "am send");
        i = j;
        continue;
      }
      const WriteOp& op = b->ops[i];
      b->headers[i] = WriteHeader{uid_,
                                  b->id,
                                  b->key,
                                  op.remote_offset,
                                  op.length,
                                  op.remote_region,
                                  static_cast<std::uint32_t>(b->ops.size())};
      ucp_request_param_t op_rp = rp;
      op_rp.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      op_rp.memh = b->resolved[i].memh;
      track(ucp_am_send_nbx(p.ep, kWrite, &b->headers[i], sizeof(WriteHeader),
                            b->resolved[i].local, b->resolved[i].length, &op_rp),
            "am send");
      ++i;
    }
    // If a send failed outright the receiver will never ack the whole batch.
    if (!b->status.ok()) {
      b->awaiting_ack = false;
      --b->outstanding;
    }
  }
  --b->outstanding;  // the posting guard
  MaybeComplete(b);
}

void UcxEngine::OpDone(Batch* b, ucs_status_t status) {
  if (status != UCS_OK) b->Fail(FromUcs(status, b->peer->use_put ? "put" : "am send"));
  --b->outstanding;
  MaybeComplete(b);
}

void UcxEngine::MaybeComplete(Batch* b) {
  if (b->outstanding == 1 && b->awaiting_ack && b->sends_done_at == TimePoint{}) {
    b->sends_done_at = Clock::now();  // only the ACK is left
  }
  if (b->outstanding > 0) return;
  batches_.erase(b->id);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const WriteOp& op : b->ops) {
      auto it = regions_.find(op.local_region);
      if (it != regions_.end()) --it->second.out_in_flight;
    }
    --b->peer->batches;
    cv_.notify_all();
  }
  if (b->done) b->done(b->id, std::move(b->status));
  delete b;
}

ucs_status_t UcxEngine::OnAck(void* arg, const void* header, size_t header_length, void*, size_t,
                              const ucp_am_recv_param_t*) {
  auto* self = static_cast<UcxEngine*>(arg);
  AckHeader h;
  if (!ReadHeader(header, header_length, &h)) return UCS_OK;
  auto it = self->batches_.find(h.batch_id);
  if (it == self->batches_.end() || !it->second->awaiting_ack) return UCS_OK;
  Batch* b = it->second;
  b->awaiting_ack = false;
  if (b->queries > 0) {
    spdlog::warn("kvferry UCX engine {}: the ACK of batch {} came on query {}, {} ms after its "
                 "last send completed: the receiver's first ACK was lost",
                 self->options_.name, b->id, b->queries,
                 std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() -
                                                                       b->sends_done_at)
                     .count());
  }
  auto code = static_cast<ErrorCode>(h.code);
  if (code != ErrorCode::kOk) {
    const char* why = "peer failed to receive the batch";
    if (code == ErrorCode::kOutOfRange) why = "peer refused a range it has not registered";
    if (code == ErrorCode::kRejected) {
      why = "peer fences its writers and refused this batch's write key (none, or revoked)";
    }
    b->Fail(Status(code, why));
  }
  --b->outstanding;
  self->MaybeComplete(b);
  return UCS_OK;
}

// ---------------------------------------------------------------------------------------------
// Writes: receiver side (am path)

ucs_status_t UcxEngine::OnWrite(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxEngine*>(arg);
  WriteHeader h;
  if (!ReadHeader(header, header_length, &h) || h.op_count == 0) return UCS_OK;
  std::byte* dst = nullptr;
  ucp_mem_h memh = nullptr;
  ErrorCode refused = ErrorCode::kOutOfRange;
  {
    // The receiver's own checks: the write's key must not be fenced, and the write must fit
    // what is registered now, whatever the sender's descriptor said.
    std::lock_guard<std::mutex> lock(self->mu_);
    auto it = self->regions_.find(h.remote_region);
    if (!self->KeyAdmitted(h.write_key)) {
      refused = ErrorCode::kRejected;
    } else if (it != self->regions_.end() && it->second.region.kind != MemoryKind::kHost) {
      // This handler copies with the CPU: device memory takes puts only, whatever a sender's
      // descriptor said (SubmitWrites refuses such a write on its side too).
      refused = ErrorCode::kInvalidArgument;
    } else if (it != self->regions_.end() && h.length == length &&
               internal::RangeFits(h.remote_offset, h.length, it->second.region.length)) {
      dst = it->second.region.base + h.remote_offset;
      memh = it->second.memh;
      ++it->second.in_in_flight;
      self->fence_.Admit(h.write_key);
    }
  }
  if (dst == nullptr) {
    self->InboundOpLanded(h.sender_uid, h.batch_id, h.op_count, refused);
    return UCS_OK;  // for a rendezvous message this drops the data without fetching it
  }
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) == 0) {
    std::memcpy(dst, data, length);
    self->RegionReleased(h.remote_region, h.write_key);
    self->InboundOpLanded(h.sender_uid, h.batch_id, h.op_count, ErrorCode::kOk);
    return UCS_OK;
  }
  auto* ctx = new RecvContext{
      self, h.sender_uid, h.batch_id, h.write_key, h.remote_region, h.op_count, 1, {}};
  ucp_request_param_t rp{};
  rp.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
  rp.memh = memh;
  rp.user_data = ctx;
  rp.cb.recv_am = [](void* request, ucs_status_t status, size_t, void* user_data) {
    auto* c = static_cast<RecvContext*>(user_data);
    --c->engine->ucx_work_;
    c->engine->RecvFinished(c, status);
    ucp_request_free(request);
  };
  ucs_status_ptr_t sp = ucp_am_recv_data_nbx(self->worker_, data, dst, length, &rp);
  if (sp == nullptr) {
    self->RecvFinished(ctx, UCS_OK);
  } else if (UCS_PTR_IS_ERR(sp)) {
    self->RecvFinished(ctx, UCS_PTR_STATUS(sp));
  } else {
    ++self->ucx_work_;
  }
  return UCS_OK;
}

ucs_status_t UcxEngine::OnWriteV(void* arg, const void* header, size_t header_length, void* data,
                                 size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxEngine*>(arg);
  WriteVHeader h;
  if (header_length < sizeof(h)) return UCS_OK;
  std::memcpy(&h, header, sizeof(h));
  if (h.extents == 0 || h.op_count < h.extents ||
      header_length != sizeof(h) + std::size_t{h.extents} * sizeof(WriteExtent)) {
    return UCS_OK;
  }
  std::vector<WriteExtent> ext(h.extents);
  std::memcpy(ext.data(), static_cast<const std::byte*>(header) + sizeof(h),
              ext.size() * sizeof(WriteExtent));
  std::byte* base = nullptr;
  ErrorCode refused = ErrorCode::kOutOfRange;
  {
    // The receiver's own checks: the key must not be fenced, and every extent must fit what is
    // registered now, and the extents must add up to the data that came with them.
    std::lock_guard<std::mutex> lock(self->mu_);
    auto it = self->regions_.find(h.remote_region);
    const bool admitted = self->KeyAdmitted(h.write_key);
    if (!admitted) refused = ErrorCode::kRejected;
    const bool host = it != self->regions_.end() && it->second.region.kind == MemoryKind::kHost;
    if (admitted && it != self->regions_.end() && !host) refused = ErrorCode::kInvalidArgument;
    bool ok = admitted && host;
    std::uint64_t total = 0;
    for (std::size_t i = 0; ok && i < ext.size(); ++i) {
      ok = ext[i].length > 0 && ext[i].length <= length - total &&
           internal::RangeFits(ext[i].remote_offset, ext[i].length, it->second.region.length);
      total += ok ? ext[i].length : 0;
    }
    if (ok && total == length) {
      base = it->second.region.base;
      ++it->second.in_in_flight;
      self->fence_.Admit(h.write_key);
    }
  }
  if (base == nullptr) {
    self->InboundOpLanded(h.sender_uid, h.batch_id, h.op_count, refused, h.extents);
    return UCS_OK;  // for a rendezvous message this drops the data without fetching it
  }
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) == 0) {
    const auto* src = static_cast<const std::byte*>(data);
    for (const WriteExtent& e : ext) {
      std::memcpy(base + e.remote_offset, src, e.length);
      src += e.length;
    }
    self->RegionReleased(h.remote_region, h.write_key);
    self->InboundOpLanded(h.sender_uid, h.batch_id, h.op_count, ErrorCode::kOk, h.extents);
    return UCS_OK;
  }
  auto* ctx = new RecvContext{self,       h.sender_uid, h.batch_id, h.write_key, h.remote_region,
                              h.op_count, h.extents,    {}};
  ctx->iov.resize(ext.size());
  for (std::size_t i = 0; i < ext.size(); ++i) {
    ctx->iov[i] = ucp_dt_iov_t{base + ext[i].remote_offset, ext[i].length};
  }
  ucp_request_param_t rp{};
  rp.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  rp.datatype = ucp_dt_make_iov();
  rp.user_data = ctx;
  rp.cb.recv_am = [](void* request, ucs_status_t status, size_t, void* user_data) {
    auto* c = static_cast<RecvContext*>(user_data);
    --c->engine->ucx_work_;
    c->engine->RecvFinished(c, status);
    ucp_request_free(request);
  };
  ucs_status_ptr_t sp =
      ucp_am_recv_data_nbx(self->worker_, data, ctx->iov.data(), ctx->iov.size(), &rp);
  if (sp == nullptr) {
    self->RecvFinished(ctx, UCS_OK);
  } else if (UCS_PTR_IS_ERR(sp)) {
    self->RecvFinished(ctx, UCS_PTR_STATUS(sp));
  } else {
    ++self->ucx_work_;
  }
  return UCS_OK;
}

void UcxEngine::RecvFinished(RecvContext* c, ucs_status_t status) {
  RegionReleased(c->region, c->key);
  InboundOpLanded(c->sender_uid, c->batch_id, c->op_count,
                  status == UCS_OK ? ErrorCode::kOk : ErrorCode::kUnavailable, c->ops);
  delete c;
}

void UcxEngine::RegionReleased(RegionId id, WriteKey key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find(id);
  if (it != regions_.end()) --it->second.in_in_flight;
  fence_.Landed(key);
  cv_.notify_all();
}

Status UcxEngine::RevokeWriteKeys(std::span<const WriteKey> keys, TimePoint deadline) {
  if (!options_.fence_writes) {
    return Status(ErrorCode::kRejected,
                  "this UCX engine does not fence writes (peers may put one-sided into it)");
  }
  if (OnProgressThread()) return CallbackMisuse("RevokeWriteKeys");
  std::unique_lock<std::mutex> lock(mu_);
  // From here on every handler refuses these keys (they check under mu_); what was admitted
  // before counts as landing until its copy or its rendezvous receive ends.
  fence_.Revoke(keys);
  const bool drained = cv_.wait_until(lock, deadline, [&] { return !fence_.AnyLanding(keys); });
  if (!drained) {
    return Status(ErrorCode::kTimeout,
                  "writes stamped with a revoked key were still landing at the deadline");
  }
  return Status::Ok();
}

void UcxEngine::InboundOpLanded(std::uint64_t sender_uid, std::uint64_t batch_id,
                                std::uint32_t op_count, ErrorCode code, std::uint32_t ops) {
  const std::uint64_t forgotten_before = inbound_.forgotten();
  const std::optional<ErrorCode> verdict =
      inbound_.Landed(sender_uid, batch_id, op_count, code, ops);
  if (const std::uint64_t forgotten = inbound_.forgotten(); forgotten != forgotten_before &&
                                                            std::has_single_bit(forgotten)) {
    // Logged at 1, 2, 4, ... forgotten: a sender opening batches without end must not flood the
    // log either.
    spdlog::warn("kvferry UCX engine {}: {} inbound batches left open (the longest-open "
                 "forgotten to stay within {}; their senders time them out); the latest opened "
                 "by sender {:x}",
                 options_.name, forgotten, internal::InboundTally::kDefaultMaxOpen, sender_uid);
  }
  if (!verdict) return;
  const ErrorCode result = *verdict;
  acks_sent_.Remember(sender_uid, batch_id, static_cast<std::uint32_t>(result));
  ucp_ep_h back = senders_.Endpoint(sender_uid);
  if (back == nullptr) {
    // Nobody to ack: the sender said goodbye or its endpoint back failed. Its side times the
    // batch out (and counts it unsettled) unless it is gone too; said, because the real-vLLM
    // tier met writes whose every op landed while the sender waited 30 s for the ack.
    ++unacked_batches_;
    spdlog::warn("kvferry UCX engine {}: batch {} of sender {:x} landed, but no endpoint back to "
                 "that sender is left (it said goodbye, or its endpoint back failed): not "
                 "acknowledged ({} such batches so far)",
                 options_.name, batch_id, sender_uid, unacked_batches_);
    return;
  }
  SendSmall(back, kAck, AckHeader{batch_id, static_cast<std::uint32_t>(result), 0});
}

void UcxEngine::BackEndpointFailed(ucp_ep_h ep, ucs_status_t status) {
  const std::optional<std::uint64_t> uid = senders_.EndpointFailed(ep);
  if (!uid) return;  // not a live sender's endpoint: one forgotten already, whose close is under way
  // A sender that died, or a live one whose connection back UCX gave up on: only the second
  // costs anything (its batches in flight stay unacknowledged), and both are rare.
  spdlog::warn("kvferry UCX engine {}: the endpoint back to sender {:x} failed ({}); its "
               "batches still landing are not acknowledged",
               options_.name, *uid, ucs_status_string(status));
  SenderGone(*uid, ep);
}

void UcxEngine::SenderGone(std::uint64_t uid, ucp_ep_h ep) {
  if (ep != nullptr) eps_to_close_.push_back(ep);
  inbound_.ForgetSender(uid);
}

ucs_status_t UcxEngine::OnBye(void* arg, const void* header, size_t header_length, void*, size_t,
                              const ucp_am_recv_param_t*) {
  auto* self = static_cast<UcxEngine*>(arg);
  ByeHeader h;
  if (!ReadHeader(header, header_length, &h)) return UCS_OK;
  // The sender's last connection closes its endpoint back; a connection this table does not
  // hold (counted before the sender's record was dropped) changes nothing (sender_table.h).
  if (std::optional<ucp_ep_h> back = self->senders_.Bye(h.sender_uid, h.nonce)) {
    self->SenderGone(h.sender_uid, *back);
  }
  return UCS_OK;
}

void UcxEngine::QueryLateAcks(TimePoint now) {
  for (auto& [id, b] : batches_) {
    if (!b->awaiting_ack || b->outstanding != 1 || b->sends_done_at == TimePoint{}) continue;
    const TimePoint since = b->queries == 0 ? b->sends_done_at : b->last_query;
    if (now - since < kAckQueryAfter || b->peer->ep == nullptr) continue;
    ++b->queries;
    b->last_query = now;
    // REPLY: the receiver can answer on an endpoint of the worker this query came in on, when
    // its endpoint back to us is gone or lost what it sent (OnQuery).
    SendSmall(b->peer->ep, kQuery, QueryHeader{uid_, b->id, b->queries, 0},
              UCP_AM_SEND_FLAG_REPLY);
  }
}

ucs_status_t UcxEngine::OnQuery(void* arg, const void* header, size_t header_length, void*,
                                size_t, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxEngine*>(arg);
  QueryHeader h;
  if (!ReadHeader(header, header_length, &h)) return UCS_OK;
  const ucp_ep_h back = self->senders_.Endpoint(h.sender_uid);
  const std::optional<std::uint32_t> verdict = self->acks_sent_.Find(h.sender_uid, h.batch_id);
  // A query means the first ACK did not arrive: the endpoint back may be gone (it failed, and
  // the sender's record went with it) or may have lost what it carried. So the verdict goes on
  // the endpoint back and, where the query brought one, on the reply endpoint too (a worker_
  // endpoint, which acks otherwise avoid: docs/transport.md); a second copy is ignored.
  const ucp_ep_h reply = (param != nullptr && (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP))
                             ? param->reply_ep
                             : nullptr;
  if (verdict && back != nullptr) self->SendSmall(back, kAck, AckHeader{h.batch_id, *verdict, 0});
  if (verdict && reply != nullptr) self->SendSmall(reply, kAck, AckHeader{h.batch_id, *verdict, 0});
  const TimePoint now = Clock::now();
  if (now < self->next_query_log_) {
    ++self->queries_unlogged_;
    return UCS_OK;
  }
  self->next_query_log_ = now + kQueryLogInterval;
  std::string known;
  if (verdict) {
    known = back != nullptr ? "acknowledged already: acknowledged again (the first ACK was lost)"
            : reply != nullptr
                ? "acknowledged already: acknowledged again on the query's reply endpoint (no "
                  "endpoint back to it is left)"
                : "acknowledged already, but no endpoint back to it is left";
  } else if (auto open = self->inbound_.Find(h.sender_uid, h.batch_id)) {
    known = fmt::format("still landing: {} of its {} ops landed", open->landed, open->op_count);
  } else {
    known = "no op of it has landed here (or it or its sender was forgotten)";
  }
  spdlog::warn("kvferry UCX engine {}: sender {:x} asks for batch {} (query {}): {}{}",
               self->options_.name, h.sender_uid, h.batch_id, h.attempt, known,
               self->queries_unlogged_ > 0
                   ? fmt::format(" ({} queries not logged before this one)", self->queries_unlogged_)
                   : std::string());
  self->queries_unlogged_ = 0;
  return UCS_OK;
}

// ---------------------------------------------------------------------------------------------
// Failure and close

void UcxEngine::PeerFailed(Peer* raw, ucs_status_t status) {
  std::shared_ptr<Peer> peer;
  {
    std::lock_guard<std::mutex> lock(mu_);
    raw->state = PeerState::kDead;
    raw->error =
        Status(ErrorCode::kUnavailable, std::string("peer failed: ") + ucs_status_string(status));
    if (!raw->connect_result) raw->connect_result = raw->error;
    cv_.notify_all();
    auto it = peers_.find(raw->id);
    if (it != peers_.end()) peer = it->second;
  }
  // Batches waiting for an ack will not get one. UCX completes the peer's outstanding requests
  // with errors itself.
  std::vector<Batch*> waiting;
  for (auto& [id, b] : batches_) {
    if (b->peer.get() == raw && b->awaiting_ack) waiting.push_back(b);
  }
  for (Batch* b : waiting) {
    b->awaiting_ack = false;
    b->Fail(raw->error);
    --b->outstanding;
    MaybeComplete(b);
  }
  // UCX requires a failed endpoint to be closed; do it outside the callback.
  if (peer && std::find(closing_.begin(), closing_.end(), peer) == closing_.end()) {
    peer->close_deadline = Clock::now();
    closing_.push_back(peer);
  }
}

Status UcxEngine::ClosePeer(ConnectionId peer_id, TimePoint deadline) {
  if (OnProgressThread()) return CallbackMisuse("ClosePeer");
  std::shared_ptr<Peer> peer;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(peer_id);
    if (it == peers_.end()) return Status(ErrorCode::kNotFound, "unknown peer");
    peer = it->second;
    if (peer->state == PeerState::kOpen) peer->state = PeerState::kClosing;
  }
  Post([this, peer, deadline] {
    auto it = std::find(closing_.begin(), closing_.end(), peer);
    if (it == closing_.end()) {
      if (!peer->close_result) {
        peer->close_deadline = deadline;
        closing_.push_back(peer);
      }
    } else {
      peer->close_deadline = std::min(peer->close_deadline, deadline);
    }
  });
  std::unique_lock<std::mutex> lock(mu_);
  // Closing is bounded by the deadline plus a forced close, which UCX completes locally; the
  // extra margin only guards against a bug turning into a hang.
  bool finished = cv_.wait_until(lock, std::max(deadline, Clock::now()) + std::chrono::seconds(5),
                                 [&] { return peer->close_result.has_value(); });
  peers_.erase(peer_id);
  if (!finished) return Status(ErrorCode::kInternal, "close did not finish");
  return *peer->close_result;
}

void UcxEngine::ForceCloseEp(ucp_ep_h ep) {
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t sp = ucp_ep_close_nbx(ep, &rp);
  if (sp != nullptr && !UCS_PTR_IS_ERR(sp)) close_requests_.push_back(sp);
}

void UcxEngine::DriveCloses() {
  for (ucp_ep_h ep : eps_to_close_) ForceCloseEp(ep);
  eps_to_close_.clear();
  for (auto it = close_requests_.begin(); it != close_requests_.end();) {
    if (ucp_request_check_status(*it) != UCS_INPROGRESS) {
      ucp_request_free(*it);
      it = close_requests_.erase(it);
    } else {
      ++it;
    }
  }
  if (closing_.empty()) return;
  TimePoint now = Clock::now();
  for (auto it = closing_.begin(); it != closing_.end();) {
    Peer& p = **it;
    int in_flight = 0;
    for (const auto& [id, b] : batches_) in_flight += b->peer.get() == &p;
    bool dead;
    {
      std::lock_guard<std::mutex> lock(mu_);
      dead = p.state == PeerState::kDead;
    }
    if (!p.close_started) {
      if (in_flight > 0 && now < p.close_deadline && !dead) {
        ++it;
        continue;
      }
      p.close_started = true;
      p.close_timed_out = in_flight > 0 && !dead;
      // Say what each batch still waited for: UCX requests of ours, or the receiver's ack.
      // That is what tells a stalled transport from a silent receiver when a write times out.
      for (auto& [id, b] : batches_) {
        if (b->peer.get() != &p) continue;
        const int sends = b->outstanding - (b->awaiting_ack ? 1 : 0);
        b->Fail(Status(ErrorCode::kCancelled,
                       fmt::format("peer closed with the batch in flight: {} {} request(s) of "
                                   "{} op(s) not completed{}",
                                   sends, p.use_put ? "put/flush" : "send", b->ops.size(),
                                   b->awaiting_ack
                                       ? fmt::format(", the receiver's ack not received ({} "
                                                     "queries for it unanswered)",
                                                     b->queries)
                                       : std::string())));
      }
      if (p.ep != nullptr) {
        // Tell the peer it can drop its back endpoint (best effort: a lost BYE only leaves that
        // endpoint open until this engine goes away).
        if (!dead) SendSmall(p.ep, kBye, ByeHeader{uid_, p.id});
        for (ucp_rkey_h k : p.rkeys) {
          if (k != nullptr) ucp_rkey_destroy(k);
        }
        p.rkeys.clear();
        p.bye_sent_at = now;
        p.closing_ep = p.ep;
        p.ep = nullptr;
      }
    }
    if (p.closing_ep != nullptr) {
      // Give the BYE a moment to leave (it is tiny), then force-close: outstanding requests are
      // cancelled by UCX and complete with UCS_ERR_CANCELED.
      if (ucx_work_ > 0 && now - p.bye_sent_at < std::chrono::milliseconds(50)) {
        ++it;
        continue;
      }
      ForceCloseEp(p.closing_ep);
      p.closing_ep = nullptr;
    }
    // Every completion of the peer runs before ClosePeer returns.
    std::vector<Batch*> left;
    for (auto& [id, b] : batches_) {
      if (b->peer.get() == &p && b->awaiting_ack) left.push_back(b);
    }
    for (Batch* b : left) {
      b->awaiting_ack = false;
      b->Fail(Status(ErrorCode::kCancelled, "peer closed"));
      --b->outstanding;
      MaybeComplete(b);
    }
    in_flight = 0;
    for (const auto& [id, b] : batches_) in_flight += b->peer.get() == &p;
    if (in_flight > 0) {  // UCX still owes cancellation callbacks
      ++it;
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      p.state = dead ? PeerState::kDead : PeerState::kClosed;
      p.close_result = p.close_timed_out
                           ? Status(ErrorCode::kTimeout,
                                    "in-flight batches were cancelled at the close deadline")
                           : Status::Ok();
      cv_.notify_all();
    }
    it = closing_.erase(it);
  }
}

Result<PeerInfo> UcxEngine::DescribePeer(ConnectionId peer_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(peer_id);
  if (it == peers_.end()) return Err(ErrorCode::kNotFound, "unknown peer");
  const Peer& p = *it->second;
  return PeerInfo{p.use_put ? "put" : "am", p.transports, static_cast<std::size_t>(p.batches)};
}

std::string UcxLibraryVersion() { return ucp_get_version_string(); }

Result<std::unique_ptr<Engine>> MakeUcxEngine(const UcxOptions& options) {
  auto engine = std::make_unique<UcxEngine>(options);
  Status s = engine->Init();
  if (!s.ok()) {
    return tl::unexpected(Status(
        s.code() == ErrorCode::kInvalidArgument ? s.code() : ErrorCode::kUnavailable, s.message()));
  }
  return std::unique_ptr<Engine>(std::move(engine));
}

}  // namespace kvferry::transport
