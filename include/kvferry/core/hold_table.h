// HoldTable: one P worker's hold on the KV of transfers that D will pull (SPEC §2, §4).
//
// Sans-IO: no sockets, threads or clock reads; every call takes `now`, and the caller drains
// the decisions with TakeEvents() and acts on them (free blocks, abort a prefill, answer pulls).
// Not thread-safe: one owner (the P worker's control thread) drives it.
//
// An entry's life:
//
//   (pull or release before admit)
//        kPlaceholder ──Admit──▶ kPrefilling ──PrefillDone──▶ kReady
//             │                      │                           │
//             └─ wait deadline, dead decoder, abort, released ───┴─ every paired D rank pulled
//                                                                   or released it, lease or
//                                                                   timeout expiry, abort
//   Every way out removes the entry, emits one kReleased and leaves a tombstone, so a later
//   pull fails at once.
//
// Deadlines (all in this process's clock):
//   kReady:       expire = prefill_done + (lease or abort_request_timeout); a renewal sets
//                 expire = max(expire, now + 2/3·lease); once renewed, the entry also goes at
//                 last_renewal + lease. A send in flight defers expiry.
//   wait:         a pull that waits for an unfinished prefill fails at first_wait + abort_timeout,
//                 and the entry goes then, also if the waiting rank released it meanwhile (so no
//                 placeholder is stranded).
//   dead decoder: with a lease, an entry renewed at least once and not prefilled is dropped
//                 (its prefill aborted) at last_renewal + lease.
//
// The expiry pass uses a min-heap whose key never exceeds the entry's real deadline: renewals
// only lengthen deadlines and do not touch the heap; a popped entry whose real deadline moved is
// pushed back. So no entry is stranded behind a renewed one (vLLM #58222), and a pass costs
// O((expired + moved) · log n) instead of a scan of every entry.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kvferry/core/enum_array.h"
#include "kvferry/core/ids.h"
#include "kvferry/core/stat_fields.h"
#include "kvferry/core/time.h"
#include "kvferry/status.h"

namespace kvferry::core {

struct HoldConfig {
  // kv_connector_extra_config.kv_lease_duration. Zero: the lease is off and P keeps today's
  // fixed timeout (abort_request_timeout) and rejects renewals.
  Duration lease{0};
  // abort_request_timeout: the fixed hold without a lease, the bound on waiting for an unfinished
  // prefill, and how long freed ids are remembered (tombstones).
  Duration abort_request_timeout = std::chrono::seconds(480);
  // Tombstones beyond this are evicted oldest first (counted in stats): a fingerprint and its
  // expiry each, ~50 MB at the default.
  std::size_t max_tombstones = 1 << 20;
  // Refusal reasons kept with their tombstones (at most kMaxRefusalReasonBytes each), newest
  // first: beyond this the oldest reason is dropped and its tombstone stays, so a late pull
  // still fails at once, only without the engine's words. A client-controlled abort can refuse
  // at will, so reasons get their own, smaller bound: ~5 MB at the default, where sharing
  // max_tombstones allowed ~300 MB. 16,384 reasons outlive the pulls they are for: a refused
  // request's D pulls within seconds, and that many refusals take minutes at any rate seen.
  std::size_t max_refusal_reasons = 1 << 14;
  // Placeholders (pulls for transfers P has not admitted) beyond this are refused with
  // kResourceExhausted: a decoder pulling random ids must not grow P's memory without bound.
  std::size_t max_placeholders = 1 << 16;

  bool lease_enabled() const { return lease.count() > 0; }
  Duration renewal_extension() const { return lease * 2 / 3; }
};

enum class HoldPhase : std::uint8_t {
  kPlaceholder,  // a pull arrived before P admitted the request
  kPrefilling,   // admitted, prefill not finished
  kReady,        // blocks final, D may pull
};
inline constexpr std::array<HoldPhase, 3> kAllHoldPhases = {
    HoldPhase::kPlaceholder, HoldPhase::kPrefilling, HoldPhase::kReady};
const char* ToString(HoldPhase phase);

// Why an entry left the table. Each is terminal and reached exactly once per entry.
enum class ReleaseReason : std::uint8_t {
  kSent,               // every paired D rank pulled it
  kExpired,            // lease (or fixed timeout) ran out on a ready entry
  kDeadDecoder,        // renewed, then not renewed for a whole lease, before prefill finished
  kWaitTimeout,        // a pull waited abort_request_timeout for a prefill that never finished
  kLeaseMismatch,      // a pull declared a different lease; D failed the request
  kAbortedByEngine,    // P's engine aborted or finished the request without a send
  kReleasedByDecoder,  // every paired D rank pulled or released it, at least one released
};
inline constexpr std::array<ReleaseReason, 7> kAllReleaseReasons = {
    ReleaseReason::kSent,
    ReleaseReason::kExpired,
    ReleaseReason::kDeadDecoder,
    ReleaseReason::kWaitTimeout,
    ReleaseReason::kLeaseMismatch,
    ReleaseReason::kAbortedByEngine,
    ReleaseReason::kReleasedByDecoder};
// Whether a D rank that renewed a transfer released for `reason` may still be waiting for it:
// every reason but kSent and kReleasedByDecoder (P tells such ranks: wire::AbortNotice).
bool LeftDecoderWaiting(ReleaseReason reason);
const char* ToString(ReleaseReason reason);

struct HoldEvent {
  enum class Kind : std::uint8_t {
    kFreeBlocks,    // phase was kReady: return the request's blocks to the pool
    kAbortPrefill,  // phase was kPrefilling: stop the request; nobody will pull it
    kPullsReady,    // pulls waiting on this transfer can send now
    kPullsFailed,   // pulls of the D ranks in `ranks` waiting on this transfer fail with
                    // `status`
    kReleased,      // the entry left the table (exactly once per entry, after the events
                    // above): `reason`, and in `status` what a D rank still waiting should hear
  };
  Kind kind;
  TransferId id;
  std::uint64_t handle = 0;  // the engine's cookie given to Admit (0 for placeholders)
  ReleaseReason reason = ReleaseReason::kSent;
  Status status;                            // for kPullsFailed and kReleased
  std::uint64_t ranks = ~std::uint64_t{0};  // kPullsFailed: bit r = D rank r
};

// What a pull should do now.
struct PullAdmission {
  enum class Verdict : std::uint8_t { kReady, kWait, kFail };
  Verdict verdict;
  Status error;            // for kFail: the reason listed in the pull's `err`
  TimePoint wait_until{};  // for kWait: when the wait fails (also reported as kPullsFailed)
};

// What each field means: kHoldStatFields and the two families below (one row each, which
// `kvferry serve`'s /metrics, the Python binding's stats() and the sum over ranks read).
struct HoldStats {
  EnumArray<HoldPhase, std::uint64_t, kAllHoldPhases.size()> entries;
  std::uint64_t blocks_ready = 0;
  std::uint64_t sending = 0;
  std::uint64_t tombstones = 0;
  std::uint64_t refusal_reasons = 0;
  EnumArray<ReleaseReason, std::uint64_t, kAllReleaseReasons.size()> released;
  std::uint64_t renewals_extended = 0;
  std::uint64_t renewals_unknown = 0;
  std::uint64_t renewals_rejected = 0;
  std::uint64_t late_pulls_rejected = 0;
  std::uint64_t tombstone_hits = 0;
  std::uint64_t tombstones_evicted = 0;
  std::uint64_t decoder_releases = 0;
  std::uint64_t decoder_releases_ignored = 0;

  // Every row and family of `other` added to this one (the tables of several ranks, summed).
  HoldStats& operator+=(const HoldStats& other);
};

// Keys carry "hold_" where a session counts something of a similar name (PrefillStats'
// renewals_rejected and late_pulls_rejected count messages; these count table calls).
inline constexpr StatField<HoldStats> kHoldStatFields[] = {
    // clang-format off
    {"hold_blocks_ready", &HoldStats::blocks_ready, StatKind::kGauge,
     "P blocks held by ready hold entries (all ranks)"},
    {"hold_sending", &HoldStats::sending, StatKind::kGauge, "P sends in flight"},
    {"tombstones", &HoldStats::tombstones, StatKind::kGauge, "Remembered freed transfer ids"},
    {"refusal_reasons", &HoldStats::refusal_reasons, StatKind::kGauge,
     "Engine refusal reasons kept for late pulls (within max_refusal_reasons)"},
    {"renewals_extended", &HoldStats::renewals_extended, StatKind::kCounter,
     "Transfers whose lease a renewal extended"},
    {"renewals_unknown", &HoldStats::renewals_unknown, StatKind::kCounter,
     "Renewed ids this P does not hold"},
    {"hold_renewals_rejected", &HoldStats::renewals_rejected, StatKind::kCounter,
     "Renewals the hold table refused (no lease)"},
    {"hold_late_pulls_rejected", &HoldStats::late_pulls_rejected, StatKind::kCounter,
     "Pulls the hold table refused for a tombstoned id"},
    {"tombstone_hits", &HoldStats::tombstone_hits, StatKind::kCounter,
     "Calls that found a tombstone"},
    {"tombstones_evicted", &HoldStats::tombstones_evicted, StatKind::kCounter,
     "Tombstones forgotten to stay within max_tombstones (oldest first)"},
    {"decoder_releases", &HoldStats::decoder_releases, StatKind::kCounter,
     "Releases by a decoder that changed a hold entry"},
    {"decoder_releases_ignored", &HoldStats::decoder_releases_ignored, StatKind::kCounter,
     "Releases by a decoder that changed nothing (unknown, repeated or mismatched)"},
    // clang-format on
};
inline constexpr StatFamily<HoldStats, HoldPhase, kAllHoldPhases.size()> kHoldEntriesFamily{
    "hold_entries_by_state", &HoldStats::entries, StatKind::kGauge,
    "P hold-table entries by state (all ranks)", "kvferry_hold_entries", "state",
    kAllHoldPhases};
inline constexpr StatFamily<HoldStats, ReleaseReason, kAllReleaseReasons.size()>
    kHoldReleasedFamily{"hold_released_by_reason", &HoldStats::released, StatKind::kCounter,
                        "Hold entries released, by reason", "kvferry_hold_released_total",
                        "reason", kAllReleaseReasons};
static_assert(sizeof(HoldStats) == std::size(kHoldStatFields) * sizeof(std::uint64_t) +
                                       sizeof(HoldStats::entries) + sizeof(HoldStats::released),
              "every counter of HoldStats has one row in kHoldStatFields or a family");

class HoldTable {
 public:
  // A refusal reason kept with its tombstone is cut to this many bytes.
  static constexpr std::size_t kMaxRefusalReasonBytes = 240;

  explicit HoldTable(HoldConfig config);
  HoldTable(const HoldTable&) = delete;
  HoldTable& operator=(const HoldTable&) = delete;

  const HoldConfig& config() const { return config_; }

  // P's engine admitted the request. `handle` is echoed in events (the engine's request cookie).
  // A placeholder created by an earlier pull is adopted. Errors: kTombstoned (the transfer was
  // already freed: the engine should not spend compute on it), kAlreadyExists.
  // The engine must end every id it admitted with PrefillDone or EngineFinished: until then an
  // entry that no D pulled or renewed has no deadline here (the table cannot know how long the
  // engine queues and prefills it).
  Status Admit(const TransferId& id, std::uint64_t handle, TimePoint now);

  // Prefill finished; `num_blocks` blocks are now held for D. Starts the lease (or timeout) and
  // releases waiting pulls (kPullsReady). Errors: kTombstoned / kNotFound, meaning nobody will
  // pull this KV: the caller frees the blocks at once.
  Status PrefillDone(const TransferId& id, std::uint32_t num_blocks, TimePoint now);

  // P's engine aborted the request. Before prefill is done the engine owns the request's
  // blocks: the entry is released at once (kAbortedByEngine; waiting pulls fail) with no
  // kAbortPrefill. Once kReady the table owns the blocks (the engine handed them over, like
  // vLLM's delay-free): kFreeBlocks follows, but only after any send reading them has ended.
  // Unknown ids are ignored.
  void EngineFinished(const TransferId& id, TimePoint now);

  // P's engine refused the request before admitting it (queue full, too large, shutting down):
  // nobody here will prefill it. A pull already waiting for it (a placeholder) fails now with
  // `why` (kAbortedByEngine); a later pull fails at once (the id is tombstoned), so D's half of
  // the request ends in milliseconds instead of waiting abort_request_timeout, and hears `why`
  // too (kept with the tombstone, cut to kMaxRefusalReasonBytes): a pull that reaches P just
  // after the refusal learns the same reason as one that was already waiting. An admitted
  // entry belongs to another request and is left alone (kAlreadyExists).
  Status Refuse(const TransferId& id, Status why, TimePoint now);

  // Renewal of the transfers named by fingerprints. Only known transfers are extended, never
  // shortened. Error kRejected when this P has no lease (D then warns once and keeps pulling).
  struct RenewResult {
    std::uint32_t extended = 0;
    std::uint32_t unknown = 0;
  };
  Result<RenewResult> Renew(std::span<const Fingerprint> ids, TimePoint now);

  // A pull for `id` from the D rank `d_rank`, which expects `need_send` D ranks in total to pull
  // this transfer from this P worker. `d_lease` is the lease D declared (nullopt: D did not
  // say; leases are compared in whole milliseconds, the wire's unit). Unknown ids get a
  // placeholder and wait. Fails at once for tombstoned ids and lease mismatches (which also
  // release the entry, or tombstone the id if P has not seen it: D fails the request and will
  // not pull it again), for a `need_send` that differs from the one the first pull gave, and
  // (kAlreadyExists, nothing changed) for a second pull of a D rank that already waits for,
  // is being sent or was sent this transfer.
  PullAdmission AdmitPull(const TransferId& id, std::uint32_t d_rank, std::uint32_t need_send,
                          std::optional<Duration> d_lease, TimePoint now);

  // D rank `d_rank` will not pull transfer `fp` (again): a wire::Release. `need_send` is how many
  // D ranks pull it from this P worker (from the release's d_tp_size). The rank counts as done:
  // once every paired rank pulled or released it, the entry is released (kReleasedByDecoder;
  // kAbortPrefill if it is still prefilling, kFreeBlocks once ready) — never while a send reads
  // its blocks — and tombstoned. A pull of that rank still waiting fails (kPullsFailed for its
  // rank only, kCancelled); its pulls from now on fail too. An id P does not hold is tombstoned
  // when `need_send` is 1, so P will not prefill it (kTombstoned); with several paired ranks it is
  // kIgnored (nothing remembers one rank's release of an unknown id; the lease still bounds the
  // hold). Never frees a transfer another paired rank may still pull. Harmless for ids already
  // freed, already pulled by that rank or already released by it (kIgnored, nothing changes); a
  // `need_send` that differs from the first pull's is kIgnored with `error` set.
  struct ReleaseOutcome {
    // kReleased: the entry is freed (or goes when its sends end); kKept: other paired ranks
    // still need it; kTombstoned: P held nothing, the id is remembered so P never prefills it;
    // kIgnored: nothing changed.
    enum class Verdict : std::uint8_t { kReleased, kKept, kTombstoned, kIgnored };
    Verdict verdict = Verdict::kIgnored;
    Status error;  // why, for a kIgnored that is not plainly "already gone"
  };
  ReleaseOutcome ReleaseByDecoder(Fingerprint fp, std::uint32_t d_rank, std::uint32_t need_send,
                                  TimePoint now);

  // The pull of `d_rank` starts writing (entry must be kReady, and no other send of that rank
  // in flight). A send in flight defers every release of the entry: its blocks are being read.
  Status BeginSend(const TransferId& id, std::uint32_t d_rank, TimePoint now);
  // The write of `d_rank` ended. A failed send does not count; once every paired D rank has
  // succeeded the entry is released (kSent) and kFreeBlocks emitted.
  Status EndSend(const TransferId& id, std::uint32_t d_rank, bool ok, TimePoint now);

  // The expiry pass: releases every entry whose deadline is <= now and drops old tombstones.
  void Expire(TimePoint now);
  // The earliest time at which Expire has work (kNever if none). A runtime sleeps until then.
  TimePoint NextDeadline() const;

  // Decisions made since the last call, in order.
  std::vector<HoldEvent> TakeEvents();

  bool Contains(const TransferId& id) const;
  // Whether an entry with this fingerprint is held (what a renewal would extend).
  bool ContainsFingerprint(Fingerprint fp) const { return entries_.count(fp) != 0; }
  std::optional<HoldPhase> PhaseOf(const TransferId& id) const;
  // The deadline the entry is held to now (kNever while a send is in flight), for tests.
  std::optional<TimePoint> DeadlineOf(const TransferId& id) const;
  bool IsTombstoned(const TransferId& id) const;
  const HoldStats& stats() const { return stats_; }
  std::size_t size() const { return entries_.size(); }

 private:
  static constexpr std::uint32_t kNotInHeap = UINT32_MAX;

  struct Entry {
    TransferId id;
    std::uint64_t handle = 0;
    TimePoint expire = kNever;         // kReady only
    TimePoint wait_deadline = kNever;  // while pulls wait for the prefill
    TimePoint last_renewal = kNever;   // kNever: never renewed
    std::uint64_t sent_mask = 0;       // D ranks that pulled successfully (ranks < 64)
    std::uint64_t sending_mask = 0;    // D ranks whose write is in flight
    // D ranks with a pull waiting for the prefill: one wait per rank, so a D rank that repeats
    // its pull cannot grow anything, and the count (its popcount) cannot wrap.
    std::uint64_t waiting_mask = 0;
    std::uint64_t released_mask = 0;  // D ranks that released it (wire::Release)
    std::uint32_t heap_pos = kNotInHeap;
    std::uint32_t num_blocks = 0;
    std::uint16_t need_send = 0;  // 0 until the first pull says
    HoldPhase phase = HoldPhase::kPlaceholder;
    // Set when the entry must go (engine abort, lease mismatch) while a send still reads its
    // blocks: it is released with this reason as soon as the last send ends.
    bool doomed = false;
    ReleaseReason doom_reason = ReleaseReason::kAbortedByEngine;
    Status doom_status;  // what waiting pulls and notices hear when it goes
  };
  struct HeapItem {
    TimePoint key;
    Entry* entry;
  };
  struct Tombstone {
    TimePoint until;
    Fingerprint fp;
  };
  // What a late pull hears for a tombstoned id: why P's engine refused it, or that it was
  // released.
  Status LatePull(const TransferId& id, Fingerprint fp) const;
  using Map = std::unordered_map<Fingerprint, Entry>;

  Entry* Find(const TransferId& id);
  const Entry* Find(const TransferId& id) const;
  TimePoint RealDeadline(const Entry& e) const;
  // Moves the entry's heap key down to its real deadline if that is earlier (never up).
  void Rearm(Entry& e);
  void Release(Entry& e, ReleaseReason reason, Status pull_error, TimePoint now);
  // Release now, or as soon as the sends in flight end.
  void ReleaseOrDoom(Entry& e, ReleaseReason reason, Status pull_error, TimePoint now);
  // Every paired D rank pulled or released it: release (or doom) with the fitting reason.
  bool MaybeDone(Entry& e, TimePoint now);
  // `refusal`: why P's engine refused the id (empty for ids released after admission).
  void AddTombstone(Fingerprint fp, TimePoint now, std::string refusal = {});
  void DropTombstone(Fingerprint fp);  // and its reason
  void ExpireTombstones(TimePoint now);

  void HeapPush(Entry& e, TimePoint key);
  void HeapRemove(Entry& e);
  void HeapUpdateKey(Entry& e, TimePoint key);
  void SiftUp(std::uint32_t pos);
  void SiftDown(std::uint32_t pos);
  void HeapSet(std::uint32_t pos, HeapItem item);

  HoldConfig config_;
  Map entries_;
  std::vector<HeapItem> heap_;
  std::deque<Tombstone> tombstone_order_;
  std::unordered_set<Fingerprint> tombstones_;
  // The engine's reasons for tombstones left by Refuse, at most max_refusal_reasons, the
  // oldest first in reason_order_ (one entry per kept reason). Reasons are kept in tombstone
  // order and tombstones leave oldest first, so a tombstone that leaves with its reason holds
  // the oldest one.
  std::unordered_map<Fingerprint, std::string> reasons_;
  std::deque<Fingerprint> reason_order_;
  std::vector<HoldEvent> events_;
  HoldStats stats_;
};

}  // namespace kvferry::core
