// DecodeWorker: one D rank in a real process — a thin pump around protocol::DecodeSession,
// which decides everything (pulls, their deadlines and quarantine, renewal passes, lookups,
// incarnations, fences; see protocol/decode_session.h for the rules). The worker owns the KV
// region registered with the data plane and the threads around the session:
//  - one I/O thread owns a ZeroMQ DEALER per P worker the session talks to. It sends what the
//    session says (never blocking), feeds it every reply and wakes it at its NextDeadline. Many
//    pulls share one socket (wire ids), so a dead P delays nothing else. ZeroMQ takes a message
//    only while a connection to P is up (ZMQ_IMMEDIATE); until then it waits here, at most 3 s,
//    then is reported unsent: a pull that never left is a plain failure, and lifts the
//    quarantine of a pull given up on meanwhile;
//  - `lookup_threads` threads run the bootstrap lookups the session asks for (with a cluster
//    secret, a lookup believes only answers signed with it);
//  - engine calls run the session directly (under its mutex) and wake the I/O thread.
// Fences: with a data plane that fences its writers (transport::Engine::fences_writes, e.g.
// UcxOptions::fence_writes), every pull carries a write key and a fence revokes the keys of the
// pulls it covers on a fencer thread of its own (a revocation waits up to 5 s for writes already
// landing); once it holds, the session releases their quarantined blocks — a dead, partitioned
// or silent P can no longer write into them, over any connection, whatever etcd says. Without
// one (one-sided puts over shared memory or RDMA cannot be refused), every fence is answered
// "not supported" and quarantined blocks wait for the P worker's late answer, which a live P
// sends within abort_request_timeout + its write bound (hence the pull_timeout rule); they stay
// quarantined if P dies first: docs/operations.md, known limits.
//
// Engine-facing calls (thread-safe), after vLLM's KV connector contract:
//   OnNewRequest     a request with remote prefill arrived (it may wait for blocks): renew it
//   StartLoad        its blocks are allocated: pull its KV from every paired P rank
//   RequestFinished  it finished or was aborted: stop renewing; unless its receive succeeded,
//                    release it to P (P frees its KV now instead of at the lease's end)
//   TakeFinished     receives that completed (ok, or failed with invalid blocks), blocks that
//                    left quarantine, and requests P aborted before their load
//
// The engine must not reuse a request's blocks before TakeFinished reports its receive, and for
// a quarantined receive not before the matching release: a P peer may still be writing.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "control/bootstrap_types.h"
#include "control/cluster_auth.h"
#include "control/warning_sink.h"
#include "kvferry/core/ids.h"
#include "kvferry/core/time.h"
#include "kvferry/status.h"
#include "kvferry/transport/transport.h"
#include "protocol/decode_session.h"
#include "runtime/kv_memory.h"

namespace kvferry::runtime {

struct DecodeWorkerOptions {
  std::string engine_id = "decode-0";
  std::uint32_t tp_size = 1;
  std::uint32_t tp_rank = 0;
  std::uint64_t block_len = 0;  // bytes per block on this rank, in each plane
  std::uint32_t num_blocks = 0;
  // The engine's own KV memory (runtime/kv_memory.h): one plane per tensor, each at least
  // num_blocks × block_len bytes, valid until the worker is destroyed (a P peer whose pull is
  // quarantined may write until then). Empty: the worker allocates one plane.
  std::vector<KvPlane> planes;
  // protocol::DecodeSessionOptions::head_slices: false for a layout that does not keep a KV
  // head's bytes together within a block.
  bool head_slices = true;
  core::Duration lease{0};  // kv_lease_duration; 0 = off (no renewals)
  // abort_request_timeout (the same kv_transfer_config key P reads) and how long a P write may
  // take until P fences it: P answers every pull within their sum, so pull_timeout must exceed
  // it (Start refuses otherwise). A pull that gets no answer by then settles as a timeout and
  // its blocks stay quarantined until the late answer comes.
  std::chrono::milliseconds abort_request_timeout{480000};
  // P's write: connect (<= write_timeout, 30 s) + the batch (<= 30 s) + closing the peer (1 s)
  // + waiting for the fence (5 s) = 66 s, rounded up. Time a write waits for a free sender on P
  // comes on top (P's senders are few and writes are short: not bounded here).
  std::chrono::milliseconds write_bound{70000};
  std::chrono::milliseconds pull_timeout{600000};
  std::chrono::milliseconds bootstrap_timeout{5000};
  // Lookups run concurrently, at most one per engine (the session's rule): a bootstrap that
  // never answers holds one thread for bootstrap_timeout. More silent bootstraps at once than
  // this make other engines' lookups wait in line, and one that waits past the session's
  // lookup deadline (bootstrap_timeout + 1 s from when it was asked) fails: measured, 64 loads
  // naming silent bootstraps failed a good engine's lookup. Bootstrap addresses come from
  // kv_transfer_params: with clients that are not trusted, see docs/vllm.md.
  std::size_t lookup_threads = 16;
  // Release transfers to P as soon as they are not needed (protocol::DecodeSessionOptions).
  bool send_releases = true;
  // Cluster authentication (docs/security.md): null for an open cluster. Otherwise every
  // DEALER is a CURVE client with the cluster's keys and every bootstrap answer must be signed
  // with this secret (control::BootstrapClient); Start fails if libzmq lacks CURVE.
  std::shared_ptr<const control::ClusterSecret> cluster_secret;
  // Where engines are looked up instead of each P's bootstrap (the etcd registry,
  // control::EtcdWatcher::Lookup); empty: the bootstrap named by each request.
  std::function<Result<control::EngineInfo>(const std::string& engine_id)> registry_lookup;
};

// One remote-prefill request as the router describes it (vLLM's kv_transfer_params).
using RemoteSource = protocol::RemoteSource;

struct ReceiveResult {
  core::RequestId request;
  bool ok = false;
  Status error;                        // first failure
  std::vector<core::BlockId> invalid;  // failed: blocks whose contents are not valid
  bool quarantined = false;            // blocks not reusable until a later release
};

struct DecodeFinished {
  std::vector<ReceiveResult> received;
  // Requests whose quarantined blocks may be reused now (blocks listed).
  std::vector<std::pair<core::RequestId, std::vector<core::BlockId>>> released;
  // Requests not yet loading whose transfer P dropped (protocol::TransferAborted): fail them.
  std::vector<std::pair<core::RequestId, Status>> aborted;

  bool empty() const { return received.empty() && released.empty() && aborted.empty(); }
};

// The session's counters (protocol/decode_session.h).
using DecodeWorkerStats = protocol::DecodeStats;

class DecodeWorker {
 public:
  using WarningSink = control::WarningSink;

  // Errors: kInvalidArgument for options DecodeSession refuses (e.g. a pull_timeout that does
  // not exceed abort_request_timeout + write_bound), the transport's errors for the region.
  [[nodiscard]] static Result<std::unique_ptr<DecodeWorker>> Start(
      DecodeWorkerOptions options, std::shared_ptr<transport::Engine> engine,
      WarningSink warn = {});
  // Stop()s.
  ~DecodeWorker();
  DecodeWorker(const DecodeWorker&) = delete;
  DecodeWorker& operator=(const DecodeWorker&) = delete;

  // Block b of plane i lives at kv(i) + b × block_len.
  std::byte* kv(std::size_t plane = 0) const;
  std::size_t num_planes() const;
  const DecodeWorkerOptions& options() const;

  void OnNewRequest(const core::RequestId& request, const RemoteSource& source);
  // Pulls the request's KV into `blocks` (in order). Returns at once; the outcome comes from
  // TakeFinished, exactly once. An empty `blocks` is a notify-only pull: nothing to wait for.
  // kAlreadyExists if the request is still loading, kOutOfRange for a block outside the region
  // (nothing is started then).
  [[nodiscard]] Status StartLoad(const core::RequestId& request, const RemoteSource& source,
                                 std::vector<core::BlockId> blocks);
  void RequestFinished(const core::RequestId& request);
  // The engine refused a remote-prefill request it never announced: release it to P now.
  void ReleaseTransfer(const RemoteSource& source);
  // A liveness source (the etcd registry) says the engine's processes are gone:
  // protocol::DecodeSession::OnEngineDown (waiting loads fail at once with `why`; endpoints
  // with pulls in flight are fenced; their blocks wait for the fence or a late answer).
  void EngineDown(const core::EngineId& engine, const Status& why);
  // The liveness source says one process of the engine is gone and another took its place
  // (protocol::DecodeSession::OnProcessGone: its pulls fail and are fenced, loads go on).
  void ProcessGone(const core::EngineId& engine, const std::string& incarnation, const Status& why);
  DecodeFinished TakeFinished();
  // Waits until TakeFinished has something or `deadline` passes.
  DecodeFinished WaitFinished(core::TimePoint deadline);

  DecodeWorkerStats Stats() const;

  // Releases every transfer it still tracks to P (best effort: handed to the side channels,
  // which get up to kStopLinger to deliver them), stops the threads (a lookup in flight ends
  // within bootstrap_timeout), then deregisters the region. When it returns nothing of the
  // worker runs and its memory is no longer registered; a WaitFinished on another thread
  // returns (empty). Idempotent and safe from several threads; calls after it change nothing.
  void Stop();

 private:
  class Impl;
  explicit DecodeWorker(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvferry::runtime
