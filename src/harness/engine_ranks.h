// EngineRanks: the kvferry runtime under one `kvferry serve` engine — per TP rank a UCX data
// plane and a runtime::PrefillWorker (P) or runtime::DecodeWorker (D), the engine adapter's
// driver over those ranks (runtime::PrefillDriver, runtime::DecodeDriver: the glue the vLLM
// connector drives too), and on D one collector thread per rank that hands its finished
// receives to the engine. ServingEngine owns one; what it does with the blocks is its own.
//
// Contracts:
//  - Start() starts every rank or none: a failure stops what it had started and names the rank.
//  - The callbacks run on kvferry's threads (P: a rank's listener and sender threads; D: the
//    collector of a rank) and must not block: they hand work to the engine's thread.
//  - The drivers are not thread-safe: the caller serializes its calls (ServingEngine: D's on its
//    engine thread, P's under a mutex shared with HTTP threads).
//  - Stop() — once every caller of the drivers is done — joins the collectors, then stops P's
//    workers (each drains its writes in flight before its memory is deregistered), then D's
//    (their pullers joined), then the data planes. The destructor Stop()s.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "harness/engine.h"
#include "kvferry/core/hold_table.h"
#include "kvferry/status.h"
#include "runtime/decode_driver.h"
#include "runtime/decode_worker.h"
#include "runtime/prefill_driver.h"
#include "runtime/prefill_worker.h"

namespace kvferry::harness {

class EngineRanks {
 public:
  struct Callbacks {
    // P: a hold table asks the engine to free a transfer's blocks or abort its prefill.
    std::function<void(std::uint32_t rank, const core::HoldEvent& event)> on_hold;
    // P: one write batch ended, `seconds` after it started.
    std::function<void(double seconds)> on_write;
    // D: receives of `rank` settled.
    std::function<void(std::uint32_t rank, runtime::DecodeFinished finished)> on_finished;
  };

  // `options` must outlive the ranks (ServingEngine's own copy).
  [[nodiscard]] static Result<std::unique_ptr<EngineRanks>> Start(const EngineOptions& options,
                                                                  Callbacks callbacks);
  ~EngineRanks() { Stop(); }
  EngineRanks(const EngineRanks&) = delete;
  EngineRanks& operator=(const EngineRanks&) = delete;

  void Stop();

  std::uint32_t size() const { return static_cast<std::uint32_t>(transports_.size()); }
  // The KV region of `rank` (num_blocks × block_len bytes), P's or D's.
  std::byte* kv(std::uint32_t rank) const;
  // Null on the other role.
  runtime::PrefillDriver* prefill_driver() { return p_driver_.get(); }
  runtime::DecodeDriver* decode_driver() { return d_driver_.get(); }
  const std::vector<std::unique_ptr<runtime::PrefillWorker>>& prefill_workers() const {
    return prefill_;
  }
  const std::vector<std::unique_ptr<runtime::DecodeWorker>>& decode_workers() const {
    return decode_;
  }

 private:
  EngineRanks(const EngineOptions& options, Callbacks callbacks)
      : options_(options), callbacks_(std::move(callbacks)) {}
  Status StartTransports();
  Status StartPrefill();
  Status StartDecode();
  // Moves `rank`'s finished receives to on_finished until Stop.
  void Collect(std::uint32_t rank);

  const EngineOptions& options_;
  const Callbacks callbacks_;
  std::vector<std::shared_ptr<transport::Engine>> transports_;
  std::vector<std::unique_ptr<runtime::PrefillWorker>> prefill_;
  std::vector<std::unique_ptr<runtime::DecodeWorker>> decode_;
  std::unique_ptr<runtime::PrefillDriver> p_driver_;
  std::unique_ptr<runtime::DecodeDriver> d_driver_;
  std::vector<std::thread> collectors_;
  std::atomic<bool> collectors_stop_{false};
};

}  // namespace kvferry::harness
