#include "runtime/decode_worker.h"

#include <fmt/format.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <tuple>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>
#include <variant>
#include <zmq.hpp>

#include "control/bootstrap_client.h"
#include "kvferry/core/thread_name.h"
#include "wire/messages.h"

namespace kvferry::runtime {
namespace {

using core::Clock;
using core::TimePoint;

// Every wait of the I/O thread is bounded even if a wake-up is lost.
constexpr std::chrono::milliseconds kMaxPollWait{1000};
// Deregistering the region at shutdown waits for the transport's last operations on it.
constexpr std::chrono::milliseconds kDeregisterTimeout{5000};
// The session's deadline for a lookup exceeds the query's own timeout by this, so the query's
// timeout, not the session's, is what reports a bootstrap that does not answer.
constexpr std::chrono::milliseconds kLookupSlack{1000};
// A DEALER's queue toward one P worker. Beyond it a send fails at once (reported to the
// session as unsent) instead of blocking every other peer behind a P that stopped reading.
constexpr int kSendHighWaterMark = 4096;
// How long a message waits here for a connection to its P worker (the first one, or again
// after the last one broke) before it fails unsent. Until ZeroMQ takes it, a message has
// provably not left: a pull that fails this way is a plain failure, and one given up on
// meanwhile (its engine declared down) has its quarantine lifted. Measured need: without it, a
// D that kept sending to a killed P for the 3 s etcd took to notice held 1,015 of its 1,024
// blocks quarantined for pulls that never left, and the next request waited for blocks forever
// (hosts_xpyd_host_loss_and_partition).
constexpr std::chrono::milliseconds kConnectWait{3000};
// A fence waits this long for writes that were already landing under the revoked keys (a
// rendezvous receive in progress; a dead P's fail within UCX's keepalive, 1 s here). Past it the
// fence fails; the session asks again after 1 s, 2 s, ... up to 60 s while the epoch's pulls wait.
constexpr std::chrono::milliseconds kFenceDrain{5000};
// Stop(): how long it waits for the I/O thread to hand the releases of everything it tracked to
// ZeroMQ, and how long ZeroMQ then gets to deliver them (linger) as the sockets close.
constexpr std::chrono::milliseconds kStopFlush{500};
constexpr std::chrono::milliseconds kStopLinger{500};

protocol::DecodeSessionOptions SessionOptions(const DecodeWorkerOptions& o,
                                              std::vector<std::uint8_t> descriptor) {
  protocol::DecodeSessionOptions s;
  s.engine_id = o.engine_id;
  s.tp_size = o.tp_size;
  s.tp_rank = o.tp_rank;
  s.block_len = o.block_len;
  s.num_blocks = o.num_blocks;
  s.region_descriptor = std::move(descriptor);
  s.head_slices = o.head_slices;
  s.lease = o.lease;
  s.abort_request_timeout = o.abort_request_timeout;
  s.write_bound = o.write_bound;
  s.pull_timeout = o.pull_timeout;
  s.lookup_timeout = o.bootstrap_timeout + kLookupSlack;
  s.send_releases = o.send_releases;
  return s;
}

}  // namespace

class DecodeWorker::Impl {
 public:
  Impl(DecodeWorkerOptions options, std::shared_ptr<transport::Engine> engine, WarningSink warn)
      : options_(std::move(options)),
        engine_(std::move(engine)),
        warn_(std::move(warn)),
        directory_(options_.cluster_secret) {}

  ~Impl() { Stop(); }

  Status Init() {
    auto memory =
        KvMemory::Register(engine_, options_.planes, options_.block_len, options_.num_blocks);
    if (!memory) return memory.error();
    memory_ = std::move(*memory);
    // One region per plane, in plane order: P writes its plane i into region i.
    auto descriptor = engine_->ExportDescriptor(memory_.ids());
    if (!descriptor) return descriptor.error();
    std::vector<std::uint8_t> bytes(descriptor->size());
    std::memcpy(bytes.data(), descriptor->data(), descriptor->size());
    protocol::DecodeSessionOptions session = SessionOptions(options_, std::move(bytes));
    if (engine_->fences_writes()) {
      // Random, below 2^63 and non-zero: keys of workers sharing an engine never meet.
      std::random_device random;
      const std::uint64_t bits = (std::uint64_t{random()} << 32) ^ random();
      session.write_key_base = (bits >> 1) | 1;
    }
    // ZeroMQ's own cap (1,023 sockets by default) must not be the one D meets first: the
    // session keeps at most max_endpoints open (one socket each), and fails what needs more.
    context_.set(zmq::ctxopt::max_sockets, static_cast<int>(session.max_endpoints + 16));
    session_.emplace(std::move(session));
    wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) return Status(ErrorCode::kInternal, fmt::format("eventfd: errno {}", errno));
    io_ = std::thread([this] {
      core::NameThisThread("kvf-d-io");
      IoMain();
    });
    for (std::size_t i = 0; i < std::max<std::size_t>(1, options_.lookup_threads); ++i) {
      lookups_.emplace_back([this] {
        core::NameThisThread("kvf-d-lookup");
        LookupMain();
      });
    }
    if (engine_->fences_writes()) fencer_ = std::thread([this] {
      core::NameThisThread("kvf-d-fence");
      FenceMain();
    });
    return Status::Ok();
  }

  void Stop() {
    {
      // One stopper; the others wait for it, so none returns while the worker still runs.
      std::unique_lock<std::mutex> lock(mu_);
      if (stop_started_) {
        cv_.wait(lock, [&] { return stopped_; });
        return;
      }
      stop_started_ = true;
      if (session_ && io_.joinable()) {
        // Everything still tracked is given up: P frees it now rather than at its lease.
        session_->ReleaseAll(Clock::now());
        const std::uint64_t target = ++flush_requests_;
        lock.unlock();
        Wake();
        lock.lock();
        cv_.wait_for(lock, kStopFlush, [&] { return flushed_ >= target; });
      }
      stopping_ = true;
    }
    cv_.notify_all();
    lookup_cv_.notify_all();
    fence_cv_.notify_all();
    Wake();
    if (io_.joinable()) io_.join();
    for (std::thread& t : lookups_) t.join();
    lookups_.clear();
    if (fencer_.joinable()) fencer_.join();
    if (wake_fd_ >= 0) ::close(wake_fd_);
    wake_fd_ = -1;
    // Every thread is joined. A P peer whose pull was quarantined may in principle still
    // write, which is why the planes go only at the very end.
    (void)memory_.Deregister(Clock::now() + kDeregisterTimeout);
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopped_ = true;
    }
    cv_.notify_all();
  }

  std::byte* kv(std::size_t plane) const { return memory_.plane(plane); }
  std::size_t num_planes() const { return memory_.num_planes(); }
  const DecodeWorkerOptions& options() const { return options_; }

  void OnNewRequest(const core::RequestId& request, const RemoteSource& source) {
    Run([&](protocol::DecodeSession& s, TimePoint now) { s.OnNewRequest(request, source, now); });
  }
  Status StartLoad(const core::RequestId& request, const RemoteSource& source,
                   std::vector<core::BlockId> blocks) {
    Status status;
    Run([&](protocol::DecodeSession& s, TimePoint now) {
      status = s.StartLoad(request, source, std::move(blocks), now);
    });
    return status;
  }
  void RequestFinished(const core::RequestId& request) {
    Run([&](protocol::DecodeSession& s, TimePoint now) { s.RequestFinished(request, now); });
  }
  void ReleaseTransfer(const RemoteSource& source) {
    Run([&](protocol::DecodeSession& s, TimePoint now) { s.ReleaseTransfer(source, now); });
  }

  void EngineDown(const core::EngineId& engine, const Status& why) {
    Run([&](protocol::DecodeSession& s, TimePoint now) { s.OnEngineDown(engine, why, now); });
  }
  void ProcessGone(const core::EngineId& engine, const std::string& incarnation,
                   const Status& why) {
    Run([&](protocol::DecodeSession& s, TimePoint now) {
      s.OnProcessGone(engine, incarnation, why, now);
    });
  }

  DecodeFinished TakeFinished() {
    std::lock_guard<std::mutex> lock(mu_);
    DecodeFinished out;
    std::swap(out, finished_);
    return out;
  }

  DecodeFinished WaitFinished(TimePoint deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, deadline, [&] { return stopping_ || !finished_.empty(); });
    DecodeFinished out;
    std::swap(out, finished_);
    return out;
  }

  DecodeWorkerStats Stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    return session_->stats();
  }

 private:
  // Runs `call` on the session under the mutex, collects what it decided for the engine, and
  // wakes the I/O thread for what it decided for the network.
  template <typename Call>
  void Run(Call&& call) {
    std::vector<std::string> warnings;
    {
      std::lock_guard<std::mutex> lock(mu_);
      call(*session_, Clock::now());
      Collect(&warnings);
    }
    Warn(warnings);
    Wake();
  }

  // mu_ held: moves the session's events to the engine's inbox.
  void Collect(std::vector<std::string>* warnings) {
    bool any = false;
    for (protocol::DecodeEvent& event : session_->TakeEvents()) {
      if (auto* done = std::get_if<protocol::ReceiveDone>(&event)) {
        finished_.received.push_back({std::move(done->request), done->ok, std::move(done->error),
                                      std::move(done->invalid), done->quarantined});
        any = true;
      } else if (auto* released = std::get_if<protocol::BlocksReleased>(&event)) {
        finished_.released.emplace_back(std::move(released->request), std::move(released->blocks));
        any = true;
      } else if (auto* aborted = std::get_if<protocol::TransferAborted>(&event)) {
        finished_.aborted.emplace_back(std::move(aborted->request), std::move(aborted->error));
        any = true;
      } else {
        warnings->push_back(std::move(std::get<protocol::Warning>(event).text));
      }
    }
    std::vector<protocol::LookupRequest> lookups = session_->TakeLookups();
    if (!lookups.empty()) {
      for (protocol::LookupRequest& l : lookups) lookup_queue_.push_back(std::move(l));
      lookup_cv_.notify_all();
    }
    if (any) cv_.notify_all();
  }

  void Warn(const std::vector<std::string>& warnings) {
    for (const std::string& w : warnings) {
      if (warn_) warn_(w);
    }
  }

  void Wake() {
    if (wake_fd_ < 0) return;
    const std::uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
  }

  // ---- lookup threads ----

  // The engine from the registry when one is configured, else from the request's bootstrap.
  Result<control::EngineInfo> FetchEngine(const protocol::LookupRequest& request) {
    if (options_.registry_lookup) return options_.registry_lookup(request.engine_id);
    directory_.Invalidate(request.engine_id);
    auto lookup =
        directory_.Lookup(request.engine_id, request.bootstrap_address, options_.bootstrap_timeout);
    if (!lookup) return tl::unexpected(lookup.error());
    return *lookup->info;
  }

  void LookupMain() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      lookup_cv_.wait(lock, [&] { return stopping_ || !lookup_queue_.empty(); });
      if (stopping_) return;
      protocol::LookupRequest request = std::move(lookup_queue_.front());
      lookup_queue_.pop_front();
      lock.unlock();
      // The session decides when to ask again; the directory only runs the query.
      Result<control::EngineInfo> lookup = FetchEngine(request);
      std::optional<protocol::PeerEngine> view;
      Status failure;
      if (lookup) {
        const control::EngineInfo& info = *lookup;
        view.emplace();
        view->engine_id = info.engine_id;
        view->incarnation = info.incarnation;
        view->tp_size = info.tp_size;
        view->features = info.protocol_features;
        for (std::uint32_t rank = 0; rank < info.tp_size; ++rank) {
          const control::WorkerAddress* worker = info.Find(rank, 0);
          view->side_channels.push_back(worker != nullptr ? worker->side_channel : std::string());
        }
      } else {
        failure = lookup.error();
      }
      Run([&](protocol::DecodeSession& s, TimePoint now) {
        if (view) {
          s.OnLookup(*view, now, request.id);
        } else {
          s.OnLookupFailed(request.engine_id, failure, now, request.id);
        }
      });
      lock.lock();
    }
  }

  // ---- the I/O thread ----

  // The socket of `endpoint`, made and connected on first use; nullptr (and *error) when it
  // cannot be made (the process is out of descriptors): the message then fails unsent.
  zmq::socket_t* SocketFor(protocol::EndpointId endpoint, const std::string& address,
                           Status* error) {
    auto it = sockets_.find(endpoint);
    if (it != sockets_.end()) return &it->second;
    try {
      return &sockets_.emplace(endpoint, NewSocket(address, error)).first->second;
    } catch (const zmq::error_t& e) {
      // Found by review: an uncaught EMFILE here, in the I/O thread, terminated D.
      *error = Status(ErrorCode::kResourceExhausted,
                      fmt::format("cannot open a side channel to {}: {}", address, e.what()));
      return nullptr;
    }
  }

  zmq::socket_t NewSocket(const std::string& address, Status* error) {
    zmq::socket_t socket(context_, zmq::socket_type::dealer);
    // A stable identity, so that P's answers still reach this socket after it reconnects (P's
    // ROUTER hands the identity over to the new connection) instead of being dropped as sent
    // to a vanished peer — a lost answer would leave a timed-out pull quarantined.
    socket.set(zmq::sockopt::routing_id, NewRoutingId());
    socket.set(zmq::sockopt::linger, 0);
    socket.set(zmq::sockopt::sndhwm, kSendHighWaterMark);
    // ZeroMQ takes a message only while a connection is up (else send says EAGAIN and the
    // message waits in pending_): what it took may have reached P, what it did not cannot have.
    socket.set(zmq::sockopt::immediate, true);
    // A reply can never be larger than the protocol's limit; a bigger frame is hostile.
    socket.set(zmq::sockopt::maxmsgsize, static_cast<std::int64_t>(wire::kMaxFrameBytes));
    if (options_.cluster_secret) {
      // A CURVE client that knows P's server key: an authenticated, encrypted channel.
      const control::ClusterSecret& secret = *options_.cluster_secret;
      socket.set(zmq::sockopt::curve_serverkey, secret.curve_server().public_z85);
      socket.set(zmq::sockopt::curve_publickey, secret.curve_client().public_z85);
      socket.set(zmq::sockopt::curve_secretkey, secret.curve_client().secret_z85);
    }
    try {
      socket.connect(address);
    } catch (const zmq::error_t& e) {
      *error = Status(ErrorCode::kUnavailable,
                      fmt::format("cannot connect to {}: {}", address, e.what()));
    }
    return socket;
  }

  // A message ZeroMQ has not taken yet (no connection up): it has not left this process.
  struct Pending {
    std::uint64_t wire_id = 0;
    std::vector<std::uint8_t> payload;
    TimePoint deadline;
  };
  using Failed = std::vector<std::tuple<protocol::EndpointId, std::uint64_t, Status>>;
  // Messages ZeroMQ took (a connection was up): (endpoint, wire id), for the session's OnSent.
  using Sent = std::vector<std::pair<protocol::EndpointId, std::uint64_t>>;

  // Hands `payload` to ZeroMQ, behind whatever waits for `endpoint` already (order kept).
  // Returns false when ZeroMQ did not take it (no connection up, or its queue is full).
  bool TrySend(zmq::socket_t& socket, const std::vector<std::uint8_t>& payload,
               const std::string& address, Status* error) {
    try {
      return socket.send(zmq::buffer(payload), zmq::send_flags::dontwait).has_value();
    } catch (const zmq::error_t& e) {
      *error = Status(ErrorCode::kUnavailable, fmt::format("send to {}: {}", address, e.what()));
      return false;
    }
  }

  void Send(const protocol::Transmit& t, TimePoint now, Failed* failed, Sent* sent) {
    const std::uint64_t id = std::visit([](const auto& m) { return m.id; }, t.message);
    Status error;
    zmq::socket_t* found = SocketFor(t.endpoint, t.address, &error);
    if (found != nullptr && error.ok()) {
      zmq::socket_t& socket = *found;
      std::vector<std::uint8_t> payload =
          std::visit([](const auto& m) { return wire::Encode(m); }, t.message);
      std::deque<Pending>& waiting = pending_[t.endpoint];
      if (waiting.empty() && TrySend(socket, payload, t.address, &error)) {
        sent->emplace_back(t.endpoint, id);
        return;
      }
      if (error.ok()) {
        // No connection up (or messages already wait for one): it waits, in order.
        if (waiting.size() < static_cast<std::size_t>(kSendHighWaterMark)) {
          waiting.push_back({id, std::move(payload), now + kConnectWait});
          return;
        }
        error = Status(ErrorCode::kUnavailable,
                       fmt::format("the queue to {} is full (it stopped reading)", t.address));
      }
    }
    if (!error.ok()) failed->emplace_back(t.endpoint, id, std::move(error));
  }

  // Sends what waits for endpoints that have a connection now, and fails what waited too long.
  void FlushPending(TimePoint now, Failed* failed, Sent* sent) {
    for (auto it = pending_.begin(); it != pending_.end();) {
      std::deque<Pending>& waiting = it->second;
      zmq::socket_t& socket = sockets_.at(it->first);
      const std::string address = socket.get(zmq::sockopt::last_endpoint);
      Status error;
      while (!waiting.empty() && TrySend(socket, waiting.front().payload, address, &error)) {
        sent->emplace_back(it->first, waiting.front().wire_id);
        waiting.pop_front();
      }
      while (!waiting.empty() && (!error.ok() || waiting.front().deadline <= now)) {
        failed->emplace_back(
            it->first, waiting.front().wire_id,
            error.ok() ? Status(ErrorCode::kUnavailable,
                                fmt::format("no connection to {} within {} ms", address,
                                            kConnectWait.count()))
                       : error);
        waiting.pop_front();
      }
      it = waiting.empty() ? pending_.erase(it) : std::next(it);
    }
  }

  TimePoint NextPendingDeadline() const {
    TimePoint next = core::kNever;
    for (const auto& [endpoint, waiting] : pending_) {
      if (!waiting.empty()) next = std::min(next, waiting.front().deadline);
    }
    return next;
  }

  // Closes the sockets of endpoints the session is done with (nothing is in flight on them).
  void Close(const std::vector<protocol::EndpointId>& endpoints) {
    for (protocol::EndpointId endpoint : endpoints) {
      pending_.erase(endpoint);
      sockets_.erase(endpoint);  // linger 0: closes at once
    }
  }

  // 16 random bytes, the first non-zero (ZeroMQ reserves identities that start with 0).
  std::string NewRoutingId() {
    std::string id(16, '\0');
    for (char& c : id) c = static_cast<char>(routing_random_() & 0xff);
    id[0] = static_cast<char>(1 + (routing_random_() % 255));
    return id;
  }

  // Reads every reply waiting on `endpoint`'s socket and hands it to the session (mu_ held).
  void Receive(protocol::EndpointId endpoint, zmq::socket_t& socket, TimePoint now) {
    for (;;) {
      zmq::message_t frame;
      std::optional<std::size_t> got;
      try {
        got = socket.recv(frame, zmq::recv_flags::dontwait);
      } catch (const zmq::error_t&) {
        return;
      }
      if (!got) return;
      session_->OnMessage(endpoint, {frame.data<std::uint8_t>(), frame.size()}, now);
    }
  }

  void IoMain() {
    std::vector<std::string> warnings;
    std::uint64_t flush_asked = 0;
    // Leaving: what ZeroMQ took (the releases of a Stop) gets kStopLinger to go out.
    struct Linger {
      std::map<protocol::EndpointId, zmq::socket_t>& sockets;
      ~Linger() {
        for (auto& [endpoint, socket] : sockets) {
          try {
            socket.set(zmq::sockopt::linger, static_cast<int>(kStopLinger.count()));
          } catch (const zmq::error_t&) {
          }
        }
      }
    } linger{sockets_};
    while (true) {
      std::vector<zmq::pollitem_t> items;
      std::vector<protocol::EndpointId> endpoints;
      items.push_back({nullptr, wake_fd_, ZMQ_POLLIN, 0});
      for (auto& [endpoint, socket] : sockets_) {
        // POLLOUT, with ZMQ_IMMEDIATE: a connection is up and could take a waiting message.
        const short events = pending_.count(endpoint) != 0 ? (ZMQ_POLLIN | ZMQ_POLLOUT)
                                                          : ZMQ_POLLIN;
        items.push_back({socket.handle(), 0, events, 0});
        endpoints.push_back(endpoint);
      }
      std::chrono::milliseconds wait = kMaxPollWait;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stopping_) return;
        const TimePoint next = std::min(session_->NextDeadline(), NextPendingDeadline());
        const TimePoint now = Clock::now();
        if (next != core::kNever) {
          wait = next <= now ? std::chrono::milliseconds(0)
                             : std::min(kMaxPollWait,
                                        std::chrono::ceil<std::chrono::milliseconds>(next - now));
        }
      }
      try {
        zmq::poll(items.data(), items.size(), wait);
      } catch (const zmq::error_t&) {
        // EINTR: the loop re-polls with a fresh deadline.
      }
      if (items[0].revents & ZMQ_POLLIN) {
        std::uint64_t count;
        [[maybe_unused]] ssize_t n = ::read(wake_fd_, &count, sizeof(count));
      }
      std::vector<protocol::Transmit> out;
      std::vector<protocol::FenceRequest> fences;
      std::vector<protocol::EndpointId> closed;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stopping_) return;
        const TimePoint now = Clock::now();
        for (std::size_t i = 1; i < items.size(); ++i) {
          if (items[i].revents & ZMQ_POLLIN) {
            Receive(endpoints[i - 1], sockets_.at(endpoints[i - 1]), now);
          }
        }
        if (session_->NextDeadline() <= now) session_->OnTimeout(now);
        out = session_->TakeMessages();
        fences = session_->TakeFences();
        closed = session_->TakeClosedEndpoints();
        flush_asked = flush_requests_;
        Collect(&warnings);
      }
      Close(closed);
      // Messages first: a fence covers only pulls sent before it was asked for.
      Failed failed;
      Sent sent;
      const TimePoint sent_at = Clock::now();
      FlushPending(sent_at, &failed, &sent);
      for (const protocol::Transmit& t : out) Send(t, sent_at, &failed, &sent);
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (flushed_ != flush_asked) {
          flushed_ = flush_asked;
          cv_.notify_all();
        }
      }
      if (!failed.empty() || !fences.empty() || !sent.empty()) {
        std::lock_guard<std::mutex> lock(mu_);
        const TimePoint now = Clock::now();
        for (auto& [endpoint, id] : sent) session_->OnSent(endpoint, id, now);
        for (auto& [endpoint, id, why] : failed) session_->OnSendFailed(endpoint, id, why, now);
        for (protocol::FenceRequest& fence : fences) {
          if (engine_->fences_writes() && !fence.write_keys.empty()) {
            fence_queue_.push_back(std::move(fence));  // the fencer thread revokes the keys
            continue;
          }
          // A data plane whose peers write one-sided cannot fence them from this side: say so,
          // and the session waits for the peer's late answer instead of releasing.
          session_->OnFenceDone(
              fence.id,
              Status(ErrorCode::kRejected,
                     fmt::format("the {} data plane does not fence writers (fence_writes off): "
                                 "cannot fence {} from the receiving side",
                                 engine_->backend(), fence.address)),
              now);
        }
        if (!fence_queue_.empty()) fence_cv_.notify_one();
        closed = session_->TakeClosedEndpoints();
        Collect(&warnings);
      }
      Close(closed);
      Warn(warnings);
      warnings.clear();
    }
  }

  // The fencer thread: revokes the write keys of the fences the session asks for and answers
  // it. Its own thread, because a revocation waits for writes already landing under its keys
  // and the I/O thread never waits. It takes every queued fence at once, revokes all their keys
  // first (refused from then on), then waits for the ones still landing until one shared
  // deadline (kFenceDrain): a stalled writer delays the others' answers by at most that.
  void FenceMain() {
    for (;;) {
      std::deque<protocol::FenceRequest> fences;
      {
        std::unique_lock<std::mutex> lock(mu_);
        fence_cv_.wait(lock, [&] { return stopping_ || !fence_queue_.empty(); });
        if (stopping_) return;
        fences.swap(fence_queue_);
      }
      std::vector<Status> results;
      results.reserve(fences.size());
      for (const protocol::FenceRequest& fence : fences) {
        results.push_back(engine_->RevokeWriteKeys(fence.write_keys, Clock::now()));
      }
      const TimePoint deadline = Clock::now() + kFenceDrain;
      for (std::size_t i = 0; i < fences.size(); ++i) {
        if (results[i].code() == ErrorCode::kTimeout) {
          results[i] = engine_->RevokeWriteKeys(fences[i].write_keys, deadline);
        }
        if (!results[i].ok()) {
          results[i] = Status(results[i].code(), fmt::format("fencing {}: {}", fences[i].address,
                                                             results[i].message()));
        }
      }
      Run([&](protocol::DecodeSession& s, TimePoint now) {
        for (std::size_t i = 0; i < fences.size(); ++i) s.OnFenceDone(fences[i].id, results[i], now);
      });
    }
  }

  const DecodeWorkerOptions options_;
  const std::shared_ptr<transport::Engine> engine_;
  const WarningSink warn_;
  KvMemory memory_;
  control::EngineDirectory directory_;  // runs lookups; thread-safe
  int wake_fd_ = -1;

  mutable std::mutex mu_;  // guards the session and everything below it
  std::optional<protocol::DecodeSession> session_;
  std::condition_variable cv_;         // finished_ has something, or stopping
  std::condition_variable lookup_cv_;  // lookup_queue_ has something, or stopping
  bool stopping_ = false;
  bool stop_started_ = false;  // Stop() called (it may still wait for the flush)
  bool stopped_ = false;       // Stop() is done: threads joined, memory deregistered
  std::uint64_t flush_requests_ = 0;  // Stop()'s ask: send what the session has now
  std::uint64_t flushed_ = 0;         // the I/O thread sent what was asked up to this
  DecodeFinished finished_;
  std::deque<protocol::LookupRequest> lookup_queue_;
  std::condition_variable fence_cv_;  // fence_queue_ has something, or stopping
  std::deque<protocol::FenceRequest> fence_queue_;

  // I/O thread only.
  zmq::context_t context_{1};
  std::map<protocol::EndpointId, zmq::socket_t> sockets_;
  std::map<protocol::EndpointId, std::deque<Pending>> pending_;  // in send order, per endpoint
  std::mt19937_64 routing_random_{std::random_device{}()};

  std::thread io_;
  std::vector<std::thread> lookups_;
  std::thread fencer_;
};

// ---------------------------------------------------------------------------------------------

Result<std::unique_ptr<DecodeWorker>> DecodeWorker::Start(DecodeWorkerOptions options,
                                                          std::shared_ptr<transport::Engine> engine,
                                                          WarningSink warn) {
  if (engine == nullptr) return Err(ErrorCode::kInvalidArgument, "decode worker: no transport");
  if (options.cluster_secret && !control::CurveAvailable()) {
    return Err(ErrorCode::kInvalidArgument,
               "decode worker: a cluster secret needs CURVE, and this libzmq was built without it");
  }
  if (Status valid = protocol::DecodeSession::ValidateOptions(SessionOptions(options, {}));
      !valid.ok()) {
    return Err(ErrorCode::kInvalidArgument, "decode worker: " + valid.message());
  }
  auto impl = std::make_unique<Impl>(std::move(options), std::move(engine), std::move(warn));
  if (Status status = impl->Init(); !status.ok()) return tl::unexpected(std::move(status));
  return std::unique_ptr<DecodeWorker>(new DecodeWorker(std::move(impl)));
}

DecodeWorker::DecodeWorker(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DecodeWorker::~DecodeWorker() = default;  // Impl's destructor stops, joins and deregisters

std::byte* DecodeWorker::kv(std::size_t plane) const { return impl_->kv(plane); }
std::size_t DecodeWorker::num_planes() const { return impl_->num_planes(); }
const DecodeWorkerOptions& DecodeWorker::options() const { return impl_->options(); }
void DecodeWorker::OnNewRequest(const core::RequestId& request, const RemoteSource& source) {
  impl_->OnNewRequest(request, source);
}
Status DecodeWorker::StartLoad(const core::RequestId& request, const RemoteSource& source,
                               std::vector<core::BlockId> blocks) {
  return impl_->StartLoad(request, source, std::move(blocks));
}
void DecodeWorker::RequestFinished(const core::RequestId& request) {
  impl_->RequestFinished(request);
}
void DecodeWorker::ReleaseTransfer(const RemoteSource& source) { impl_->ReleaseTransfer(source); }
void DecodeWorker::EngineDown(const core::EngineId& engine, const Status& why) {
  impl_->EngineDown(engine, why);
}
void DecodeWorker::ProcessGone(const core::EngineId& engine, const std::string& incarnation,
                               const Status& why) {
  impl_->ProcessGone(engine, incarnation, why);
}
DecodeFinished DecodeWorker::TakeFinished() { return impl_->TakeFinished(); }
DecodeFinished DecodeWorker::WaitFinished(TimePoint deadline) {
  return impl_->WaitFinished(deadline);
}
DecodeWorkerStats DecodeWorker::Stats() const { return impl_->Stats(); }
void DecodeWorker::Stop() { impl_->Stop(); }

}  // namespace kvferry::runtime
