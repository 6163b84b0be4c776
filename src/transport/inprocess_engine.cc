// In-process backend: memcpy between engines that share a fabric, with failure injection.
// See include/kvferry/transport/inprocess.h for the contract.
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "descriptor.h"
#include "kvferry/transport/inprocess.h"
#include "write_fence.h"

namespace kvferry::transport {

class InProcessEngineImpl;

class InProcessFabric {
 public:
  // Guards `engines` and the region tables of every engine, and is held while bytes are copied,
  // so a copy never races with a deregistration.
  std::mutex mu;
  std::map<std::string, InProcessEngineImpl*, std::less<>> engines;
};

std::shared_ptr<InProcessFabric> MakeInProcessFabric() {
  return std::make_shared<InProcessFabric>();
}

namespace {

struct LocalRegion {
  Region region;
  bool owned = false;  // mmap'ed by AllocateRegion
  int in_flight = 0;   // accepted batches that read from it
};

}  // namespace

class InProcessEngineImpl final : public InProcessEngine {
 public:
  InProcessEngineImpl(std::shared_ptr<InProcessFabric> fabric, InProcessOptions options)
      : fabric_(std::move(fabric)),
        options_(std::move(options)),
        uid_(internal::RandomUid()),
        fence_(options_.fence_writes) {
    if (!options_.manual_pump) worker_ = std::thread([this] { WorkerLoop(); });
  }

  ~InProcessEngineImpl() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      cv_.notify_all();
    }
    if (worker_.joinable()) worker_.join();
    // Whatever is still pending is cancelled: its completion runs here, exactly once.
    std::vector<Pending> left;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [key, p] : pending_) left.push_back(std::move(p));
      pending_.clear();
    }
    for (auto& p : left) FinishBatch(p, Status(ErrorCode::kCancelled, "engine shut down"));
    std::lock_guard<std::mutex> lock(fabric_->mu);
    fabric_->engines.erase(options_.name);
    for (auto& [id, r] : regions_) {
      if (r.owned) munmap(r.region.base, r.region.length);
    }
  }

  bool Attach() {
    std::lock_guard<std::mutex> lock(fabric_->mu);
    return fabric_->engines.emplace(options_.name, this).second;
  }

  std::string_view backend() const override { return "inprocess"; }

  Result<Region> RegisterMemory(void* base, std::size_t length, MemoryKind kind) override {
    return AddRegion(static_cast<std::byte*>(base), length, kind, false);
  }

  Result<Region> AllocateRegion(std::size_t length) override {
    if (length == 0) return Err(ErrorCode::kInvalidArgument, "empty region");
    void* p = mmap(nullptr, length, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED) return Err(ErrorCode::kResourceExhausted, "mmap failed");
    auto r = AddRegion(static_cast<std::byte*>(p), length, MemoryKind::kHost, true);
    if (!r) munmap(p, length);
    return r;
  }

  Status DeregisterMemory(RegionId id, TimePoint deadline) override {
    if (OnCallbackThread()) return CallbackMisuse("DeregisterMemory");
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      {
        std::lock_guard<std::mutex> flock(fabric_->mu);
        auto it = regions_.find(id);
        if (it == regions_.end()) return Status(ErrorCode::kNotFound, "unknown region");
        if (it->second.in_flight == 0) {
          if (it->second.owned) munmap(it->second.region.base, it->second.region.length);
          regions_.erase(it);
          return Status::Ok();
        }
      }
      if (options_.manual_pump || cv_.wait_until(lock, deadline) == std::cv_status::timeout) {
        if (!options_.manual_pump && Clock::now() < deadline) continue;
        return Status(ErrorCode::kTimeout, "region still used by in-flight batches");
      }
    }
  }

  Result<std::vector<std::byte>> ExportDescriptor(std::span<const RegionId> ids) override {
    internal::Descriptor d;
    d.backend = "inprocess";
    d.engine_uid = uid_;
    const auto* name = reinterpret_cast<const std::byte*>(options_.name.data());
    d.address.assign(name, name + options_.name.size());
    std::lock_guard<std::mutex> lock(fabric_->mu);
    Status listed = internal::AddRegions(d, regions_, ids, [](const LocalRegion& r) {
      return internal::DescriptorRegion{
          RemoteRegion{r.region.id, reinterpret_cast<std::uint64_t>(r.region.base),
                       r.region.length, r.region.kind},
          {}};
    });
    if (!listed.ok()) return tl::unexpected(listed);
    return internal::EncodeDescriptor(d);
  }

  Result<ConnectionId> Connect(std::span<const std::byte> descriptor,
                               TimePoint /*deadline*/) override {
    if (OnCallbackThread()) return tl::unexpected(CallbackMisuse("Connect"));
    auto d = internal::DecodeDescriptor(descriptor);
    if (!d) return tl::unexpected(d.error());
    if (d->backend != "inprocess")
      return Err(ErrorCode::kProtocol, "descriptor of another backend");
    std::string name(reinterpret_cast<const char*>(d->address.data()), d->address.size());
    {
      std::lock_guard<std::mutex> flock(fabric_->mu);
      auto it = fabric_->engines.find(name);
      if (it == fabric_->engines.end() || it->second->uid_ != d->engine_uid) {
        return Err(ErrorCode::kUnavailable, "no engine '" + name + "' in the fabric");
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    ConnectionId id = next_peer_++;
    peers_[id] = Peer{std::move(name), std::move(*d), false, 0};
    return id;
  }

  Result<BatchId> SubmitWrites(ConnectionId peer, std::span<const WriteOp> ops, WriteKey key,
                               CompletionFn done) override {
    if (ops.empty()) return Err(ErrorCode::kInvalidArgument, "empty batch");
    std::unique_lock<std::mutex> lock(mu_);
    auto pit = peers_.find(peer);
    if (pit == peers_.end()) return Err(ErrorCode::kNotFound, "unknown peer");
    Peer& p = pit->second;
    if (p.closing) return Err(ErrorCode::kCancelled, "peer is being closed");
    {
      std::lock_guard<std::mutex> flock(fabric_->mu);
      for (const WriteOp& op : ops) {
        if (op.length == 0) return Err(ErrorCode::kInvalidArgument, "zero-length write");
        auto lit = regions_.find(op.local_region);
        if (lit == regions_.end()) return Err(ErrorCode::kNotFound, "unknown local region");
        if (!internal::RangeFits(op.local_offset, op.length, lit->second.region.length)) {
          return Err(ErrorCode::kOutOfRange, "write outside the local region");
        }
        const auto* rr = p.desc.Find(op.remote_region);
        if (rr == nullptr) return Err(ErrorCode::kOutOfRange, "remote region not in descriptor");
        if (!internal::RangeFits(op.remote_offset, op.length, rr->info.length)) {
          return Err(ErrorCode::kOutOfRange, "write outside the remote region");
        }
      }
      for (const WriteOp& op : ops) ++regions_[op.local_region].in_flight;
    }
    Pending b;
    b.id = next_batch_++;
    b.peer = peer;
    b.ops.assign(ops.begin(), ops.end());
    b.key = key;
    b.done = std::move(done);
    TimePoint due = options_.manual_pump ? now_ : Clock::now();
    auto& faults = faults_[p.name];
    if (!faults.empty()) {
      Fault& f = faults.front();
      b.fault = f.kind;
      b.fail_code = f.code;
      if (f.kind == FaultKind::kDelay) due += f.delay;
      if (f.count > 0 && --f.count == 0) faults.pop_front();
    }
    if (b.fault == FaultKind::kDrop) due = TimePoint::max();
    ++p.pending;
    BatchId id = b.id;
    pending_.emplace(std::make_pair(due, id), std::move(b));
    cv_.notify_all();
    return id;
  }

  Status ClosePeer(ConnectionId peer, TimePoint deadline) override {
    if (OnCallbackThread()) return CallbackMisuse("ClosePeer");
    std::vector<Pending> cancelled;
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto pit = peers_.find(peer);
      if (pit == peers_.end()) return Status(ErrorCode::kNotFound, "unknown peer");
      pit->second.closing = true;
      // Dropped batches will never land: they are not worth waiting for.
      auto deliverable = [&] {
        int n = pit->second.delivering;
        for (const auto& [key, b] : pending_) {
          if (b.peer == peer && b.fault != FaultKind::kDrop) ++n;
        }
        return n;
      };
      if (!options_.manual_pump) {
        cv_.wait_until(lock, deadline, [&] { return deliverable() == 0; });
      }
      // A batch being copied right now finishes first (bounded by one memcpy): after this
      // nothing more of this peer lands.
      cv_.wait(lock, [&] { return pit->second.delivering == 0; });
      for (auto it = pending_.begin(); it != pending_.end();) {
        if (it->second.peer == peer) {
          cancelled.push_back(std::move(it->second));
          it = pending_.erase(it);
        } else {
          ++it;
        }
      }
      peers_.erase(pit);
    }
    bool timed_out = false;
    for (auto& b : cancelled) {
      timed_out |= b.fault != FaultKind::kDrop;
      FinishBatch(b, Status(ErrorCode::kCancelled, "peer closed"));
    }
    if (timed_out) {
      return Status(ErrorCode::kTimeout,
                    "peer closed with batches still in flight; they were cancelled");
    }
    return Status::Ok();
  }

  Result<PeerInfo> DescribePeer(ConnectionId peer) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto pit = peers_.find(peer);
    if (pit == peers_.end()) return Err(ErrorCode::kNotFound, "unknown peer");
    return PeerInfo{"memcpy", "inprocess", static_cast<std::size_t>(pit->second.pending)};
  }

  void InjectFault(std::string_view peer_name, const Fault& fault) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (fault.count == 0) return;
    faults_[std::string(peer_name)].push_back(fault);
  }

  void ClearFaults(std::string_view peer_name) override {
    std::lock_guard<std::mutex> lock(mu_);
    faults_.erase(std::string(peer_name));
  }

  std::size_t Pump(TimePoint now) override {
    if (!options_.manual_pump) return 0;
    std::size_t n = 0;
    std::unique_lock<std::mutex> lock(mu_);
    now_ = std::max(now_, now);
    while (!pending_.empty() && pending_.begin()->first.first <= now_) {
      DeliverFront(lock);
      ++n;
    }
    return n;
  }

  std::size_t PendingBatches() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return pending_.size();
  }
  bool fences_writes() const override { return options_.fence_writes; }

  // Bytes are copied under the fabric's lock, where the key is checked: once the revocation
  // holds the lock, nothing stamped with these keys is copying or can start to.
  Status RevokeWriteKeys(std::span<const WriteKey> keys, TimePoint deadline) override {
    (void)deadline;
    if (!options_.fence_writes) {
      return Status(ErrorCode::kRejected, "this in-process engine does not fence writes");
    }
    std::lock_guard<std::mutex> flock(fabric_->mu);
    fence_.Revoke(keys);
    return Status::Ok();
  }

 private:
  struct Peer {
    std::string name;
    internal::Descriptor desc;
    bool closing = false;
    int pending = 0;     // submitted, not completed
    int delivering = 0;  // being copied right now (outside mu_)
  };
  struct Pending {
    BatchId id = 0;
    ConnectionId peer = 0;
    std::vector<WriteOp> ops;
    WriteKey key = kNoWriteKey;
    CompletionFn done;
    std::optional<FaultKind> fault;
    ErrorCode fail_code = ErrorCode::kUnavailable;
  };

  Result<Region> AddRegion(std::byte* base, std::size_t length, MemoryKind kind, bool owned) {
    if (base == nullptr || length == 0) return Err(ErrorCode::kInvalidArgument, "empty region");
    if (kind != MemoryKind::kHost) {
      return Err(ErrorCode::kInvalidArgument, "only host memory is supported");
    }
    std::lock_guard<std::mutex> lock(fabric_->mu);
    Region r{next_region_++, base, length, kind};
    regions_[r.id] = LocalRegion{r, owned, 0};
    return r;
  }

  // Delivers the earliest pending batch. Called with mu_ held; releases it while copying and
  // while running the completion.
  void DeliverFront(std::unique_lock<std::mutex>& lock) {
    Pending b = std::move(pending_.begin()->second);
    pending_.erase(pending_.begin());
    Peer& peer = peers_.at(b.peer);  // a peer with pending batches is never erased
    ++peer.delivering;
    std::string peer_name = peer.name;
    lock.unlock();
    Status status;
    if (b.fault == FaultKind::kFail) {
      status = Status(b.fail_code, "injected failure");
    } else {
      status = Copy(peer_name, b.ops, b.key);
    }
    lock.lock();
    --peer.delivering;
    lock.unlock();
    FinishBatch(b, std::move(status));
    lock.lock();
    cv_.notify_all();
  }

  Status Copy(const std::string& peer_name, const std::vector<WriteOp>& ops, WriteKey key) {
    std::lock_guard<std::mutex> flock(fabric_->mu);
    auto eit = fabric_->engines.find(peer_name);
    if (eit == fabric_->engines.end()) return Status(ErrorCode::kUnavailable, "peer is gone");
    InProcessEngineImpl* dst = eit->second;
    if (!dst->fence_.Admitted(key)) {
      return Status(ErrorCode::kRejected,
                    "peer fences its writers and refused this batch's write key (none, or revoked)");
    }
    // The receiver's check: every range against what it has registered now.
    for (const WriteOp& op : ops) {
      auto rit = dst->regions_.find(op.remote_region);
      if (rit == dst->regions_.end() ||
          !internal::RangeFits(op.remote_offset, op.length, rit->second.region.length)) {
        return Status(ErrorCode::kOutOfRange, "peer refused a range that it has not registered");
      }
    }
    for (const WriteOp& op : ops) {
      std::memcpy(dst->regions_.at(op.remote_region).region.base + op.remote_offset,
                  regions_.at(op.local_region).region.base + op.local_offset, op.length);
    }
    return Status::Ok();
  }

  // Runs the completion exactly once and releases the batch's hold on its regions. Called
  // without mu_.
  void FinishBatch(Pending& b, Status status) {
    {
      std::lock_guard<std::mutex> flock(fabric_->mu);
      for (const WriteOp& op : b.ops) {
        auto it = regions_.find(op.local_region);
        if (it != regions_.end()) --it->second.in_flight;
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto pit = peers_.find(b.peer);
      if (pit != peers_.end()) --pit->second.pending;
    }
    if (b.done) {
      auto prev = callback_thread_.exchange(std::this_thread::get_id());
      b.done(b.id, std::move(status));
      callback_thread_.store(prev);
    }
    std::lock_guard<std::mutex> lock(mu_);
    cv_.notify_all();
  }

  void WorkerLoop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stopping_) {
      if (pending_.empty()) {
        cv_.wait(lock);
        continue;
      }
      TimePoint due = pending_.begin()->first.first;
      if (due == TimePoint::max()) {  // only dropped batches are left
        cv_.wait(lock);
        continue;
      }
      if (due > Clock::now()) {
        cv_.wait_until(lock, due);
        continue;
      }
      DeliverFront(lock);
    }
  }

  bool OnCallbackThread() const { return callback_thread_.load() == std::this_thread::get_id(); }
  static Status CallbackMisuse(const char* what) {
    return Status(ErrorCode::kInvalidArgument,
                  std::string(what) + " must not be called from a completion callback");
  }

  std::shared_ptr<InProcessFabric> fabric_;
  const InProcessOptions options_;
  const std::uint64_t uid_;

  std::map<RegionId, LocalRegion> regions_;  // guarded by fabric_->mu
  RegionId next_region_ = 1;                 // guarded by fabric_->mu
  internal::WriteFence fence_;  // guarded by fabric_->mu (copies land under it: no Admit)

  mutable std::mutex mu_;  // guards everything below
  std::condition_variable cv_;
  std::map<ConnectionId, Peer> peers_;
  std::map<std::string, std::deque<Fault>, std::less<>> faults_;
  std::map<std::pair<TimePoint, BatchId>, Pending> pending_;
  TimePoint now_{};  // manual mode: the `now` of the last Pump
  ConnectionId next_peer_ = 1;
  BatchId next_batch_ = 1;
  bool stopping_ = false;
  std::atomic<std::thread::id> callback_thread_{};
  std::thread worker_;
};

Result<std::unique_ptr<InProcessEngine>> MakeInProcessEngine(
    std::shared_ptr<InProcessFabric> fabric, const InProcessOptions& options) {
  if (!fabric) return Err(ErrorCode::kInvalidArgument, "no fabric");
  if (options.name.empty()) return Err(ErrorCode::kInvalidArgument, "engine name is empty");
  auto engine = std::make_unique<InProcessEngineImpl>(std::move(fabric), options);
  if (!engine->Attach()) {
    return Err(ErrorCode::kAlreadyExists, "engine name '" + options.name + "' is taken");
  }
  return std::unique_ptr<InProcessEngine>(std::move(engine));
}

}  // namespace kvferry::transport
