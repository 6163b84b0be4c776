// AheadWrites: the writes P starts for a parked request before its prefill ends (layer writes:
// PrefillSession::LayersReady, docs/protocol.md §8.5), and everything they hold back until they
// end. Sans-IO bookkeeping for PrefillSession, which plans each write and emits its job; this
// class decides which planes a write takes and what follows its end.
//
// The rules it keeps (each with a test in ahead_writes_test.cc, and end to end through the
// session in layer_writes_test.cc):
//  - At most one ahead write per request is in flight; planes computed meanwhile queue and go
//    together in the next (Begin after End says kWriteMore). A plane is written ahead at most
//    once, and only from the blocks the request's first LayersReady named.
//  - While one is in flight, neither the request's own write (HoldSend) nor its listing
//    (Defer) may happen: the first must not free the source blocks it reads, the second must
//    not answer D while bytes may still land. End hands the held step back, once.
//  - The worst end of a request's ahead writes is kept (unsettled over failed over landed,
//    the first reason of each): the request fails with it (Failure), unsettled if any may
//    still land.
//  - The engine's kFreeBlocks of a transfer is held while any ahead write still reads its
//    blocks (HoldFree) and handed back by the End of the last one.
//  - The request's own write takes only the planes no ahead write took (PlanesLeft).
//
// What it holds is bounded by the parked requests (an entry per request that got LayersReady,
// dropped by Forget when the request is listed) and the transfers they read.
//
// Not thread-safe: one owner (PrefillSession) calls everything.
#pragma once

#include <compare>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "kvferry/core/hold_table.h"
#include "kvferry/core/ids.h"
#include "kvferry/status.h"
#include "protocol/write_outcome.h"

namespace kvferry::protocol {

// One request of a pull in progress: the session's key of the pull, the request's index in it.
struct RequestRef {
  std::uint64_t pull_key = 0;
  std::uint32_t request = 0;
  friend auto operator<=>(const RequestRef&, const RequestRef&) = default;
};

class AheadWrites {
 public:
  // The session's decision about a request, kept while ahead writes of it are in flight: its
  // listing in `wave`, in `ok` or else in `err` for `status` (Ok: the ahead writes' reason).
  struct Listing {
    std::uint32_t wave = 0;
    bool ok = false;
    Status status;
    bool unsettled = false;
  };
  // What follows the end of an ahead write (End).
  struct Ended {
    // The engine's kFreeBlocks held for its transfer, when this was the last write reading it.
    std::optional<core::HoldEvent> freed;
    bool known = false;  // false: no such request (nothing else below is set)
    enum class Then : std::uint8_t {
      kNothing,    // more writes of it are in flight, or none is wanted
      kList,       // make `listing` now (Defer kept it)
      kSend,       // start the request's own write now (HoldSend kept it)
      kWriteMore,  // start the next ahead write: planes were queued meanwhile (Begin)
    } then = Then::kNothing;
    std::optional<Listing> listing;
  };

  // `num_planes`: the KV planes of one block on this rank (PrefillSessionOptions::num_planes).
  explicit AheadWrites(std::uint32_t num_planes) : num_planes_(num_planes) {}

  // The engine computed `planes` (each < num_planes) of the parked request `ref`, in `blocks`.
  // Queues the planes not yet written or queued, unless an ahead write of it already failed or
  // the first call named other blocks. `shared` is a cache for one LayersReady call: the block
  // list every request of that call shares, made on first need. True when a write should
  // start now (planes are queued and none is in flight): plan it, then Begin or DropQueued.
  bool Note(const RequestRef& ref, std::span<const core::BlockId> blocks,
            std::span<const std::uint32_t> planes,
            std::shared_ptr<const std::vector<core::BlockId>>& shared);
  // The blocks the ahead writes of `ref` read: what to plan them from. Null for a request
  // with none.
  const std::vector<core::BlockId>* Blocks(const RequestRef& ref) const;
  // Starts the write of the queued planes of `ref` (which reads `transfer`'s blocks): returns
  // them sorted, now counted as written. Empty when none is queued.
  std::vector<std::uint32_t> Begin(const RequestRef& ref, const core::TransferId& transfer);
  // The queued planes of `ref` are left to the request's own write (its plan wrote nothing).
  void DropQueued(const RequestRef& ref);
  // Reports the end of a write Begin started (once per Begin).
  [[nodiscard]] Ended End(const RequestRef& ref, const core::TransferId& transfer,
                          const WriteOutcome& outcome);

  bool InFlight(const RequestRef& ref) const;
  // The request's own write waits for the ahead write in flight (End then says kSend).
  void HoldSend(const RequestRef& ref);
  // The request's listing waits for the ahead write in flight (End then says kList). False,
  // keeping nothing, when none is in flight.
  bool Defer(const RequestRef& ref, Listing listing);
  // The worst end of the ahead writes of `ref` when one failed; null while none did.
  const WriteOutcome* Failure(const RequestRef& ref) const;
  // The planes the request's own write must take from `source` (its blocks at PrefillDone):
  // nullopt when every plane landed ahead; empty for every plane (none was written ahead, or
  // ahead writes read other blocks); else the planes no ahead write took, ascending.
  // Call once none is in flight and none failed.
  std::optional<std::vector<std::uint32_t>> PlanesLeft(const RequestRef& ref,
                                                       std::span<const core::BlockId> source) const;
  // The request was listed: its entry goes. Called only once none is in flight.
  void Forget(const RequestRef& ref);

  // When an ahead write still reads the blocks of `event.id` (a kFreeBlocks), keeps the event
  // (moved from `event`) until End of the last one and returns true.
  bool HoldFree(core::HoldEvent& event);

  std::size_t requests() const { return requests_.size(); }

 private:
  struct Request {
    std::shared_ptr<const std::vector<core::BlockId>> blocks;  // what they read
    std::vector<bool> planes;                                  // written or being written
    std::vector<std::uint32_t> queued;  // computed while a write of it was in flight: next
    std::uint32_t in_flight = 0;        // 0 or 1
    WriteOutcome outcome;               // the worst end so far: kLanded while none failed
    bool send_pending = false;
    std::optional<Listing> listing;
  };

  const std::uint32_t num_planes_;
  std::map<RequestRef, Request> requests_;
  // Ahead writes in flight per transfer, and the kFreeBlocks of a transfer that left the table
  // while some were (its request failed meanwhile).
  std::unordered_map<core::TransferId, std::uint32_t> reads_;
  std::unordered_map<core::TransferId, core::HoldEvent> held_frees_;
};

}  // namespace kvferry::protocol
