// ReceiveLedger: D's account of who may still write into a request's destination blocks
// (SPEC §3). Sans-IO and single-owner; the caller reports what each P peer said and drains the
// decisions with TakeEvents().
//
// Each (request, peer) pair is an entry that settles exactly once. The request's receive
// completes exactly once, when its last entry settles — never earlier, even after a failure,
// because another peer may still be writing into the blocks (the write-after-free of vLLM's
// MooncakeConnector). The first failure is the one reported; later ones are counted only.
//
// An entry settled by a local timeout (or a broken channel) has an unknown writer: the peer may
// still be writing. The request still completes (as failed) so the user hears at once, but its
// blocks are quarantined: not reusable until every such peer settles the entry after all or is
// declared quiesced (known dead and its data-plane endpoint closed). kBlocksReleased says when.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvferry/core/ids.h"
#include "kvferry/status.h"

namespace kvferry::core {

// A P worker as seen by this D worker (the caller maps (engine, rank) to a small integer).
using PeerId = std::uint32_t;

enum class Settle : std::uint8_t {
  kOk,            // the peer listed the request in `ok`: its slice landed
  kErr,           // the peer listed it in `err`: it wrote nothing more
  kMessageError,  // the peer answered the whole pull with ERROR
  kFinished,      // the peer sent FINISH without listing the request (counts as failed)
  kTimeout,       // local timeout or broken channel: the peer may still write (quarantine)
};

struct LedgerEvent {
  enum class Kind : std::uint8_t {
    kCompleted,       // the receive finished (once per request); see ok / error
    kBlocksReleased,  // a completed request's quarantined blocks may be reused now
  };
  Kind kind;
  RequestId request;
  bool ok = false;
  Status error;  // the first failure, for !ok
  // For a failed kCompleted: the blocks whose contents are invalid (all the request's blocks).
  // For kBlocksReleased: the blocks that left quarantine.
  std::vector<BlockId> blocks;
  // For kCompleted: true when the blocks are NOT reusable yet (a peer's writer state is
  // unknown); a kBlocksReleased follows.
  bool quarantined = false;
};

enum class SettleOutcome : std::uint8_t {
  kSettled,             // the entry settled now
  kUnknownRequest,      // no such receive (never begun, or completed and fully released)
  kNotAPeer,            // the peer is not one this request pulls from
  kAlreadySettled,      // a second settlement of the same entry: ignored
  kResolvedQuarantine,  // a late answer from a peer that had timed out; its writer is now known
};

class ReceiveLedger {
 public:
  // Starts receiving `blocks` for `request` from `peers` (distinct). No blocks: a notify-only
  // pull, nothing is tracked and no completion is produced. No peers: nobody could be reached
  // (e.g. the bootstrap failed): completes at once as failed with `no_peer_error`.
  // Error kAlreadyExists if the request is already being received.
  Status Begin(const RequestId& request, std::vector<BlockId> blocks, std::span<const PeerId> peers,
               Status no_peer_error = Status(ErrorCode::kUnavailable, "no prefill peer"));

  // Forgets a receive none of whose entries settled, for a caller that knows nothing of it was
  // ever sent (every pull failed unsent), so no peer can write: no event, nothing quarantined.
  // kNotFound for an unknown request, kAlreadyExists once any entry settled.
  Status Forget(const RequestId& request);

  // Settles the entry (request, peer). `reason` is used for failures.
  SettleOutcome Settle(const RequestId& request, PeerId peer, core::Settle how, Status reason = {});

  // Settles every pending entry of `peer` (its channel broke or timed out) with `how`.
  void SettlePeer(PeerId peer, core::Settle how, const Status& reason);

  // `peer` is known to have stopped writing (it died and its data-plane endpoint is closed, or
  // it answered after all). Its unknown entries resolve; blocks leave quarantine when no
  // unknown writer is left.
  void PeerQuiesced(PeerId peer);

  std::vector<LedgerEvent> TakeEvents();

  std::size_t active() const { return requests_.size(); }  // includes quarantined
  std::uint64_t quarantined_blocks() const { return quarantined_blocks_; }
  bool IsPending(const RequestId& request, PeerId peer) const;
  std::uint64_t duplicate_failures() const { return duplicate_failures_; }

 private:
  enum class EntryState : std::uint8_t { kPending, kOk, kFailed, kUnknownWriter };
  struct PeerEntry {
    PeerId peer;
    EntryState state = EntryState::kPending;
  };
  struct Receive {
    std::vector<BlockId> blocks;
    std::vector<PeerEntry> peers;
    std::uint32_t pending = 0;
    std::uint32_t unknown_writers = 0;
    bool completed = false;
    bool failed = false;
    Status first_error;
  };
  using Map = std::unordered_map<RequestId, Receive>;

  void SettleEntry(Map::iterator it, PeerEntry& entry, core::Settle how, const Status& reason);
  void MaybeComplete(Map::iterator it);
  void MaybeRelease(Map::iterator it);

  Map requests_;
  std::vector<LedgerEvent> events_;
  std::uint64_t quarantined_blocks_ = 0;
  std::uint64_t duplicate_failures_ = 0;
};

}  // namespace kvferry::core
