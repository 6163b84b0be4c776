// PrefillListener: one P worker's side channel (SPEC §1, §2.4, §3.5, §4). A ZeroMQ ROUTER that
// answers D's renewals and serves D's pulls, driving the worker's core::HoldTable.
//
// Threads and ownership (one owner per resource):
//  - The listener thread owns the ROUTER socket, the HoldTable, the parked pulls and the
//    descriptor cache. It reads every message, answers renewals itself at once (so renewals are
//    never stuck behind writes or unfinished prefills), admits pulls and runs the expiry pass at
//    HoldTable::NextDeadline().
//  - `num_senders` sender threads call KvWriter::Write and report the result back to the
//    listener through its command queue (the listener does BeginSend/EndSend).
//  - Engine threads call Admit / PrefillDone / EngineFinished; these are queued commands the
//    listener drains (woken through an eventfd). Each returns a future with the HoldTable's
//    Status, so a refusal (e.g. kTombstoned: nobody will pull this KV) reaches the engine.
//  - Hold events kFreeBlocks / kAbortPrefill reach the engine through `on_hold_event`, called on
//    the listener thread.
//
// Wire framing (docs/protocol.md §1): a message arrives as [identity][payload] and each reply
// goes out as [identity][payload] with the request's wire `id` copied into it, which is how D
// matches replies to requests. Any other frame count is answered with ERROR and not served.
//
// Replies: a Renewal gets one RenewalReply (kAccepted with counts, kRejected when P has no
// lease, kError when it does not decode); p_lease_ms is always filled. A Pull gets one
// PullResponse per readiness wave — CONTINUE, with FINISH on the last one, which may carry that
// wave's ok/err lists too — and every request of the pull is listed exactly once in some ok or
// err; or one ERROR when the whole message is unusable (undecodable, unsupported version, wrong
// type, wrong frame count, D rank not paired with this P rank, unknown region descriptor,
// duplicate d_req_id).
// Malformed input changes nothing in the HoldTable.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "kvferry/core/hold_table.h"
#include "kvferry/core/ids.h"
#include "kvferry/core/time.h"
#include "kvferry/status.h"

namespace kvferry::control {

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
};

// One request of a pull, ready to be written: the transfer's KV goes into `dst_block_ids`.
struct WriteJob {
  core::TransferId transfer_id;
  std::uint64_t handle = 0;  // the engine's cookie given to Admit (finds the source blocks)
  core::RequestId d_req_id;
  std::vector<core::BlockId> dst_block_ids;
};

// The data plane as the listener sees it. Implementations plan slices (core/tp_plan.h) and
// write them.
class KvWriter {
 public:
  virtual ~KvWriter() = default;

  // Writes the job's KV into D and returns when the bytes landed (OK) or the write failed; the
  // error is listed in the pull's `err`. Called on sender threads, up to `num_senders` at once.
  // Must not throw. Must return soon after CancelWrites().
  virtual Status Write(const PullContext& context, const WriteJob& job) = 0;

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
  core::HoldConfig hold;
  std::uint32_t p_tp_size = 1;
  std::uint32_t p_tp_rank = 0;
  std::size_t num_senders = 4;  // >= 1
  // Stop(): how long in-flight writes may take to finish, then how long after CancelWrites().
  std::chrono::milliseconds drain_timeout{5000};
  std::chrono::milliseconds cancel_grace{1000};
  // How long the socket may take to flush the last replies when it closes.
  std::chrono::milliseconds linger{1000};
  // Region descriptors remembered per (d_engine_id, d_tp_rank); beyond this, one is evicted.
  std::size_t max_cached_descriptors = 4096;
};

// A snapshot of the listener's counters (Prometheus style: monotonic totals, plus gauges).
struct ListenerStats {
  std::uint64_t messages_received = 0;
  std::uint64_t messages_malformed = 0;  // answered with ERROR / RenewalReply kError
  std::uint64_t renewals_accepted = 0;   // messages, not fingerprints (see hold for those)
  std::uint64_t renewals_rejected = 0;   // messages answered kRejected (no lease on P)
  std::uint64_t pulls_received = 0;      // Pull messages admitted (not ERROR)
  std::uint64_t pull_errors = 0;         // Pull messages answered with ERROR
  std::uint64_t requests_ok = 0;
  std::uint64_t requests_err = 0;
  std::uint64_t late_pulls_rejected = 0;  // requests failed kTombstoned
  std::uint64_t lease_mismatches = 0;     // requests failed kLeaseMismatch
  std::uint64_t writes_started = 0;
  std::uint64_t writes_failed = 0;
  std::uint64_t responses_sent = 0;         // PullResponse + RenewalReply messages
  std::uint64_t replies_dropped = 0;        // peer gone or its queue full (ROUTER_MANDATORY)
  std::uint64_t hold_events_delivered = 0;  // kFreeBlocks + kAbortPrefill
  // Gauges.
  std::uint64_t pulls_in_progress = 0;
  std::uint64_t requests_parked = 0;   // waiting for a prefill
  std::uint64_t writes_in_flight = 0;  // queued or running on a sender
  // The HoldTable's own view.
  core::HoldStats hold;
  std::size_t hold_entries = 0;
};

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
  [[nodiscard]] std::future<Status> PrefillDone(const core::TransferId& id,
                                                std::uint32_t num_blocks);
  [[nodiscard]] std::future<Status> EngineFinished(const core::TransferId& id);

  // Counters as of after every message and command already received. Waits up to `wait` for
  // the listener; after that (or once stopped) returns the last published snapshot.
  ListenerStats Stats(std::chrono::milliseconds wait = std::chrono::milliseconds(1000));

  // Stops reading the socket; fails parked pulls and queued writes with kCancelled (answered
  // to D); waits up to drain_timeout (+ cancel_grace after KvWriter::CancelWrites) for running
  // writes and answers them; flushes replies (linger) and joins every thread. Idempotent.
  // Returns kTimeout if some write never returned in time (those pulls are left unanswered:
  // D's timeout quarantines their blocks).
  Status Stop();

 private:
  class Impl;
  explicit PrefillListener(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvferry::control
