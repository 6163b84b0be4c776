// D's side of the side channel (SPEC §2.2–2.4, §3): a DecodeChannel per P worker (a ZeroMQ
// DEALER), helpers that settle a core::ReceiveLedger from pull responses, and the RenewalPump
// that sends a core::RenewalScheduler's batches.
//
// Framing (docs/protocol.md §1): one frame per message. Each Pull and Renewal gets a fresh
// non-zero wire `id` (a counter private to the channel) that P copies into its replies; a reply
// with another non-zero id answers a request that timed out earlier and is discarded (counted).
// A reply with id 0 (P could not read ours) is taken as the answer to the one request
// outstanding, since a channel's calls are serialized.
//
// Every call takes a deadline and returns by it: a missing reply is kTimeout, never a hang.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kvferry/core/ids.h"
#include "kvferry/core/receive_ledger.h"
#include "kvferry/core/renewal_scheduler.h"
#include "kvferry/core/time.h"
#include "kvferry/status.h"
#include "wire/messages.h"

namespace kvferry::control {

// A ZeroMQ context (its I/O thread) shared by the channels of one process. Thread-safe.
class SideChannelContext {
 public:
  explicit SideChannelContext(int io_threads = 1);
  ~SideChannelContext();
  SideChannelContext(const SideChannelContext&) = delete;
  SideChannelContext& operator=(const SideChannelContext&) = delete;

  void* raw();  // the zmq::context_t, for the .cc files

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct ChannelOptions {
  // On close, how long queued requests may still go out. Requests are only ever queued while
  // a call waits for their reply, so this matters when a channel is closed right after a call
  // timed out; it never delays a call.
  std::chrono::milliseconds linger{500};
  int send_hwm = 1000;
  int receive_hwm = 1000;
};

struct ChannelStats {
  std::uint64_t requests = 0;
  std::uint64_t replies = 0;
  std::uint64_t stale_replies = 0;  // answers to requests that had timed out, discarded
  std::uint64_t timeouts = 0;
  std::uint64_t bad_replies = 0;  // undecodable or of the wrong type
};

// One DEALER connected to one P worker's side channel. Calls are serialized: a call from a
// second thread waits until the first returns. For renewals that must not wait behind a long
// pull, use another channel (RenewalPump owns its own).
class DecodeChannel {
 public:
  // Connects (asynchronously: ZeroMQ queues requests until the connection is up).
  // Errors: kInvalidArgument for a bad endpoint.
  [[nodiscard]] static Result<std::unique_ptr<DecodeChannel>> Connect(
      std::shared_ptr<SideChannelContext> context, std::string endpoint,
      ChannelOptions options = {});
  ~DecodeChannel();
  DecodeChannel(const DecodeChannel&) = delete;
  DecodeChannel& operator=(const DecodeChannel&) = delete;

  const std::string& endpoint() const { return endpoint_; }

  // Sends a Renewal and waits for its RenewalReply until `deadline`. A P that predates leases
  // answers a Renewal with PullResponse ERROR; that is returned as a RenewalReply with status
  // kRejected (and the ERROR's reason in `message`), since it means the same: no lease there.
  // Errors: kTimeout, kInvalidArgument (the renewal fails wire::Validate), kProtocol (an
  // undecodable reply).
  [[nodiscard]] Result<wire::RenewalReply> Renew(const wire::Renewal& renewal,
                                                 core::TimePoint deadline);

  // Sends a Pull and calls `on_response` (on this thread) for every PullResponse until FINISH
  // or ERROR (both delivered too), or until `deadline`. OK once FINISH or ERROR was delivered;
  // kTimeout at the deadline (the caller settles the pull's pending entries kTimeout);
  // kProtocol for an undecodable reply (treat like a timeout: the peer's state is unknown);
  // kInvalidArgument when the pull fails wire::Validate (nothing sent).
  using ResponseCallback = std::function<void(const wire::PullResponse&)>;
  [[nodiscard]] Status Pull(const wire::Pull& pull, core::TimePoint deadline,
                            const ResponseCallback& on_response);

  // Sends raw payload bytes and returns the next reply's payload, whatever its id (probes and
  // tests).
  [[nodiscard]] Result<std::vector<std::uint8_t>> RoundTrip(std::span<const std::uint8_t> payload,
                                                            core::TimePoint deadline);

  ChannelStats stats() const;

 private:
  class Impl;
  DecodeChannel(std::string endpoint, std::unique_ptr<Impl> impl);
  std::string endpoint_;
  std::unique_ptr<Impl> impl_;
};

// ---- Settling a ReceiveLedger from one pull's responses (SPEC §3.1) ----

// Applies one response of the pull whose requests are `pull_requests` to the entries of
// `peer`: protocol::ApplyPullResponse (protocol/pull_reply.h), which settles only the ids the
// pull asked for.
void ApplyPullResponse(core::ReceiveLedger& ledger, core::PeerId peer,
                       std::span<const core::RequestId> pull_requests,
                       const wire::PullResponse& response);

// The pull ended without FINISH/ERROR (timeout, broken channel): every still-pending request
// of it settles kTimeout (its blocks are quarantined until the peer is known quiet).
void ApplyPullFailure(core::ReceiveLedger& ledger, core::PeerId peer,
                      std::span<const core::RequestId> pull_requests, const Status& reason);

// Pull + the two above: sends `pull` on `channel` and settles `ledger` from what comes back
// (the requests must have been begun in the ledger with `peer`). Returns the channel's status.
Status PullIntoLedger(DecodeChannel& channel, const wire::Pull& pull, core::TimePoint deadline,
                      core::ReceiveLedger& ledger, core::PeerId peer);

// ---- Renewal pump (SPEC §2.2–2.3) ----

// The side-channel endpoints of every P worker D would pull from for `engine` (the same
// address selection as the pull; after a bootstrap query if needed).
using EndpointResolver =
    std::function<Result<std::vector<std::string>>(const core::EngineId& engine)>;
// Where the pump's warnings go (default: spdlog::warn). Tests count them.
using WarningSink = std::function<void(std::string_view message)>;

struct RenewalPumpOptions {
  core::EngineId d_engine_id;
  core::Duration lease{0};  // D's kv_lease_duration, sent with every renewal
  // Each renewal waits this long for its reply.
  std::chrono::milliseconds reply_timeout{1000};
  ChannelOptions channel;
};

struct PumpReport {
  std::uint64_t sent = 0;      // renewal messages
  std::uint64_t accepted = 0;  // replies kAccepted
  std::uint64_t rejected = 0;  // replies kRejected (or an old P's ERROR)
  std::uint64_t failed = 0;    // timeouts, unreachable, kError replies, resolver failures
  std::uint64_t extended = 0;
  std::uint64_t unknown = 0;
};

// Sends renewal batches to every P worker of their engine and acts on the replies. Owns one
// DecodeChannel per endpoint (so renewals never queue behind a pull on D's pull channels).
// Not thread-safe: one owner, the thread that owns the RenewalScheduler.
class RenewalPump {
 public:
  RenewalPump(std::shared_ptr<SideChannelContext> context, RenewalPumpOptions options,
              EndpointResolver resolver, WarningSink warn = {});
  ~RenewalPump();

  // Sends each batch to each endpoint of its engine and waits for each reply. A rejection
  // (P has no lease) calls scheduler.NoteRejected and warns once per P engine; the engine's
  // remaining endpoints are skipped. A failure (timeout, unreachable P) warns once per endpoint
  // until that endpoint answers again.
  PumpReport Send(std::span<const core::RenewalBatch> batches, core::RenewalScheduler& scheduler);

  // Drops the channel of an endpoint (e.g. its P worker restarted).
  void Forget(const std::string& endpoint);

 private:
  Result<DecodeChannel*> ChannelFor(const std::string& endpoint);
  void Warn(const std::string& message);

  std::shared_ptr<SideChannelContext> context_;
  RenewalPumpOptions options_;
  EndpointResolver resolver_;
  WarningSink warn_;
  std::unordered_map<std::string, std::unique_ptr<DecodeChannel>> channels_;
  std::unordered_set<std::string> failing_endpoints_;         // warned, not answered since
  std::unordered_set<core::EngineId> lease_mismatch_warned_;  // warned about p_lease_ms
};

}  // namespace kvferry::control
