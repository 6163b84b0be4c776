// PrefillListener: one P worker's side channel (SPEC §1, §2.4, §3.5, §4): a thin ZeroMQ pump
// around protocol::PrefillSession, which makes every protocol decision (pairing, parking,
// waves, replies, renewals, expiry, limits; see protocol/prefill_session.h for the contracts).
//
// Threads and ownership (one owner per resource):
//  - The listener thread owns the ROUTER socket and the PrefillSession. It feeds the session
//    every message (renewals are answered at once, so they are never stuck behind writes or
//    unfinished prefills), the engine's calls, write completions and the time, and carries out
//    what comes back: replies go out on the socket, write jobs to the senders, hold events to
//    the engine. It wakes at PrefillSession::NextDeadline() for the expiry pass.
//  - `num_senders` sender threads call KvWriter::Write and post the outcome back.
//  - Engine threads call Admit / PrefillDone / EngineFinished; these are queued commands the
//    listener drains (woken through an eventfd). Each returns a future with the session's
//    Status, so a refusal (e.g. kTombstoned: nobody will pull this KV) reaches the engine.
//  - Hold events kFreeBlocks / kAbortPrefill reach the engine through `on_hold_event`, called on
//    the listener thread.
//
// Wire framing (docs/protocol.md §1): a message arrives as [identity][payload] and each reply
// goes out as [identity][payload] with the request's wire `id` copied into it, which is how D
// matches replies to requests. Any other frame count is answered with ERROR and not served.
//
// Cluster authentication (ListenerOptions::cluster_secret; docs/security.md): with a secret the
// ROUTER is a CURVE server (so every frame is encrypted and authenticated), and the listener
// thread also serves, in the same poll set and the same ZeroMQ context as the ROUTER,
//  - the ZAP handler (inproc://zeromq.zap.01), which admits only the cluster's CURVE client
//    key, and
//  - a monitor of the ROUTER's handshakes: each one P refuses (a greeting naming another
//    mechanism than CURVE, another secret's keys, a client key ZAP refuses) counts in
//    ListenerStats::auth_refusals; one the peer abandons before P could tell why counts in
//    ListenerStats::handshakes_abandoned (a libzmq NULL client may read P's CURVE greeting and
//    hang up before sending its own mechanism). Either way nothing is served to such a peer.
// Both sockets belong to the listener thread and close with the ROUTER; nothing extra to stop.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "control/cluster_auth.h"
#include "kvferry/core/hold_table.h"
#include "kvferry/core/ids.h"
#include "kvferry/core/stat_fields.h"
#include "kvferry/core/time.h"
#include "kvferry/status.h"
#include "protocol/prefill_session.h"

namespace kvferry::control {

// The data plane as the listener sees it. Implementations plan slices (core/tp_plan.h) and
// write them.
class KvWriter {
 public:
  virtual ~KvWriter() = default;

  // Writes the job's KV into D and returns when the bytes landed (kLanded) or the write failed:
  // kFailed when nothing more of it can land (its reason is listed in the pull's `err`),
  // kUnsettled when that cannot be proved (a timeout, a cancel, a dead peer: the request is
  // listed `unsettled`, so D fails it at once and quarantines its blocks). Called on sender threads, up to `num_senders`
  // at once. Must not throw. Must return soon after CancelWrites().
  virtual protocol::WriteOutcome Write(const protocol::PullContext& context,
                                       const protocol::WriteJob& job) = 0;

  // Called once from the listener thread when Stop() finds writes still running after
  // `drain_timeout`: make every blocked Write return (e.g. close the data-plane endpoints).
  // Writes that still do not return within `cancel_grace` are left unanswered, so D times out
  // and quarantines those blocks; Stop() then blocks in join until they return.
  virtual void CancelWrites() {}
};

// Engine callback for HoldEvent kFreeBlocks / kAbortPrefill, called on the listener thread.
// It must not block (renewals wait behind it), must not wait on a listener future and must not
// call Stop().
using HoldEventCallback = std::function<void(const core::HoldEvent&)>;

struct ListenerOptions {
  // Where the ROUTER binds. Port 0 picks a free port; endpoint() says which.
  std::string endpoint = "tcp://127.0.0.1:0";
  // Everything the session decides with (engine id, hold config, TP rank, KV layout, limits),
  // handed to it as is: PrefillSession::ValidateOptions checks it at Start.
  protocol::PrefillSessionOptions session;
  std::size_t num_senders = 4;  // >= 1
  // Stop(): how long in-flight writes may take to finish, then how long after CancelWrites().
  std::chrono::milliseconds drain_timeout{5000};
  std::chrono::milliseconds cancel_grace{1000};
  // How long the socket may take to flush the last replies when it closes.
  std::chrono::milliseconds linger{1000};
  // Null: an open side channel (anyone who reaches the port is served). Otherwise only D
  // peers holding the same secret can connect (CURVE + ZAP, see above); Start fails with
  // kInvalidArgument if this libzmq lacks CURVE.
  std::shared_ptr<const ClusterSecret> cluster_secret;
};

// A snapshot of the listener's counters: the session's (protocol::kPrefillStatFields), and what
// the socket did with its replies (kListenerStatFields).
struct ListenerStats : protocol::PrefillStats {
  std::uint64_t responses_sent = 0;
  std::uint64_t replies_dropped = 0;
  std::uint64_t auth_refusals = 0;
  std::uint64_t handshakes_abandoned = 0;
};

// The rows of ListenerStats's own fields (the session's are protocol::kPrefillStatFields).
inline constexpr core::StatField<ListenerStats> kListenerStatFields[] = {
    // clang-format off
    {"responses_sent", &ListenerStats::responses_sent, core::StatKind::kCounter,
     "Side-channel replies and notices sent", "kvferry_side_channel_sent_total"},
    {"replies_dropped", &ListenerStats::replies_dropped, core::StatKind::kCounter,
     "Side-channel replies dropped: the D peer gone or its queue full",
     "kvferry_side_channel_replies_dropped_total"},
    // A peer that keeps reconnecting counts once per attempt.
    {"auth_refusals", &ListenerStats::auth_refusals, core::StatKind::kCounter,
     "Side-channel handshakes refused: no CURVE, another cluster secret, or denied by ZAP "
     "(0 in an open cluster)", "kvferry_side_channel_auth_refusals_total"},
    // A libzmq NULL client that read P's CURVE greeting and hung up before sending its own did
    // so in about 1 of 3 tries on loopback.
    {"handshakes_abandoned", &ListenerStats::handshakes_abandoned, core::StatKind::kCounter,
     "Side-channel connections that ended mid-handshake before P could tell why: a port "
     "probe, or a peer without CURVE that hung up first (0 in an open cluster)",
     "kvferry_side_channel_handshakes_abandoned_total"},
    // clang-format on
};
static_assert(sizeof(ListenerStats) == sizeof(protocol::PrefillStats) +
                                           std::size(kListenerStatFields) * sizeof(std::uint64_t),
              "every field ListenerStats adds has one row in kListenerStatFields");

class PrefillListener {
 public:
  // Binds the ROUTER and starts the listener and sender threads. `writer` must be non-null.
  // Errors: kInvalidArgument (bad options), kUnavailable (cannot bind).
  [[nodiscard]] static Result<std::unique_ptr<PrefillListener>> Start(
      ListenerOptions options, std::shared_ptr<KvWriter> writer, HoldEventCallback on_hold_event);

  // Stops (see Stop) and joins.
  ~PrefillListener();
  PrefillListener(const PrefillListener&) = delete;
  PrefillListener& operator=(const PrefillListener&) = delete;

  // The bound endpoint, e.g. "tcp://127.0.0.1:41231" (what bootstrap advertises).
  const std::string& endpoint() const;

  // Engine calls, thread-safe: HoldTable::Admit / PrefillDone / EngineFinished, run on the
  // listener thread in call order. The future holds the HoldTable's Status (kCancelled once
  // Stop() began). Never block on it from `on_hold_event`.
  [[nodiscard]] std::future<Status> Admit(const core::TransferId& id, std::uint64_t handle);
  // `blocks`: the transfer's KV on this rank (PrefillSession::PrefillDone).
  [[nodiscard]] std::future<Status> PrefillDone(const core::TransferId& id,
                                                std::vector<core::BlockId> blocks);
  // Planes `planes` of the transfer's KV are final in `blocks` before its prefill ended
  // (PrefillSession::LayersReady): pulls already waiting get them written now.
  [[nodiscard]] std::future<Status> LayersReady(const core::TransferId& id,
                                                std::vector<core::BlockId> blocks,
                                                std::vector<std::uint32_t> planes);
  [[nodiscard]] std::future<Status> EngineFinished(const core::TransferId& id);
  // The engine refused the request without admitting it: core::HoldTable::Refuse (D's pull
  // of it fails at once with `why`).
  [[nodiscard]] std::future<Status> Refuse(const core::TransferId& id, Status why);

  // Counters as of after every message and command already received. Waits up to `wait` for
  // the listener; after that (or once stopped) returns the last published snapshot.
  ListenerStats Stats(std::chrono::milliseconds wait = std::chrono::milliseconds(1000));

  // Stops reading the socket; fails parked pulls and queued writes with kCancelled (answered
  // to D: PrefillSession::Shutdown); waits up to drain_timeout (+ cancel_grace after
  // KvWriter::CancelWrites) for running writes and answers them; flushes replies (linger) and joins
  // every thread. Idempotent. Returns kTimeout if some write never returned in time (those pulls
  // are left unanswered: D's timeout quarantines their blocks).
  Status Stop();

 private:
  class Impl;
  explicit PrefillListener(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvferry::control
