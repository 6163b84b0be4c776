// KvMemory: the KV memory of one rank as the data plane sees it, registered for as long as the
// worker that owns it lives.
//
// A rank's KV is one or more *planes* that share block ids: block b of plane i is the bytes
// [b × block_len, (b + 1) × block_len) of plane i. A serving engine keeps its KV in its own
// tensors, several per rank: vLLM's flash-attention layout is one tensor [2, blocks, ...] per
// layer, so 2 × layers planes (the K half and the V half of every layer), and MLA one latent
// tensor per layer. kvferry's own engine has one plane it allocates itself.
//
// P and D of one model have the same planes in the same order (the same layers and K/V
// split); only block_len differs when their TP sizes do. D exports its planes in one data-plane
// descriptor, one region per plane in plane order, and P writes plane i of its blocks into
// region i of that descriptor (TransportKvWriter). A descriptor with another plane count is
// refused before anything is written.
//
// Caller-owned planes must stay valid until the owning worker stopped (its Stop or destructor
// returned): the worker deregisters them last, after every write from or into them ended.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kvferry/core/time.h"
#include "kvferry/status.h"
#include "kvferry/transport/transport.h"

namespace kvferry::runtime {

// One caller-owned plane: `length` bytes at `base`, at least num_blocks × block_len, in host
// memory or, GPU-direct, in a GPU's (kCuda: the engine registers it only where its UCX has CUDA
// memory support and itself sees device memory at `base`; transport.h).
struct KvPlane {
  std::byte* base = nullptr;
  std::size_t length = 0;
  transport::MemoryKind kind = transport::MemoryKind::kHost;
};

// The most planes one rank may register: 2 × 512 layers. Every plane costs D's pull
// descriptor one region entry (about 100 bytes with UCX over tcp), and the descriptor must fit
// wire::kMaxDescriptorBytes (64 KiB), which DecodeWorker checks at start.
inline constexpr std::size_t kMaxKvPlanes = 1024;

class KvMemory {
 public:
  // Registers `planes` with `engine`, or, when `planes` is empty, allocates one plane of
  // num_blocks × block_len bytes (pre-faulted, zeroed: transport::Engine::AllocateRegion).
  // Errors: kInvalidArgument for block_len or num_blocks 0, a size that overflows, more than
  // kMaxKvPlanes planes, a null plane, one shorter than num_blocks × block_len, or two planes
  // whose num_blocks × block_len bytes overlap; the engine's errors (nothing stays registered
  // then; a kCuda plane the engine cannot register GPU-direct is its kInvalidArgument, with the
  // reason). Only num_blocks × block_len bytes of each plane are registered, as the plane's
  // kind. That the memory exists is the caller's word: an address is not checked.
  [[nodiscard]] static Result<KvMemory> Register(std::shared_ptr<transport::Engine> engine,
                                                 std::span<const KvPlane> planes,
                                                 std::uint64_t block_len,
                                                 std::uint32_t num_blocks);

  KvMemory() = default;
  KvMemory(KvMemory&&) noexcept;
  KvMemory& operator=(KvMemory&&) noexcept;
  KvMemory(const KvMemory&) = delete;
  KvMemory& operator=(const KvMemory&) = delete;
  // Deregisters what is still registered (waiting up to 5 s per plane).
  ~KvMemory();

  std::size_t num_planes() const { return regions_.size(); }
  // Plane i's memory: block b of it at plane(i) + b × block_len. i < num_planes().
  std::byte* plane(std::size_t i) const { return regions_[i].base; }
  // The planes' region ids, in plane order.
  std::vector<transport::RegionId> ids() const;

  // Waits until the transport no longer uses any plane, then deregisters every plane; the
  // first error (kTimeout at `deadline`). Idempotent: later calls return OK.
  Status Deregister(core::TimePoint deadline);

 private:
  std::shared_ptr<transport::Engine> engine_;
  std::vector<transport::Region> regions_;
};

}  // namespace kvferry::runtime
