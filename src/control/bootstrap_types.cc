#include "control/bootstrap_types.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <tuple>

namespace kvferry::control {
namespace {

// Checks one id or address; `may_be_empty` only for data_plane.
Status CheckString(const char* field, const std::string& value, bool may_be_empty, ErrorCode code) {
  if (value.empty()) {
    if (may_be_empty) return Status::Ok();
    return Status(code, fmt::format("{} must not be empty", field));
  }
  if (value.size() > kMaxStringBytes) {
    return Status(code,
                  fmt::format("{} is {} bytes, limit {}", field, value.size(), kMaxStringBytes));
  }
  for (char c : value) {
    // Printable ASCII only: these strings go into logs, URLs and error messages verbatim.
    if (c < 0x20 || c > 0x7e) {
      return Status(code, fmt::format("{} has a byte outside printable ASCII", field));
    }
  }
  return Status::Ok();
}

Status CheckRank(const char* field, std::uint32_t value, ErrorCode code) {
  if (value >= kMaxRank) {
    return Status(code, fmt::format("{} {} is not below {}", field, value, kMaxRank));
  }
  return Status::Ok();
}

Status CheckShape(std::uint32_t tp_size, std::uint32_t pp_size, double lease, ErrorCode code) {
  if (tp_size == 0 || pp_size == 0) {
    return Status(code,
                  fmt::format("tp_size {} and pp_size {} must be at least 1", tp_size, pp_size));
  }
  if (std::uint64_t{tp_size} * pp_size > kMaxWorkersPerEngine) {
    return Status(code, fmt::format("tp_size {} x pp_size {} exceeds {} workers", tp_size, pp_size,
                                    kMaxWorkersPerEngine));
  }
  if (!std::isfinite(lease) || lease < 0 || lease > kMaxLeaseSeconds) {
    return Status(code, fmt::format("kv_lease_duration {} is not in [0, {}] seconds", lease,
                                    kMaxLeaseSeconds));
  }
  return Status::Ok();
}

}  // namespace

Status Validate(const WorkerRegistration& r) {
  constexpr ErrorCode kBad = ErrorCode::kInvalidArgument;
  for (const auto& [field, value] :
       {std::pair<const char*, const std::string*>{"engine_id", &r.engine_id},
        {"side_channel", &r.side_channel},
        {"incarnation", &r.incarnation}}) {
    if (Status s = CheckString(field, *value, /*may_be_empty=*/false, kBad); !s.ok()) return s;
  }
  if (Status s = CheckString("data_plane", r.data_plane, /*may_be_empty=*/true, kBad); !s.ok()) {
    return s;
  }
  for (const auto& [field, value] : {std::pair<const char*, std::uint32_t>{"dp_rank", r.dp_rank},
                                     {"tp_rank", r.tp_rank},
                                     {"pp_rank", r.pp_rank}}) {
    if (Status s = CheckRank(field, value, kBad); !s.ok()) return s;
  }
  if (Status s = CheckShape(r.tp_size, r.pp_size, r.kv_lease_duration, kBad); !s.ok()) return s;
  if (r.tp_rank >= r.tp_size || r.pp_rank >= r.pp_size) {
    return Status(kBad, fmt::format("rank (tp {}, pp {}) is outside tp_size {} x pp_size {}",
                                    r.tp_rank, r.pp_rank, r.tp_size, r.pp_size));
  }
  return Status::Ok();
}

const WorkerAddress* EngineInfo::Find(std::uint32_t tp_rank, std::uint32_t pp_rank) const {
  auto it = std::lower_bound(
      workers.begin(), workers.end(), std::pair{pp_rank, tp_rank},
      [](const WorkerAddress& w, const std::pair<std::uint32_t, std::uint32_t>& key) {
        return std::pair{w.pp_rank, w.tp_rank} < key;
      });
  if (it == workers.end() || it->tp_rank != tp_rank || it->pp_rank != pp_rank) return nullptr;
  return &*it;
}

Status ValidateEngineInfo(const EngineInfo& info) {
  constexpr ErrorCode kBad = ErrorCode::kProtocol;
  if (Status s = CheckString("engine_id", info.engine_id, false, kBad); !s.ok()) return s;
  if (Status s = CheckString("incarnation", info.incarnation, false, kBad); !s.ok()) return s;
  if (Status s = CheckRank("dp_rank", info.dp_rank, kBad); !s.ok()) return s;
  if (Status s = CheckShape(info.tp_size, info.pp_size, info.kv_lease_duration, kBad); !s.ok()) {
    return s;
  }
  const std::size_t expected = std::size_t{info.tp_size} * info.pp_size;
  if (info.workers.size() > expected) {
    return Status(
        kBad, fmt::format("engine {} lists {} workers for tp_size {} x pp_size {}", info.engine_id,
                          info.workers.size(), info.tp_size, info.pp_size));
  }
  for (std::size_t i = 0; i < info.workers.size(); ++i) {
    const WorkerAddress& w = info.workers[i];
    if (w.dp_rank != info.dp_rank || w.tp_rank >= info.tp_size || w.pp_rank >= info.pp_size) {
      return Status(kBad, fmt::format("engine {} lists a worker (dp {}, tp {}, pp {}) outside "
                                      "dp_rank {}, tp_size {} x pp_size {}",
                                      info.engine_id, w.dp_rank, w.tp_rank, w.pp_rank, info.dp_rank,
                                      info.tp_size, info.pp_size));
    }
    if (i > 0 && std::tie(info.workers[i - 1].pp_rank, info.workers[i - 1].tp_rank) >=
                     std::tie(w.pp_rank, w.tp_rank)) {
      return Status(kBad, fmt::format("engine {} lists workers unsorted or twice", info.engine_id));
    }
    if (Status s = CheckString("side_channel", w.side_channel, false, kBad); !s.ok()) return s;
    if (Status s = CheckString("data_plane", w.data_plane, true, kBad); !s.ok()) return s;
  }
  if (info.complete != (info.workers.size() == expected)) {
    return Status(kBad, fmt::format("engine {} says complete={} with {} of {} workers",
                                    info.engine_id, info.complete, info.workers.size(), expected));
  }
  return Status::Ok();
}

std::string LeaseText(double lease_s) {
  if (lease_s == 0) return "off";
  return fmt::format("{}s", lease_s);
}

Status CheckLease(double decoder_lease_s, const EngineInfo& prefiller) {
  if (!std::isfinite(decoder_lease_s) || decoder_lease_s < 0) {
    return Status(
        ErrorCode::kInvalidArgument,
        fmt::format("decoder kv_lease_duration {} is not a finite number >= 0", decoder_lease_s));
  }
  // Exact comparison: both sides come from the same kind of config value, and JSON carries
  // doubles losslessly; "almost equal" leases would still make renewals and expiry disagree.
  if (decoder_lease_s == prefiller.kv_lease_duration) return Status::Ok();
  return Status(ErrorCode::kLeaseMismatch,
                fmt::format("kv_lease_duration mismatch: decoder has {}, prefiller has {} "
                            "(engine {})",
                            LeaseText(decoder_lease_s), LeaseText(prefiller.kv_lease_duration),
                            prefiller.engine_id));
}

}  // namespace kvferry::control
