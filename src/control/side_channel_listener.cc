#include "control/side_channel_listener.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <utility>
#include <variant>
#include <zmq.hpp>

#include "wire/messages.h"

namespace kvferry::control {
namespace {

using core::Clock;
using core::TimePoint;

protocol::PrefillSessionOptions SessionOptions(const ListenerOptions& o) {
  protocol::PrefillSessionOptions s;
  s.engine_id = o.engine_id;
  s.hold = o.hold;
  s.p_tp_size = o.p_tp_size;
  s.p_tp_rank = o.p_tp_rank;
  s.max_cached_descriptors = o.max_cached_descriptors;
  s.max_pulls_in_progress = o.max_pulls_in_progress;
  s.max_parked_requests = o.max_parked_requests;
  return s;
}

}  // namespace

class PrefillListener::Impl {
 public:
  struct Command {
    enum class Kind : std::uint8_t {
      kAdmit,
      kPrefillDone,
      kEngineFinished,
      kRefuse,
      kWriteDone,
      kStats,
      kStop
    };
    Kind kind = Kind::kStop;
    core::TransferId id;
    std::uint64_t handle = 0;
    std::uint32_t num_blocks = 0;
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
        session_(SessionOptions(options_)) {}

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
      router_.bind(options_.endpoint);
      endpoint_ = router_.get(zmq::sockopt::last_endpoint);
    } catch (const zmq::error_t& e) {
      return Status(ErrorCode::kUnavailable,
                    fmt::format("side channel cannot bind {}: {}", options_.endpoint, e.what()));
    }
    for (std::size_t i = 0; i < options_.num_senders; ++i) {
      senders_.emplace_back([this] { SenderMain(); });
    }
    listener_ = std::thread([this] { ListenerMain(); });
    return Status::Ok();
  }

  const std::string& endpoint() const { return endpoint_; }

  std::future<Status> PostEngineCommand(Command::Kind kind, const core::TransferId& id,
                                        std::uint64_t handle, std::uint32_t num_blocks,
                                        Status why = {});
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
  std::deque<protocol::WriteJob> jobs_;
  bool senders_quit_ = false;

  // Listener thread only.
  zmq::context_t ctx_{1};
  zmq::socket_t router_;
  protocol::PrefillSession session_;
  std::uint64_t responses_sent_ = 0;
  std::uint64_t replies_dropped_ = 0;
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
                                                             std::uint32_t num_blocks, Status why) {
  Command command;
  command.kind = kind;
  command.why = std::move(why);
  command.id = id;
  command.handle = handle;
  command.num_blocks = num_blocks;
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
  while (!stop) {
    zmq::pollitem_t items[] = {
        {router_.handle(), 0, ZMQ_POLLIN, 0},
        {nullptr, wake_fd_, ZMQ_POLLIN, 0},
    };
    try {
      zmq::poll(items, 2, std::chrono::milliseconds(PollTimeoutMs(Clock::now())));
    } catch (const zmq::error_t& e) {
      if (e.num() != EINTR) spdlog::error("side channel {}: poll failed: {}", endpoint_, e.what());
    }
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
    session_.RejectMessage(peer, ErrorCode::kProtocol,
                           fmt::format("expected 2 frames [identity, payload], got {}", frames));
  } else {
    session_.OnMessage(peer, {static_cast<const std::uint8_t*>(payload.data()), payload.size()},
                       Clock::now());
  }
  Pump();  // renewals are answered before the next message is read
  return true;
}

void PrefillListener::Impl::Pump() {
  for (protocol::Outgoing& out : session_.TakeOutgoing()) {
    std::visit([&](const auto& message) { Send(out.peer, wire::Encode(message)); }, out.message);
  }
  std::vector<protocol::WriteJob> writes = session_.TakeWrites();
  if (!writes.empty()) {
    {
      std::lock_guard<std::mutex> lock(job_mu_);
      for (protocol::WriteJob& job : writes) jobs_.push_back(std::move(job));
    }
    job_cv_.notify_all();
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
        status = session_.PrefillDone(c.id, c.num_blocks, now);
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
  router_.close();  // linger (set at bind) lets the last replies go out
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
  if (Status valid = protocol::PrefillSession::ValidateOptions(SessionOptions(options));
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
  return impl_->PostEngineCommand(Impl::Command::Kind::kAdmit, id, handle, 0);
}
std::future<Status> PrefillListener::PrefillDone(const core::TransferId& id,
                                                 std::uint32_t num_blocks) {
  return impl_->PostEngineCommand(Impl::Command::Kind::kPrefillDone, id, 0, num_blocks);
}
std::future<Status> PrefillListener::EngineFinished(const core::TransferId& id) {
  return impl_->PostEngineCommand(Impl::Command::Kind::kEngineFinished, id, 0, 0);
}
std::future<Status> PrefillListener::Refuse(const core::TransferId& id, Status why) {
  return impl_->PostEngineCommand(Impl::Command::Kind::kRefuse, id, 0, 0, std::move(why));
}
ListenerStats PrefillListener::Stats(std::chrono::milliseconds wait) { return impl_->Stats(wait); }
Status PrefillListener::Stop() { return impl_->Stop(); }

}  // namespace kvferry::control
