// KnownEngines: what one D rank knows of the P engines its requests name — each engine's view
// (the process a lookup found: incarnation, TP size, side channels), the bootstrap lookups in
// flight and their deadlines, a failed lookup believed for a while, a liveness source's word
// that the engine is down, and the work that waits for a lookup. Sans-IO and part of
// DecodeSession: a lookup here is a LookupRequest the caller makes and answers (OnAnswer,
// OnFailure); what was waiting comes back to the caller, which sends it or fails it.
//
// The rules it keeps (DecodeSession's, each with a test in known_engines_test.cc or
// decode_session_test.cc):
//  - One lookup per engine and bootstrap address at a time, at most kMaxLookupsPerEngine at
//    distinct addresses (a client may name any address: a bad one must not hold up the others,
//    and a new one per request must not grow D's work). Ids are unique and increasing.
//  - An answer to a lookup asked before the engine was declared down or one of its processes
//    gone is stale (it may describe the dead process): it is counted and changes nothing, and
//    what waits gets a fresh lookup.
//  - A failed lookup of an engine never reached is believed for `failure_ttl`, only for loads
//    naming the address that failed; a liveness source's down covers every address. A failed
//    refresh of a known view is no failure: what waited goes to the known view.
//  - A new incarnation found at the very bootstrap the old one was learned from means the
//    engine restarted (`Answered::replaced`); found elsewhere, it settles nothing.
//  - Engines never reached, with nothing waiting and named by no tracked request, are forgotten
//    (Sweep, when SweepDue says: at most once per 10 s): clients name engines, and one naming a
//    new engine per request must not grow D's memory.
//
// Not thread-safe: one owner calls everything.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kvferry/core/ids.h"
#include "kvferry/core/time.h"
#include "kvferry/status.h"

namespace kvferry::protocol {

// One remote-prefill request as the router describes it (vLLM's kv_transfer_params).
struct RemoteSource {
  core::TransferId transfer_id;
  core::EngineId engine_id;       // remote_engine_id
  std::string bootstrap_address;  // remote_bootstrap_addr
};

// What a lookup found out about a P engine.
struct PeerEngine {
  core::EngineId engine_id;
  std::string incarnation;  // a new value: a new process
  std::uint32_t tp_size = 1;
  std::vector<std::string> side_channels;  // by P rank; size() == tp_size
  // wire::kFeature* bits its workers read (bootstrap "protocol_features"); releases go only to
  // an engine with wire::kFeatureRelease.
  std::uint32_t features = 0;
};

// A bootstrap lookup to make; answer with DecodeSession::OnLookup (or OnLookupFailed), passing
// its id.
struct LookupRequest {
  core::EngineId engine_id;
  std::string bootstrap_address;
  std::uint64_t id = 0;  // unique per session, increasing; never 0
};

// A load that waits for a lookup of its engine.
struct ParkedLoad {
  core::RequestId request;
  RemoteSource source;
  std::vector<core::BlockId> blocks;
  bool retried = false;  // sent again once after its only pull never left (OnSendFailed)
};

// What waits for a lookup of one engine.
struct ParkedWork {
  std::vector<ParkedLoad> loads;
  std::vector<std::vector<core::Fingerprint>> renewals;  // this renewal pass's batches
  std::vector<core::Fingerprint> releases;
  bool empty() const { return loads.empty() && renewals.empty() && releases.empty(); }
};

// One P engine as D knows it. The view and the lookups change only through KnownEngines; the
// public fields are the session's own per-engine state.
class KnownEngine {
 public:
  // The process a lookup found; null before any answer, and after a down or its process gone.
  const PeerEngine* view() const { return view_ ? &*view_ : nullptr; }
  // Something said the process the view names may be gone (a send found nobody listening, a
  // pull timed out): loads and releases wait for a fresh lookup; renewals go on to the view.
  bool view_stale() const { return view_stale_; }
  // The view a liveness source declared down (DeclareDown): loads fail while the failure is
  // believed, but renewals and releases still go there — the source may be wrong (a partition,
  // a lapsed registry lease) and P keeps its KV only while renewed. Cleared by the next answer.
  const PeerEngine* declared_down() const { return declared_down_ ? &*declared_down_ : nullptr; }
  // Whether a failed lookup (or a down) is still believed for a load naming `address`.
  bool FailureCovers(const std::string& address, core::TimePoint now) const {
    return failed_until_ > now && (failure_address_.empty() || failure_address_ == address);
  }
  // Whether a failure is believed at all (at any address).
  bool FailureBelieved(core::TimePoint now) const { return failed_until_ > now; }
  // Why loads fail while FailureCovers: the lookup's error or the down's.
  const Status& failure() const { return failure_; }
  // The latest bootstrap address a request named: where a lookup goes by default.
  const std::string& bootstrap_address() const { return bootstrap_address_; }
  // Where a parked load's lookup asks: the address its request named, else the latest.
  const std::string& AddressOf(const ParkedLoad& load) const {
    return load.source.bootstrap_address.empty() ? bootstrap_address_
                                                 : load.source.bootstrap_address;
  }

  ParkedWork parked;
  std::vector<core::Fingerprint> pending_releases;  // batched until the session's release_due
  bool releases_unsupported = false;                // it answered a Release with ERROR PROTOCOL
  bool warned_lease = false;                        // a lease mismatch was warned of

 private:
  friend class KnownEngines;
  struct InFlightLookup {
    std::uint64_t id = 0;
    core::TimePoint deadline = core::kNever;
  };
  std::string bootstrap_address_;
  std::optional<PeerEngine> view_;
  std::string view_address_;  // where view_ was learned
  bool view_stale_ = false;
  std::optional<PeerEngine> declared_down_;
  // Lookups in flight by bootstrap address (at most kMaxLookupsPerEngine; usually one).
  std::map<std::string, InFlightLookup> lookups_;
  std::uint64_t lookup_id_ = 0;     // the latest lookup asked
  std::string lookup_address_;      // where the latest lookup asked
  std::uint64_t lookup_floor_ = 0;  // answers to lookups with a lower id are stale
  core::TimePoint failed_until_ = core::TimePoint::min();
  Status failure_;
  // The address whose lookup failed; empty: every address (a down).
  std::string failure_address_;
};

class KnownEngines {
 public:
  static constexpr std::size_t kMaxLookupsPerEngine = 4;

  struct Stats {
    std::uint64_t lookups = 0;
    std::uint64_t lookup_failures = 0;
    std::uint64_t lookups_stale = 0;
    std::uint64_t engines_forgotten = 0;
  };
  // A lookup's answer, taken.
  struct Answered {
    KnownEngine* entry = nullptr;
    // The incarnation the view named before, when the answer names another process.
    std::optional<std::string> previous;
    // The answer came from where the previous process was learned: that process is gone.
    bool replaced = false;
    ParkedWork parked;  // to send to the new view
  };
  // A lookup's failure (or deadline), taken.
  struct Failed {
    KnownEngine* entry = nullptr;
    // The engine has a view (a refresh failed): `parked` is everything that waited, to send to
    // that view. Otherwise `parked.loads` are the loads that named the failed address, to fail
    // with entry->failure(), and renewals and releases are what no lookup in flight will serve.
    bool refreshed = false;
    ParkedWork parked;
  };
  // A liveness source's down, taken.
  struct Down {
    KnownEngine* entry = nullptr;
    std::optional<PeerEngine> view;  // the view it had, now gone (DeclareDown keeps it)
    ParkedWork parked;               // loads to fail with entry->failure(); releases
  };

  // How long a lookup is awaited, and a failed one believed.
  KnownEngines(core::Duration lookup_timeout, core::Duration failure_ttl)
      : lookup_timeout_(lookup_timeout), failure_ttl_(failure_ttl) {}

  // The entry of `engine`, made on first use; a non-empty `bootstrap_address` becomes where the
  // next lookup goes (it settles nothing by itself: an answer only adds peers).
  KnownEngine& Note(const core::EngineId& engine, const std::string& bootstrap_address);
  KnownEngine* Find(const core::EngineId& engine);
  const KnownEngine* Find(const core::EngineId& engine) const;
  std::size_t size() const { return engines_.size(); }
  auto begin() { return engines_.begin(); }
  auto end() { return engines_.end(); }

  // Asks for a lookup of `engine` at `address` (default: its latest address) unless one is in
  // flight there or kMaxLookupsPerEngine are.
  void Ask(const core::EngineId& engine, KnownEngine& entry, core::TimePoint now,
           const std::string* address = nullptr);
  // Asks for the lookups that what is parked needs: at the latest address (renewals, releases,
  // or loads of an engine with a view), and while unpaired at each address a parked load named
  // that no believed failure covers.
  void AskForParked(const core::EngineId& engine, KnownEngine& entry, core::TimePoint now);

  // The answer to lookup `id` (0: the engine's latest): nullopt when stale. Clears the failure,
  // sets the view and hands back what was parked.
  std::optional<Answered> OnAnswer(const PeerEngine& engine, core::TimePoint now, std::uint64_t id);
  // Lookup `id` failed (0: the latest): nullopt when the engine is unknown, the answer stale,
  // or the lookup no longer in flight (its deadline failed it already).
  std::optional<Failed> OnFailure(const core::EngineId& engine, const Status& why,
                                  core::TimePoint now, std::uint64_t id);
  // Lookups whose deadline passed, as (engine, id), in engine order then address order: fail
  // each with OnFailure.
  std::vector<std::pair<core::EngineId, std::uint64_t>> Expired(core::TimePoint now) const;

  // A liveness source says the engine is down: its view goes, lookups in flight become stale,
  // and loads fail at every address for failure_ttl. nullopt for an engine never known.
  std::optional<Down> OnEngineDown(const core::EngineId& engine, const Status& why,
                                   core::TimePoint now);
  // Where renewals and releases go while the down is believed (KnownEngine::declared_down).
  void DeclareDown(KnownEngine& entry, PeerEngine view) { entry.declared_down_ = std::move(view); }
  // One process of the engine is gone: lookups in flight become stale and are asked again for
  // what waits, and a view or declared-down view of that process is dropped. Null for an engine
  // never known.
  KnownEngine* OnProcessGone(const core::EngineId& engine, const std::string& incarnation,
                             core::TimePoint now);
  // Every engine whose view names the side channel `address` has a stale view.
  void MarkViewsStale(const std::string& address);

  // Whether a Sweep is due (at most one per 10 s): the caller collects `named` only then.
  bool SweepDue(core::TimePoint now) const { return now >= next_sweep_; }
  // Forgets engines never reached that nothing waits for and `named` does not hold.
  void Sweep(core::TimePoint now, const std::unordered_set<core::EngineId>& named);
  // The earliest lookup deadline (kNever: none).
  core::TimePoint NextDeadline() const;
  std::vector<LookupRequest> TakeLookups();
  const Stats& stats() const { return stats_; }

 private:
  // The in-flight lookup `id` answers (0: the latest asked), removed; nullopt if none is in
  // flight under that id. It returns the address it asked.
  static std::optional<std::string> TakeLookup(KnownEngine& entry, std::uint64_t id);
  // True (and counted, and what waits asked for again) when `id` was asked before the floor.
  bool Stale(const core::EngineId& engine, KnownEngine& entry, std::uint64_t id,
             core::TimePoint now);

  const core::Duration lookup_timeout_;
  const core::Duration failure_ttl_;
  std::unordered_map<core::EngineId, KnownEngine> engines_;
  std::uint64_t last_lookup_id_ = 0;
  core::TimePoint next_sweep_ = core::TimePoint::min();
  std::vector<LookupRequest> out_;
  Stats stats_;
};

}  // namespace kvferry::protocol
