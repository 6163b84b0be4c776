// In-process data plane: engines that share an InProcessFabric write into each other's regions
// with memcpy. Same contract as every Engine (transport.h), plus failure injection, for unit
// tests and the simulator.
//
// Delivery modes:
//   automatic (default)  a worker thread per engine delivers batches in submission order; a
//                        delayed batch is delivered once its delay has passed in real time.
//   manual               nothing moves until Pump(now) is called; `now` is the caller's clock
//                        (virtual time in the simulator). Pump delivers every batch whose due
//                        time is <= now, in (due time, submission order), and runs completions on
//                        the calling thread. Fully deterministic; no sleeps anywhere.
// A batch is due at (the engine's current time + injected delay); the current time is the
// `now` of the last Pump in manual mode and the steady clock in automatic mode.
//
// Bytes are copied under the fabric's lock, and a region's registration is checked at delivery
// time (kOutOfRange if the peer deregistered it meanwhile), so once DeregisterMemory returns
// nothing more lands in that region.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "kvferry/transport/transport.h"

namespace kvferry::transport {

// The shared "network" that engines of one process use to find each other by name.
class InProcessFabric;
std::shared_ptr<InProcessFabric> MakeInProcessFabric();

enum class FaultKind : std::uint8_t {
  kFail,   // the batch writes nothing and completes with `code`
  kDelay,  // the batch is delivered `delay` later (in the engine's time)
  kDrop,   // the batch writes nothing and never completes until ClosePeer/shutdown (kCancelled)
};

struct Fault {
  FaultKind kind = FaultKind::kFail;
  // How many upcoming batches to the peer this applies to; -1 = every batch until cleared.
  int count = 1;
  Duration delay{0};                         // kDelay
  ErrorCode code = ErrorCode::kUnavailable;  // kFail
};

struct InProcessOptions {
  std::string name;  // unique within the fabric; faults name peers by it
  bool manual_pump = false;
  // Engine::fences_writes: refuse inbound writes without a key or with a revoked one (checked
  // under the fabric's lock at delivery, so RevokeWriteKeys never has to wait).
  bool fence_writes = false;
};

class InProcessEngine : public Engine {
 public:
  // Applies `fault` to batches this engine submits to the engine called `peer_name`, after the
  // faults already queued for that peer (each consumed by `count` batches). Checked at submit.
  virtual void InjectFault(std::string_view peer_name, const Fault& fault) = 0;
  virtual void ClearFaults(std::string_view peer_name) = 0;

  // Manual mode only (returns 0 otherwise): advances this engine's time to `now` and delivers
  // every due batch. Returns the number of completions it ran.
  virtual std::size_t Pump(TimePoint now) = 0;

  // Batches submitted and not yet completed (delayed, dropped or waiting for Pump).
  virtual std::size_t PendingBatches() const = 0;
};

// kAlreadyExists if the name is taken in the fabric; kInvalidArgument if it is empty.
Result<std::unique_ptr<InProcessEngine>> MakeInProcessEngine(
    std::shared_ptr<InProcessFabric> fabric, const InProcessOptions& options);

}  // namespace kvferry::transport
