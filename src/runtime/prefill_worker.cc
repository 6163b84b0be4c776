#include "runtime/prefill_worker.h"

#include <fmt/format.h>

#include <thread>

#include "control/bootstrap_client.h"
#include "wire/messages.h"

namespace kvferry::runtime {

namespace {

core::TimePoint Deadline(std::chrono::milliseconds timeout) { return core::Clock::now() + timeout; }

// How long a sender waits for its batch's completion once the peer is being closed. ClosePeer
// bounds itself (kFenceDrain, then cancels), so this is a generous upper bound. D's write_bound
// (DecodeWorkerOptions) is P's write_timeout plus this.
constexpr std::chrono::milliseconds kFenceWait{5000};
// The fence after a failed write: ClosePeer waits this long for the peer's in-flight batches to
// drain before it cancels them.
constexpr std::chrono::milliseconds kFenceDrain{1000};
// A duplicate endpoint (two senders connected to the same D at once) has nothing in flight.
constexpr std::chrono::milliseconds kDuplicateClose{100};
// Shutdown closes every endpoint: CancelWrites must return soon (KvWriter's contract).
constexpr std::chrono::milliseconds kCancelClose{500};
// Registration retries with backoff until this (BootstrapClient::Register).
constexpr std::chrono::milliseconds kRegisterTimeout{10000};
// Deregistering the region waits for the transport's last operations on it.
constexpr std::chrono::milliseconds kDeregisterTimeout{5000};

}  // namespace

TransportKvWriter::TransportKvWriter(std::shared_ptr<transport::Engine> engine, Options options)
    : engine_(std::move(engine)), options_(std::move(options)) {}

TransportKvWriter::~TransportKvWriter() { CancelWrites(); }

std::uint64_t TransportKvWriter::bytes_written() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_written_;
}

std::uint64_t TransportKvWriter::batches() const {
  std::lock_guard<std::mutex> lock(mu_);
  return batches_;
}

Result<TransportKvWriter::Peer> TransportKvWriter::PeerFor(
    const std::vector<std::uint8_t>& descriptor) {
  const std::string key(descriptor.begin(), descriptor.end());
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(key);
    if (it != peers_.end()) return it->second;
  }
  const auto bytes = std::as_bytes(std::span(descriptor));
  auto info = transport::ParseDescriptor(bytes);
  if (!info) return tl::unexpected(info.error());
  if (info->regions.size() != options_.regions.size()) {
    // Another model, or another KV layout (kv_memory.h): no plane of it can be written safely.
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("the decoder registered {} KV planes and this prefill worker {}: "
                           "not the same model and KV layout",
                           info->regions.size(), options_.regions.size()));
  }
  // Connect outside the lock: it waits for the peer to answer.
  auto id = engine_->Connect(bytes, Deadline(options_.write_timeout));
  if (!id) return tl::unexpected(id.error());
  Peer peer{*id, {}};
  peer.remote_regions.reserve(info->regions.size());
  for (const transport::RemoteRegion& r : info->regions) peer.remote_regions.push_back(r.id);
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, inserted] = peers_.try_emplace(key, peer);
  if (!inserted) {
    // Another sender connected first; keep one endpoint per peer.
    (void)engine_->ClosePeer(*id, Deadline(kDuplicateClose));
  }
  return it->second;
}

void TransportKvWriter::DropPeer(const std::vector<std::uint8_t>& descriptor,
                                 transport::ConnectionId id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(std::string(descriptor.begin(), descriptor.end()));
    if (it == peers_.end() || it->second.id != id) return;
    peers_.erase(it);
  }
  // The fence: when ClosePeer returns, nothing more of ours can land in that peer's memory.
  (void)engine_->ClosePeer(id, Deadline(kFenceDrain));
}

protocol::WriteOutcome TransportKvWriter::Write(const protocol::PullContext& context,
                                                const protocol::WriteJob& job) {
  using protocol::WriteOutcome;
  // Every failure before SubmitWrites wrote nothing.
  auto failed = [](Status why) { return WriteOutcome::Failed(std::move(why)); };
  if (job.writes.empty()) return WriteOutcome::Landed();  // the session hands out none such
  auto peer = PeerFor(*context.region_descriptor);
  if (!peer) return failed(peer.error());
  // The same offsets in every plane: planes share block ids and block_len. A job names the
  // planes it writes (layers computed before the prefill ended) or none: every plane.
  std::vector<std::uint32_t> planes = job.planes;
  if (planes.empty()) {
    for (std::uint32_t p = 0; p < options_.regions.size(); ++p) planes.push_back(p);
  }
  for (std::uint32_t plane : planes) {
    if (plane >= options_.regions.size()) {
      return failed(Status(ErrorCode::kOutOfRange,
                           fmt::format("write of {}: plane {} of {}", job.transfer_id, plane,
                                       options_.regions.size())));
    }
  }
  std::vector<transport::WriteOp> batch;
  batch.reserve(job.writes.size() * planes.size());
  std::uint64_t bytes = 0;
  for (std::uint32_t plane : planes) {
    for (const core::BlockWrite& op : job.writes) {
      batch.push_back({options_.regions[plane], peer->remote_regions[plane], op.src_offset,
                       op.dst_offset, op.length});
      bytes += op.length;
    }
  }
  transport::BatchWaiter waiter;
  if (options_.trace) options_.trace(WritePhase::kStart, context, job, core::Clock::now(), {});
  auto submitted = engine_->SubmitWrites(peer->id, batch, context.write_key, waiter.Callback());
  if (!submitted) {
    if (submitted.error().code() == ErrorCode::kUnavailable) {
      DropPeer(*context.region_descriptor, peer->id);
    }
    return failed(submitted.error());
  }
  Status status = waiter.Wait(Deadline(options_.write_timeout));
  if (status.code() == ErrorCode::kTimeout || status.code() == ErrorCode::kUnavailable) {
    // Close the peer: nothing more is posted to it, the next write gets a fresh endpoint, and
    // once our batch completes the transport no longer reads our blocks. Whichever sender
    // closes the peer, ClosePeer returns only after every batch of it completed.
    DropPeer(*context.region_descriptor, peer->id);
    Status fenced = waiter.Wait(Deadline(kFenceWait));
    if (fenced.code() == ErrorCode::kTimeout) {
      // Bytes of this batch may still land: the request stays unanswered so D quarantines it.
      return WriteOutcome::Unsettled(
          Status(ErrorCode::kInternal, fmt::format("write of {} could not be fenced within {} ms",
                                                   job.transfer_id, kFenceWait.count())));
    }
    if (status.code() == ErrorCode::kTimeout) {
      // The fenced status says what the batch still waited for when the peer was closed.
      status = Status(ErrorCode::kTimeout,
                      fmt::format("write of {} did not complete within {} ms ({})",
                                  job.transfer_id, options_.write_timeout.count(),
                                  fenced.ok() ? "it completed as the peer closed"
                                              : fenced.message()));
    }
  }
  if (options_.trace) options_.trace(WritePhase::kEnd, context, job, core::Clock::now(), status);
  if (status.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    bytes_written_ += bytes;
    ++batches_;
  }
  if (status.ok()) return WriteOutcome::Landed();
  // Only the receiver's own verdict (its ack: every op applied or refused) proves that nothing
  // more of a failed batch can land. A send cancelled or failed on our side proves nothing of
  // the kind: its bytes may still sit in a socket buffer or in the receiver's queue and be
  // applied after D reused the blocks. Such a write is listed `unsettled`: D fails the load
  // at once and quarantines the blocks (fencing the writer where it fences).
  if (status.code() == ErrorCode::kOutOfRange || status.code() == ErrorCode::kRejected) {
    return failed(std::move(status));
  }
  return WriteOutcome::Unsettled(std::move(status));
}

void TransportKvWriter::CancelWrites() {
  std::unordered_map<std::string, Peer> peers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    peers.swap(peers_);
  }
  for (const auto& [key, peer] : peers) {
    (void)engine_->ClosePeer(peer.id, Deadline(kCancelClose));
  }
}

Result<std::unique_ptr<PrefillWorker>> PrefillWorker::Start(
    PrefillWorkerOptions options, std::shared_ptr<transport::Engine> engine,
    control::HoldEventCallback on_hold_event) {
  if (options.block_len == 0 || options.num_blocks == 0 || options.tp_rank >= options.tp_size) {
    return Err(
        ErrorCode::kInvalidArgument,
        fmt::format("prefill worker: block_len {}, num_blocks {}, rank {} of tp {}",
                    options.block_len, options.num_blocks, options.tp_rank, options.tp_size));
  }
  std::unique_ptr<PrefillWorker> worker(new PrefillWorker());
  worker->options_ = options;
  worker->engine_ = std::move(engine);
  auto memory = KvMemory::Register(worker->engine_, options.planes, options.block_len,
                                   options.num_blocks);
  if (!memory) return tl::unexpected(memory.error());
  worker->memory_ = std::move(*memory);

  TransportKvWriter::Options writer_options;
  writer_options.regions = worker->memory_.ids();
  writer_options.write_timeout = options.write_timeout;
  writer_options.trace = options.trace;
  worker->writer_ = std::make_shared<TransportKvWriter>(worker->engine_, writer_options);

  control::ListenerOptions listener_options;
  listener_options.endpoint = options.side_channel_endpoint;
  protocol::PrefillSessionOptions& session = listener_options.session;
  session.engine_id = options.engine_id;
  session.hold = options.hold;
  session.p_tp_size = options.tp_size;
  session.p_tp_rank = options.tp_rank;
  session.kv_heads = options.kv_heads;
  session.block_len = options.block_len;
  session.num_blocks = options.num_blocks;
  session.num_planes = static_cast<std::uint32_t>(options.planes.size());
  session.head_slices = options.head_slices;
  listener_options.num_senders = options.num_senders;
  listener_options.cluster_secret = options.cluster_secret;
  std::shared_ptr<control::KvWriter> writer = worker->writer_;
  if (options.decorate_writer) writer = options.decorate_writer(std::move(writer));
  auto listener = control::PrefillListener::Start(listener_options, std::move(writer),
                                                  std::move(on_hold_event));
  if (!listener) return tl::unexpected(listener.error());
  worker->listener_ = std::move(*listener);

  control::WorkerRegistration& reg = worker->registration_;
  reg.engine_id = options.engine_id;
  reg.dp_rank = options.dp_rank;
  reg.tp_rank = options.tp_rank;
  reg.tp_size = options.tp_size;
  reg.side_channel = worker->listener_->endpoint();
  reg.data_plane = std::string(worker->engine_->backend());
  reg.kv_lease_duration = core::ToSeconds(options.hold.lease);
  reg.protocol_version = wire::kProtocolVersion;
  reg.protocol_features = wire::kProtocolFeatures;
  reg.incarnation = options.incarnation;
  if (!options.bootstrap_address.empty()) {
    auto client =
        control::BootstrapClient::Create(options.bootstrap_address, options.cluster_secret);
    if (!client) return tl::unexpected(client.error());
    Status registered = client->Register(reg, kRegisterTimeout);
    if (!registered.ok()) return tl::unexpected(registered);
  }
  return worker;
}

Status PrefillWorker::Stop() {
  if (stopped_) return Status::Ok();
  stopped_ = true;
  Status status = listener_ ? listener_->Stop() : Status::Ok();
  if (writer_) writer_->CancelWrites();
  // Only after the listener drained: no write reads the planes any more.
  Status dereg = memory_.Deregister(Deadline(kDeregisterTimeout));
  if (status.ok()) status = dereg;
  return status;
}

PrefillWorker::~PrefillWorker() { (void)Stop(); }

}  // namespace kvferry::runtime
