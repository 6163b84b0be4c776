// ServingEngine: the synthetic model behind `kvferry serve` (SPEC §6). One per process; its TP
// ranks are threads of that process, each a runtime::PrefillWorker (P) or runtime::DecodeWorker (D)
// with its own UCX engine and KV region, all driven by one continuous-batching scheduler.
//
// The model: a request's cost is --prefill-us-per-token · prompt tokens (+ a per-batch cost) to
// prefill and --decode-us-per-step per step to decode; one step runs every running request's
// next decode token plus prefill chunks up to --max-batch-tokens. Its KV lives in a fixed-size
// block pool (BlockPool) and its bytes are kv_pattern.h's function of the transfer id, so D
// verifies every block it receives.
//
// Requests by kind:
//   local           (no kv_transfer_params; the probe): admitted when prompt+max_tokens blocks
//                   are free, prefilled, decoded on this instance, blocks freed.
//   remote decode   (P, do_remote_decode): Admit'ed with every rank's hold table at arrival,
//                   prefilled into prompt blocks, answered with its one token; PrefillDone then
//                   hands the blocks to the hold tables, and they return to the pool when every
//                   rank said kFreeBlocks. kAbortPrefill (dead decoder) fails the request.
//   remote prefill  (D, do_remote_prefill): OnNewRequest at arrival (renewals start while it
//                   queues); admitted when prompt+max_tokens blocks are free; StartLoad on every
//                   rank; once every rank reported the receive, verified and decoded. A failed
//                   receive fails the request (kv_load_failure_policy "fail"); its blocks go back
//                   only when every rank's ledger allows (quarantine).
//
// Threads: the engine thread owns the scheduler state and the pool. HTTP threads call Submit and
// Abort; listener threads deliver hold events and one collector thread per D rank delivers
// receive results, all through the engine's inbox. Every wait has a deadline.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "control/bootstrap_types.h"
#include "control/cluster_auth.h"
#include "harness/fault_writer.h"
#include "harness/kv_pattern.h"
#include "harness/serve_config.h"
#include "kvferry/core/hold_table.h"
#include "kvferry/status.h"
#include "runtime/prefill_worker.h"

namespace kvferry::harness {

class TraceFile;

struct EngineCosts {
  std::uint32_t prefill_us_per_token = 2;
  std::uint32_t prefill_us_per_batch = 1000;
  std::uint32_t decode_us_per_step = 2000;
  std::uint32_t max_batch_tokens = 8192;
  std::uint32_t max_running = 256;
};

struct EngineOptions {
  Role role = Role::kPrefill;
  std::string engine_id;
  KvGeometry geometry;  // geometry.tp is the instance's TP size
  std::uint32_t num_blocks = 4096;
  EngineCosts costs;
  std::uint32_t max_waiting = 4096;  // queued requests beyond this get 503
  // P: the hold (lease, abort_request_timeout) and where every rank registers.
  core::HoldConfig hold;
  std::string bootstrap_address;  // "host:port"
  // P: the address every rank's side channel binds (D must reach it: the HTTP host).
  std::string side_channel_host = "127.0.0.1";
  std::string incarnation;
  // Faults (SPEC §8 C): err_after_write_fraction applies to err_ranks, max_write_delay to
  // delay_ranks (other ranks write without faults).
  WriteFaults faults;
  std::vector<std::uint32_t> fault_err_ranks;
  std::vector<std::uint32_t> fault_delay_ranks;
  std::size_t num_senders = 4;
  // D: the lease it renews and how long a pull may take before its blocks are quarantined
  // (must exceed hold.abort_request_timeout + write_bound: runtime::DecodeWorkerOptions).
  core::Duration lease{0};
  std::chrono::milliseconds pull_timeout{600000};
  std::chrono::milliseconds write_bound{70000};  // runtime::DecodeWorkerOptions::write_bound
  bool send_releases = true;                     // runtime::DecodeWorkerOptions::send_releases
  bool fence_writes = false;  // D: its data plane fences writers (transport::UcxOptions)
  // Optional JSON-lines trace (block alloc/free on both roles, WRITE start/end on P).
  std::shared_ptr<TraceFile> trace;
  // UCX: how ranks name their workers in UCX logs.
  std::string ucx_name = "kvferry-serve";
  // Cluster authentication (docs/security.md), null for an open cluster: P's listeners and
  // registrations, D's side channels and lookups use it.
  std::shared_ptr<const control::ClusterSecret> cluster_secret;
  // P: the registrations its embedded bootstrap service refused for authentication, for
  // /metrics (kvferry_bootstrap_auth_refusals_total); empty when it embeds none.
  std::function<std::uint64_t()> bootstrap_auth_refusals;
  // D: look P engines up here instead of in each P's bootstrap (the etcd registry); empty: the
  // bootstrap named by each request.
  std::function<Result<control::EngineInfo>(const std::string& engine_id)> registry_lookup;
};

enum class RequestKind : std::uint8_t { kLocal, kRemoteDecode, kRemotePrefill };

struct CompletionSpec {
  RequestKind kind = RequestKind::kLocal;
  std::uint32_t prompt_tokens = 0;
  std::uint32_t max_tokens = 1;
  std::string transfer_id;            // remote kinds
  std::string remote_engine_id;       // remote prefill
  std::string remote_bootstrap_addr;  // remote prefill
};

struct StreamEvent {
  enum class Kind : std::uint8_t { kToken, kFinished, kError };
  Kind kind = Kind::kToken;
  std::uint32_t token = 0;    // kToken
  int http_status = 0;        // kError: 500 / 503
  std::string message;        // kError: the reason
  std::string finish_reason;  // kToken: set on the last token ("length"); kFinished: the same
};

// The engine → one HTTP handler: the request's tokens (the last one carries finish_reason), then
// exactly one kFinished or kError.
class RequestStream {
 public:
  explicit RequestStream(std::uint64_t handle) : handle_(handle) {}
  std::uint64_t handle() const { return handle_; }

  // ServingEngine side. Events after the terminal one are dropped.
  void Push(StreamEvent event);
  // Handler side: every event available by `deadline` (empty if none came).
  std::vector<StreamEvent> Wait(std::chrono::steady_clock::time_point deadline);

 private:
  const std::uint64_t handle_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<StreamEvent> events_;
  bool closed_ = false;
};

class ServingEngine {
 public:
  // Starts every rank (UCX engine, KV region, worker) and the engine thread. P ranks register
  // with the bootstrap service at options.bootstrap_address, which must already serve.
  [[nodiscard]] static Result<std::unique_ptr<ServingEngine>> Start(EngineOptions options);
  // Shutdown()s.
  ~ServingEngine();
  ServingEngine(const ServingEngine&) = delete;
  ServingEngine& operator=(const ServingEngine&) = delete;

  // Queues a request. Errors: kInvalidArgument (does not fit this instance, wrong kind for the
  // role), kAlreadyExists (the transfer is already held here), kTombstoned (P freed that transfer
  // earlier: nobody will pull it), kResourceExhausted (queue full), kUnavailable (shutting down).
  // A remote-prefill request D can never serve as sent (kInvalidArgument) is released to its P
  // at once (P neither prefills nor holds it).
  [[nodiscard]] Result<std::shared_ptr<RequestStream>> Submit(const CompletionSpec& spec);
  // A remote request this instance refused and will never serve as sent (Submit calls it for
  // its own refusals; the HTTP front for bodies it refused after reading their transfer). Its
  // transfer is settled with the other half: P refuses it on every rank (D's pulls fail at
  // once, tombstoned); D releases it to P (P frees its KV now) when the refusal is for good
  // (kInvalidArgument) — not for a full queue or a shutdown, which a router may retry
  // elsewhere with the same transfer.
  void Refused(const CompletionSpec& spec, const Status& why);
  // The client went away: finish the request early (its blocks follow the normal rules).
  void Abort(std::uint64_t handle);
  // D: a liveness source says P engine `engine_id` is gone (runtime::DecodeWorker::EngineDown on
  // every rank). No-op on P.
  void EngineDown(const std::string& engine_id, const Status& why);
  // D: one process (`incarnation`) of P engine `engine_id` is gone and another replaced it
  // (runtime::DecodeWorker::ProcessGone on every rank). No-op on P.
  void ProcessGone(const std::string& engine_id, const std::string& incarnation,
                   const Status& why);
  // P: what its ranks register (bootstrap and etcd); empty on D.
  [[nodiscard]] std::vector<control::WorkerRegistration> Registrations() const;

  // Prometheus text for /metrics.
  std::string RenderMetrics();

  // Fails every request still open with 503, stops the engine thread, then the ranks (P drains
  // in-flight writes before its memory goes). Idempotent.
  void Shutdown();

  const EngineOptions& options() const { return options_; }

 private:
  struct Impl;
  explicit ServingEngine(EngineOptions options);
  Result<std::shared_ptr<RequestStream>> Enqueue(const CompletionSpec& spec);
  EngineOptions options_;
  std::unique_ptr<Impl> impl_;
};

// Blocks a request of `tokens` tokens occupies.
inline std::uint32_t BlocksFor(std::uint64_t tokens, std::uint32_t block_tokens) {
  return static_cast<std::uint32_t>((tokens + block_tokens - 1) / block_tokens);
}

}  // namespace kvferry::harness
