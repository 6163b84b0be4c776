#include "control/side_channel_listener.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <zmq.hpp>

#include "kvferry/core/tp_plan.h"
#include "wire/messages.h"

namespace kvferry::control {
namespace {

using core::Clock;
using core::TimePoint;

std::string Truncated(std::string text) {
  if (text.size() > wire::kMaxTextBytes) text.resize(wire::kMaxTextBytes);
  return text;
}

std::string LeaseMsText(std::uint64_t ms) { return ms == 0 ? "off" : fmt::format("{} ms", ms); }

// Who a reply goes to: the ROUTER routing id of the D socket that sent the message.
struct Peer {
  std::string routing_id;
};

}  // namespace

class PrefillListener::Impl {
 public:
  struct Command {
    enum class Kind : std::uint8_t {
      kAdmit,
      kPrefillDone,
      kEngineFinished,
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
    std::uint64_t pull_key = 0;
    std::uint32_t wave = 0;
    std::uint32_t request = 0;
    Status write_status;
  };
  Impl(ListenerOptions options, std::shared_ptr<KvWriter> writer, HoldEventCallback on_hold_event)
      : options_(std::move(options)),
        writer_(std::move(writer)),
        on_hold_event_(std::move(on_hold_event)),
        table_(options_.hold),
        p_lease_ms_(static_cast<std::uint64_t>(
            std::chrono::duration_cast<std::chrono::milliseconds>(options_.hold.lease).count())) {}

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
                                        std::uint64_t handle, std::uint32_t num_blocks);
  ListenerStats Stats(std::chrono::milliseconds wait);
  Status Stop();

 private:
  friend class PrefillListener;

  struct Job {
    std::uint64_t pull_key = 0;
    std::uint32_t wave = 0;
    std::uint32_t request = 0;
    std::shared_ptr<const PullContext> context;
    WriteJob write;
  };

  // A set of requests of one pull answered together in one PullResponse once none of them is
  // still being written.
  struct Wave {
    std::uint32_t outstanding = 0;
    std::vector<core::RequestId> ok;
    std::vector<wire::RequestError> err;
  };

  struct PendingPull {
    Peer peer;
    std::uint64_t id = 0;  // the Pull's wire id, copied into every response
    std::shared_ptr<const PullContext> context;
    std::vector<wire::PullRequest> requests;
    std::uint32_t need_send = 0;
    std::optional<core::Duration> d_lease;
    std::size_t listed = 0;  // requests already sent in some ok/err
    std::map<std::uint32_t, Wave> waves;
    std::uint32_t next_wave = 0;
    std::uint64_t open_step = UINT64_MAX;  // the step in which `open_wave` accepts more
    std::uint32_t open_wave = 0;
  };

  struct ParkedRef {
    std::uint64_t pull_key;
    std::uint32_t request;
  };

  // ---- any thread ----
  void Post(Command command);
  void Wake();

  // ---- sender threads ----
  void SenderMain();

  // ---- listener thread ----
  void ListenerMain();
  int PollTimeoutMs(TimePoint now) const;
  bool ReadMessage();
  void HandleMessage(Peer peer, const zmq::message_t& payload);
  void HandleRenewal(const Peer& peer, const zmq::message_t& payload, TimePoint now);
  void HandlePull(Peer peer, const zmq::message_t& payload, TimePoint now);
  void ReplyPullError(const Peer& peer, ErrorCode code, std::string message, std::uint64_t id = 0);
  void Send(const Peer& peer, const std::vector<std::uint8_t>& payload);
  void AdmitRequest(PendingPull& pull, std::uint64_t key, std::uint32_t index, TimePoint now);
  void Dispatch(PendingPull& pull, std::uint64_t key, std::uint32_t index, TimePoint now);
  Wave& OpenWave(PendingPull& pull, std::uint64_t key, std::uint32_t* index = nullptr);
  void AddOk(PendingPull& pull, std::uint64_t key, Wave& wave, std::uint32_t index);
  void AddErr(PendingPull& pull, std::uint64_t key, Wave& wave, std::uint32_t index,
              const Status& status);
  void DrainHoldEvents(TimePoint now);
  bool ProcessCommands();  // true once kStop was seen
  void OnWriteDone(Command& command, TimePoint now);
  void Flush();
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

  // Shared: the sender job queue.
  std::mutex job_mu_;
  std::condition_variable job_cv_;
  std::deque<Job> jobs_;
  bool senders_quit_ = false;

  std::mutex stop_mu_;  // serializes Stop()
  bool stopped_ = false;
  Status stop_result_;

  std::thread listener_;
  std::vector<std::thread> senders_;

  // Listener thread only (and Init before it starts).
  zmq::context_t ctx_{1};
  zmq::socket_t router_;
  core::HoldTable table_;
  const std::uint64_t p_lease_ms_;
  std::unordered_map<core::TransferId, std::uint64_t> handles_;  // admitted transfers
  std::unordered_map<std::string, std::shared_ptr<const std::vector<std::uint8_t>>> descriptors_;
  std::unordered_map<std::uint64_t, PendingPull> pulls_;
  std::unordered_map<core::TransferId, std::vector<ParkedRef>> parked_;
  std::vector<std::uint64_t> touched_;  // pulls that may have a wave to flush
  std::uint64_t next_pull_key_ = 1;
  std::uint64_t step_ = 0;
  std::uint64_t in_flight_ = 0;
  ListenerStats counters_;
  Status drain_result_;
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
                                                             std::uint32_t num_blocks) {
  Command command;
  command.kind = kind;
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
    Job job;
    {
      std::unique_lock<std::mutex> lock(job_mu_);
      job_cv_.wait(lock, [this] { return senders_quit_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    Status status;
    try {
      status = writer_->Write(*job.context, job.write);
    } catch (const std::exception& e) {
      status = Status(ErrorCode::kInternal, fmt::format("KvWriter threw: {}", e.what()));
    } catch (...) {
      status = Status(ErrorCode::kInternal, "KvWriter threw");
    }
    Command done;
    done.kind = Command::Kind::kWriteDone;
    done.pull_key = job.pull_key;
    done.wave = job.wave;
    done.request = job.request;
    done.write_status = std::move(status);
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
    table_.Expire(now);
    DrainHoldEvents(now);
    Flush();
    Publish();
  }
  Drain();
  Publish();
}

int PrefillListener::Impl::PollTimeoutMs(TimePoint now) const {
  // Capped so that a lost wake-up can cost at most a second, never a hang.
  constexpr int kMaxMs = 1000;
  const TimePoint next = table_.NextDeadline();
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
  Peer peer;
  peer.routing_id.assign(frame.data<char>(), frame.size());
  // docs/protocol.md §1: exactly [identity, payload]. The rest of a multipart message is
  // already here; frames beyond the payload are read and dropped, never buffered.
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
  ++counters_.messages_received;
  if (frames != 2) {
    ++counters_.messages_malformed;
    ReplyPullError(peer, ErrorCode::kProtocol,
                   fmt::format("expected 2 frames [identity, payload], got {}", frames));
    return true;
  }
  HandleMessage(std::move(peer), payload);
  return true;
}

void PrefillListener::Impl::HandleMessage(Peer peer, const zmq::message_t& payload) {
  const TimePoint now = Clock::now();
  if (payload.size() > wire::kMaxFrameBytes) {
    ++counters_.messages_malformed;
    ReplyPullError(peer, ErrorCode::kOutOfRange,
                   fmt::format("frame of {} bytes exceeds the limit of {} bytes", payload.size(),
                               wire::kMaxFrameBytes));
    return;
  }
  Result<wire::MessageType> type =
      wire::PeekType(static_cast<const std::uint8_t*>(payload.data()), payload.size());
  if (!type) {
    ++counters_.messages_malformed;
    ReplyPullError(peer, type.error().code(), type.error().message());
    return;
  }
  switch (*type) {
    case wire::MessageType::kRenewal:
      HandleRenewal(peer, payload, now);
      return;
    case wire::MessageType::kPull:
      HandlePull(std::move(peer), payload, now);
      return;
    case wire::MessageType::kRenewalReply:
    case wire::MessageType::kPullResponse:
      break;
  }
  ++counters_.messages_malformed;
  ReplyPullError(
      peer, ErrorCode::kProtocol,
      fmt::format("unexpected {} message on a prefill side channel", wire::ToString(*type)));
}

void PrefillListener::Impl::HandleRenewal(const Peer& peer, const zmq::message_t& payload,
                                          TimePoint now) {
  wire::RenewalReply reply;
  reply.p_lease_ms = p_lease_ms_;
  Result<wire::Renewal> renewal =
      wire::DecodeRenewal(static_cast<const std::uint8_t*>(payload.data()), payload.size());
  if (!renewal) {
    ++counters_.messages_malformed;
    reply.status = wire::RenewalStatus::kError;
    reply.message = Truncated(renewal.error().ToString());
    Send(peer, wire::Encode(reply));
    return;
  }
  reply.id = renewal->id;
  Result<core::HoldTable::RenewResult> result = table_.Renew(renewal->fingerprints, now);
  if (!result) {
    ++counters_.renewals_rejected;
    reply.status = wire::RenewalStatus::kRejected;
    reply.message = Truncated(result.error().message());
  } else {
    ++counters_.renewals_accepted;
    reply.status = wire::RenewalStatus::kAccepted;
    reply.extended = result->extended;
    reply.unknown = result->unknown;
    if (renewal->d_lease_ms != p_lease_ms_) {
      reply.message = fmt::format("kv_lease_duration mismatch: decoder has {}, prefiller has {}",
                                  LeaseMsText(renewal->d_lease_ms), LeaseMsText(p_lease_ms_));
    }
  }
  DrainHoldEvents(now);
  Send(peer, wire::Encode(reply));
}

void PrefillListener::Impl::ReplyPullError(const Peer& peer, ErrorCode code, std::string message,
                                           std::uint64_t id) {
  wire::PullResponse response;
  response.id = id;
  response.status = wire::PullStatus::kError;
  response.code = code == ErrorCode::kOk ? ErrorCode::kInternal : code;
  response.message = Truncated(message.empty() ? std::string("error") : std::move(message));
  Send(peer, wire::Encode(response));
}

void PrefillListener::Impl::Send(const Peer& peer, const std::vector<std::uint8_t>& payload) {
  try {
    if (router_.send(zmq::buffer(peer.routing_id),
                     zmq::send_flags::sndmore | zmq::send_flags::dontwait) &&
        router_.send(zmq::buffer(payload), zmq::send_flags::dontwait)) {
      ++counters_.responses_sent;
      return;
    }
  } catch (const zmq::error_t& e) {
    spdlog::debug("side channel {}: reply not sent: {}", endpoint_, e.what());
  }
  // The peer disconnected or stopped reading: it will time out and settle on its side.
  ++counters_.replies_dropped;
}

void PrefillListener::Impl::HandlePull(Peer peer, const zmq::message_t& payload, TimePoint now) {
  Result<wire::Pull> decoded =
      wire::DecodePull(static_cast<const std::uint8_t*>(payload.data()), payload.size());
  if (!decoded) {
    ++counters_.messages_malformed;
    ++counters_.pull_errors;
    ReplyPullError(peer, decoded.error().code(), decoded.error().message());  // id unreadable
    return;
  }
  wire::Pull& pull = *decoded;
  // Whole-message checks first, so a refused message changes nothing.
  Result<std::vector<std::uint32_t>> paired =
      core::PairedDecoderRanks(options_.p_tp_rank, options_.p_tp_size, pull.d_tp_size);
  if (!paired || std::find(paired->begin(), paired->end(), pull.d_tp_rank) == paired->end()) {
    ++counters_.pull_errors;
    ReplyPullError(peer, ErrorCode::kInvalidArgument,
                   fmt::format("decoder rank {} of tp {} is not paired with prefill rank {} of "
                               "tp {}{}",
                               pull.d_tp_rank, pull.d_tp_size, options_.p_tp_rank,
                               options_.p_tp_size, paired ? "" : ": " + paired.error().message()),
                   pull.id);
    return;
  }
  {
    std::unordered_set<std::string_view> seen;
    for (const wire::PullRequest& r : pull.requests) {
      if (!seen.insert(r.d_req_id).second) {
        ++counters_.pull_errors;
        ReplyPullError(peer, ErrorCode::kInvalidArgument,
                       fmt::format("d_req_id {} appears twice in one pull", r.d_req_id), pull.id);
        return;
      }
    }
  }
  const std::string descriptor_key = fmt::format("{}\n{}", pull.d_engine_id, pull.d_tp_rank);
  std::shared_ptr<const std::vector<std::uint8_t>> descriptor;
  if (pull.region_descriptor) {
    descriptor =
        std::make_shared<const std::vector<std::uint8_t>>(std::move(*pull.region_descriptor));
  } else {
    auto it = descriptors_.find(descriptor_key);
    if (it == descriptors_.end()) {
      ++counters_.pull_errors;
      ReplyPullError(peer, ErrorCode::kNotFound,
                     fmt::format("no region descriptor known for decoder {} rank {}; resend it",
                                 pull.d_engine_id, pull.d_tp_rank),
                     pull.id);
      return;
    }
    descriptor = it->second;
  }
  if (pull.region_descriptor.has_value() || !descriptors_.count(descriptor_key)) {
    if (descriptors_.size() >= options_.max_cached_descriptors &&
        !descriptors_.count(descriptor_key)) {
      descriptors_.erase(descriptors_.begin());  // that D resends it (ERROR kNotFound) if needed
    }
    descriptors_[descriptor_key] = descriptor;
  }
  ++counters_.pulls_received;

  auto context = std::make_shared<PullContext>();
  context->d_engine_id = pull.d_engine_id;
  context->d_tp_size = pull.d_tp_size;
  context->d_tp_rank = pull.d_tp_rank;
  context->p_tp_size = options_.p_tp_size;
  context->p_tp_rank = options_.p_tp_rank;
  context->region_descriptor = std::move(descriptor);
  context->block_len = pull.block_len;
  context->num_blocks = pull.num_blocks;

  const std::uint64_t key = next_pull_key_++;
  PendingPull& pending = pulls_[key];
  pending.peer = std::move(peer);
  pending.id = pull.id;
  pending.context = std::move(context);
  pending.requests = std::move(pull.requests);
  pending.need_send = static_cast<std::uint32_t>(paired->size());
  if (pull.d_lease_ms) pending.d_lease = std::chrono::milliseconds(*pull.d_lease_ms);
  touched_.push_back(key);
  if (pending.requests.empty()) {
    // Notify-only pull: nothing to write, just close it.
    wire::PullResponse finish;
    finish.status = wire::PullStatus::kFinish;
    finish.id = pending.id;
    Send(pending.peer, wire::Encode(finish));
    pulls_.erase(key);
    return;
  }
  for (std::uint32_t i = 0; i < pending.requests.size(); ++i) AdmitRequest(pending, key, i, now);
}

void PrefillListener::Impl::AdmitRequest(PendingPull& pull, std::uint64_t key, std::uint32_t index,
                                         TimePoint now) {
  const wire::PullRequest& request = pull.requests[index];
  Status blocks = wire::CheckBlockIds(request, pull.context->num_blocks);
  if (!blocks.ok()) {
    AddErr(pull, key, OpenWave(pull, key), index, blocks);
    return;
  }
  core::PullAdmission admission = table_.AdmitPull(request.transfer_id, pull.context->d_tp_rank,
                                                   pull.need_send, pull.d_lease, now);
  switch (admission.verdict) {
    case core::PullAdmission::Verdict::kFail:
      AddErr(pull, key, OpenWave(pull, key), index, admission.error);
      break;
    case core::PullAdmission::Verdict::kWait:
      parked_[request.transfer_id].push_back({key, index});
      ++counters_.requests_parked;
      break;
    case core::PullAdmission::Verdict::kReady:
      Dispatch(pull, key, index, now);
      break;
  }
  // A lease mismatch releases the entry, which may fail other parked pulls.
  DrainHoldEvents(now);
}

void PrefillListener::Impl::Dispatch(PendingPull& pull, std::uint64_t key, std::uint32_t index,
                                     TimePoint now) {
  wire::PullRequest& request = pull.requests[index];
  std::uint32_t wave_index = 0;
  Wave& wave = OpenWave(pull, key, &wave_index);
  Status begin = table_.BeginSend(request.transfer_id, pull.context->d_tp_rank, now);
  if (!begin.ok()) {
    AddErr(pull, key, wave, index, begin);
    return;
  }
  Job job;
  job.pull_key = key;
  job.wave = wave_index;
  job.request = index;
  job.context = pull.context;
  job.write.transfer_id = request.transfer_id;
  auto handle = handles_.find(request.transfer_id);
  job.write.handle = handle == handles_.end() ? 0 : handle->second;
  job.write.d_req_id = request.d_req_id;
  job.write.dst_block_ids = std::move(request.block_ids);  // not needed here any more
  ++wave.outstanding;
  ++in_flight_;
  ++counters_.writes_started;
  {
    std::lock_guard<std::mutex> lock(job_mu_);
    jobs_.push_back(std::move(job));
  }
  job_cv_.notify_one();
}

PrefillListener::Impl::Wave& PrefillListener::Impl::OpenWave(PendingPull& pull, std::uint64_t key,
                                                             std::uint32_t* index) {
  if (pull.open_step != step_ || !pull.waves.count(pull.open_wave)) {
    pull.open_wave = pull.next_wave++;
    pull.open_step = step_;
    pull.waves[pull.open_wave];
    touched_.push_back(key);
  }
  if (index != nullptr) *index = pull.open_wave;
  return pull.waves[pull.open_wave];
}

void PrefillListener::Impl::AddOk(PendingPull& pull, std::uint64_t key, Wave& wave,
                                  std::uint32_t index) {
  wave.ok.push_back(pull.requests[index].d_req_id);
  ++counters_.requests_ok;
  touched_.push_back(key);
}

void PrefillListener::Impl::AddErr(PendingPull& pull, std::uint64_t key, Wave& wave,
                                   std::uint32_t index, const Status& status) {
  wire::RequestError error;
  error.d_req_id = pull.requests[index].d_req_id;
  error.code = status.ok() ? ErrorCode::kInternal : status.code();
  error.reason = Truncated(status.message().empty() ? status.ToString() : status.message());
  wave.err.push_back(std::move(error));
  ++counters_.requests_err;
  if (status.code() == ErrorCode::kTombstoned) ++counters_.late_pulls_rejected;
  if (status.code() == ErrorCode::kLeaseMismatch) ++counters_.lease_mismatches;
  touched_.push_back(key);
}

void PrefillListener::Impl::DrainHoldEvents(TimePoint now) {
  for (core::HoldEvent& event : table_.TakeEvents()) {
    switch (event.kind) {
      case core::HoldEvent::Kind::kFreeBlocks:
      case core::HoldEvent::Kind::kAbortPrefill:
        handles_.erase(event.id);
        ++counters_.hold_events_delivered;
        if (on_hold_event_) {
          try {
            on_hold_event_(event);
          } catch (const std::exception& e) {
            spdlog::error("side channel {}: hold event callback threw: {}", endpoint_, e.what());
          }
        }
        break;
      case core::HoldEvent::Kind::kPullsReady:
      case core::HoldEvent::Kind::kPullsFailed: {
        auto it = parked_.find(event.id);
        if (it == parked_.end()) break;
        std::vector<ParkedRef> refs = std::move(it->second);
        parked_.erase(it);
        for (const ParkedRef& ref : refs) {
          --counters_.requests_parked;
          auto pull = pulls_.find(ref.pull_key);
          if (pull == pulls_.end()) continue;
          if (event.kind == core::HoldEvent::Kind::kPullsReady) {
            Dispatch(pull->second, ref.pull_key, ref.request, now);
          } else {
            AddErr(pull->second, ref.pull_key, OpenWave(pull->second, ref.pull_key), ref.request,
                   event.status);
          }
        }
        break;
      }
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
        status = table_.Admit(c.id, c.handle, now);
        if (status.ok()) handles_[c.id] = c.handle;
        break;
      case Command::Kind::kPrefillDone:
        status = table_.PrefillDone(c.id, c.num_blocks, now);
        break;
      case Command::Kind::kEngineFinished:
        table_.EngineFinished(c.id, now);
        handles_.erase(c.id);
        break;
      case Command::Kind::kWriteDone:
        OnWriteDone(c, now);
        break;
      case Command::Kind::kStats:
        c.stats->set_value(Snapshot());
        break;
      case Command::Kind::kStop:
        stop = true;
        break;
    }
    DrainHoldEvents(now);
    if (c.done) c.done->set_value(std::move(status));
    Flush();
  }
  return stop;
}

void PrefillListener::Impl::OnWriteDone(Command& command, TimePoint now) {
  --in_flight_;
  auto it = pulls_.find(command.pull_key);
  if (it == pulls_.end()) return;  // cannot happen: a pull lives until every write answered
  PendingPull& pull = it->second;
  const wire::PullRequest& request = pull.requests[command.request];
  const bool ok = command.write_status.ok();
  Status end = table_.EndSend(request.transfer_id, pull.context->d_tp_rank, ok, now);
  if (!end.ok()) {
    // The entry left the table while we wrote (e.g. the engine aborted it). The write's outcome
    // is still what D must hear.
    spdlog::debug("side channel {}: {}", endpoint_, end.ToString());
  }
  Wave& wave = pull.waves[command.wave];
  --wave.outstanding;
  if (ok) {
    AddOk(pull, command.pull_key, wave, command.request);
  } else {
    ++counters_.writes_failed;
    AddErr(pull, command.pull_key, wave, command.request,
           Status(command.write_status.code(),
                  fmt::format("write of {} failed: {}", request.transfer_id,
                              command.write_status.message())));
  }
}

void PrefillListener::Impl::Flush() {
  std::sort(touched_.begin(), touched_.end());
  touched_.erase(std::unique(touched_.begin(), touched_.end()), touched_.end());
  for (std::uint64_t key : touched_) {
    auto it = pulls_.find(key);
    if (it == pulls_.end()) continue;
    PendingPull& pull = it->second;
    for (auto w = pull.waves.begin(); w != pull.waves.end();) {
      Wave& wave = w->second;
      if (wave.outstanding > 0) {
        ++w;
        continue;
      }
      const std::size_t listed = wave.ok.size() + wave.err.size();
      if (listed > 0) {
        wire::PullResponse response;
        response.id = pull.id;
        pull.listed += listed;
        response.status = pull.listed == pull.requests.size() ? wire::PullStatus::kFinish
                                                              : wire::PullStatus::kContinue;
        response.ok = std::move(wave.ok);
        response.err = std::move(wave.err);
        Send(pull.peer, wire::Encode(response));
      }
      w = pull.waves.erase(w);
    }
    if (pull.listed == pull.requests.size()) pulls_.erase(it);
  }
  touched_.clear();
  ++step_;
}

ListenerStats PrefillListener::Impl::Snapshot() const {
  ListenerStats s = counters_;
  s.pulls_in_progress = pulls_.size();
  s.writes_in_flight = in_flight_;
  s.hold = table_.stats();
  s.hold_entries = table_.size();
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
  for (auto& [transfer, refs] : parked_) {
    for (const ParkedRef& ref : refs) {
      --counters_.requests_parked;
      auto pull = pulls_.find(ref.pull_key);
      if (pull == pulls_.end()) continue;
      AddErr(pull->second, ref.pull_key, OpenWave(pull->second, ref.pull_key), ref.request,
             Status(ErrorCode::kCancelled,
                    fmt::format("prefill worker shut down before {} was ready", transfer)));
    }
  }
  parked_.clear();
  // Queued writes that no sender started: they wrote nothing, so D may reuse the blocks.
  std::deque<Job> queued;
  {
    std::lock_guard<std::mutex> lock(job_mu_);
    queued.swap(jobs_);
  }
  for (Job& job : queued) {
    Command cancelled;
    cancelled.kind = Command::Kind::kWriteDone;
    cancelled.pull_key = job.pull_key;
    cancelled.wave = job.wave;
    cancelled.request = job.request;
    cancelled.write_status =
        Status(ErrorCode::kCancelled, "prefill worker shut down before the write started");
    OnWriteDone(cancelled, now);
  }
  DrainHoldEvents(now);
  Flush();
  WaitForWrites(Clock::now() + options_.drain_timeout);
  if (in_flight_ > 0) {
    spdlog::warn("side channel {}: {} writes still running after {} ms; cancelling them", endpoint_,
                 in_flight_, options_.drain_timeout.count());
    writer_->CancelWrites();
    WaitForWrites(Clock::now() + options_.cancel_grace);
  }
  if (in_flight_ > 0) {
    drain_result_ = Status(ErrorCode::kTimeout,
                           fmt::format("{} writes did not return by shutdown; their pulls are left "
                                       "unanswered so D quarantines the blocks",
                                       in_flight_));
  }
  router_.close();  // linger (set at bind) lets the last replies go out
}

void PrefillListener::Impl::WaitForWrites(TimePoint deadline) {
  while (in_flight_ > 0) {
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
  if (options.p_tp_size == 0 || options.p_tp_rank >= options.p_tp_size) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("p_tp_rank {} outside tp {}", options.p_tp_rank, options.p_tp_size));
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
ListenerStats PrefillListener::Stats(std::chrono::milliseconds wait) { return impl_->Stats(wait); }
Status PrefillListener::Stop() { return impl_->Stop(); }

}  // namespace kvferry::control
