// DecodeAdapter: the glue between a D engine and its ranks' DecodeSessions, written once and
// sans-IO (engine-adapter issue). The simulator, `kvferry serve` and the vLLM connector's worker
// all drive it; each turns its own calls into the adapter's inputs and carries out its outputs.
//
// An engine sees one request; each of its ranks (TP workers) runs a DecodeSession that sees
// that rank's share. What lies between, and what every engine got subtly different before:
//   - which rank calls follow from an engine call (track on every rank, load on every rank,
//     finish on every rank, a refused request's release to P);
//   - per-rank settlement: a load ends for the engine once *every* rank's receive ended (a
//     rank whose StartLoad failed counts as ended, failed, with nothing to quarantine);
//   - the quarantine gate: the load's blocks may be reused only once no P writer can touch
//     them — every rank ended and every rank that quarantined its blocks released them;
//   - what P's abort notice does to a request still queued here.
//
// Inputs are calls; decisions come out of TakeCommands() (rank calls to make, in order) and
// TakeEvents() (for the engine). No threads, sockets or clocks: nothing here needs time.
//
// The decisions (docs/design.md, "The engine adapter", lists each with its test):
//  - Duplicate request id: Track/StartLoad of a request already tracked or loading answer
//    kAlreadyExists and change nothing; the first request goes on untouched.
//  - Refusal: an engine that refuses a remote-prefill request it never tracked calls Refuse, so
//    every rank releases the transfer to P (P prefilled its copy all the same; without the
//    release P holds it for a lease).
//  - Abort notice (P dropped the transfer of a request not yet loading): TransferDropped once,
//    naming P's reason. An engine that can end a queued request ends it now; one that cannot
//    (vLLM) just calls StartLoad when it schedules it, which fails at once with P's reason
//    without sending anything (P serves no pull for it).
//  - Release: Finish() when the engine is done with a request (decoded, aborted, failed): every
//    rank stops renewing and releases the transfer to P. Idempotent.
//  - Stop: Stop() forgets everything and reports what was still unsettled; the ranks' own stop
//    releases what they track (DecodeSession::ReleaseAll), and quarantined blocks stay
//    registered until the ranks' workers are destroyed.
//
// Events, each exactly once per request and load:
//   LoadDone        every rank's receive ended: ok, or the first failure; `quarantined` when
//                   some rank keeps the blocks quarantined (a P writer may still land).
//   BlocksReusable  after LoadDone: no P writer can touch the load's blocks any more. The
//                   engine may reuse them once it is done with the request itself.
//   TransferDropped see above.
// An entry is forgotten once the engine called Finish() and, for a load, BlocksReusable came.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <variant>
#include <vector>

#include "kvferry/core/ids.h"
#include "kvferry/status.h"
#include "protocol/decode_session.h"

namespace kvferry::protocol {

struct DecodeAdapterOptions {
  std::uint32_t ranks = 1;
  // Requests tracked at once; Track and StartLoad beyond it answer kResourceExhausted (an
  // engine's own admission limit is normally far lower: this only bounds a runaway caller).
  std::size_t max_requests = 1 << 20;
};

// A call the engine makes on one rank's worker (or session).
struct DecodeRankCall {
  enum class Kind : std::uint8_t {
    kTrack,      // OnNewRequest(request, source)
    kStartLoad,  // StartLoad(request, source, blocks); answer a failure with OnStartFailed
    kFinish,     // RequestFinished(request)
    kRelease,    // ReleaseTransfer(source): a refused request's transfer
  };
  std::uint32_t rank = 0;
  Kind kind = Kind::kTrack;
  core::RequestId request;
  RemoteSource source;
  std::vector<core::BlockId> blocks;  // kStartLoad
};

struct LoadDone {
  core::RequestId request;
  Status status;  // OK, or the first rank's failure
  bool quarantined = false;
};
struct BlocksReusable {
  core::RequestId request;
  bool after_quarantine = false;  // its LoadDone said `quarantined` (a release came since)
};
struct TransferDropped {
  core::RequestId request;
  Status why;  // P's reason (kept as P sent it)
};
using AdapterEvent = std::variant<LoadDone, BlocksReusable, TransferDropped>;

struct DecodeAdapterStats {
  std::size_t tracked = 0;   // requests known (queued, loading, or waiting for reuse)
  std::size_t loading = 0;   // loads with a rank still receiving
  std::size_t quarantined = 0;  // loads ended whose blocks some rank still quarantines
  std::uint64_t stray_results = 0;  // rank results for no load of that rank (ignored)
  std::uint64_t dropped = 0;        // TransferDropped events
};

// What Stop() found still unsettled (for the engine's shutdown log).
struct DecodeAdapterStopReport {
  std::size_t loading = 0;
  std::size_t quarantined = 0;
};

class DecodeAdapter {
 public:
  explicit DecodeAdapter(DecodeAdapterOptions options);

  // ---- The engine ----
  // A remote-prefill request arrived (renewals start on every rank while it queues).
  // kInvalidArgument for an empty request or transfer id, kAlreadyExists for a request already
  // tracked, kResourceExhausted at max_requests; nothing changes then.
  [[nodiscard]] Status Track(const core::RequestId& request, const RemoteSource& source);
  // The engine gave the request `blocks` (the prompt's, in order): every rank loads into them.
  // A request not tracked yet is tracked now. kAlreadyExists if it is loading or loaded
  // already, kInvalidArgument for empty ids, kResourceExhausted at max_requests: nothing
  // changes. A request whose transfer P dropped ends at once (LoadDone failed with P's
  // reason, BlocksReusable): no rank call is made, since P serves no pull for it.
  [[nodiscard]] Status StartLoad(const core::RequestId& request, const RemoteSource& source,
                                 std::vector<core::BlockId> blocks);
  // The engine is done with the request. Idempotent; unknown requests are ignored.
  void Finish(const core::RequestId& request);
  // The engine refused a request it never tracked: P is told on every rank.
  void Refuse(const RemoteSource& source);

  // ---- What the ranks report ----
  // The rank's StartLoad call failed: its receive ends failed, with nothing to quarantine.
  void OnStartFailed(std::uint32_t rank, const core::RequestId& request, const Status& why);
  // A rank's receive ended (DecodeSession's ReceiveDone, runtime::ReceiveResult).
  void OnReceiveDone(std::uint32_t rank, const core::RequestId& request, bool ok,
                     const Status& error, bool quarantined);
  // A rank released the blocks it had quarantined (BlocksReleased).
  void OnReleased(std::uint32_t rank, const core::RequestId& request);
  // A rank heard P drop the transfer of a request not yet loading (TransferAborted).
  void OnTransferAborted(std::uint32_t rank, const core::RequestId& request, const Status& why);

  // The engine stops: see the file comment.
  DecodeAdapterStopReport Stop();

  std::vector<DecodeRankCall> TakeCommands();
  std::vector<AdapterEvent> TakeEvents();
  DecodeAdapterStats stats() const;
  std::uint32_t ranks() const { return options_.ranks; }

 private:
  enum class RankState : std::uint8_t { kIdle, kLoading, kEnded, kQuarantined };
  struct Entry {
    RemoteSource source;
    bool load_started = false;
    bool load_done = false;  // LoadDone emitted
    bool quarantined_at_done = false;
    bool reusable = false;   // BlocksReusable emitted
    bool finished = false;   // the engine called Finish
    bool dropped = false;    // TransferDropped emitted
    Status drop_reason;
    std::vector<RankState> ranks;
    std::uint32_t ranks_loading = 0;
    std::uint32_t ranks_quarantined = 0;
    Status first_error;
  };

  Status CheckNew(const core::RequestId& request, const RemoteSource& source) const;
  void Call(DecodeRankCall::Kind kind, const core::RequestId& request, const Entry& entry,
            const std::vector<core::BlockId>* blocks);
  // The rank's state for `request` if it is loading (else counts a stray result).
  Entry* Loading(std::uint32_t rank, const core::RequestId& request);
  void RankEnded(const core::RequestId& request, Entry& entry, std::uint32_t rank, bool ok,
                 const Status& error, bool quarantined);
  // Emits BlocksReusable once the load ended and no rank quarantines; forgets a finished entry.
  void Settle(const core::RequestId& request);

  DecodeAdapterOptions options_;
  std::unordered_map<core::RequestId, Entry> entries_;
  std::vector<DecodeRankCall> commands_;
  std::vector<AdapterEvent> events_;
  std::uint64_t stray_results_ = 0;
  std::uint64_t dropped_ = 0;
};

}  // namespace kvferry::protocol
