// DecodeDriver: protocol::DecodeAdapter pumped onto the DecodeWorkers of an engine's ranks —
// the engine glue of a real D process. `kvferry serve` drives one over all its ranks; the vLLM
// connector's worker one over its own rank (vLLM's scheduler then combines the ranks' reports
// as the adapter combines ranks: a load is finished once every rank says so). The simulator
// drives the same adapter over sessions instead of workers.
//
// Contract: not thread-safe (one engine thread calls it; the binding calls it with the GIL
// held). The workers must outlive the driver. Every call returns at once: worker calls only
// queue work for the workers' threads.
//
// Usage: call the engine inputs (Track, StartLoad, Finish, Refuse) and feed every worker's
// TakeFinished to OnFinished; then Pump() until it returns no event, acting on each
// (protocol::LoadDone, BlocksReusable, TransferDropped; see protocol/decode_adapter.h).
#pragma once

#include <cstdint>
#include <vector>

#include "protocol/decode_adapter.h"
#include "runtime/decode_worker.h"

namespace kvferry::runtime {

class DecodeDriver {
 public:
  // One worker per rank, in rank order (non-null).
  explicit DecodeDriver(std::vector<DecodeWorker*> ranks,
                        std::size_t max_requests = protocol::DecodeAdapterOptions{}.max_requests);

  // The engine's inputs: protocol::DecodeAdapter's, with its errors.
  [[nodiscard]] Status Track(const core::RequestId& request, const RemoteSource& source);
  [[nodiscard]] Status StartLoad(const core::RequestId& request, const RemoteSource& source,
                                 std::vector<core::BlockId> blocks);
  void Finish(const core::RequestId& request);
  void Refuse(const RemoteSource& source);

  // What rank `rank`'s worker reported (its TakeFinished).
  void OnFinished(std::uint32_t rank, const DecodeFinished& finished);

  // Makes the rank calls the adapter decided (a worker's refused StartLoad goes back to the
  // adapter as OnStartFailed) and returns the adapter's events since the last Pump. Events may
  // lead the engine to more inputs: pump again until none comes.
  [[nodiscard]] std::vector<protocol::AdapterEvent> Pump();

  protocol::DecodeAdapterStopReport Stop() { return adapter_.Stop(); }
  protocol::DecodeAdapterStats stats() const { return adapter_.stats(); }

 private:
  std::vector<DecodeWorker*> ranks_;
  protocol::DecodeAdapter adapter_;
};

}  // namespace kvferry::runtime
