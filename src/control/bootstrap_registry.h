// BootstrapRegistry: the bootstrap service's state and its rules, without HTTP (sans-IO, so the
// rules are unit-tested directly). Not thread-safe: BootstrapServer serializes calls.
//
// Rules for Register(r), in order:
//   1. r must pass Validate()                                              -> kInvalidArgument
//   2. r names the engine that embeds this registry (`own_engine`) with another incarnation:
//      a P restart restarts its embedded bootstrap, so while this one runs, that engine's
//      incarnation is fixed and any other is forged or misconfigured       -> kAlreadyExists
//   3. dp_rank is owned by one engine: another engine_id on it             -> kAlreadyExists
//   4. r.engine_id unknown: a new engine with this one worker              -> kAdded
//   5. same incarnation as the engine's current one:
//        engine fields (dp_rank, tp_size, pp_size, lease, version) differ  -> kAlreadyExists
//        (tp_rank, pp_rank) registered with the same addresses           -> kUnchanged (retry)
//        (tp_rank, pp_rank) registered with other addresses              -> kAlreadyExists
//        otherwise the worker is added                                     -> kAdded
//   6. an incarnation this engine had before (a late retry from a P process that has since
//      been replaced; accepting it would flip D back to a dead peer)    -> kAlreadyExists
//   7. a new incarnation: P restarted. The old incarnation's workers are dropped, the engine
//      takes r's fields and has r as its only worker until the other ranks re-register
//                                                                          -> kNewIncarnation
// Capacity: at most `max_workers` workers in total, else kResourceExhausted. A rejected call
// changes nothing.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "control/bootstrap_types.h"
#include "kvferry/status.h"

namespace kvferry::control {

class BootstrapRegistry {
 public:
  enum class Outcome : std::uint8_t { kAdded, kUnchanged, kNewIncarnation };

  // Retired incarnations remembered per engine (rule 6); older ones are forgotten.
  static constexpr std::size_t kRetiredIncarnations = 8;

  // `own_engine`: the P engine incarnation of the process this registry runs in (rule 2);
  // none for a standalone bootstrap service.
  explicit BootstrapRegistry(std::size_t max_workers = 16384,
                             std::optional<EngineIncarnation> own_engine = std::nullopt)
      : max_workers_(max_workers), own_engine_(std::move(own_engine)) {}

  [[nodiscard]] Result<Outcome> Register(const WorkerRegistration& r);

  // kNotFound for an engine that never registered.
  [[nodiscard]] Result<EngineInfo> Query(const std::string& engine_id) const;
  // Every engine, sorted by engine_id.
  [[nodiscard]] std::vector<EngineInfo> QueryAll() const;

  std::size_t engine_count() const { return engines_.size(); }
  std::size_t worker_count() const { return worker_count_; }

 private:
  struct Engine {
    EngineInfo info;  // `complete` is computed on the way out
    std::deque<std::string> retired;
  };

  std::size_t max_workers_;
  std::optional<EngineIncarnation> own_engine_;
  std::size_t worker_count_ = 0;
  std::map<std::string, Engine> engines_;          // ordered: QueryAll is sorted for free
  std::map<std::uint32_t, std::string> dp_owner_;  // dp_rank -> engine_id
};

const char* ToString(BootstrapRegistry::Outcome outcome);

}  // namespace kvferry::control
