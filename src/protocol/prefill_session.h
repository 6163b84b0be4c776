// PrefillSession: the P side of the side-channel protocol for one P worker (SPEC §1–§5), sans-IO.
//
// It owns everything P decides: the core::HoldTable (lease, renewals, tombstones, expiry), the
// pairing checks of each pull, the pulls that wait for a prefill (parked), the plan of every
// write (from the source blocks PrefillDone gave it: see WriteJob), the waves of writes and the
// replies they produce, the cache of D's region descriptors, and every limit a peer can
// push against. It owns no socket, thread or clock: every call takes `now`, and what it decides
// comes out of the Take*() queues —
//   TakeOutgoing()      replies (wire structs) and the peer they go to,
//   TakeWrites()        data-plane writes to run (each must be answered once with OnWriteDone),
//   TakeEngineEvents()  core::HoldEvent kFreeBlocks / kAbortPrefill for the engine,
// and NextDeadline() says when OnTimeout() has work. The ZeroMQ listener
// (control/side_channel_listener.h) is a thin pump around it, and the simulator (src/sim) drives
// this same class, so what exploration checks is what P runs.
//
// Releases and notices (docs/protocol.md §3.5–3.7): a Release gets one ReleaseReply; the hold
// table frees what every paired D rank pulled or released (core::HoldTable::ReleaseByDecoder).
// When an entry leaves the table for any other reason than "every rank has it or gave it up",
// each socket that renewed it with accepts_notices gets an AbortNotice (batched per call), so
// a D still queueing the request fails it at once instead of pulling late. Both are best
// effort: losing one changes only timing.
//
// Replies (docs/protocol.md): a Renewal gets one RenewalReply. A Pull gets one PullResponse per
// readiness wave — the requests whose outcome became known in one call — CONTINUE, with FINISH on
// the last; every request is listed exactly once in some `ok` or `err`, or the whole pull gets
// one ERROR when it is unusable (checked before anything changes). A write whose bytes may
// still land (WriteEnd::kUnsettled) is listed in `err` with `unsettled` set: D fails the
// request at once with the reason, but quarantines its blocks until the writer is fenced or
// known stopped.
//
// Hostile input changes nothing and costs bounded memory: every size is checked before it is
// used (d_tp_size against core::kMaxTpSize before any per-rank work), one D rank waits at most
// once per transfer (HoldTable), and pulls in progress, parked requests and cached descriptors
// are capped (PrefillSessionOptions). Each refusal is counted in PrefillStats.
//
// Not thread-safe: one owner calls everything (the listener thread; the simulator's loop).
#pragma once

#include <cstdint>
#include <iterator>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <variant>
#include <vector>

#include "kvferry/core/hold_table.h"
#include "kvferry/core/ids.h"
#include "kvferry/core/stat_fields.h"
#include "kvferry/core/time.h"
#include "kvferry/core/tp_plan.h"
#include "kvferry/status.h"
#include "protocol/ahead_writes.h"
#include "protocol/hold.h"
#include "protocol/write_outcome.h"
#include "wire/messages.h"

namespace kvferry::protocol {

// The pump's name for the D socket a message came from, echoed on every reply to it (a ZeroMQ
// routing id; a link name in the simulator). Opaque to the session.
using PeerAddress = std::string;

// The D side of one pull, as the writer needs it. Shared (read-only) by every job of the pull.
struct PullContext {
  core::EngineId d_engine_id;
  std::uint32_t d_tp_size = 1;
  std::uint32_t d_tp_rank = 0;
  std::uint32_t p_tp_size = 1;
  std::uint32_t p_tp_rank = 0;
  // D's region descriptor (from this pull, or cached from an earlier one of this D rank).
  // Never null.
  std::shared_ptr<const std::vector<std::uint8_t>> region_descriptor;
  std::uint64_t block_len = 0;   // D's block stride in bytes
  std::uint32_t num_blocks = 0;  // blocks D registered (every dst id was checked against it)
  // D's credential for this pull's writes (wire::Pull::write_key; 0: D gave none): the writer
  // stamps every batch with it, so a D that revoked it refuses them (transport::WriteKey).
  std::uint64_t write_key = 0;
};

// One request of a pull, ready to be written: the transfer's KV goes into `dst_block_ids`.
// The session planned it (core/tp_plan.h): `writes` are the byte ranges this P rank owes the
// pulling D rank, the same in every KV plane (planes share block ids and block_len), with
// contiguous runs merged. Never empty: a request with nothing to write (replicated KV a lower
// P rank writes) or that cannot be planned is answered by the session without a job.
struct WriteJob {
  std::uint64_t ticket = 0;   // give it back to OnWriteDone
  std::uint64_t pull_id = 0;  // the Pull's wire id (for traces)
  std::shared_ptr<const PullContext> context;
  core::TransferId transfer_id;
  core::RequestId d_req_id;
  std::vector<core::BlockId> dst_block_ids;
  std::vector<core::BlockWrite> writes;
  // The KV planes to write, ascending (each below PrefillSessionOptions::num_planes); empty:
  // every plane. A job of layers computed ahead of the prefill's end (LayersReady) names those
  // layers' planes, and the job PrefillDone then starts names the rest.
  std::vector<std::uint32_t> planes;
  // A LayersReady write: the request's own write follows once the prefill ends.
  bool ahead = false;
};

struct Outgoing {
  PeerAddress peer;
  std::variant<wire::PullResponse, wire::RenewalReply, wire::ReleaseReply, wire::AbortNotice>
      message;
};

struct PrefillSessionOptions {
  core::EngineId engine_id = "prefill-0";  // named in AbortNotices
  core::HoldConfig hold;
  std::uint32_t p_tp_size = 1;
  std::uint32_t p_tp_rank = 0;
  // This rank's KV layout, for planning writes (core::TpLayout): the model's KV heads (0:
  // unknown, as many as the larger TP of a pair) and the bytes of one block in one plane (> 0).
  std::uint32_t kv_heads = 0;
  std::uint64_t block_len = 0;
  // Blocks in this rank's KV region (> 0): PrefillDone refuses a source block id at or above
  // it, so no write is ever planned to read outside the region.
  std::uint32_t num_blocks = 0;
  // False: a block does not keep a KV head's bytes together (a token-major layout), so a pull
  // that needs part of a block (a decoder of a larger TP size) fails with the reason instead of
  // moving the wrong bytes.
  bool head_slices = true;
  // KV planes of this rank's region (the writer's regions, in order; at most kMaxPlanes), for
  // LayersReady; 0: unknown, and LayersReady is refused (kInvalidArgument).
  std::uint32_t num_planes = 0;
  // Region descriptors remembered per (d_engine_id, d_tp_rank); beyond this one is evicted (its
  // D gets ERROR kNotFound on its next descriptor-less pull and resends it).
  std::size_t max_cached_descriptors = 4096;
  // Pulls with requests still unanswered; a pull beyond this gets ERROR kResourceExhausted.
  std::size_t max_pulls_in_progress = 16384;
  // Requests parked until a prefill finishes, over all pulls; beyond this a request that would
  // wait is listed in `err` with kResourceExhausted (the hold table is not touched).
  std::size_t max_parked_requests = 65536;
  // Destination block ids kept for requests not yet answered, over all pulls (4 bytes each);
  // a pull that would exceed it gets ERROR kResourceExhausted. 16 Mi blocks = 64 MiB. The ahead
  // writes in flight (LayersReady: one per request) copy at most as many again.
  std::size_t max_retained_blocks = std::size_t{1} << 24;
  // Finished pulls whose (socket, id) is remembered, so that a late duplicate is dropped too:
  // answered again, it could start a second write into blocks D already settled (and freed).
  // D numbers pulls with a 64-bit counter per socket, so a real id never comes back.
  std::size_t remembered_pull_ids = 65536;
};

// Sockets remembered per held transfer for AbortNotices: one per paired D rank is what a real
// D needs (its rank's worker); more sockets renewing one transfer are ignored.
inline constexpr std::size_t kMaxNoticePeersPerTransfer = 64;

// PrefillSessionOptions::num_planes at most (a 405B model has 126 layers × K and V = 252).
inline constexpr std::uint32_t kMaxPlanes = 4096;

// What each std::uint64_t field means: kPrefillStatFields below (one row per field, which the
// binding and /metrics read); `hold` is the HoldTable's own view.
struct PrefillStats {
  std::uint64_t messages_received = 0;
  std::uint64_t messages_malformed = 0;
  std::uint64_t stalls = 0;
  std::uint64_t renewals_accepted = 0;
  std::uint64_t renewals_rejected = 0;
  std::uint64_t pulls_received = 0;
  std::uint64_t pull_errors = 0;
  std::uint64_t pulls_unpaired = 0;
  std::uint64_t pulls_over_limit = 0;
  std::uint64_t pulls_duplicate = 0;
  std::uint64_t requests_ok = 0;
  std::uint64_t requests_err = 0;
  std::uint64_t requests_over_limit = 0;
  std::uint64_t late_pulls_rejected = 0;
  std::uint64_t lease_mismatches = 0;
  std::uint64_t writes_started = 0;
  std::uint64_t writes_failed = 0;
  std::uint64_t writes_unsettled = 0;
  std::uint64_t layer_writes = 0;
  std::uint64_t descriptors_replaced = 0;
  std::uint64_t descriptors_evicted = 0;
  std::uint64_t replies = 0;
  std::uint64_t hold_events_delivered = 0;
  std::uint64_t releases_received = 0;
  std::uint64_t releases_refused = 0;
  std::uint64_t released_entries = 0;
  std::uint64_t released_kept = 0;
  std::uint64_t released_unknown = 0;
  std::uint64_t notices_sent = 0;
  std::uint64_t notified_transfers = 0;
  std::uint64_t pulls_in_progress = 0;
  std::uint64_t requests_parked = 0;
  std::uint64_t writes_in_flight = 0;
  std::uint64_t source_transfers = 0;
  core::HoldStats hold;
  std::uint64_t hold_entries = 0;
};

inline constexpr core::StatField<PrefillStats> kPrefillStatFields[] = {
    // clang-format off
    {"messages_received", &PrefillStats::messages_received, core::StatKind::kCounter,
     "Side-channel messages received"},
    {"messages_malformed", &PrefillStats::messages_malformed, core::StatKind::kCounter,
     "Malformed side-channel messages (answered with an error)",
     "kvferry_side_channel_malformed_total"},
    {"stalls", &PrefillStats::stalls, core::StatKind::kCounter,
     "Expiry passes put off because P's timer stalled (no lease ends on a late timer)",
     "kvferry_timer_stalls_total"},
    {"renewals_accepted", &PrefillStats::renewals_accepted, core::StatKind::kCounter,
     "Renewal messages accepted"},
    {"renewals_rejected", &PrefillStats::renewals_rejected, core::StatKind::kCounter,
     "Renewal messages rejected (no lease)"},
    {"pulls_received", &PrefillStats::pulls_received, core::StatKind::kCounter,
     "Pull messages admitted"},
    {"pull_errors", &PrefillStats::pull_errors, core::StatKind::kCounter,
     "Pull messages answered with ERROR"},
    {"releases_refused", &PrefillStats::releases_refused, core::StatKind::kCounter,
     "What a D peer pushed against P's limits, by kind (each changed nothing)",
     "kvferry_side_channel_refusals_total", {"kind", "release_refused"}},
    {"pulls_unpaired", &PrefillStats::pulls_unpaired, core::StatKind::kCounter,
     "What a D peer pushed against P's limits, by kind (each changed nothing)",
     "kvferry_side_channel_refusals_total", {"kind", "unpaired_pull"}},
    {"pulls_over_limit", &PrefillStats::pulls_over_limit, core::StatKind::kCounter,
     "What a D peer pushed against P's limits, by kind (each changed nothing)",
     "kvferry_side_channel_refusals_total", {"kind", "pulls_in_progress_limit"}},
    {"pulls_duplicate", &PrefillStats::pulls_duplicate, core::StatKind::kCounter,
     "What a D peer pushed against P's limits, by kind (each changed nothing)",
     "kvferry_side_channel_refusals_total", {"kind", "duplicate_pull"}},
    {"requests_over_limit", &PrefillStats::requests_over_limit, core::StatKind::kCounter,
     "What a D peer pushed against P's limits, by kind (each changed nothing)",
     "kvferry_side_channel_refusals_total", {"kind", "parked_requests_limit"}},
    {"descriptors_evicted", &PrefillStats::descriptors_evicted, core::StatKind::kCounter,
     "What a D peer pushed against P's limits, by kind (each changed nothing)",
     "kvferry_side_channel_refusals_total", {"kind", "descriptor_evicted"}},
    {"descriptors_replaced", &PrefillStats::descriptors_replaced, core::StatKind::kCounter,
     "What a D peer pushed against P's limits, by kind (each changed nothing)",
     "kvferry_side_channel_refusals_total", {"kind", "descriptor_replaced"}},
    {"requests_ok", &PrefillStats::requests_ok, core::StatKind::kCounter,
     "Requests of pulls answered, by outcome", "kvferry_pull_requests_total",
     {"outcome", "ok"}},
    {"requests_err", &PrefillStats::requests_err, core::StatKind::kCounter,
     "Requests of pulls answered, by outcome", "kvferry_pull_requests_total",
     {"outcome", "error"}},
    {"late_pulls_rejected", &PrefillStats::late_pulls_rejected, core::StatKind::kCounter,
     "Pulls failed at once: KV already freed"},
    {"lease_mismatches", &PrefillStats::lease_mismatches, core::StatKind::kCounter,
     "Requests failed: P and D lease differ"},
    {"writes_started", &PrefillStats::writes_started, core::StatKind::kCounter,
     "KV WRITE batches started"},
    {"writes_failed", &PrefillStats::writes_failed, core::StatKind::kCounter,
     "KV WRITE batches failed"},
    {"writes_unsettled", &PrefillStats::writes_unsettled, core::StatKind::kCounter,
     "Failed writes that could not be fenced: left unanswered so D quarantines"},
    {"layer_writes", &PrefillStats::layer_writes, core::StatKind::kCounter,
     "KV WRITE batches of layers computed before their prefill finished (LayersReady)"},
    {"replies", &PrefillStats::replies, core::StatKind::kCounter,
     "PullResponse and RenewalReply messages produced", "kvferry_side_channel_replies_total"},
    {"hold_events_delivered", &PrefillStats::hold_events_delivered, core::StatKind::kCounter,
     "Frees and prefill aborts handed to the engine"},
    {"releases_received", &PrefillStats::releases_received, core::StatKind::kCounter,
     "Release messages processed", "kvferry_release_messages_received_total"},
    {"released_entries", &PrefillStats::released_entries, core::StatKind::kCounter,
     "Transfers D released, by what P did (freed, left to other D ranks, not held)",
     "kvferry_releases_received_total", {"outcome", "released"}},
    {"released_kept", &PrefillStats::released_kept, core::StatKind::kCounter,
     "Transfers D released, by what P did (freed, left to other D ranks, not held)",
     "kvferry_releases_received_total", {"outcome", "kept"}},
    {"released_unknown", &PrefillStats::released_unknown, core::StatKind::kCounter,
     "Transfers D released, by what P did (freed, left to other D ranks, not held)",
     "kvferry_releases_received_total", {"outcome", "unknown"}},
    {"notices_sent", &PrefillStats::notices_sent, core::StatKind::kCounter,
     "AbortNotice messages sent", "kvferry_abort_notice_messages_sent_total"},
    {"notified_transfers", &PrefillStats::notified_transfers, core::StatKind::kCounter,
     "Transfers P dropped and told the renewing D ranks about",
     "kvferry_abort_notices_sent_total"},
    {"pulls_in_progress", &PrefillStats::pulls_in_progress, core::StatKind::kGauge,
     "Pulls admitted and not yet answered"},
    {"requests_parked", &PrefillStats::requests_parked, core::StatKind::kGauge,
     "Requests of pulls waiting for their prefill"},
    {"writes_in_flight", &PrefillStats::writes_in_flight, core::StatKind::kGauge,
     "KV writes queued or running"},
    {"source_transfers", &PrefillStats::source_transfers, core::StatKind::kGauge,
     "Transfers whose source blocks P keeps"},
    {"hold_entries", &PrefillStats::hold_entries, core::StatKind::kGauge,
     "Entries of P's hold table", "kvferry_hold_table_size"},
    // clang-format on
};
static_assert(sizeof(PrefillStats) ==
                  std::size(kPrefillStatFields) * sizeof(std::uint64_t) + sizeof(core::HoldStats),
              "every counter of PrefillStats has one row in kPrefillStatFields");

class PrefillSession {
 public:
  // Options must satisfy ValidateOptions (the pump checks it first). `make_hold` builds the hold
  // table from options.hold; empty: the real one (CoreHold).
  explicit PrefillSession(PrefillSessionOptions options, const HoldFactory& make_hold = {});
  PrefillSession(const PrefillSession&) = delete;
  PrefillSession& operator=(const PrefillSession&) = delete;

  // kInvalidArgument for a rank outside the tp, a tp of 0 or above core::kMaxTpSize.
  [[nodiscard]] static Status ValidateOptions(const PrefillSessionOptions& options);

  // ---- Input from D ----
  // One message as it arrived (the payload frame). Undecodable or unexpected messages get an
  // ERROR (a RenewalReply kError for a renewal) and change nothing.
  void OnMessage(const PeerAddress& peer, std::span<const std::uint8_t> payload,
                 core::TimePoint now);
  // Already-decoded messages (what OnMessage calls after decoding).
  void OnPull(const PeerAddress& peer, wire::Pull pull, core::TimePoint now);
  void OnRenewal(const PeerAddress& peer, const wire::Renewal& renewal, core::TimePoint now);
  void OnRelease(const PeerAddress& peer, const wire::Release& release, core::TimePoint now);
  // The pump found the message unusable before the session could read it (e.g. a wrong frame
  // count): answers ERROR with `reason` (and `id`, when the message's id could be read),
  // changes nothing.
  void RejectMessage(const PeerAddress& peer, ErrorCode code, std::string reason,
                     std::uint64_t id = 0);

  // ---- Input from P's engine: core::HoldTable's contracts ----
  [[nodiscard]] Status Admit(const core::TransferId& id, std::uint64_t handle, core::TimePoint now);
  // `blocks` hold the transfer's KV on this rank, in order (at most wire::kMaxBlocksPerRequest,
  // kInvalidArgument beyond); the session keeps them until it tells the engine to free them
  // (kFreeBlocks, kAbortPrefill) and plans every write from them. D may ask for fewer (a prefix
  // hit on D): it gets the last ones.
  [[nodiscard]] Status PrefillDone(const core::TransferId& id, std::vector<core::BlockId> blocks,
                                   core::TimePoint now);
  void EngineFinished(const core::TransferId& id, core::TimePoint now);
  // Planes `planes` of the transfer's KV are final in `blocks` before its prefill finished (the
  // step that completes the prompt computed those layers: vLLM's save_kv_layer). Every pull
  // already parked for the transfer gets those planes written now, so that what is left to
  // write when PrefillDone comes is the layers computed last (docs/protocol.md §8.5); a request
  // has one such write in flight at a time, and the planes computed meanwhile go in its next.
  // A hint:
  // with no pull parked it does nothing, and the request's outcome is still decided as without
  // it — listed only once every write of it ended, its ahead writes included (an ahead write
  // that failed fails the request; one that may still land makes it `unsettled`), and its
  // blocks freed (kFreeBlocks) only after. PrefillDone must name the same blocks, or its write
  // covers every plane again. If the request ends before PrefillDone (aborted, expired), the
  // engine may reuse `blocks` while an ahead write still reads them: only the failed request's
  // blocks on D can receive those bytes, and D frees them only after P's answer, which waits
  // for the write. kInvalidArgument when num_planes is 0 or for more blocks than a request may
  // have, kOutOfRange for a block or plane outside the region; nothing changes then.
  [[nodiscard]] Status LayersReady(const core::TransferId& id,
                                   std::span<const core::BlockId> blocks,
                                   std::span<const std::uint32_t> planes, core::TimePoint now);
  // The engine refused the request without admitting it: core::HoldTable::Refuse.
  [[nodiscard]] Status Refuse(const core::TransferId& id, Status why, core::TimePoint now);

  // ---- Input from the data plane ----
  // The write of a job from TakeWrites ended; exactly once per ticket. `outcome.status` is the
  // reason listed in `err` for kFailed. Unknown tickets are ignored.
  void OnWriteDone(std::uint64_t ticket, const WriteOutcome& outcome, core::TimePoint now);

  // ---- Time ----
  // Runs the expiry pass. Call at NextDeadline() (earlier is harmless). A call more than
  // kStallThreshold (1 s) after the pass was due means this process did not run meanwhile (a
  // freeze, a stop, an overloaded host): the renewals a live D sent then still wait in the
  // socket, so the pass is put off by kStallGrace (500 ms) for the caller to read them first
  // (found by review: after a freeze longer than the lease, P expired the transfers a live D
  // was renewing before it read the renewals queued during the freeze). The pass is due at the
  // table's next deadline, or, if a call made a deadline that had already passed due, at that
  // call (the end of a write that put an expiry off): such a pass is not late.
  void OnTimeout(core::TimePoint now);
  core::TimePoint NextDeadline() const;

  // Stop serving: every parked request is listed in `err` (kCancelled), and later messages get
  // ERROR kUnavailable. Writes already handed out are still answered through OnWriteDone.
  void Shutdown(core::TimePoint now);

  // ---- Output ----
  std::vector<Outgoing> TakeOutgoing();
  std::vector<WriteJob> TakeWrites();
  std::vector<core::HoldEvent> TakeEngineEvents();

  PrefillStats stats() const;
  const Hold& hold() const { return *table_; }
  std::uint64_t writes_in_flight() const { return writes_.size(); }

 private:
  using PullName = std::pair<PeerAddress, std::uint64_t>;  // (socket, wire id)

  // The requests of one pull whose outcome became known in one call, answered together once
  // none of them is still being written.
  struct Wave {
    std::uint32_t outstanding = 0;
    std::vector<core::RequestId> ok;
    std::vector<wire::RequestError> err;
  };
  struct PendingPull {
    PeerAddress peer;
    std::uint64_t id = 0;  // the Pull's wire id, copied into every response
    std::shared_ptr<const PullContext> context;
    std::vector<wire::PullRequest> requests;
    std::vector<std::uint32_t> blocks;  // per request: block ids still retained (0 once listed)
    std::uint32_t need_send = 0;
    std::optional<core::Duration> d_lease;
    std::size_t listed = 0;     // requests already sent in some ok/err
    std::map<std::uint32_t, Wave> waves;
    std::uint32_t next_wave = 0;
    std::uint64_t open_step = UINT64_MAX;  // the step in which `open_wave` accepts more
    std::uint32_t open_wave = 0;
  };
  struct Ticket {
    RequestRef ref;
    std::uint32_t wave;
    bool ahead = false;  // a LayersReady write (no wave: its request is not decided yet)
  };
  void ReplyPullError(const PeerAddress& peer, ErrorCode code, std::string message,
                      std::uint64_t id);
  void Emit(const PeerAddress& peer, wire::PullResponse response);
  void Emit(const PeerAddress& peer, wire::RenewalReply reply);
  void Emit(const PeerAddress& peer, wire::ReleaseReply reply);
  // Remembers `peer` as a socket to notify about every held transfer among `fingerprints`.
  void NoteRenewers(const PeerAddress& peer, std::span<const core::Fingerprint> fingerprints);
  // Whole-message checks of a pull; on failure the ERROR is sent and nullopt returned.
  std::optional<std::uint32_t> CheckPull(const PeerAddress& peer, const wire::Pull& pull);
  std::shared_ptr<const std::vector<std::uint8_t>> Descriptor(const PeerAddress& peer,
                                                              wire::Pull& pull);
  void AdmitRequest(std::uint64_t key, std::uint32_t index, core::TimePoint now);
  // Source blocks the engine names (PrefillDone, LayersReady): at most a request's, each in
  // the region.
  Status CheckSourceBlocks(const core::TransferId& id,
                           std::span<const core::BlockId> blocks) const;
  void Dispatch(std::uint64_t key, std::uint32_t index, core::TimePoint now);
  // The request's write, once BeginSend succeeded and no ahead write of it is in flight.
  void SendRequest(std::uint64_t key, std::uint32_t index, core::TimePoint now);
  // What this rank writes for `request` of `pull` (see WriteJob): the tail of `source` (the
  // transfer's blocks) into D's, sliced to the heads the two ranks share.
  Result<std::vector<core::BlockWrite>> PlanRequest(const PendingPull& pull,
                                                    const wire::PullRequest& request,
                                                    std::span<const core::BlockId> source) const;
  // True when the request has ahead writes in flight: the listing is kept until they end
  // (holding `wave` open) and made then, with their outcome.
  bool DeferListing(std::uint64_t key, Wave& wave, std::uint32_t index, bool ok,
                    const Status& status, bool unsettled);
  void AheadWriteDone(const Ticket& ticket, const WriteOutcome& outcome, core::TimePoint now);
  // Starts the write of the planes queued for `ref`, unless the plan says no (they are then
  // left to the request's own write).
  void StartAheadWrite(const RequestRef& ref);
  Wave& OpenWave(PendingPull& pull, std::uint64_t key, std::uint32_t* index = nullptr);
  void AddOk(std::uint64_t key, Wave& wave, std::uint32_t index);
  void AddErr(std::uint64_t key, Wave& wave, std::uint32_t index, const Status& status,
              bool unsettled = false);
  // The request is answered (or will never be): drop what it retained.
  void Listed(std::uint64_t key, std::uint32_t index);
  // Also notes when the next expiry pass is due (NotePassDue): every call that changes the
  // table drains its events.
  void DrainHoldEvents(core::TimePoint now);
  void DrainHoldEventBatch(std::vector<core::HoldEvent>& events, core::TimePoint now);
  void NotePassDue(core::TimePoint now);
  // Sends the waves that are complete, forgets finished pulls, closes the step.
  void Flush();
  // A finished pull's id stays known for a while (remembered_pull_ids).
  void Remember(PullName name);

  const PrefillSessionOptions options_;
  const std::uint64_t p_lease_ms_;
  std::unique_ptr<Hold> table_;
  bool shut_down_ = false;
  // While set: an expiry pass found late by a stall waits until then (OnTimeout).
  core::TimePoint stall_grace_until_ = core::TimePoint::min();
  // When the expiry pass fell due (kNever: no deadline), as the calls so far saw it: the time
  // OnTimeout's lateness is measured from.
  core::TimePoint pass_due_ = core::kNever;

  std::unordered_map<std::uint64_t, PendingPull> pulls_;
  std::uint64_t next_pull_key_ = 1;
  // (peer, wire id) of the pulls in progress and of the last `remembered_pull_ids` finished
  // ones: a repeated id is a duplicate, not a new pull.
  std::set<PullName> pull_ids_;
  std::deque<PullName> finished_ids_;  // oldest first
  std::unordered_map<core::TransferId, std::vector<RequestRef>> parked_;
  std::size_t parked_count_ = 0;
  std::size_t retained_blocks_ = 0;
  // Source blocks of each transfer prefilled and not yet freed (PrefillDone .. kFreeBlocks).
  std::unordered_map<core::TransferId, std::vector<core::BlockId>> sources_;
  std::unordered_map<std::string, std::shared_ptr<const std::vector<std::uint8_t>>> descriptors_;
  std::unordered_map<std::uint64_t, Ticket> writes_;
  // Parked requests with writes from LayersReady, and the frees those writes hold back.
  AheadWrites ahead_;
  std::uint64_t next_ticket_ = 1;
  std::vector<std::uint64_t> touched_;  // pulls that may have a wave to send
  // Held transfers -> the sockets that renewed them asking for notices. An entry goes with its
  // transfer (kReleased), so this is bounded by the table × kMaxNoticePeersPerTransfer.
  std::unordered_map<core::Fingerprint, std::vector<PeerAddress>> renewers_;
  // Notices decided in this call, sent by Flush (one message per socket and
  // kMaxAbortsPerNotice transfers).
  std::map<PeerAddress, std::vector<wire::AbortedTransfer>> notices_;
  std::uint64_t step_ = 0;

  std::vector<Outgoing> outgoing_;
  std::vector<WriteJob> new_writes_;
  std::vector<core::HoldEvent> engine_events_;
  PrefillStats counters_;
};

}  // namespace kvferry::protocol
