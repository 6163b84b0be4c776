// The data plane: moves bytes from a registered local KV region into a registered region of a
// peer, in batches with one completion each.
//
// The interface is deliberately narrow: register memory, export a descriptor of it (bytes that
// travel inside a side-channel message), connect to a peer from its descriptor, submit batches
// of writes, and close (fence) a peer. Backends: UCX (ucx.h) and an in-process memcpy backend
// with failure injection (inprocess.h). No backend header leaks into this file.
//
// Threading: every Engine method is thread-safe. Completion callbacks run on a backend thread
// (UCX: its progress thread; in-process: its worker thread or the thread calling Pump()). A
// callback must not block and must not call a blocking method (Connect, ClosePeer,
// DeregisterMemory, AllocateRegion, RegisterMemory, ExportDescriptor, the destructor); such a
// call from a callback fails with kInvalidArgument. SubmitWrites may be called from a callback.
//
// Deadlines: every method that waits takes a deadline (steady clock) and never waits past it by
// more than a bounded, small amount of cleanup work.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/core/time.h"
#include "kvferry/status.h"

namespace kvferry::transport {

using Clock = core::Clock;
using TimePoint = core::TimePoint;
using Duration = core::Duration;

// Where a region lives. kCuda: the UCX backend registers it when its UCX was built with CUDA
// and UCX itself sees CUDA memory at that address (never on the caller's word), and not with
// fence_writes (a fencing receiver copies writes with the CPU). Device memory takes puts only: a
// sender refuses a write into a remote CUDA region over a connection that writes by active
// messages, and a receiver refuses such a write into its own. The in-process backend refuses
// kCuda.
enum class MemoryKind : std::uint8_t { kHost = 0, kCuda = 1 };

// Engine-local handle of a registered region. It also names the region inside descriptors, so a
// writer addresses a remote region by the id its owner assigned. Never reused by one engine.
using RegionId = std::uint32_t;
// Engine-local handle of a connection to a peer. Never reused by one engine.
using ConnectionId = std::uint64_t;
// Engine-local id of a submitted batch, passed to its completion. Never reused by one engine.
using BatchId = std::uint64_t;

struct Region {
  RegionId id = 0;
  std::byte* base = nullptr;
  std::size_t length = 0;
  MemoryKind kind = MemoryKind::kHost;
};

// One contiguous write: `length` bytes at `local_offset` of local region `local_region` go to
// `remote_offset` of the peer's region `remote_region`. A backend posts each op as one operation
// (it never splits or merges ops itself); callers coalesce contiguous blocks into one op.
struct WriteOp {
  RegionId local_region = 0;
  RegionId remote_region = 0;
  std::uint64_t local_offset = 0;
  std::uint64_t remote_offset = 0;
  std::uint64_t length = 0;
};

// A receiver's credential for writes into its memory: it hands one out with each request for
// data (wire::Pull carries it), and the writer stamps every batch it writes for that request with
// it. A receiver that fences (Engine::fences_writes) refuses a write without a key or with a
// revoked one, so revoking a key stops every writer that holds it — over its current connection
// and any later one — without the writer's help: the receiver's fence (RevokeWriteKeys).
using WriteKey = std::uint64_t;
inline constexpr WriteKey kNoWriteKey = 0;

// Called exactly once for every batch that SubmitWrites accepted. OK means every byte of every
// op is in the peer's memory (not merely handed to the network). Errors:
//   kUnavailable  the peer died or became unreachable (some ops may have landed)
//   kOutOfRange   the peer refused a range (e.g. it deregistered the region meanwhile)
//   kRejected     the peer fences writes and refused the batch's key (none, or revoked)
//   kCancelled    ClosePeer or engine shutdown cancelled the batch (some ops may have landed)
//   kInternal     a backend failure that is not one of the above
using CompletionFn = std::function<void(BatchId, Status)>;

// What a descriptor says about one region of its owner.
struct RemoteRegion {
  RegionId id = 0;
  std::uint64_t base = 0;  // address in the owner's process (informational)
  std::uint64_t length = 0;
  MemoryKind kind = MemoryKind::kHost;
};

// The parsed, backend-independent part of a descriptor (for checks such as "does this block id
// fit the peer's region" before a transfer is accepted).
struct DescriptorInfo {
  std::string backend;           // "ucx" or "inprocess"
  std::uint64_t engine_uid = 0;  // random per engine instance
  std::vector<RemoteRegion> regions;
};

// Parses descriptor bytes defensively (hostile input gets kProtocol, never a crash or a huge
// allocation).
Result<DescriptorInfo> ParseDescriptor(std::span<const std::byte> descriptor);

// How a peer's writes are carried; reported by Engine::DescribePeer for logs and benchmarks.
struct PeerInfo {
  std::string path;        // "put" (one-sided), "am" (active messages + receiver ack), "memcpy"
  std::string transports;  // e.g. "tcp", "posix", "cma+tcp"
  std::size_t batches_in_flight = 0;
};

class Engine {
 public:
  virtual ~Engine() = default;

  // "ucx" or "inprocess".
  virtual std::string_view backend() const = 0;

  // Registers caller-owned memory [base, base + length). The memory must stay valid until
  // DeregisterMemory returns OK (or the engine is destroyed). kInvalidArgument for an empty
  // range or an unsupported kind.
  virtual Result<Region> RegisterMemory(void* base, std::size_t length, MemoryKind kind) = 0;

  // Allocates `length` bytes of host memory, pre-faults every page (first-touch faults would cut
  // copy bandwidth by ~10x), zero-fills it and registers it. The engine owns the memory and frees
  // it on DeregisterMemory. Prefer this for KV regions: the UCX backend allocates through UCX so
  // that shared-memory transports can write into it with one copy.
  virtual Result<Region> AllocateRegion(std::size_t length) = 0;

  // Waits until no accepted batch reads from the region and no inbound write (that this engine
  // carries out itself) is copying into it, then deregisters it. kTimeout at the deadline, with
  // the region still registered. kNotFound for an unknown id.
  virtual Status DeregisterMemory(RegionId id, TimePoint deadline) = 0;

  // Serializes what a peer needs to write into the given regions (address ranges, remote keys,
  // this engine's address). An empty span exports every registered region.
  virtual Result<std::vector<std::byte>> ExportDescriptor(std::span<const RegionId> regions) = 0;

  // Connects to the engine that exported `descriptor` and waits until it answers (so a dead or
  // wrong address fails here, not at the first write): kUnavailable when it cannot be reached,
  // kTimeout at the deadline, kProtocol for a malformed descriptor or one from another backend.
  virtual Result<ConnectionId> Connect(std::span<const std::byte> descriptor,
                                       TimePoint deadline) = 0;

  // Submits a batch. Every op is checked before anything is posted: kOutOfRange if a range is
  // outside its local region or outside the remote region as the descriptor describes it,
  // kNotFound for an unknown peer or local region, kInvalidArgument for an empty batch or a
  // zero-length op, kUnavailable if the peer is known dead, kCancelled if it is being closed.
  // On such an error nothing was posted and `done` is never called. Otherwise `done` is called
  // exactly once with the batch's outcome.
  // `key` is the receiver's credential for these writes (kNoWriteKey if it gave none); a
  // receiver that fences checks it on every op it receives.
  virtual Result<BatchId> SubmitWrites(ConnectionId peer, std::span<const WriteOp> ops,
                                       WriteKey key, CompletionFn done) = 0;

  // Fence and close: refuses new batches at once, waits for in-flight batches until `deadline`,
  // cancels what is left (completions get kCancelled) and closes the endpoint. When it returns,
  // this engine will post nothing more to the peer and every completion of the peer was called.
  // OK if every batch finished before the deadline; kTimeout if some had to be cancelled (their
  // bytes may have partly landed); kNotFound for an unknown or already closed peer. A dead peer
  // is closed the same way (its batches have already failed).
  virtual Status ClosePeer(ConnectionId peer, TimePoint deadline) = 0;

  // Transport details for logs and benchmarks.
  virtual Result<PeerInfo> DescribePeer(ConnectionId peer) = 0;

  // ---- Receiver-side fencing ----
  // True when this engine was made to fence writes (UcxOptions / InProcessOptions::fence_writes):
  // it carries out every inbound write itself (no peer can write one-sided into its memory: a
  // UCX engine's descriptors then carry no remote keys, so peers use active messages) and
  // refuses, with kRejected at the writer, every write stamped with kNoWriteKey or a revoked
  // key.
  virtual bool fences_writes() const = 0;

  // The fence: refuses from now on every inbound write stamped with one of `keys`, whichever
  // connection carries it, then waits until no write stamped with one of them is still landing.
  // OK: no byte of a write stamped with these keys lands in this engine's memory after the
  // return. kTimeout at the deadline with some still landing (the keys stay revoked; a later
  // call waits again). kRejected when this engine does not fence writes. Revoked keys are
  // remembered for the engine's life (8 bytes each: receivers revoke on pull timeouts and
  // peer deaths, not per transfer). Must not be called from a completion callback.
  virtual Status RevokeWriteKeys(std::span<const WriteKey> keys, TimePoint deadline) = 0;
};

// A completion that a thread can wait on: pass Callback() as SubmitWrites' `done`, then Wait.
// Thread-safe; one instance serves one batch.
class BatchWaiter {
 public:
  BatchWaiter() : state_(std::make_shared<State>()) {}

  CompletionFn Callback() const;
  // The batch's status, or kTimeout if it did not complete by `deadline` (the batch is still in
  // flight then; close the peer to fence it).
  Status Wait(TimePoint deadline) const;
  bool done() const;

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::optional<Status> status;
  };
  std::shared_ptr<State> state_;
};

}  // namespace kvferry::transport
