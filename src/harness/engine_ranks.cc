#include "harness/engine_ranks.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>
#include <string_view>

#include "harness/fault_writer.h"
#include "harness/trace_file.h"
#include "kvferry/transport/ucx.h"

namespace kvferry::harness {
namespace {

// How long the engine thread waits for a hold-table command to be acknowledged. The listener
// answers commands between messages, so this is only hit when a listener is wedged.
constexpr auto kListenerAckTimeout = std::chrono::seconds(5);
// How long a collector waits for a rank's receives before it looks at Stop again.
constexpr auto kCollectWait = std::chrono::milliseconds(100);

}  // namespace

Result<std::unique_ptr<EngineRanks>> EngineRanks::Start(const EngineOptions& options,
                                                        Callbacks callbacks) {
  std::unique_ptr<EngineRanks> ranks(new EngineRanks(options, std::move(callbacks)));
  Status started = ranks->StartTransports();
  if (started.ok()) {
    started = options.role == Role::kPrefill ? ranks->StartPrefill() : ranks->StartDecode();
  }
  if (!started.ok()) return tl::unexpected(started);  // the destructor stops what started
  return ranks;
}

Status EngineRanks::StartTransports() {
  for (std::uint32_t rank = 0; rank < options_.geometry.tp; ++rank) {
    transport::UcxOptions ucx;
    ucx.name = fmt::format("{}-r{}", options_.ucx_name, rank);
    ucx.fence_writes = options_.role == Role::kDecode && options_.fence_writes;
    auto made = transport::MakeUcxEngine(ucx);
    if (!made) {
      return Status(made.error().code(),
                    fmt::format("rank {}: UCX: {}", rank, made.error().message()));
    }
    transports_.push_back(std::shared_ptr<transport::Engine>(std::move(*made)));
  }
  return Status::Ok();
}

Status EngineRanks::StartPrefill() {
  const std::uint32_t tp = options_.geometry.tp;
  for (std::uint32_t rank = 0; rank < tp; ++rank) {
    runtime::PrefillWorkerOptions o;
    o.engine_id = options_.engine_id;
    o.tp_size = tp;
    o.tp_rank = rank;
    o.kv_heads = options_.geometry.kv_heads;
    o.block_len = options_.geometry.block_len();
    o.num_blocks = options_.num_blocks;
    o.hold = options_.hold;
    o.num_senders = options_.num_senders;
    o.bootstrap_address = options_.bootstrap_address;
    o.incarnation = options_.incarnation;
    o.cluster_secret = options_.cluster_secret;
    o.side_channel_endpoint = fmt::format("tcp://{}:0", options_.side_channel_host);
    auto listed = [rank](const std::vector<std::uint32_t>& ranks) {
      return std::find(ranks.begin(), ranks.end(), rank) != ranks.end();
    };
    WriteFaults faults;
    faults.seed = options_.faults.seed + rank;
    if (listed(options_.fault_err_ranks)) {
      faults.err_after_write_fraction = options_.faults.err_after_write_fraction;
    }
    if (listed(options_.fault_delay_ranks))
      faults.max_write_delay = options_.faults.max_write_delay;
    if (faults.any()) {
      o.decorate_writer = [faults](std::shared_ptr<control::KvWriter> writer) {
        return std::make_shared<FaultInjectingWriter>(std::move(writer), faults);
      };
    }
    TraceFile* trace = options_.trace.get();
    o.trace = [this, trace, rank](runtime::WritePhase phase, const protocol::PullContext& ctx,
                                  const protocol::WriteJob& job, core::TimePoint t,
                                  const Status& status) {
      // Start and end of one write run on the same sender thread (Write is synchronous).
      thread_local core::TimePoint started{};
      if (phase == runtime::WritePhase::kStart) {
        started = t;
      } else if (callbacks_.on_write) {
        callbacks_.on_write(std::chrono::duration<double>(t - started).count());
      }
      if (trace == nullptr) return;
      // Ids come from the network: nlohmann escapes them.
      nlohmann::json line = {
          {"t_ns",
           std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count()},
          {"role", "prefill"},
          {"event", phase == runtime::WritePhase::kStart ? "write_start" : "write_end"},
          {"transfer_id", job.transfer_id},
          {"d_req_id", job.d_req_id},
          {"d_engine_id", ctx.d_engine_id},
          {"d_rank", ctx.d_tp_rank},
          {"p_rank", rank},
          {"dst_blocks", job.dst_block_ids},
      };
      if (phase == runtime::WritePhase::kEnd) line["status"] = status.ToString();
      trace->Line(line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    };
    auto on_hold = [this, rank](const core::HoldEvent& event) {
      // Listener thread: must not block. The engine thread acts on it.
      if (event.kind != core::HoldEvent::Kind::kFreeBlocks &&
          event.kind != core::HoldEvent::Kind::kAbortPrefill) {
        return;
      }
      if (callbacks_.on_hold) callbacks_.on_hold(rank, event);
    };
    auto worker = runtime::PrefillWorker::Start(o, transports_[rank], on_hold);
    if (!worker) {
      return Status(worker.error().code(),
                    fmt::format("prefill rank {}: {}", rank, worker.error().message()));
    }
    prefill_.push_back(std::move(*worker));
  }
  std::vector<runtime::PrefillWorker*> ranks;
  for (auto& worker : prefill_) ranks.push_back(worker.get());
  p_driver_ = std::make_unique<runtime::PrefillDriver>(std::move(ranks), kListenerAckTimeout);
  return Status::Ok();
}

Status EngineRanks::StartDecode() {
  const std::uint32_t tp = options_.geometry.tp;
  for (std::uint32_t rank = 0; rank < tp; ++rank) {
    runtime::DecodeWorkerOptions o;
    o.engine_id = options_.engine_id;
    o.tp_size = tp;
    o.tp_rank = rank;
    o.block_len = options_.geometry.block_len();
    o.num_blocks = options_.num_blocks;
    o.lease = options_.lease;
    o.abort_request_timeout =
        std::chrono::ceil<std::chrono::milliseconds>(options_.hold.abort_request_timeout);
    o.write_bound = options_.write_bound;
    o.pull_timeout = options_.pull_timeout;
    o.send_releases = options_.send_releases;
    o.cluster_secret = options_.cluster_secret;
    o.registry_lookup = options_.registry_lookup;
    auto warn = [this, rank](std::string_view message) {
      spdlog::warn("[{} r{}] {}", options_.engine_id, rank, message);
    };
    auto worker = runtime::DecodeWorker::Start(o, transports_[rank], warn);
    if (!worker) {
      return Status(worker.error().code(),
                    fmt::format("decode rank {}: {}", rank, worker.error().message()));
    }
    decode_.push_back(std::move(*worker));
  }
  std::vector<runtime::DecodeWorker*> ranks;
  for (auto& worker : decode_) ranks.push_back(worker.get());
  d_driver_ = std::make_unique<runtime::DecodeDriver>(std::move(ranks));
  for (std::uint32_t rank = 0; rank < tp; ++rank) {
    collectors_.emplace_back([this, rank] { Collect(rank); });
  }
  return Status::Ok();
}

void EngineRanks::Collect(std::uint32_t rank) {
  // One owner per rank's finished queue: this thread moves it to the engine.
  while (!collectors_stop_.load()) {
    runtime::DecodeFinished finished =
        decode_[rank]->WaitFinished(std::chrono::steady_clock::now() + kCollectWait);
    if (finished.empty()) continue;
    if (callbacks_.on_finished) callbacks_.on_finished(rank, std::move(finished));
  }
}

std::byte* EngineRanks::kv(std::uint32_t rank) const {
  return options_.role == Role::kPrefill ? prefill_[rank]->kv() : decode_[rank]->kv();
}

void EngineRanks::Stop() {
  collectors_stop_ = true;
  for (std::thread& t : collectors_) t.join();
  collectors_.clear();
  // The drivers hold the workers' addresses: they go first.
  p_driver_.reset();
  d_driver_.reset();
  // P: Stop drains in-flight writes before each region is deregistered.
  for (auto& worker : prefill_) {
    Status stopped = worker->Stop();
    if (!stopped.ok()) spdlog::warn("prefill worker stop: {}", stopped.ToString());
  }
  prefill_.clear();
  // D: the destructor joins pullers (a pull in flight ends at its deadline at the latest).
  decode_.clear();
  transports_.clear();
}

}  // namespace kvferry::harness
