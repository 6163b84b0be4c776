#include "runtime/decode_worker.h"

#include <fmt/format.h>

#include <cstring>

#include "kvferry/core/tp_plan.h"
#include "wire/messages.h"

namespace kvferry::runtime {

Result<std::unique_ptr<DecodeWorker>> DecodeWorker::Start(DecodeWorkerOptions options,
                                                          std::shared_ptr<transport::Engine> engine,
                                                          WarningSink warn) {
  if (options.block_len == 0 || options.num_blocks == 0 || options.tp_rank >= options.tp_size ||
      options.num_pullers == 0) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("decode worker: block_len {}, num_blocks {}, rank {} of tp {}, {} "
                           "pullers",
                           options.block_len, options.num_blocks, options.tp_rank, options.tp_size,
                           options.num_pullers));
  }
  std::unique_ptr<DecodeWorker> worker(new DecodeWorker());
  worker->options_ = options;
  worker->engine_ = std::move(engine);
  worker->warn_ = std::move(warn);
  auto region = worker->engine_->AllocateRegion(options.block_len * options.num_blocks);
  if (!region) return tl::unexpected(region.error());
  worker->region_ = *region;
  const transport::RegionId ids[] = {region->id};
  auto descriptor = worker->engine_->ExportDescriptor(ids);
  if (!descriptor) return tl::unexpected(descriptor.error());
  worker->descriptor_.resize(descriptor->size());
  std::memcpy(worker->descriptor_.data(), descriptor->data(), descriptor->size());
  worker->context_ = std::make_shared<control::SideChannelContext>();
  for (std::size_t i = 0; i < options.num_pullers; ++i) {
    worker->pullers_.emplace_back([w = worker.get()] { w->PullerLoop(); });
  }
  if (options.lease.count() > 0) {
    worker->renewal_thread_ = std::thread([w = worker.get()] { w->RenewalLoop(); });
  }
  return worker;
}

DecodeWorker::~DecodeWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : pullers_) t.join();
  if (renewal_thread_.joinable()) renewal_thread_.join();
  {
    std::lock_guard<std::mutex> lock(mu_);
    idle_channels_.clear();
  }
  if (engine_ && region_.base != nullptr) {
    // Pullers are joined: every pull ended. A P peer that timed out may in principle still
    // write, which is why its blocks were quarantined; the region goes only at the very end.
    (void)engine_->DeregisterMemory(region_.id, core::Clock::now() + std::chrono::seconds(5));
  }
}

core::PeerId DecodeWorker::PeerIdFor(const control::EngineInfo& info, std::uint32_t rank) {
  auto [it, inserted] = peer_ids_.try_emplace(PeerKey{info.engine_id, info.incarnation, rank},
                                              static_cast<core::PeerId>(peer_ids_.size()));
  return it->second;
}

void DecodeWorker::NoteIncarnation(const control::EngineInfo& info) {
  std::string& known = incarnation_of_[info.engine_id];
  if (known == info.incarnation) return;
  const bool restarted = !known.empty();
  known = info.incarnation;
  if (!restarted) return;
  // The old process is gone with its endpoints: nothing of it can write any more.
  for (const auto& [key, id] : peer_ids_) {
    if (key.engine == info.engine_id && key.incarnation != info.incarnation) {
      ledger_.PeerQuiesced(id);
    }
  }
  CollectLedgerEvents();
  renewal_commands_.push_back({RenewalCommand::Kind::kResetEngine, {}, info.engine_id});
}

void DecodeWorker::Complete(ReceiveResult result) {
  loading_.erase(result.request);
  ++(result.ok ? stats_.receives_ok : stats_.receives_failed);
  // The receive settled: stop renewing it (SPEC §2.1).
  auto tracked = tracked_.find(result.request);
  if (tracked != tracked_.end()) {
    renewal_commands_.push_back({RenewalCommand::Kind::kUntrack, tracked->second, {}});
    tracked_.erase(tracked);
  }
  finished_.received.push_back(std::move(result));
  cv_.notify_all();
}

void DecodeWorker::OnNewRequest(const core::RequestId& request, const RemoteSource& source) {
  std::lock_guard<std::mutex> lock(mu_);
  bootstrap_of_engine_[source.engine_id] = source.bootstrap_address;
  if (options_.lease.count() == 0) return;
  if (tracked_.try_emplace(request, source.transfer_id).second) {
    renewal_commands_.push_back(
        {RenewalCommand::Kind::kTrack, source.transfer_id, source.engine_id});
  }
}

void DecodeWorker::RequestFinished(const core::RequestId& request) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = tracked_.find(request);
  if (it == tracked_.end()) return;
  renewal_commands_.push_back({RenewalCommand::Kind::kUntrack, it->second, {}});
  tracked_.erase(it);
}

Status DecodeWorker::StartLoad(const core::RequestId& request, const RemoteSource& source,
                               std::vector<core::BlockId> blocks) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    bootstrap_of_engine_[source.engine_id] = source.bootstrap_address;
    if (blocks.empty()) return Status::Ok();  // notify-only: nothing will be written
    if (!loading_.insert(request).second) {
      return Status(ErrorCode::kAlreadyExists,
                    fmt::format("request {} is already loading", request));
    }
    jobs_.push_back({request, source, std::move(blocks)});
  }
  cv_.notify_all();
  return Status::Ok();
}

DecodeFinished DecodeWorker::TakeFinished() {
  std::lock_guard<std::mutex> lock(mu_);
  DecodeFinished out;
  std::swap(out, finished_);
  return out;
}

DecodeFinished DecodeWorker::WaitFinished(core::TimePoint deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_until(lock, deadline, [&] {
    return stopping_ || !finished_.received.empty() || !finished_.released.empty();
  });
  DecodeFinished out;
  std::swap(out, finished_);
  return out;
}

DecodeWorkerStats DecodeWorker::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  DecodeWorkerStats s = stats_;
  s.quarantined_blocks = ledger_.quarantined_blocks();
  s.tracked = tracked_.size();
  return s;
}

void DecodeWorker::CollectLedgerEvents() {
  for (core::LedgerEvent& e : ledger_.TakeEvents()) {
    if (e.kind == core::LedgerEvent::Kind::kCompleted) {
      Complete({e.request, e.ok, std::move(e.error), std::move(e.blocks), e.quarantined});
    } else {
      finished_.released.emplace_back(e.request, std::move(e.blocks));
      cv_.notify_all();
    }
  }
}

void DecodeWorker::PullerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
    if (stopping_) return;
    PullJob job = std::move(jobs_.front());
    jobs_.pop_front();
    lock.unlock();
    RunPull(job);
    lock.lock();
  }
}

void DecodeWorker::RunPull(PullJob& job) {
  // Nothing was sent to any peer: the receive completes at once as failed.
  auto fail = [&](Status why) {
    std::lock_guard<std::mutex> lock(mu_);
    Complete({job.request, false, std::move(why), std::move(job.blocks), false});
  };
  auto lookup = directory_.Lookup(job.source.engine_id, job.source.bootstrap_address,
                                  options_.bootstrap_timeout);
  if (!lookup) {
    fail(Status(
        lookup.error().code(),
        fmt::format("bootstrap lookup of {}: {}", job.source.engine_id, lookup.error().message())));
    return;
  }
  const control::EngineInfo& info = *lookup->info;
  // A lease mismatch seen in P's registration is still pulled: P refuses the pull naming both
  // values and frees the transfer's KV at once. Failing here, unsent, left P holding it until
  // abort_request_timeout (140 such requests once filled P's pool in 0.2 s).
  if (Status lease = control::CheckLease(core::ToSeconds(options_.lease), info);
      lease.code() == ErrorCode::kInvalidArgument) {
    fail(lease);
    return;
  }
  auto targets = core::PullTargets(options_.tp_rank, options_.tp_size, info.tp_size);
  if (!targets) {
    fail(targets.error());
    return;
  }
  struct Target {
    std::string endpoint;
    core::PeerId peer;
  };
  std::vector<Target> plan;
  std::vector<core::PeerId> peers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    NoteIncarnation(info);
    for (std::uint32_t rank : *targets) {
      const control::WorkerAddress* worker = info.Find(rank, 0);
      if (worker == nullptr) continue;
      const core::PeerId peer = PeerIdFor(info, rank);
      plan.push_back({worker->side_channel, peer});
      peers.push_back(peer);
    }
  }
  if (plan.size() != targets->size()) {
    fail(
        Status(ErrorCode::kUnavailable,
               fmt::format("engine {} lacks a worker this rank pulls from", job.source.engine_id)));
    return;
  }

  wire::Pull pull;
  pull.d_engine_id = options_.engine_id;
  pull.d_tp_size = options_.tp_size;
  pull.d_tp_rank = options_.tp_rank;
  pull.d_lease_ms = static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(options_.lease).count());
  pull.region_descriptor = descriptor_;
  pull.block_len = options_.block_len;
  pull.num_blocks = options_.num_blocks;
  pull.requests.push_back({job.request, job.source.transfer_id, job.blocks});
  {
    std::lock_guard<std::mutex> lock(mu_);
    Status begun = ledger_.Begin(job.request, job.blocks, peers);
    if (!begun.ok()) {
      // E.g. the same request id still quarantined from an earlier receive.
      Complete({job.request, false, begun, std::move(job.blocks), false});
      return;
    }
  }
  // One thread per extra peer, so every paired P rank is pulled at once (their writes overlap);
  // each settles its own ledger entries.
  std::vector<std::thread> others;
  for (std::size_t i = 1; i < plan.size(); ++i) {
    others.emplace_back([this, &job, &pull, &plan, i] {
      PullFromPeer(job.request, job.source.engine_id, pull, plan[i].endpoint, plan[i].peer);
    });
  }
  PullFromPeer(job.request, job.source.engine_id, pull, plan[0].endpoint, plan[0].peer);
  for (std::thread& t : others) t.join();
}

std::unique_ptr<control::DecodeChannel> DecodeWorker::TakeChannel(const std::string& endpoint) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = idle_channels_.find(endpoint);
    if (it != idle_channels_.end()) {
      auto channel = std::move(it->second);
      idle_channels_.erase(it);
      return channel;
    }
  }
  auto channel = control::DecodeChannel::Connect(context_, endpoint);
  if (!channel) return nullptr;
  return std::move(*channel);
}

void DecodeWorker::ReturnChannel(std::unique_ptr<control::DecodeChannel> channel) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return;
  const std::string endpoint = channel->endpoint();
  idle_channels_.emplace(endpoint, std::move(channel));
}

void DecodeWorker::PullFromPeer(const core::RequestId& request, const core::EngineId& engine,
                                const wire::Pull& pull, const std::string& endpoint,
                                core::PeerId peer) {
  const std::vector<core::RequestId> requests = {request};
  auto channel = TakeChannel(endpoint);
  if (!channel) {
    std::lock_guard<std::mutex> lock(mu_);
    // Nothing was sent: the peer cannot be writing for this pull.
    (void)ledger_.Settle(
        request, peer, core::Settle::kErr,
        Status(ErrorCode::kUnavailable, fmt::format("cannot open side channel {}", endpoint)));
    CollectLedgerEvents();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.pulls_sent;
  }
  const core::TimePoint deadline = core::Clock::now() + options_.pull_timeout;
  Status status = channel->Pull(pull, deadline, [&](const wire::PullResponse& response) {
    std::lock_guard<std::mutex> lock(mu_);
    control::ApplyPullResponse(ledger_, peer, requests, response);
    CollectLedgerEvents();
  });
  if (status.ok()) {
    ReturnChannel(std::move(channel));
    return;
  }
  // Timeout or a broken reply: the peer's state is unknown; its blocks stay quarantined until it
  // answers after all or is known gone. This channel may hold a stale reply: drop it. The next
  // lookup of the engine asks the bootstrap again, which tells whether P restarted (then the old
  // process's entries are quiesced).
  directory_.Invalidate(engine);
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.pull_timeouts;
  control::ApplyPullFailure(ledger_, peer, requests, status);
  CollectLedgerEvents();
}

Result<std::vector<std::string>> DecodeWorker::ResolveEndpoints(const core::EngineId& engine) {
  std::string bootstrap;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = bootstrap_of_engine_.find(engine);
    if (it == bootstrap_of_engine_.end()) {
      return Err(ErrorCode::kNotFound, fmt::format("no bootstrap address for {}", engine));
    }
    bootstrap = it->second;
  }
  auto lookup = directory_.Lookup(engine, bootstrap, options_.bootstrap_timeout);
  if (!lookup) return tl::unexpected(lookup.error());
  {
    std::lock_guard<std::mutex> lock(mu_);
    NoteIncarnation(*lookup->info);
  }
  auto targets = core::PullTargets(options_.tp_rank, options_.tp_size, lookup->info->tp_size);
  if (!targets) return tl::unexpected(targets.error());
  std::vector<std::string> endpoints;
  for (std::uint32_t rank : *targets) {
    if (const control::WorkerAddress* w = lookup->info->Find(rank, 0)) {
      endpoints.push_back(w->side_channel);
    }
  }
  return endpoints;
}

void DecodeWorker::RenewalLoop() {
  core::RenewalScheduler scheduler(options_.lease);
  control::RenewalPumpOptions pump_options;
  pump_options.d_engine_id = options_.engine_id;
  pump_options.lease = options_.lease;
  control::RenewalPump pump(
      context_, pump_options,
      [this](const core::EngineId& engine) { return ResolveEndpoints(engine); }, warn_);
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    for (const RenewalCommand& c : renewal_commands_) {
      switch (c.kind) {
        case RenewalCommand::Kind::kTrack:
          scheduler.Track(c.transfer, c.engine);
          break;
        case RenewalCommand::Kind::kUntrack:
          scheduler.Untrack(c.transfer);
          break;
        case RenewalCommand::Kind::kResetEngine:
          scheduler.ResetEngine(c.engine);
          break;
      }
    }
    renewal_commands_.clear();
    const core::TimePoint now = core::Clock::now();
    if (now < scheduler.NextDue()) {
      cv_.wait_until(lock, scheduler.NextDue(), [&] { return stopping_; });
      continue;
    }
    auto batches = scheduler.Poll(now);
    lock.unlock();
    control::PumpReport report = pump.Send(batches, scheduler);
    lock.lock();
    stats_.renewal_messages += report.sent;
    stats_.renewals_accepted += report.accepted;
    stats_.renewals_rejected += report.rejected;
    stats_.renewal_failures += report.failed;
  }
}

}  // namespace kvferry::runtime
