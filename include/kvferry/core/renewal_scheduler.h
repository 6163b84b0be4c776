// RenewalScheduler: D's side of the lease (SPEC §2 rules 1–3). Decides which transfer ids to
// renew with which P engine, and when. Sans-IO: the caller sends the batches (to every P worker
// it would pull from) and reports rejections. Not thread-safe: one owner.
//
// D tracks a request from the moment it first sees it (it may still be queued) until its
// receive settles or it finishes or aborts. Every lease/6 the tracked ids are grouped by P
// engine into batches of at most `max_ids_per_batch`.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvferry/core/ids.h"
#include "kvferry/core/time.h"

namespace kvferry::core {

struct RenewalBatch {
  EngineId engine;
  std::vector<Fingerprint> ids;  // fingerprints of transfer ids (what renewals carry)
};

class RenewalScheduler {
 public:
  // `lease` zero disables renewals: Poll() never yields anything.
  explicit RenewalScheduler(Duration lease, std::size_t max_ids_per_batch = 128);

  // on_new_request: start renewing `transfer` with `engine`. Tracking twice is a no-op.
  void Track(const TransferId& transfer, const EngineId& engine);
  // finished_recving / request_finished / abort. Unknown ids are ignored.
  void Untrack(const TransferId& transfer);

  // The batches due at `now` (empty before NextDue()). Engines that rejected renewals are
  // skipped until ResetEngine. Advances the schedule by one interval from `now`.
  std::vector<RenewalBatch> Poll(TimePoint now);
  // When Poll next has work; kNever with the lease off.
  TimePoint NextDue() const { return lease_.count() > 0 ? next_due_ : kNever; }
  Duration interval() const { return lease_ / 6; }

  // P answered "no lease". Returns true the first time for `engine`, so the caller logs one
  // warning per P engine and keeps pulling without renewing it.
  bool NoteRejected(const EngineId& engine);
  // The engine restarted (new bootstrap incarnation): forget that it rejected renewals.
  void ResetEngine(const EngineId& engine);

  std::size_t tracked() const { return by_transfer_.size(); }
  bool IsTracked(const TransferId& transfer) const { return by_transfer_.count(transfer) != 0; }

 private:
  struct EngineState {
    EngineId name;
    std::size_t tracked = 0;
    bool rejected = false;
  };
  std::uint32_t EngineIndex(const EngineId& engine);

  Duration lease_;
  std::size_t max_ids_per_batch_;
  TimePoint next_due_ = TimePoint{};
  std::unordered_map<TransferId, std::uint32_t> by_transfer_;  // transfer -> engine index
  std::vector<EngineState> engines_;
  std::unordered_map<EngineId, std::uint32_t> engine_index_;
};

}  // namespace kvferry::core
