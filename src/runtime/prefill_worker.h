// PrefillWorker: one P rank in a real process. It bundles the pieces a serving engine embeds on
// the prefill side: a KV region registered with the data plane, the side-channel listener (which
// owns the rank's HoldTable), the writer that turns a pull into data-plane writes (TP slices,
// coalesced runs), and the registration with the bootstrap service.
//
// The engine keeps its own block allocator. It tells the worker when a request is admitted and
// when its prefill is done (with the block ids holding its KV); the worker tells the engine when
// those blocks may be freed (kFreeBlocks) or the request aborted (kAbortPrefill), through
// `on_hold_event` (called on the listener thread; it must not block).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "control/bootstrap_types.h"
#include "control/side_channel_listener.h"
#include "kvferry/core/hold_table.h"
#include "kvferry/core/tp_plan.h"
#include "kvferry/status.h"
#include "kvferry/transport/transport.h"
#include "runtime/kv_memory.h"

namespace kvferry::runtime {

// What a trace hook sees: the moment a write of `job` starts or ends (steady clock, which is
// system-wide on Linux, so traces of several processes on one host can be merged).
enum class WritePhase : std::uint8_t { kStart, kEnd };
using WriteTraceFn = std::function<void(WritePhase, const protocol::PullContext&,
                                        const protocol::WriteJob&, core::TimePoint, const Status&)>;

// KvWriter over a transport::Engine: writes the byte ranges the session planned for a job
// (protocol::WriteJob::writes), for every KV plane, as one batch. A failed batch is kFailed only when nothing of it was posted or the receiver
// itself refused it (kOutOfRange, kRejected: its ack came after every op was applied or
// refused); any other failure (timeout, cancel, a dead or unreachable peer) is kUnsettled,
// because bytes already sent may still be applied at the receiver.
class TransportKvWriter : public control::KvWriter {
 public:
  struct Options {
    // This rank's KV planes (runtime/kv_memory.h), in plane order; D's descriptor must list as
    // many regions, in the same order.
    std::vector<transport::RegionId> regions;
    std::chrono::milliseconds write_timeout{30000};
    WriteTraceFn trace;  // optional
  };
  TransportKvWriter(std::shared_ptr<transport::Engine> engine, Options options);
  ~TransportKvWriter() override;

  protocol::WriteOutcome Write(const protocol::PullContext& context,
                               const protocol::WriteJob& job) override;
  void CancelWrites() override;

  // Bytes written and batches, for metrics.
  std::uint64_t bytes_written() const;
  std::uint64_t batches() const;

 private:
  struct Peer {
    transport::ConnectionId id;
    std::vector<transport::RegionId> remote_regions;  // D's planes, in plane order
  };
  Result<Peer> PeerFor(const std::vector<std::uint8_t>& descriptor);
  void DropPeer(const std::vector<std::uint8_t>& descriptor, transport::ConnectionId id);

  std::shared_ptr<transport::Engine> engine_;
  Options options_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, Peer> peers_;  // by descriptor bytes
  std::uint64_t bytes_written_ = 0;
  std::uint64_t batches_ = 0;
};

struct PrefillWorkerOptions {
  std::string engine_id = "prefill-0";
  std::uint32_t dp_rank = 0;
  std::uint32_t tp_size = 1;
  std::uint32_t tp_rank = 0;
  std::uint32_t kv_heads = 0;   // 0: as many as tp ranks
  std::uint64_t block_len = 0;  // bytes per block on this rank, in each plane
  std::uint32_t num_blocks = 0;
  // The engine's own KV memory (runtime/kv_memory.h): one plane per tensor, each at least
  // num_blocks × block_len bytes, valid until the worker stopped. Empty: the worker allocates
  // one plane.
  std::vector<KvPlane> planes;
  // False: this rank's blocks do not keep a KV head's bytes together (a token-major layout),
  // so a pull that needs part of a block (a decoder of a larger TP size) fails with the reason
  // instead of moving the wrong bytes.
  bool head_slices = true;
  core::HoldConfig hold;
  std::size_t num_senders = 4;
  std::string side_channel_endpoint = "tcp://127.0.0.1:0";
  // Where to register ("host:port"); empty: do not register.
  std::string bootstrap_address;
  std::string incarnation;  // random per process start; all ranks of the engine share it
  std::chrono::milliseconds write_timeout{30000};
  WriteTraceFn trace;
  // Optional: wraps the writer the listener calls (the serving harness injects its faults this
  // way, so the worker carries none); the worker keeps the undecorated writer for its metrics.
  std::function<std::shared_ptr<control::KvWriter>(std::shared_ptr<control::KvWriter>)>
      decorate_writer;
  // Cluster authentication (docs/security.md): null for an open cluster. Otherwise the
  // listener admits only CURVE peers with the cluster's keys, and the registration is signed.
  std::shared_ptr<const control::ClusterSecret> cluster_secret;
};

class PrefillWorker {
 public:
  // Allocates the KV region (num_blocks × block_len, pre-faulted) on `engine`, starts the
  // listener, and registers with the bootstrap service when an address is given.
  [[nodiscard]] static Result<std::unique_ptr<PrefillWorker>> Start(
      PrefillWorkerOptions options, std::shared_ptr<transport::Engine> engine,
      control::HoldEventCallback on_hold_event);
  // Stops the listener (drains in-flight writes) before the region is deregistered.
  ~PrefillWorker();

  // The KV memory of this rank: block b of plane i lives at kv(i) + b × block_len.
  std::byte* kv(std::size_t plane = 0) const { return memory_.plane(plane); }
  std::size_t num_planes() const { return memory_.num_planes(); }
  const std::string& side_channel() const { return listener_->endpoint(); }
  control::PrefillListener& listener() { return *listener_; }
  const TransportKvWriter& writer() const { return *writer_; }
  // What this worker registers (with the bootstrap service, and in etcd when that is on).
  const control::WorkerRegistration& registration() const { return registration_; }

  [[nodiscard]] std::future<Status> Admit(const core::TransferId& id, std::uint64_t handle) {
    return listener_->Admit(id, handle);
  }
  // `blocks`: the transfer's KV on this rank, kept until kFreeBlocks / kAbortPrefill.
  [[nodiscard]] std::future<Status> PrefillDone(const core::TransferId& id,
                                                std::vector<core::BlockId> blocks) {
    return listener_->PrefillDone(id, std::move(blocks));
  }
  // Layers computed before the prefill ended (control::PrefillListener::LayersReady): `planes`
  // index this worker's KvPlanes.
  [[nodiscard]] std::future<Status> LayersReady(const core::TransferId& id,
                                                std::vector<core::BlockId> blocks,
                                                std::vector<std::uint32_t> planes) {
    return listener_->LayersReady(id, std::move(blocks), std::move(planes));
  }
  [[nodiscard]] std::future<Status> EngineFinished(const core::TransferId& id) {
    return listener_->EngineFinished(id);
  }
  [[nodiscard]] std::future<Status> Refuse(const core::TransferId& id, Status why) {
    return listener_->Refuse(id, std::move(why));
  }

  // Stops serving; idempotent. The destructor calls it.
  Status Stop();

 private:
  PrefillWorker() = default;

  PrefillWorkerOptions options_;
  std::shared_ptr<transport::Engine> engine_;
  KvMemory memory_;
  std::shared_ptr<TransportKvWriter> writer_;
  std::unique_ptr<control::PrefillListener> listener_;
  control::WorkerRegistration registration_;
  bool stopped_ = false;
};

}  // namespace kvferry::runtime
