#include "protocol/known_engines.h"

#include <algorithm>
#include <utility>

namespace kvferry::protocol {
namespace {

// How often Sweep is due at most.
constexpr core::Duration kEngineSweep = std::chrono::seconds(10);

}  // namespace

KnownEngine& KnownEngines::Note(const core::EngineId& engine,
                                const std::string& bootstrap_address) {
  KnownEngine& entry = engines_[engine];
  if (!bootstrap_address.empty()) entry.bootstrap_address_ = bootstrap_address;
  return entry;
}

KnownEngine* KnownEngines::Find(const core::EngineId& engine) {
  auto it = engines_.find(engine);
  return it == engines_.end() ? nullptr : &it->second;
}

const KnownEngine* KnownEngines::Find(const core::EngineId& engine) const {
  auto it = engines_.find(engine);
  return it == engines_.end() ? nullptr : &it->second;
}

void KnownEngines::Ask(const core::EngineId& engine, KnownEngine& entry, core::TimePoint now,
                       const std::string* address) {
  const std::string& where = address != nullptr ? *address : entry.bootstrap_address_;
  if (entry.lookups_.count(where) != 0 || entry.lookups_.size() >= kMaxLookupsPerEngine) return;
  entry.lookup_id_ = ++last_lookup_id_;
  entry.lookup_address_ = where;
  entry.lookups_.emplace(where,
                         KnownEngine::InFlightLookup{entry.lookup_id_, now + lookup_timeout_});
  ++stats_.lookups;
  out_.push_back({engine, where, entry.lookup_id_});
}

void KnownEngines::AskForParked(const core::EngineId& engine, KnownEngine& entry,
                                core::TimePoint now) {
  if (!entry.parked.renewals.empty() || !entry.parked.releases.empty() ||
      (entry.view_ && !entry.parked.loads.empty())) {
    Ask(engine, entry, now);
  }
  if (entry.view_) return;
  for (const ParkedLoad& load : entry.parked.loads) {
    const std::string& address = entry.AddressOf(load);
    if (!entry.FailureCovers(address, now)) Ask(engine, entry, now, &address);
  }
}

std::optional<std::string> KnownEngines::TakeLookup(KnownEngine& entry, std::uint64_t id) {
  if (id == 0) id = entry.lookup_id_;
  for (auto it = entry.lookups_.begin(); it != entry.lookups_.end(); ++it) {
    if (it->second.id == id) {
      std::string address = it->first;
      entry.lookups_.erase(it);
      return address;
    }
  }
  return std::nullopt;
}

bool KnownEngines::Stale(const core::EngineId& engine, KnownEngine& entry, std::uint64_t id,
                         core::TimePoint now) {
  if (id == 0 || id >= entry.lookup_floor_) return false;
  // Asked before the engine was declared down: the answer may name the dead process (a
  // registry read before its lease lapsed), and believing it would send loads there to wait
  // for their pull deadline. A fresh lookup answers whoever waits.
  ++stats_.lookups_stale;
  (void)TakeLookup(entry, id);
  AskForParked(engine, entry, now);
  return true;
}

std::optional<KnownEngines::Answered> KnownEngines::OnAnswer(const PeerEngine& engine,
                                                             core::TimePoint now,
                                                             std::uint64_t id) {
  KnownEngine& entry = Note(engine.engine_id, "");
  if (Stale(engine.engine_id, entry, id, now)) return std::nullopt;
  // An answer to a lookup no longer in flight (it timed out) is taken as the latest's.
  const std::string asked = TakeLookup(entry, id).value_or(entry.lookup_address_);
  entry.failed_until_ = core::TimePoint::min();
  entry.failure_ = Status();
  entry.failure_address_.clear();
  Answered answered;
  answered.entry = &entry;
  if (entry.view_ && entry.view_->incarnation != engine.incarnation) {
    answered.previous = entry.view_->incarnation;
    // P's embedded bootstrap refuses any other incarnation while its process lives, so the
    // service that named the old process naming another means a restart. Another service says
    // nothing of the old process: a client may name any bootstrap.
    answered.replaced = entry.view_address_ == asked;
  }
  entry.view_ = engine;
  entry.view_address_ = asked;
  entry.view_stale_ = false;
  entry.declared_down_.reset();
  answered.parked = std::exchange(entry.parked, {});
  return answered;
}

std::optional<KnownEngines::Failed> KnownEngines::OnFailure(const core::EngineId& engine,
                                                            const Status& why, core::TimePoint now,
                                                            std::uint64_t id) {
  KnownEngine* found = Find(engine);
  if (found == nullptr) return std::nullopt;
  KnownEngine& entry = *found;
  if (Stale(engine, entry, id, now)) return std::nullopt;
  const std::optional<std::string> taken = TakeLookup(entry, id);
  ++stats_.lookup_failures;
  // A failure of a lookup no longer in flight (its deadline already failed it) says nothing new,
  // and must not fail loads that wait for a newer lookup at the same address.
  if (id != 0 && !taken) return std::nullopt;
  const std::string asked = taken.value_or(entry.lookup_address_);
  Failed failed;
  failed.entry = &entry;
  if (entry.view_) {
    // A refresh failed: what waited goes with what is known (the pulls' own deadlines decide).
    failed.refreshed = true;
    failed.parked = std::exchange(entry.parked, {});
    return failed;
  }
  entry.failed_until_ = now + failure_ttl_;
  entry.failure_ = Status(why.ok() ? ErrorCode::kUnavailable : why.code(),
                          "bootstrap lookup of " + engine + ": " + why.message());
  entry.failure_address_ = asked;
  // Only the loads that named this address fail: others wait for their own lookups.
  std::vector<ParkedLoad> waiting;
  for (ParkedLoad& load : entry.parked.loads) {
    (entry.AddressOf(load) == asked ? failed.parked.loads : waiting).push_back(std::move(load));
  }
  entry.parked.loads = std::move(waiting);
  if (entry.lookups_.empty()) {
    failed.parked.renewals = std::exchange(entry.parked.renewals, {});
    failed.parked.releases = std::exchange(entry.parked.releases, {});
  }
  return failed;
}

std::vector<std::pair<core::EngineId, std::uint64_t>> KnownEngines::Expired(
    core::TimePoint now) const {
  std::vector<std::pair<core::EngineId, std::uint64_t>> expired;
  for (const auto& [engine, entry] : engines_) {
    for (const auto& [address, lookup] : entry.lookups_) {
      if (lookup.deadline <= now) expired.emplace_back(engine, lookup.id);
    }
  }
  return expired;
}

std::optional<KnownEngines::Down> KnownEngines::OnEngineDown(const core::EngineId& engine,
                                                             const Status& why,
                                                             core::TimePoint now) {
  KnownEngine* found = Find(engine);
  if (found == nullptr) return std::nullopt;
  KnownEngine& entry = *found;
  Down down;
  down.entry = &entry;
  down.view = std::exchange(entry.view_, std::nullopt);
  entry.view_stale_ = false;
  // A lookup in flight may answer with the dead process: its answer will be stale, and the
  // next lookup need not wait for it.
  entry.lookups_.clear();
  entry.lookup_floor_ = last_lookup_id_ + 1;
  entry.failed_until_ = now + failure_ttl_;
  entry.failure_address_.clear();  // down wherever a request names it
  entry.failure_ = Status(why.ok() ? ErrorCode::kUnavailable : why.code(),
                          "prefill engine " + engine + " is down: " + why.message());
  down.parked.loads = std::exchange(entry.parked.loads, {});
  down.parked.releases = std::exchange(entry.parked.releases, {});
  down.parked.releases.insert(down.parked.releases.end(), entry.pending_releases.begin(),
                              entry.pending_releases.end());
  entry.pending_releases.clear();
  return down;
}

KnownEngine* KnownEngines::OnProcessGone(const core::EngineId& engine,
                                         const std::string& incarnation, core::TimePoint now) {
  KnownEngine* found = Find(engine);
  if (found == nullptr) return nullptr;
  KnownEngine& entry = *found;
  // A lookup asked before now may have read the process that is gone: its answer is stale.
  entry.lookup_floor_ = last_lookup_id_ + 1;
  if (!entry.lookups_.empty()) {
    entry.lookups_.clear();
    AskForParked(engine, entry, now);
  }
  if (entry.view_ && entry.view_->incarnation == incarnation) {
    // The view names the process that is gone: the next load asks again.
    entry.view_.reset();
    entry.view_stale_ = false;
    AskForParked(engine, entry, now);
  }
  if (entry.declared_down_ && entry.declared_down_->incarnation == incarnation) {
    entry.declared_down_.reset();
  }
  return &entry;
}

void KnownEngines::MarkViewsStale(const std::string& address) {
  for (auto& [engine, entry] : engines_) {
    if (entry.view_ &&
        std::find(entry.view_->side_channels.begin(), entry.view_->side_channels.end(), address) !=
            entry.view_->side_channels.end()) {
      entry.view_stale_ = true;
    }
  }
}

void KnownEngines::Sweep(core::TimePoint now, const std::unordered_set<core::EngineId>& named) {
  next_sweep_ = now + kEngineSweep;
  for (auto it = engines_.begin(); it != engines_.end();) {
    const KnownEngine& e = it->second;
    const bool unreached = !e.view_ && !e.declared_down_ && e.lookups_.empty() &&
                           e.failed_until_ <= now && e.parked.empty() && e.pending_releases.empty();
    if (unreached && named.count(it->first) == 0) {
      it = engines_.erase(it);
      ++stats_.engines_forgotten;
    } else {
      ++it;
    }
  }
}

core::TimePoint KnownEngines::NextDeadline() const {
  core::TimePoint next = core::kNever;
  for (const auto& [engine, entry] : engines_) {
    for (const auto& [address, lookup] : entry.lookups_) next = std::min(next, lookup.deadline);
  }
  return next;
}

std::vector<LookupRequest> KnownEngines::TakeLookups() { return std::exchange(out_, {}); }

}  // namespace kvferry::protocol
