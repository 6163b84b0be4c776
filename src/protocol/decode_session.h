// DecodeSession: the D side of the side-channel protocol for one D worker (rank), sans-IO
// (SPEC §2, §3, §5). The twin of PrefillSession.
//
// It owns what D decides: the receive ledger (through protocol::Ledger: who may still write
// into which blocks), the renewal schedule (core::RenewalScheduler), what D knows of each P
// engine (KnownEngines: views, lookups, their failures, incarnations), every pull in flight with
// its deadline, the renewal passes with theirs, and the fences it asks for (FenceBook). No sockets, threads or clock reads:
// every call takes `now`; decisions come out of the Take*() queues —
//   TakeLookups()   bootstrap lookups to make (at most one in flight per engine and address),
//   TakeMessages()  Pulls and Renewals to send, each to an endpoint (a P worker's side channel),
//   TakeFences()    data-plane fences to perform (answer each with OnFenceDone),
//   TakeEvents()    receive completions, blocks leaving quarantine, warnings, for the engine,
// and NextDeadline() says when OnTimeout() has work. The runtime's DecodeWorker and the
// simulator drive this same class.
//
// The rules it keeps (the holes of the protocol-sessions issue, each with a test):
//  - Nothing waits behind anything: every pull and renewal goes out at once, many per endpoint
//    (wire ids are per endpoint), so a dead P delays no pull or renewal to a live one. A renewal
//    pass sends to every P worker at once; each reply is awaited at most `renewal_reply_timeout`
//    (≤ lease/12); one lookup per engine and bootstrap address at a time (an answer to a
//    lookup that already timed out may overlap the next one), and a failed lookup is cached
//    for `lookup_failure_ttl`, during which loads naming that engine at that address fail at
//    once (nothing sent).
//  - One client's bootstrap address never holds up another's: until D has paired with an
//    engine, a load naming it at another address than a lookup in flight or a cached failure
//    gets a lookup of its own (up to kMaxLookupsPerEngine at once), and a failed lookup fails
//    only the loads that named its address. The first answer pairs the engine for all.
//  - A pull's deadline settles its still-pending entries as timeouts: the receive fails at once
//    but its blocks stay quarantined (a local timeout is not proof that P stopped writing). The
//    pull stays known, so a late reply still settles it and releases the quarantine; and the
//    session asks for a fence of that peer, whose success (OnFenceDone OK) also releases it.
//    Pulls sent after a fence was asked for belong to a new epoch of the peer, so the fence
//    never releases entries it does not cover.
//  - A new incarnation of an engine never settles anything by itself: the old process's pulls
//    end by their own replies or by a fence. A lookup that finds it at the very bootstrap the
//    old process was learned from means the engine restarted: the old process's pulls fail at
//    once (their blocks stay quarantined), as with a registry's OnProcessGone; an answer from
//    another bootstrap (any client may name one) only adds peers.
//  - With a lease, once no renewal has reached a P worker for a whole lease (every one since
//    failed unsent: provably not delivered), its pulls fail (quarantined, fenced): P has
//    dropped those transfers if it lives, and answers nothing if it is gone.
//  - A message that could not be sent (OnSendFailed: nothing listens at the address, or its
//    queue is full) or a pull that timed out makes every engine whose view names that side
//    channel stale: its next loads, releases and renewal pass wait for a fresh lookup (renewals
//    still go to the known view meanwhile), so a P restarted on a new port gets traffic again.
//  - Only the requests a pull asked for are settled by its replies (ApplyPullResponse).
//  - `pull_timeout` must exceed `abort_request_timeout` + `write_bound` (P answers every pull
//    within that, even one that waits for a prefill), or the options are refused.
//  - Release at once: a request that ends without a successful receive — finished or aborted
//    before or during its load, or its receive failed — is released to every P rank it pulls
//    from (wire::Release, batched per engine over `release_delay`), so P frees its KV now
//    instead of at the end of a lease. A P engine that cannot read releases (it answers ERROR
//    PROTOCOL) gets none again until a lookup finds a new incarnation. Releases never touch
//    D's own blocks: those follow the ledger.
//  - P's AbortNotice fails a request that has not started loading at once (TransferAborted);
//    a loading one is left to its pull's answer. A notice counts only from a side channel of
//    the engine the request names.
//
// Not thread-safe: one owner calls everything.
#pragma once

#include <cstdint>
#include <iterator>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <variant>
#include <vector>

#include "kvferry/core/ids.h"
#include "kvferry/core/receive_ledger.h"
#include "kvferry/core/renewal_scheduler.h"
#include "kvferry/core/stat_fields.h"
#include "kvferry/core/time.h"
#include "kvferry/status.h"
#include "protocol/endpoint_pool.h"
#include "protocol/fence_book.h"
#include "protocol/known_engines.h"
#include "protocol/ledger.h"
#include "wire/messages.h"

namespace kvferry::protocol {

using namespace std::chrono_literals;

// EndpointId (endpoint_pool.h): one P worker's side channel as the session names it (one socket
// in the runtime). Never reused: an endpoint closed (TakeClosedEndpoints) and needed again for
// the same address gets a new id.

struct DecodeSessionOptions {
  core::EngineId engine_id = "decode-0";
  std::uint32_t tp_size = 1;
  std::uint32_t tp_rank = 0;
  std::uint64_t block_len = 0;  // bytes per block in this rank's region
  std::uint32_t num_blocks = 0;
  std::vector<std::uint8_t> region_descriptor;  // sent with every pull
  // False: this rank's blocks do not keep a KV head's bytes together (a token-major layout), so
  // they must be written whole: a load from an engine of a larger TP size (whose ranks each
  // write a head slice of every block) fails at once, unsent, with the reason.
  bool head_slices = true;
  core::Duration lease{0};                      // kv_lease_duration; 0 = off
  // P answers every pull within abort_request_timeout (a prefill that never finishes) plus the
  // time a write may take until it is fenced; D's deadline must be longer.
  core::Duration abort_request_timeout = 480s;
  core::Duration write_bound = 70s;  // runtime::DecodeWorkerOptions::write_bound says why
  core::Duration pull_timeout = 600s;
  core::Duration lookup_timeout = 5s;      // a lookup not answered by then failed
  core::Duration lookup_failure_ttl = 2s;  // how long a failed lookup is believed
  // How long one renewal reply is awaited (0: lease/12). Longer than lease/12 is refused: a
  // pass must never run into the next one.
  core::Duration renewal_reply_timeout{0};
  // Releases (wire::Release): off only to measure what they save. They wait up to
  // `release_delay` to be batched (0: each goes out at once); a reply not received within
  // `release_reply_timeout` is counted failed (the lease still frees P's KV).
  bool send_releases = true;
  core::Duration release_delay = std::chrono::milliseconds(2);
  core::Duration release_reply_timeout = std::chrono::seconds(2);
  // Write keys (transport::WriteKey, wire::Pull::write_key): 0 = none. Otherwise each ledger
  // peer (one epoch of one P rank of one incarnation) gets the key write_key_base + its id + 1,
  // carried by its pulls and listed in the fences that cover it, so a data plane that fences
  // its writers revokes exactly the pulls a fence covers. The base must be below 2^63 and
  // should be random (sessions sharing one data-plane engine must not share keys).
  std::uint64_t write_key_base = 0;
  // Endpoints with nothing in flight (no pull, renewal, release or fence) are kept open for
  // reuse up to this many, least recently used first out; beyond it they are closed. So the
  // side channels (sockets) D holds stay within this plus those in use, whatever the churn of
  // P addresses (found by review: every P restart binds a new port, and D kept every socket
  // it ever opened until it died of EMFILE at its 1,024th address).
  std::size_t max_idle_endpoints = 256;
  // Endpoints open at once, in use or idle. A message that needs another endpoint while every
  // one has something in flight fails at once (a load: unsent, kResourceExhausted); the runtime
  // sizes its socket table to this.
  std::size_t max_endpoints = 4096;
};

struct Transmit {
  EndpointId endpoint = 0;
  std::string address;  // the side channel's address (e.g. "tcp://10.0.0.1:5600")
  std::variant<wire::Pull, wire::Renewal, wire::Release> message;
};

// Make it impossible for `endpoint`'s P worker to land any write that a pull of epoch
// <= `through_epoch` asked for — also over a later reconnection (closing today's connection is
// not enough: P reconnects to serve newer pulls), e.g. by revoking the credentials those pulls
// carried — then answer OnFenceDone(id, OK). A data plane that cannot prove that answers an
// error: the session then waits for the peer's late replies instead, and asks again at the
// deadline of each pull the fence covers. (The runtime revokes `write_keys` in a data plane that
// fences its writers, and so does the simulator's.)
struct FenceRequest {
  std::uint64_t id = 0;
  EndpointId endpoint = 0;
  std::string address;
  std::uint32_t through_epoch = 0;
  // The write keys of the covered epochs' pulls (empty when the session hands out none): a data
  // plane that fences writers revokes them (transport::Engine::RevokeWriteKeys) — which holds
  // over every later connection of the peer — and answers OK once nothing stamped with them
  // can land.
  std::vector<std::uint64_t> write_keys;
};

struct ReceiveDone {
  core::RequestId request;
  bool ok = false;
  Status error;                        // the first failure
  std::vector<core::BlockId> invalid;  // failed: blocks whose contents are not valid
  bool quarantined = false;            // blocks not reusable until a BlocksReleased
};
struct BlocksReleased {
  core::RequestId request;
  std::vector<core::BlockId> blocks;
};
// P dropped the transfer of a request that has not started loading (wire::AbortNotice): fail
// it now with `error` (P's reason). No pull was sent for it, so no block of D is involved.
struct TransferAborted {
  core::RequestId request;
  Status error;
};
struct Warning {
  enum class Kind : std::uint8_t {
    kNoLease,        // a P engine rejects renewals (runs without a lease): once per engine
    kLeaseMismatch,  // a P engine accepted renewals but declared another lease: once per engine
    kIncarnation,    // a lookup named another process for a known engine
    kFence,          // the data plane cannot fence a peer: once per session
    kNoRelease,      // a P engine cannot read releases: once per engine
    kEndpointsExhausted,  // every side channel in use: at the 1st, 10th, 100th... message
  };
  Kind kind;
  std::string text;
};
using DecodeEvent = std::variant<ReceiveDone, BlocksReleased, TransferAborted, Warning>;

// What each field means: kDecodeStatFields below (one row per field, which the binding and
// /metrics read).
struct DecodeStats {
  std::uint64_t pulls_sent = 0;
  std::uint64_t loads_retried = 0;
  std::uint64_t pull_timeouts = 0;
  std::uint64_t pulls_abandoned = 0;
  std::uint64_t processes_replaced = 0;
  std::uint64_t late_replies = 0;
  std::uint64_t unsettled_writes = 0;
  std::uint64_t replies_unmatched = 0;
  std::uint64_t receives_ok = 0;
  std::uint64_t receives_failed = 0;
  std::uint64_t renewal_messages = 0;
  std::uint64_t renewals_accepted = 0;
  std::uint64_t renewals_rejected = 0;
  std::uint64_t renewal_failures = 0;
  std::uint64_t lookups = 0;
  std::uint64_t lookup_failures = 0;
  std::uint64_t lookups_stale = 0;
  std::uint64_t engines_known = 0;
  std::uint64_t engines_forgotten = 0;
  std::uint64_t endpoints = 0;
  std::uint64_t endpoints_closed = 0;
  std::uint64_t endpoints_exhausted = 0;
  std::uint64_t fences_requested = 0;
  std::uint64_t fences_failed = 0;
  std::uint64_t release_messages = 0;
  std::uint64_t releases_sent = 0;
  std::uint64_t releases_dropped = 0;
  std::uint64_t release_failures = 0;
  std::uint64_t p_released = 0;
  std::uint64_t p_kept = 0;
  std::uint64_t p_unknown = 0;
  std::uint64_t notices_received = 0;
  std::uint64_t notices_ignored = 0;
  std::uint64_t transfers_aborted = 0;
  std::uint64_t undecodable = 0;
  std::uint64_t pulls_in_flight = 0;
  std::uint64_t quarantined_blocks = 0;
  std::uint64_t tracked = 0;
  std::uint64_t receiving = 0;
};

inline constexpr core::StatField<DecodeStats> kDecodeStatFields[] = {
    // clang-format off
    {"pulls_sent", &DecodeStats::pulls_sent, core::StatKind::kCounter,
     "Pull messages sent (per P peer)"},
    {"loads_retried", &DecodeStats::loads_retried, core::StatKind::kCounter,
     "Loads whose only pull never left, sent again after a lookup"},
    {"pull_timeouts", &DecodeStats::pull_timeouts, core::StatKind::kCounter,
     "Pulls whose deadline passed unanswered (their blocks quarantined)"},
    {"pulls_abandoned", &DecodeStats::pulls_abandoned, core::StatKind::kCounter,
     "Pulls given up on because their P engine went down"},
    {"processes_replaced", &DecodeStats::processes_replaced, core::StatKind::kCounter,
     "Lookups that found a P engine restarted as another process"},
    {"late_replies", &DecodeStats::late_replies, core::StatKind::kCounter,
     "Answers to pulls after their deadline (each releases its quarantine)"},
    {"unsettled_writes", &DecodeStats::unsettled_writes, core::StatKind::kCounter,
     "Loads failed because P's write failed with bytes that may still land: their blocks stay "
     "quarantined until a fence holds or P is known stopped"},
    {"replies_unmatched", &DecodeStats::replies_unmatched, core::StatKind::kCounter,
     "Replies naming no pull or renewal of their side channel"},
    {"receives_ok", &DecodeStats::receives_ok, core::StatKind::kCounter,
     "Per-rank receives settled, by outcome", "kvferry_receives_total", {"outcome", "ok"}},
    {"receives_failed", &DecodeStats::receives_failed, core::StatKind::kCounter,
     "Per-rank receives settled, by outcome", "kvferry_receives_total", {"outcome", "failed"}},
    {"renewal_messages", &DecodeStats::renewal_messages, core::StatKind::kCounter,
     "Renewal messages sent", "kvferry_renewals_sent_total"},
    {"renewals_accepted", &DecodeStats::renewals_accepted, core::StatKind::kCounter,
     "Renewal messages accepted by P"},
    {"renewals_rejected", &DecodeStats::renewals_rejected, core::StatKind::kCounter,
     "Renewal messages rejected by P (it runs without a lease)"},
    {"renewal_failures", &DecodeStats::renewal_failures, core::StatKind::kCounter,
     "Renewals that got no reply in time, or an error reply"},
    {"lookups", &DecodeStats::lookups, core::StatKind::kCounter,
     "Bootstrap lookups started", "kvferry_bootstrap_lookups_total"},
    {"lookup_failures", &DecodeStats::lookup_failures, core::StatKind::kCounter,
     "Bootstrap lookups that failed", "kvferry_bootstrap_lookup_failures_total"},
    {"lookups_stale", &DecodeStats::lookups_stale, core::StatKind::kCounter,
     "Bootstrap answers asked before their engine was declared down (not used)",
     "kvferry_bootstrap_lookups_stale_total"},
    {"engines_known", &DecodeStats::engines_known, core::StatKind::kGauge,
     "P engines D keeps state for (engines never reached are forgotten once no request names "
     "them)", "kvferry_decode_engines_known"},
    {"engines_forgotten", &DecodeStats::engines_forgotten, core::StatKind::kCounter,
     "P engines never reached and no longer named: their state dropped"},
    {"endpoints", &DecodeStats::endpoints, core::StatKind::kGauge,
     "Side channels to P workers open", "kvferry_side_channels_open"},
    {"endpoints_closed", &DecodeStats::endpoints_closed, core::StatKind::kCounter,
     "Side channels closed because they were idle", "kvferry_side_channels_closed_total"},
    {"endpoints_exhausted", &DecodeStats::endpoints_exhausted, core::StatKind::kCounter,
     "Messages that found every one of max_endpoints side channels in use: a load failed at "
     "once, a renewal or release not sent (a decoder at its cap cannot keep P's leases)",
     "kvferry_side_channels_exhausted_total"},
    {"fences_requested", &DecodeStats::fences_requested, core::StatKind::kCounter,
     "Fences of P workers D asked its data plane for (pull timeouts, engines down)",
     "kvferry_fences_total"},
    {"fences_failed", &DecodeStats::fences_failed, core::StatKind::kCounter,
     "Fences not proved (data plane without fence_writes, or writes still landing after 5 s): "
     "their blocks stay quarantined until P answers or a later fence holds"},
    {"release_messages", &DecodeStats::release_messages, core::StatKind::kCounter,
     "Release messages sent"},
    {"releases_sent", &DecodeStats::releases_sent, core::StatKind::kCounter,
     "Transfers released to P (per P rank) as soon as D no longer needed them"},
    {"releases_dropped", &DecodeStats::releases_dropped, core::StatKind::kCounter,
     "Releases not sent (P engine unreachable or without support): its lease frees them"},
    {"release_failures", &DecodeStats::release_failures, core::StatKind::kCounter,
     "Release messages P did not accept (no reply in time, or an error reply)"},
    {"p_released", &DecodeStats::p_released, core::StatKind::kCounter,
     "Released transfers, by what P's reply said it did", "kvferry_releases_answered_total",
     {"outcome", "released"}},
    {"p_kept", &DecodeStats::p_kept, core::StatKind::kCounter,
     "Released transfers, by what P's reply said it did", "kvferry_releases_answered_total",
     {"outcome", "kept"}},
    {"p_unknown", &DecodeStats::p_unknown, core::StatKind::kCounter,
     "Released transfers, by what P's reply said it did", "kvferry_releases_answered_total",
     {"outcome", "unknown"}},
    {"notices_received", &DecodeStats::notices_received, core::StatKind::kCounter,
     "AbortNotice messages received from P"},
    {"notices_ignored", &DecodeStats::notices_ignored, core::StatKind::kCounter,
     "Transfers named in AbortNotices that D does not track from that engine"},
    {"transfers_aborted", &DecodeStats::transfers_aborted, core::StatKind::kCounter,
     "Queued requests failed at once because P dropped their transfer",
     "kvferry_abort_notices_applied_total"},
    {"undecodable", &DecodeStats::undecodable, core::StatKind::kCounter,
     "Side-channel messages D could not use", "kvferry_side_channel_undecodable_total"},
    {"pulls_in_flight", &DecodeStats::pulls_in_flight, core::StatKind::kGauge,
     "Pulls not fully answered (late ones included)"},
    {"quarantined_blocks", &DecodeStats::quarantined_blocks, core::StatKind::kGauge,
     "D blocks whose writer state is unknown (ledger view)"},
    {"tracked", &DecodeStats::tracked, core::StatKind::kGauge,
     "Requests D renews", "kvferry_renewal_tracked"},
    {"receiving", &DecodeStats::receiving, core::StatKind::kGauge,
     "Requests whose KV D is receiving", "kvferry_requests_receiving"},
    // clang-format on
};
static_assert(sizeof(DecodeStats) ==
                  std::size(kDecodeStatFields) * sizeof(std::uint64_t),
              "every field of DecodeStats has one row in kDecodeStatFields");

class DecodeSession {
 public:
  [[nodiscard]] static Status ValidateOptions(const DecodeSessionOptions& options);
  // Options must satisfy ValidateOptions. `make_ledger` empty: the real ledger (CoreLedger).
  explicit DecodeSession(DecodeSessionOptions options, const LedgerFactory& make_ledger = {});
  DecodeSession(const DecodeSession&) = delete;
  DecodeSession& operator=(const DecodeSession&) = delete;

  // ---- Engine (vLLM's connector contract) ----
  // A request with remote prefill arrived (it may still wait for blocks): renew it.
  void OnNewRequest(const core::RequestId& request, const RemoteSource& source,
                    core::TimePoint now);
  // Its blocks are allocated: pull its KV from every paired P rank. The outcome comes exactly
  // once as a ReceiveDone. Empty `blocks`: notify-only, nothing to wait for. kAlreadyExists if
  // the request is still receiving or its blocks are still quarantined, kOutOfRange for a block
  // outside the region, kInvalidArgument for ids or a block count the wire cannot carry;
  // nothing is started then.
  [[nodiscard]] Status StartLoad(const core::RequestId& request, const RemoteSource& source,
                                 std::vector<core::BlockId> blocks, core::TimePoint now);
  // It finished or was aborted: stop renewing it, and unless its receive succeeded release its
  // transfer to P (wire::Release).
  void RequestFinished(const core::RequestId& request, core::TimePoint now);
  // The engine refused a request before announcing it and will not serve it as sent (e.g. too
  // large for this instance): release its transfer so P neither prefills nor holds it for
  // nobody. An engine D does not know yet is looked up first, while D knows fewer than 1,024
  // engines (a refusal costs a client nothing: beyond that the release is dropped and P's
  // lease frees the KV). Ignored while a tracked request names the same transfer. Do not call
  // it for a refusal a router may retry elsewhere with the same transfer (queue full, shutting
  // down).
  void ReleaseTransfer(const RemoteSource& source, core::TimePoint now);

  // The engine stops: every request still tracked is finished — releases of all of them are
  // queued and go out with the next TakeMessages (not batched: there is no later pass).
  void ReleaseAll(core::TimePoint now);

  // ---- Results of what the session asked for ----
  // `lookup_id` is the LookupRequest's id; 0 stands for the engine's latest lookup. An answer
  // to a lookup asked before the engine was declared down (OnEngineDown) is stale: it may
  // describe the dead process, so it is counted (lookups_stale) and changes nothing; whatever
  // waits for the engine gets a fresh lookup.
  void OnLookup(const PeerEngine& engine, core::TimePoint now, std::uint64_t lookup_id = 0);
  void OnLookupFailed(const core::EngineId& engine, const Status& why, core::TimePoint now,
                      std::uint64_t lookup_id = 0);
  void OnPullResponse(EndpointId endpoint, const wire::PullResponse& response, core::TimePoint now);
  void OnRenewalReply(EndpointId endpoint, const wire::RenewalReply& reply, core::TimePoint now);
  void OnReleaseReply(EndpointId endpoint, const wire::ReleaseReply& reply, core::TimePoint now);
  void OnAbortNotice(EndpointId endpoint, const wire::AbortNotice& notice, core::TimePoint now);
  // One message as it arrived from `endpoint`: decoded and dispatched to the calls above.
  // Undecodable or unknown messages are counted and change nothing (their requests' deadlines
  // decide).
  void OnMessage(EndpointId endpoint, std::span<const std::uint8_t> payload, core::TimePoint now);
  // The transport took the message (a connection to P was up): it may reach P. Optional —
  // a driver that cannot tell may skip it — but a driver that reports unsent messages
  // (OnSendFailed) should report these too: without them, renewals that failed unsent around
  // one that left would look like a lease without any renewal reaching P.
  void OnSent(EndpointId endpoint, std::uint64_t wire_id, core::TimePoint now);
  // A message could not be sent (it never left): its requests settle as failed, not
  // quarantined — P cannot be writing for a pull it never got.
  void OnSendFailed(EndpointId endpoint, std::uint64_t wire_id, const Status& why,
                    core::TimePoint now);
  void OnFenceDone(std::uint64_t fence_id, const Status& result, core::TimePoint now);
  // A liveness source says the engine's processes are gone (e.g. its registry lease expired).
  // Loads waiting for it and new ones fail at once (until a lookup succeeds again, after
  // lookup_failure_ttl), and so do the requests of its pulls in flight (as at their deadline);
  // its endpoints with pulls in flight are fenced — the blocks of those pulls stay quarantined
  // until the fences (or late replies) release them, never by this call alone.
  void OnEngineDown(const core::EngineId& engine, const Status& why, core::TimePoint now);
  // A liveness source says one process of the engine — `incarnation` — is gone while the engine
  // lives on in another (e.g. it restarted within its registry lease's TTL, so its keys were
  // replaced rather than deleted). That process's pulls in flight fail now (as at their
  // deadlines: blocks quarantined) and are fenced — only that incarnation's epochs, so pulls to
  // the new process are untouched; a view of that process is dropped, so waiting and later
  // loads look the engine up again (nothing fails for want of a view).
  void OnProcessGone(const core::EngineId& engine, const std::string& incarnation,
                     const Status& why, core::TimePoint now);

  // ---- Time ----
  void OnTimeout(core::TimePoint now);
  core::TimePoint NextDeadline() const;

  // ---- Output ----
  std::vector<LookupRequest> TakeLookups();
  std::vector<Transmit> TakeMessages();
  std::vector<FenceRequest> TakeFences();
  std::vector<DecodeEvent> TakeEvents();
  // Endpoints the session is done with: close their sockets (nothing is in flight on them,
  // and no later message names them). Call after the other Take*() calls.
  std::vector<EndpointId> TakeClosedEndpoints();

  DecodeStats stats() const;
  const DecodeSessionOptions& options() const { return options_; }
  // The address of an open endpoint; empty once it is closed.
  std::string AddressOf(EndpointId endpoint) const {
    const Endpoint* ep = endpoints_.Find(endpoint);
    return ep == nullptr ? std::string() : ep->address;
  }

 private:
  struct PullOp {
    core::RequestId request;
    core::PeerId peer;
    core::TimePoint deadline;
    bool timed_out = false;
    bool sent = false;  // the pump handed it to a connection (OnSent)
    // The load, while it may still be retried: its only pull, never retried before.
    std::optional<ParkedLoad> retry;
  };
  // A renewal or release awaiting its reply.
  struct ReplyOp {
    core::EngineId engine;
    core::TimePoint deadline;
  };
  // (deadline, endpoint, wire id) of a pull or of a message awaiting its reply.
  using Deadline = std::tuple<core::TimePoint, EndpointId, std::uint64_t>;
  struct Endpoint {
    std::string address;
    std::uint32_t fences_in_flight = 0;
    // When the oldest renewal sent since a message last left for the worker (OnSent) or it
    // last answered anything was sent, if every renewal since has failed unsent; kNever
    // otherwise (OnSendFailed).
    core::TimePoint unsent_since = core::kNever;
    // Renewals whose reply deadline passed: wire id -> when sent (bounded; OnSendFailed).
    std::map<std::uint64_t, core::TimePoint> unanswered_renewals;
    std::map<std::uint64_t, PullOp> pulls;      // by wire id
    std::map<std::uint64_t, ReplyOp> renewals;  // by wire id
    std::map<std::uint64_t, ReplyOp> releases;  // by wire id
    std::uint32_t epoch = 0;  // bumped when a fence is asked for: later pulls are a new peer
  };
  // A request D has heard of and not yet finished (or settled): what to renew and release.
  struct Tracked {
    core::TransferId transfer;
    core::EngineId engine;
  };
  // The entry of `engine` (made on first use), and where its next lookup goes.
  KnownEngine& Engine(const core::EngineId& engine, const std::string& bootstrap_address) {
    return engines_.Note(engine, bootstrap_address);
  }
  // Sends what waited for a lookup to `view`: loads, then renewals, then releases.
  void SendParked(const core::EngineId& engine, const PeerEngine& view, ParkedWork parked,
                  core::TimePoint now);
  // Forgets engines never reached that no tracked request names (KnownEngines::Sweep): clients
  // name engines, and one naming a new engine per request must not grow D's memory.
  void SweepEngines(core::TimePoint now);
  // The endpoint of `address`, opened if needed (closing the least recently idle one when
  // max_endpoints are open); nullopt when every open one has something in flight.
  std::optional<EndpointId> EndpointFor(const std::string& address);
  // An endpoint the pool closes: its ledger peers go with it (nothing of theirs is pending).
  void EndpointClosed(EndpointId endpoint);
  Status TooManyEndpoints(const std::string& address) const;
  // A message to `address` found every one of max_endpoints side channels in use: counted, and
  // a Warning at the 1st, 10th, 100th... time (a decoder at its cap cannot keep P's leases,
  // so an operator must hear of it, but not once per message).
  void NoteEndpointsExhausted(const std::string& address, std::string_view what);
  Endpoint* FindEndpoint(EndpointId endpoint) { return endpoints_.Find(endpoint); }
  // Something in flight on `endpoint` ended: it may be idle now (CloseIdleEndpoints decides).
  void NoteMaybeIdle(EndpointId endpoint) { endpoints_.NoteMaybeIdle(endpoint); }
  // Endpoints with nothing in flight become idle; those beyond max_idle_endpoints close
  // (EndpointPool), with the ledger peers they carried.
  void CloseIdleEndpoints();
  core::PeerId PeerFor(EndpointId endpoint, const std::string& incarnation);
  void SendLoad(ParkedLoad load, const PeerEngine& view, core::TimePoint now);
  void FailLoad(ParkedLoad load, Status why, core::TimePoint now);
  void ForgetPull(EndpointId endpoint, std::map<std::uint64_t, PullOp>::iterator op);
  void SendRenewals(const core::EngineId& engine, const PeerEngine& view,
                    std::span<const core::Fingerprint> ids, core::TimePoint now);
  // Stops tracking `request` and, once no tracked request names its transfer, renewing it;
  // with `release`, queues a release of the transfer.
  void Untrack(const core::RequestId& request, bool release, core::TimePoint now);
  // Batches a release of `transfer` to `engine` (unless releases are off or the engine cannot
  // read them).
  void QueueRelease(const core::EngineId& engine, const core::TransferId& transfer,
                    core::TimePoint now);
  void FlushReleases(core::TimePoint now);
  void SendReleases(const core::EngineId& engine, const PeerEngine& view,
                    std::span<const core::Fingerprint> ids, core::TimePoint now);
  // An ERROR answered message `id` of `endpoint`. If it is a release, that release failed, and
  // a PROTOCOL error means its engine cannot read releases (an old P). Returns false if `id`
  // is not a release.
  bool ReleaseRefused(EndpointId endpoint, std::uint64_t id, const wire::PullResponse& error);
  // Takes the renewal or release `id` of `endpoint` (in `ops`) out with its deadline: its
  // engine, or nullopt (counted unmatched) when none is awaited.
  std::optional<core::EngineId> TakeReplyOp(EndpointId endpoint,
                                            std::map<std::uint64_t, ReplyOp> Endpoint::*ops,
                                            std::set<Deadline>& deadlines, std::uint64_t id);
  void RenewalPass(core::TimePoint now);
  void ExpirePulls(core::TimePoint now);
  void GiveUpOnPull(PullOp& op, const Status& why);
  // Gives up on every pull in flight on `endpoint` (as at their deadlines) and fences it. The
  // caller drains the ledger.
  void GiveUpOnEndpoint(EndpointId endpoint, const Status& failure);
  // Gives up on every pull of the process `incarnation` (as at their deadlines) and fences the
  // epochs they belong to. The caller drains the ledger.
  void GiveUpOnProcess(const std::string& incarnation, const Status& failure);
  // Fences every epoch of `endpoint` not yet proved stopped — of `incarnation` only, when given
  // (another process behind the same address is another writer) — and starts a new epoch.
  void AskFence(EndpointId endpoint, const std::string* incarnation = nullptr);
  // Asks for a fence of one epoch, unless it is proved stopped or a fence of it is in flight.
  void IssueFence(core::PeerId peer, std::uint32_t through);
  // The process a ledger peer of an open endpoint belongs to.
  const std::string& IncarnationOf(core::PeerId peer) const {
    return fences_.At(peer).incarnation;
  }
  // Whether pulls of this epoch are still known (given up on and awaiting proof, or in flight).
  bool PullsWaitFor(core::PeerId peer) const;
  // The write key of a ledger peer's pulls (0 when keys are off).
  std::uint64_t WriteKeyOf(core::PeerId peer) const {
    return options_.write_key_base == 0 ? 0 : options_.write_key_base + peer + 1;
  }
  void DrainLedger(core::TimePoint now);
  std::optional<std::vector<std::uint32_t>> Targets(const PeerEngine& view, Status* why) const;

  const DecodeSessionOptions options_;
  const core::Duration renewal_reply_timeout_;
  std::unique_ptr<Ledger> ledger_;
  core::RenewalScheduler renewals_;

  // What D knows of each P engine: views, lookups, failures, what waits for a lookup.
  KnownEngines engines_;
  // Open side channels, the idle LRU and the addresses of recently closed ones (a message's
  // unsent report may come after its endpoint went idle and closed: a release's reply is
  // awaited 2 s, a send 3 s).
  EndpointPool<Endpoint> endpoints_;
  // Wire ids of pulls, renewals and releases: unique across the session (so across the
  // endpoints ever made for one address), which per endpoint is what the protocol needs.
  std::uint64_t next_wire_id_ = 0;
  // Ledger peers (epochs), the fences in flight, the epochs they proved stopped, and retries.
  FenceBook fences_;
  // Pulls not yet timed out, renewals and releases not yet answered.
  std::set<Deadline> pull_deadlines_;
  std::set<Deadline> renewal_deadlines_;
  std::set<Deadline> release_deadlines_;
  core::TimePoint release_due_ = core::kNever;  // when pending releases go out
  std::unordered_map<core::RequestId, Tracked> tracked_;
  std::unordered_multimap<core::TransferId, core::RequestId> by_transfer_;
  std::unordered_set<core::RequestId> loading_;      // StartLoad until its ReceiveDone
  std::unordered_set<core::RequestId> quarantined_;  // ReceiveDone quarantined, not released
  bool warned_fence_ = false;

  std::vector<Transmit> messages_out_;
  std::vector<FenceRequest> fences_out_;
  std::vector<DecodeEvent> events_out_;
  DecodeStats counters_;
};

}  // namespace kvferry::protocol
