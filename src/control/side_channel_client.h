// A blocking client of P's side channel: a DecodeChannel per P worker (a ZeroMQ DEALER), one
// request at a time. D's runtime does not use it (DecodeWorker multiplexes every pull and
// renewal of a P worker on one socket, driven by protocol::DecodeSession); it serves tools
// (`kvferry bench sidechannel`) and the listener's tests, which talk to P the way any D does,
// so it is a library of its own (kvferry_sidechannel_client) that no runtime links.
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
#include <vector>

#include "control/cluster_auth.h"
#include "kvferry/core/ids.h"
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
  // Null: connect without authentication (an open P). Otherwise the DEALER is a CURVE client
  // with the cluster's keys (cluster_auth.h); a P with another secret, or none, never completes
  // the handshake, so every call ends in kTimeout.
  std::shared_ptr<const ClusterSecret> cluster_secret;
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

}  // namespace kvferry::control
