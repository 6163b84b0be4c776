// PrefillDriver: protocol::PrefillAdapter pumped onto the PrefillWorkers of an engine's ranks —
// the twin of DecodeDriver (decode_driver.h). `kvferry serve` drives one over all its ranks,
// the vLLM connector's worker one over its own rank; the simulator drives the same adapter
// over sessions.
//
// Contract: not thread-safe (one caller at a time). The workers must outlive the driver. The
// engine leaves a transfer's blocks untouched from PrefillDone until FreeBlocks (each rank's
// session plans its writes from the block ids it was given). Pump() waits for each rank call's
// acknowledgement, at most `ack_timeout` (the worker's listener thread answers it): an Admit
// that does not answer counts as refused (and is rolled back); a PrefillDone that does not
// answer counts as held — its blocks are kept until that rank frees them, since reusing them
// while a write may read them would corrupt a decoder's KV, and a leak shows in the metrics.
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

#include "protocol/prefill_adapter.h"
#include "runtime/prefill_worker.h"

namespace kvferry::runtime {

class PrefillDriver {
 public:
  // One worker per rank, in rank order (non-null).
  explicit PrefillDriver(std::vector<PrefillWorker*> ranks,
                         std::chrono::milliseconds ack_timeout = std::chrono::seconds(5));

  // The engine's inputs: protocol::PrefillAdapter's, with its errors.
  [[nodiscard]] Status Admit(const core::TransferId& transfer, std::uint64_t handle);
  [[nodiscard]] Status PrefillDone(const core::TransferId& transfer,
                                   std::vector<core::BlockId> blocks);
  bool LayersReady(const core::TransferId& transfer, std::uint64_t handle,
                   const std::vector<core::BlockId>& blocks,
                   const std::vector<std::uint32_t>& planes);
  void Finish(const core::TransferId& transfer);
  void Drop(const core::TransferId& transfer, const Status& why);

  // A hold event of rank `rank`'s worker (its on_hold callback, moved to the engine's thread).
  void OnHoldEvent(std::uint32_t rank, const core::HoldEvent& event);

  // Makes the rank calls the adapter decided, feeding back each acknowledgement, and returns
  // the adapter's events since the last Pump. Pump again after acting on them until none comes.
  [[nodiscard]] std::vector<protocol::PrefillAdapterEvent> Pump();

  std::size_t Stop() { return adapter_.Stop(); }
  protocol::PrefillAdapterStats stats() const { return adapter_.stats(); }
  std::optional<std::uint64_t> handle_of(const core::TransferId& transfer) const {
    return adapter_.handle_of(transfer);
  }
  bool abort_told(const core::TransferId& transfer) const { return adapter_.abort_told(transfer); }

 private:
  Status Ack(std::future<Status> f, const char* what);

  std::vector<PrefillWorker*> ranks_;
  std::chrono::milliseconds ack_timeout_;
  protocol::PrefillAdapter adapter_;
};

}  // namespace kvferry::runtime
