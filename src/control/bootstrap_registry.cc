#include "control/bootstrap_registry.h"

#include <fmt/format.h>

#include <algorithm>
#include <tuple>

namespace kvferry::control {
namespace {

EngineInfo Finish(const EngineInfo& info) {
  EngineInfo out = info;
  out.complete = out.workers.size() == std::size_t{out.tp_size} * out.pp_size;
  return out;
}

// The first engine-level field in which `r` disagrees with `info`, or "" if none.
std::string EngineFieldConflict(const EngineInfo& info, const WorkerRegistration& r) {
  if (info.dp_rank != r.dp_rank) {
    return fmt::format("dp_rank {} (registered {})", r.dp_rank, info.dp_rank);
  }
  if (info.tp_size != r.tp_size) {
    return fmt::format("tp_size {} (registered {})", r.tp_size, info.tp_size);
  }
  if (info.pp_size != r.pp_size) {
    return fmt::format("pp_size {} (registered {})", r.pp_size, info.pp_size);
  }
  if (info.kv_lease_duration != r.kv_lease_duration) {
    return fmt::format("kv_lease_duration {} (registered {})", LeaseText(r.kv_lease_duration),
                       LeaseText(info.kv_lease_duration));
  }
  if (info.protocol_version != r.protocol_version) {
    return fmt::format("protocol_version {} (registered {})", r.protocol_version,
                       info.protocol_version);
  }
  if (info.protocol_features != r.protocol_features) {
    return fmt::format("protocol_features {:#x} (registered {:#x})", r.protocol_features,
                       info.protocol_features);
  }
  return "";
}

WorkerAddress AddressOf(const WorkerRegistration& r) {
  return WorkerAddress{r.dp_rank, r.tp_rank, r.pp_rank, r.side_channel, r.data_plane};
}

EngineInfo FreshEngine(const WorkerRegistration& r) {
  EngineInfo info;
  info.engine_id = r.engine_id;
  info.incarnation = r.incarnation;
  info.dp_rank = r.dp_rank;
  info.tp_size = r.tp_size;
  info.pp_size = r.pp_size;
  info.kv_lease_duration = r.kv_lease_duration;
  info.protocol_version = r.protocol_version;
  info.protocol_features = r.protocol_features;
  info.workers.push_back(AddressOf(r));
  return info;
}

}  // namespace

const char* ToString(BootstrapRegistry::Outcome outcome) {
  switch (outcome) {
    case BootstrapRegistry::Outcome::kAdded:
      return "added";
    case BootstrapRegistry::Outcome::kUnchanged:
      return "unchanged";
    case BootstrapRegistry::Outcome::kNewIncarnation:
      return "new_incarnation";
  }
  return "unknown";
}

Result<BootstrapRegistry::Outcome> BootstrapRegistry::Register(const WorkerRegistration& r) {
  if (Status s = Validate(r); !s.ok()) return tl::unexpected(std::move(s));

  if (own_engine_ && r.engine_id == own_engine_->engine_id &&
      r.incarnation != own_engine_->incarnation) {
    return Err(ErrorCode::kAlreadyExists,
               fmt::format("engine {} is served by this process, incarnation {}; a new "
                           "incarnation cannot register while it runs (this one says {})",
                           r.engine_id, own_engine_->incarnation, r.incarnation));
  }

  if (auto owner = dp_owner_.find(r.dp_rank);
      owner != dp_owner_.end() && owner->second != r.engine_id) {
    return Err(ErrorCode::kAlreadyExists, fmt::format("dp_rank {} belongs to engine {}, not {}",
                                                      r.dp_rank, owner->second, r.engine_id));
  }

  auto it = engines_.find(r.engine_id);
  if (it == engines_.end()) {
    if (worker_count_ + 1 > max_workers_) {
      return Err(ErrorCode::kResourceExhausted,
                 fmt::format("registry holds its limit of {} workers", max_workers_));
    }
    engines_.emplace(r.engine_id, Engine{FreshEngine(r), {}});
    dp_owner_[r.dp_rank] = r.engine_id;
    ++worker_count_;
    return Outcome::kAdded;
  }

  Engine& engine = it->second;
  EngineInfo& info = engine.info;
  if (r.incarnation == info.incarnation) {
    if (std::string field = EngineFieldConflict(info, r); !field.empty()) {
      return Err(ErrorCode::kAlreadyExists, fmt::format("engine {} incarnation {} states {}",
                                                        r.engine_id, r.incarnation, field));
    }
    auto pos = std::lower_bound(info.workers.begin(), info.workers.end(), r,
                                [](const WorkerAddress& w, const WorkerRegistration& key) {
                                  return std::tie(w.pp_rank, w.tp_rank) <
                                         std::tie(key.pp_rank, key.tp_rank);
                                });
    if (pos != info.workers.end() && pos->tp_rank == r.tp_rank && pos->pp_rank == r.pp_rank) {
      if (pos->side_channel == r.side_channel && pos->data_plane == r.data_plane) {
        return Outcome::kUnchanged;
      }
      return Err(
          ErrorCode::kAlreadyExists,
          fmt::format(
              "engine {} incarnation {} tp_rank {} pp_rank {} is registered at "
              "side_channel {} data_plane '{}'; this one has side_channel {} data_plane '{}'",
              r.engine_id, r.incarnation, r.tp_rank, r.pp_rank, pos->side_channel, pos->data_plane,
              r.side_channel, r.data_plane));
    }
    if (worker_count_ + 1 > max_workers_) {
      return Err(ErrorCode::kResourceExhausted,
                 fmt::format("registry holds its limit of {} workers", max_workers_));
    }
    info.workers.insert(pos, AddressOf(r));
    ++worker_count_;
    return Outcome::kAdded;
  }

  if (std::find(engine.retired.begin(), engine.retired.end(), r.incarnation) !=
      engine.retired.end()) {
    return Err(ErrorCode::kAlreadyExists,
               fmt::format("engine {} incarnation {} was replaced by incarnation {}", r.engine_id,
                           r.incarnation, info.incarnation));
  }

  // A restarted P: its old workers are gone. (Capacity cannot be exceeded: one worker replaces
  // at least one.)
  engine.retired.push_back(info.incarnation);
  if (engine.retired.size() > kRetiredIncarnations) engine.retired.pop_front();
  worker_count_ -= info.workers.size();
  if (info.dp_rank != r.dp_rank) {
    dp_owner_.erase(info.dp_rank);
    dp_owner_[r.dp_rank] = r.engine_id;
  }
  info = FreshEngine(r);
  ++worker_count_;
  return Outcome::kNewIncarnation;
}

Result<EngineInfo> BootstrapRegistry::Query(const std::string& engine_id) const {
  auto it = engines_.find(engine_id);
  if (it == engines_.end()) {
    return Err(ErrorCode::kNotFound, fmt::format("unknown engine_id {}", engine_id));
  }
  return Finish(it->second.info);
}

std::vector<EngineInfo> BootstrapRegistry::QueryAll() const {
  std::vector<EngineInfo> out;
  out.reserve(engines_.size());
  for (const auto& [id, engine] : engines_) out.push_back(Finish(engine.info));
  return out;
}

}  // namespace kvferry::control
