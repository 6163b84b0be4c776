#include "control/side_channel_listener.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <utility>
#include <variant>
#include <zmq.hpp>

#include "kvferry/core/thread_name.h"
#include "wire/messages.h"

namespace kvferry::control {
namespace {

using core::Clock;
using core::TimePoint;

// ZeroMQ's fixed ZAP endpoint (RFC 27), per context: each listener has its own context.
constexpr const char* kZapEndpoint = "inproc://zeromq.zap.01";
constexpr const char* kMonitorEndpoint = "inproc://kvferry-side-channel-monitor";
// The handshake verdicts counted as authentication refusals. A connection that merely ends
// mid-handshake (HANDSHAKE_FAILED_NO_DETAIL: a port probe, a peer that closed) is not one; it
// is counted apart, as abandoned.
constexpr int kRefusalEvents =
    ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH;
constexpr int kMonitoredEvents = kRefusalEvents | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL;

// Why a handshake failed, in words for the log.
std::string RefusalReason(std::uint16_t event, std::uint32_t value) {
  if (event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) {
    return fmt::format("ZAP refused its CURVE client key (status {}): not the cluster's", value);
  }
  switch (value) {
    case ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
      return "it did not use CURVE: a decoder without the cluster secret?";
    case ZMQ_PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
      return "its CURVE keys are not the cluster's: another cluster secret?";
    default:
      return fmt::format("handshake protocol error {:#x}", value);
  }
}

}  // namespace

class PrefillListener::Impl {
 public:
  struct Command {
    enum class Kind : std::uint8_t {
      kAdmit,
      kPrefillDone,
      kLayersReady,
      kEngineFinished,
      kRefuse,
      kWriteDone,
      kStats,
      kStop
    };
    Kind kind = Kind::kStop;
    core::TransferId id;
    std::uint64_t handle = 0;
    std::vector<core::BlockId> blocks;  // kPrefillDone, kLayersReady
    std::vector<std::uint32_t> planes;  // kLayersReady
    std::optional<std::promise<Status>> done;
    std::optional<std::promise<ListenerStats>> stats;
    // kWriteDone
    std::uint64_t ticket = 0;
    protocol::WriteOutcome outcome;
    Status why;  // kRefuse
  };
  Impl(ListenerOptions options, std::shared_ptr<KvWriter> writer, HoldEventCallback on_hold_event)
      : options_(std::move(options)),
        writer_(std::move(writer)),
        on_hold_event_(std::move(on_hold_event)),
        session_(options_.session) {}

  ~Impl() {
    (void)Stop();
    if (wake_fd_ >= 0) ::close(wake_fd_);
  }

  Status Init() {
    wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) return Status(ErrorCode::kInternal, fmt::format("eventfd: errno {}", errno));
    try {
      router_ = zmq::socket_t(ctx_, zmq::socket_type::router);
      // Replies to a vanished peer fail loudly (counted) instead of vanishing silently.
      router_.set(zmq::sockopt::router_mandatory, 1);
      // A D socket that reconnects keeps its identity (D sets one): hand it the identity, so
      // the answers to its pulls in progress reach it instead of being dropped.
      router_.set(zmq::sockopt::router_handover, 1);
      // Frames up to 1 MiB over the protocol limit still get an ERROR reply; beyond that ZeroMQ
      // drops the connection before we would buffer the frame.
      router_.set(zmq::sockopt::maxmsgsize,
                  static_cast<std::int64_t>(wire::kMaxFrameBytes + (std::size_t{1} << 20)));
      router_.set(zmq::sockopt::linger, static_cast<int>(options_.linger.count()));
      // A peer that connects and never completes its handshake is dropped after 5 s (libzmq's
      // default is 30 s): half-open strangers cannot pile up sessions for long.
      router_.set(zmq::sockopt::handshake_ivl, 5000);
      if (options_.cluster_secret) {
        if (Status s = SecureRouter(*options_.cluster_secret); !s.ok()) return s;
      }
      router_.bind(options_.endpoint);
      endpoint_ = router_.get(zmq::sockopt::last_endpoint);
    } catch (const zmq::error_t& e) {
      return Status(ErrorCode::kUnavailable,
                    fmt::format("side channel cannot bind {}: {}", options_.endpoint, e.what()));
    }
    for (std::size_t i = 0; i < options_.num_senders; ++i) {
      senders_.emplace_back([this] {
        core::NameThisThread("kvf-p-send");
        SenderMain();
      });
    }
    listener_ = std::thread([this] {
      core::NameThisThread("kvf-p-listen");
      ListenerMain();
    });
    return Status::Ok();
  }

  const std::string& endpoint() const { return endpoint_; }

  // Makes the ROUTER a CURVE server behind this listener's ZAP handler, and monitors its
  // handshakes. Called by Init before the bind, so no peer ever connects unauthenticated.
  Status SecureRouter(const ClusterSecret& secret) {
    if (!CurveAvailable()) {
      return Status(ErrorCode::kInvalidArgument,
                    "a cluster secret needs CURVE, and this libzmq was built without it");
    }
    if (zmq_z85_decode(cluster_client_key_.data(), secret.curve_client().public_z85.c_str()) ==
        nullptr) {
      return Status(ErrorCode::kInternal, "derived CURVE client key is not Z85");
    }
    try {
      // The ZAP handler must serve before the first handshake.
      zap_ = zmq::socket_t(ctx_, zmq::socket_type::rep);
      zap_.set(zmq::sockopt::linger, 0);
      zap_.bind(kZapEndpoint);
      if (zmq_socket_monitor(router_.handle(), kMonitorEndpoint, kMonitoredEvents) != 0) {
        throw zmq::error_t();
      }
      monitor_ = zmq::socket_t(ctx_, zmq::socket_type::pair);
      monitor_.set(zmq::sockopt::linger, 0);
      // Unbounded toward us (an inproc pipe is unbounded when the connecting side's receive
      // limit is 0): libzmq's I/O thread sends monitor events blocking, so a bounded pipe the
      // listener is slow to drain (say while Stop() waits for writes) could stall it.
      monitor_.set(zmq::sockopt::rcvhwm, 0);
      monitor_.connect(kMonitorEndpoint);
      router_.set(zmq::sockopt::curve_server, true);
      router_.set(zmq::sockopt::curve_secretkey, secret.curve_server().secret_z85);
      router_.set(zmq::sockopt::zap_domain, std::string(kZapDomain));
    } catch (const zmq::error_t& e) {
      return Status(ErrorCode::kInternal,
                    fmt::format("side channel: cannot set up CURVE authentication: {}", e.what()));
    }
    return Status::Ok();
  }

  std::future<Status> PostEngineCommand(Command::Kind kind, const core::TransferId& id,
                                        std::uint64_t handle,
                                        std::vector<core::BlockId> blocks = {},
                                        Status why = {}, std::vector<std::uint32_t> planes = {});
  ListenerStats Stats(std::chrono::milliseconds wait);
  Status Stop();

 private:
  // ---- any thread ----
  void Post(Command command);
  void Wake();

  // ---- sender threads ----
  void SenderMain();

  // ---- listener thread ----
  void ListenerMain();
  int PollTimeoutMs(TimePoint now) const;
  bool ReadMessage();
  void ReadMonitor();      // counts refused handshakes
  void ServeZap();         // answers ZAP requests: only the cluster's client key passes
  bool ProcessCommands();  // true once kStop was seen
  // Carries out what the session decided: replies, writes, hold events.
  void Pump();
  void Send(const protocol::PeerAddress& peer, const std::vector<std::uint8_t>& payload);
  ListenerStats Snapshot() const;
  void Publish();
  void Drain();
  void WaitForWrites(TimePoint deadline);

  const ListenerOptions options_;
  const std::shared_ptr<KvWriter> writer_;
  const HoldEventCallback on_hold_event_;
  std::string endpoint_;
  int wake_fd_ = -1;

  // Shared: command queue and published stats.
  std::mutex mu_;
  std::deque<Command> commands_;
  bool accepting_ = true;  // false once Stop() began: engine calls answer kCancelled
  ListenerStats published_;

  // Stop() is idempotent and may race with the destructor.
  std::mutex stop_mu_;
  bool stopped_ = false;
  Status stop_result_;

  // Shared with the senders: jobs not yet started.
  std::mutex job_mu_;
  std::condition_variable job_cv_;
  bool noted_ahead_ = false;  // listener thread: the first layer write was logged
  std::deque<protocol::WriteJob> jobs_;
  bool senders_quit_ = false;

  // Listener thread only.
  zmq::context_t ctx_{1};
  zmq::socket_t router_;
  zmq::socket_t zap_;      // with a cluster secret: the ZAP handler (REP)
  zmq::socket_t monitor_;  // with a cluster secret: the ROUTER's handshake events (PAIR)
  std::array<std::uint8_t, 32> cluster_client_key_{};
  protocol::PrefillSession session_;
  std::uint64_t responses_sent_ = 0;
  std::uint64_t replies_dropped_ = 0;
  std::uint64_t auth_refusals_ = 0;
  std::uint64_t handshakes_abandoned_ = 0;
  Status drain_result_;

  std::vector<std::thread> senders_;
  std::thread listener_;
};

// ---------------------------------------------------------------------------------------------
// Any thread.

void PrefillListener::Impl::Wake() {
  const std::uint64_t one = 1;
  // A full counter (never in practice) still leaves the fd readable, so a failed write is fine.
  [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
}

void PrefillListener::Impl::Post(Command command) {
  bool was_empty;
  {
    std::lock_guard<std::mutex> lock(mu_);
    was_empty = commands_.empty();
    commands_.push_back(std::move(command));
  }
  if (was_empty) Wake();
}

std::future<Status> PrefillListener::Impl::PostEngineCommand(Command::Kind kind,
                                                             const core::TransferId& id,
                                                             std::uint64_t handle,
                                                             std::vector<core::BlockId> blocks,
                                                             Status why,
                                                             std::vector<std::uint32_t> planes) {
  Command command;
  command.planes = std::move(planes);
  command.kind = kind;
  command.why = std::move(why);
  command.id = id;
  command.handle = handle;
  command.blocks = std::move(blocks);
  command.done.emplace();
  std::future<Status> result = command.done->get_future();
  bool was_empty = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!accepting_) {
      command.done->set_value(Status(ErrorCode::kCancelled, "prefill listener is stopping"));
      return result;
    }
    was_empty = commands_.empty();
    commands_.push_back(std::move(command));
  }
  if (was_empty) Wake();
  return result;
}

ListenerStats PrefillListener::Impl::Stats(std::chrono::milliseconds wait) {
  Command command;
  command.kind = Command::Kind::kStats;
  command.stats.emplace();
  std::future<ListenerStats> result = command.stats->get_future();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!accepting_) return published_;
    commands_.push_back(std::move(command));
  }
  Wake();
  if (result.wait_for(wait) == std::future_status::ready) return result.get();
  std::lock_guard<std::mutex> lock(mu_);
  return published_;
}

Status PrefillListener::Impl::Stop() {
  std::lock_guard<std::mutex> stop_lock(stop_mu_);
  if (stopped_) return stop_result_;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (accepting_ && listener_.joinable()) {
      accepting_ = false;
      Command command;
      command.kind = Command::Kind::kStop;
      commands_.push_back(std::move(command));
    }
    accepting_ = false;
  }
  if (listener_.joinable()) {
    Wake();
    listener_.join();
  }
  {
    std::lock_guard<std::mutex> lock(job_mu_);
    senders_quit_ = true;
  }
  job_cv_.notify_all();
  // Blocks only if a KvWriter ignores CancelWrites (documented in KvWriter).
  for (std::thread& t : senders_) t.join();
  senders_.clear();
  // Commands nobody will run now: engine calls and stats queued before Stop.
  std::deque<Command> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    left.swap(commands_);
  }
  for (Command& c : left) {
    if (c.done) c.done->set_value(Status(ErrorCode::kCancelled, "prefill listener stopped"));
    if (c.stats) c.stats->set_value(published_);
  }
  stopped_ = true;
  stop_result_ = drain_result_;
  return stop_result_;
}

// ---------------------------------------------------------------------------------------------
// Sender threads.

void PrefillListener::Impl::SenderMain() {
  for (;;) {
    protocol::WriteJob job;
    {
      std::unique_lock<std::mutex> lock(job_mu_);
      job_cv_.wait(lock, [this] { return senders_quit_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    protocol::WriteOutcome outcome;
    try {
      outcome = writer_->Write(*job.context, job);
    } catch (const std::exception& e) {
      // Whether a throwing writer left bytes in flight is unknown: D must quarantine.
      outcome = protocol::WriteOutcome::Unsettled(
          Status(ErrorCode::kInternal, fmt::format("KvWriter threw: {}", e.what())));
    } catch (...) {
      outcome = protocol::WriteOutcome::Unsettled(Status(ErrorCode::kInternal, "KvWriter threw"));
    }
    Command done;
    done.kind = Command::Kind::kWriteDone;
    done.ticket = job.ticket;
    done.outcome = std::move(outcome);
    Post(std::move(done));  // always accepted: the listener drains writes while stopping
  }
}

// ---------------------------------------------------------------------------------------------
// Listener thread.

void PrefillListener::Impl::ListenerMain() {
  bool stop = false;
  const bool secured = zap_.handle() != nullptr;
  while (!stop) {
    zmq::pollitem_t items[] = {
        {router_.handle(), 0, ZMQ_POLLIN, 0},
        {nullptr, wake_fd_, ZMQ_POLLIN, 0},
        {zap_.handle(), 0, ZMQ_POLLIN, 0},
        {monitor_.handle(), 0, ZMQ_POLLIN, 0},
    };
    try {
      zmq::poll(items, secured ? 4 : 2, std::chrono::milliseconds(PollTimeoutMs(Clock::now())));
    } catch (const zmq::error_t& e) {
      if (e.num() != EINTR) spdlog::error("side channel {}: poll failed: {}", endpoint_, e.what());
    }
    if (secured && (items[2].revents & ZMQ_POLLIN)) ServeZap();
    if (secured && (items[3].revents & ZMQ_POLLIN)) ReadMonitor();
    if (items[0].revents & ZMQ_POLLIN) {
      // Bounded so engine commands and the expiry pass are not starved by a flood.
      for (int i = 0; i < 64 && ReadMessage(); ++i) {
      }
    }
    if (items[1].revents & ZMQ_POLLIN) {
      std::uint64_t count;
      [[maybe_unused]] ssize_t n = ::read(wake_fd_, &count, sizeof(count));
    }
    stop = ProcessCommands();
    const TimePoint now = Clock::now();
    if (session_.NextDeadline() <= now) session_.OnTimeout(now);
    Pump();
    Publish();
  }
  Drain();
  Publish();
}

int PrefillListener::Impl::PollTimeoutMs(TimePoint now) const {
  // Capped so that a lost wake-up can cost at most a second, never a hang.
  constexpr int kMaxMs = 1000;
  const TimePoint next = session_.NextDeadline();
  if (next == core::kNever) return kMaxMs;
  if (next <= now) return 0;
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(next - now).count();
  return static_cast<int>(std::min<std::int64_t>(ms, kMaxMs));
}

bool PrefillListener::Impl::ReadMessage() {
  zmq::message_t frame;
  std::optional<std::size_t> got;
  try {
    got = router_.recv(frame, zmq::recv_flags::dontwait);
  } catch (const zmq::error_t& e) {
    spdlog::error("side channel {}: recv failed: {}", endpoint_, e.what());
    return false;
  }
  if (!got) return false;
  protocol::PeerAddress peer(frame.data<char>(), frame.size());
  // docs/protocol.md §1: exactly [identity, payload]. The rest of a multipart message is
  // already here (libzmq delivers a multipart message whole, so a peer can make it large:
  // bounded only by ZMQ_MAXMSGSIZE per frame, until peers are authenticated); frames beyond the
  // payload are read and dropped.
  std::size_t frames = 1;
  zmq::message_t payload;
  bool more = frame.more();
  while (more) {
    zmq::message_t next;
    try {
      // The remaining parts of a multipart message arrive atomically with the first.
      if (!router_.recv(next, zmq::recv_flags::dontwait)) break;
    } catch (const zmq::error_t& e) {
      spdlog::error("side channel {}: recv of a message part failed: {}", endpoint_, e.what());
      return false;
    }
    more = next.more();
    if (++frames == 2) payload = std::move(next);
  }
  if (frames != 2) {
    // With more than two frames the second is still a payload whose id may be readable.
    session_.RejectMessage(
        peer, ErrorCode::kProtocol,
        fmt::format("expected 2 frames [identity, payload], got {}", frames),
        frames > 2 ? wire::PeekId(static_cast<const std::uint8_t*>(payload.data()), payload.size())
                   : 0);
  } else {
    session_.OnMessage(peer, {static_cast<const std::uint8_t*>(payload.data()), payload.size()},
                       Clock::now());
  }
  Pump();  // renewals are answered before the next message is read
  return true;
}

void PrefillListener::Impl::ServeZap() {
  // ZAP (RFC 27) request: version, request id, domain, address, routing id, mechanism,
  // credentials (CURVE: the client's 32-byte public key).
  for (;;) {
    std::vector<zmq::message_t> parts;
    try {
      zmq::message_t part;
      if (!zap_.recv(part, zmq::recv_flags::dontwait)) return;
      bool more = part.more();
      parts.push_back(std::move(part));
      while (more) {  // a REP socket must read the whole request before it may reply
        zmq::message_t next;
        if (!zap_.recv(next, zmq::recv_flags::dontwait)) break;
        more = next.more();
        parts.push_back(std::move(next));
      }
    } catch (const zmq::error_t& e) {
      spdlog::error("side channel {}: ZAP receive failed: {}", endpoint_, e.what());
      return;
    }
    auto text = [&](std::size_t i) {
      return i < parts.size() ? parts[i].to_string_view() : std::string_view();
    };
    const bool member =
        parts.size() == 7 && text(0) == "1.0" && text(2) == kZapDomain && text(5) == "CURVE" &&
        parts[6].size() == cluster_client_key_.size() &&
        std::memcmp(parts[6].data(), cluster_client_key_.data(), cluster_client_key_.size()) == 0;
    const std::string request_id(text(1));
    try {
      zap_.send(zmq::buffer(std::string_view("1.0")), zmq::send_flags::sndmore);
      zap_.send(zmq::buffer(request_id), zmq::send_flags::sndmore);
      zap_.send(zmq::buffer(std::string_view(member ? "200" : "400")), zmq::send_flags::sndmore);
      zap_.send(zmq::buffer(std::string_view(member ? "OK" : "not a cluster member")),
                zmq::send_flags::sndmore);
      zap_.send(zmq::buffer(std::string_view(member ? "kvferry-cluster" : "")),
                zmq::send_flags::sndmore);
      zap_.send(zmq::const_buffer(nullptr, 0), zmq::send_flags::none);
    } catch (const zmq::error_t& e) {
      spdlog::error("side channel {}: ZAP reply failed: {}", endpoint_, e.what());
    }
  }
}

void PrefillListener::Impl::ReadMonitor() {
  for (;;) {
    zmq::message_t event_frame;
    zmq::message_t address_frame;
    try {
      if (!monitor_.recv(event_frame, zmq::recv_flags::dontwait)) return;
      if (event_frame.more()) (void)monitor_.recv(address_frame);
    } catch (const zmq::error_t&) {
      return;
    }
    if (event_frame.size() < 6) continue;
    std::uint16_t event = 0;
    std::uint32_t value = 0;
    std::memcpy(&event, event_frame.data(), sizeof(event));
    std::memcpy(&value, static_cast<const char*>(event_frame.data()) + sizeof(event),
                sizeof(value));
    if (event == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) {
      ++handshakes_abandoned_;
      continue;
    }
    if ((event & kRefusalEvents) == 0) continue;
    ++auth_refusals_;
    // Loud at 1, 10, 100, ... refusals: a misconfigured D reconnects every 100 ms.
    std::uint64_t n = auth_refusals_;
    while (n % 10 == 0) n /= 10;
    if (n == 1) {
      spdlog::warn("side channel {}: refused an unauthenticated peer ({}); {} refusal(s) so far",
                   endpoint_, RefusalReason(event, value), auth_refusals_);
    }
  }
}

void PrefillListener::Impl::Pump() {
  for (protocol::Outgoing& out : session_.TakeOutgoing()) {
    std::visit([&](const auto& message) { Send(out.peer, wire::Encode(message)); }, out.message);
  }
  std::vector<protocol::WriteJob> writes = session_.TakeWrites();
  if (!noted_ahead_) {
    for (const protocol::WriteJob& job : writes) {
      if (!job.ahead) continue;
      // Once per process: an operator (and the tests inside vLLM) can see that layers leave
      // before their prefill ends; layer_writes in the metrics counts them.
      noted_ahead_ = true;
      spdlog::info("side channel {}: layers of {} leave for decoder {} before its prefill ended "
                   "(layer writes)",
                   endpoint_, job.transfer_id, job.context->d_engine_id);
      break;
    }
  }
  if (!writes.empty()) {
    {
      std::lock_guard<std::mutex> lock(job_mu_);
      for (protocol::WriteJob& job : writes) jobs_.push_back(std::move(job));
    }
    // One sender per job: waking all of them for one write cost a pull ~4 context switches on
    // its critical path (perf sched, `kvferry bench handoff`, docs/performance.md).
    for (std::size_t i = 0; i < std::min(writes.size(), senders_.size()); ++i) {
      job_cv_.notify_one();
    }
  }
  for (const core::HoldEvent& event : session_.TakeEngineEvents()) {
    if (!on_hold_event_) continue;
    try {
      on_hold_event_(event);
    } catch (const std::exception& e) {
      spdlog::error("side channel {}: hold event callback threw: {}", endpoint_, e.what());
    }
  }
}

bool PrefillListener::Impl::ProcessCommands() {
  std::deque<Command> batch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    batch.swap(commands_);
  }
  bool stop = false;
  for (Command& c : batch) {
    const TimePoint now = Clock::now();
    Status status;
    switch (c.kind) {
      case Command::Kind::kAdmit:
        status = session_.Admit(c.id, c.handle, now);
        break;
      case Command::Kind::kPrefillDone:
        status = session_.PrefillDone(c.id, std::move(c.blocks), now);
        break;
      case Command::Kind::kLayersReady:
        status = session_.LayersReady(c.id, c.blocks, c.planes, now);
        break;
      case Command::Kind::kEngineFinished:
        session_.EngineFinished(c.id, now);
        break;
      case Command::Kind::kRefuse:
        status = session_.Refuse(c.id, std::move(c.why), now);
        break;
      case Command::Kind::kWriteDone:
        session_.OnWriteDone(c.ticket, c.outcome, now);
        break;
      case Command::Kind::kStats:
        c.stats->set_value(Snapshot());
        break;
      case Command::Kind::kStop:
        stop = true;
        break;
    }
    Pump();
    if (c.done) c.done->set_value(std::move(status));
  }
  return stop;
}

void PrefillListener::Impl::Send(const protocol::PeerAddress& peer,
                                 const std::vector<std::uint8_t>& payload) {
  try {
    if (router_.send(zmq::buffer(peer), zmq::send_flags::sndmore | zmq::send_flags::dontwait) &&
        router_.send(zmq::buffer(payload), zmq::send_flags::dontwait)) {
      ++responses_sent_;
      return;
    }
  } catch (const zmq::error_t& e) {
    spdlog::debug("side channel {}: reply not sent: {}", endpoint_, e.what());
  }
  // The peer disconnected or stopped reading: it will time out and settle on its side.
  ++replies_dropped_;
}

ListenerStats PrefillListener::Impl::Snapshot() const {
  ListenerStats s;
  static_cast<protocol::PrefillStats&>(s) = session_.stats();
  s.responses_sent = responses_sent_;
  s.replies_dropped = replies_dropped_;
  s.auth_refusals = auth_refusals_;
  s.handshakes_abandoned = handshakes_abandoned_;
  return s;
}

void PrefillListener::Impl::Publish() {
  ListenerStats s = Snapshot();
  std::lock_guard<std::mutex> lock(mu_);
  published_ = s;
}

void PrefillListener::Impl::Drain() {
  const TimePoint now = Clock::now();
  // Parked pulls: their prefill will not be waited for any more.
  session_.Shutdown(now);
  // Queued writes that no sender started: they wrote nothing, so D may reuse the blocks.
  std::deque<protocol::WriteJob> queued;
  {
    std::lock_guard<std::mutex> lock(job_mu_);
    queued.swap(jobs_);
  }
  for (const protocol::WriteJob& job : queued) {
    session_.OnWriteDone(
        job.ticket,
        protocol::WriteOutcome::Failed(
            Status(ErrorCode::kCancelled, "prefill worker shut down before the write started")),
        now);
  }
  Pump();
  WaitForWrites(Clock::now() + options_.drain_timeout);
  if (session_.writes_in_flight() > 0) {
    spdlog::warn("side channel {}: {} writes still running after {} ms; cancelling them", endpoint_,
                 session_.writes_in_flight(), options_.drain_timeout.count());
    writer_->CancelWrites();
    WaitForWrites(Clock::now() + options_.cancel_grace);
  }
  if (session_.writes_in_flight() > 0) {
    drain_result_ = Status(ErrorCode::kTimeout,
                           fmt::format("{} writes did not return by shutdown; their pulls are left "
                                       "unanswered so D quarantines the blocks",
                                       session_.writes_in_flight()));
  }
  router_.close();  // linger (set at bind) lets the last replies go out (stops the monitor)
  if (monitor_.handle() != nullptr) ReadMonitor();
  monitor_.close();
  zap_.close();
}

void PrefillListener::Impl::WaitForWrites(TimePoint deadline) {
  while (session_.writes_in_flight() > 0) {
    const TimePoint now = Clock::now();
    if (now >= deadline) return;
    zmq::pollitem_t item = {nullptr, wake_fd_, ZMQ_POLLIN, 0};
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(deadline - now);
    try {
      zmq::poll(&item, 1, std::min(ms, std::chrono::milliseconds(100)));
    } catch (const zmq::error_t&) {
    }
    if (item.revents & ZMQ_POLLIN) {
      std::uint64_t count;
      [[maybe_unused]] ssize_t n = ::read(wake_fd_, &count, sizeof(count));
    }
    (void)ProcessCommands();  // engine calls were refused at Post; only writes and stats remain
    Publish();
  }
}

// ---------------------------------------------------------------------------------------------

Result<std::unique_ptr<PrefillListener>> PrefillListener::Start(ListenerOptions options,
                                                                std::shared_ptr<KvWriter> writer,
                                                                HoldEventCallback on_hold_event) {
  if (writer == nullptr) return Err(ErrorCode::kInvalidArgument, "KvWriter is null");
  if (options.num_senders == 0) return Err(ErrorCode::kInvalidArgument, "num_senders is 0");
  if (Status valid = protocol::PrefillSession::ValidateOptions(options.session);
      !valid.ok()) {
    return tl::unexpected<Status>(std::move(valid));
  }
  auto impl =
      std::make_unique<Impl>(std::move(options), std::move(writer), std::move(on_hold_event));
  Status status = impl->Init();
  if (!status.ok()) return tl::unexpected<Status>(std::move(status));
  return std::unique_ptr<PrefillListener>(new PrefillListener(std::move(impl)));
}

PrefillListener::PrefillListener(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PrefillListener::~PrefillListener() = default;  // Impl's destructor stops and joins

const std::string& PrefillListener::endpoint() const { return impl_->endpoint(); }

std::future<Status> PrefillListener::Admit(const core::TransferId& id, std::uint64_t handle) {
  return impl_->PostEngineCommand(Impl::Command::Kind::kAdmit, id, handle);
}
std::future<Status> PrefillListener::PrefillDone(const core::TransferId& id,
                                                 std::vector<core::BlockId> blocks) {
  return impl_->PostEngineCommand(Impl::Command::Kind::kPrefillDone, id, 0, std::move(blocks));
}
std::future<Status> PrefillListener::LayersReady(const core::TransferId& id,
                                                 std::vector<core::BlockId> blocks,
                                                 std::vector<std::uint32_t> planes) {
  return impl_->PostEngineCommand(Impl::Command::Kind::kLayersReady, id, 0, std::move(blocks), {},
                                  std::move(planes));
}
std::future<Status> PrefillListener::EngineFinished(const core::TransferId& id) {
  return impl_->PostEngineCommand(Impl::Command::Kind::kEngineFinished, id, 0);
}
std::future<Status> PrefillListener::Refuse(const core::TransferId& id, Status why) {
  return impl_->PostEngineCommand(Impl::Command::Kind::kRefuse, id, 0, {}, std::move(why));
}
ListenerStats PrefillListener::Stats(std::chrono::milliseconds wait) { return impl_->Stats(wait); }
Status PrefillListener::Stop() { return impl_->Stop(); }

}  // namespace kvferry::control
