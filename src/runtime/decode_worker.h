// DecodeWorker: one D rank in a real process. It bundles what a serving engine embeds on the
// decode side: a KV region registered with the data plane, the renewal of leases for every
// request D has seen (a thread of its own), the pulls to every paired P rank (a pool of puller
// threads), and the receive ledger that decides when a request's blocks may be reused.
//
// Engine-facing calls (thread-safe), after vLLM's KV connector contract:
//   OnNewRequest     a request with remote prefill arrived (it may wait for blocks): renew it
//   StartLoad        its blocks are allocated: pull its KV from every paired P rank
//   RequestFinished  it finished or was aborted: stop renewing
//   TakeFinished     receives that completed (ok, or failed with invalid blocks) and blocks
//                    that left quarantine
//
// The engine must not reuse a request's blocks before TakeFinished reports its receive, and for
// a quarantined receive not before the matching release: a P peer may still be writing.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "control/bootstrap_client.h"
#include "control/side_channel_client.h"
#include "kvferry/core/receive_ledger.h"
#include "kvferry/core/renewal_scheduler.h"
#include "kvferry/status.h"
#include "kvferry/transport/transport.h"

namespace kvferry::runtime {

struct DecodeWorkerOptions {
  std::string engine_id = "decode-0";
  std::uint32_t tp_size = 1;
  std::uint32_t tp_rank = 0;
  std::uint64_t block_len = 0;  // bytes per block on this rank
  std::uint32_t num_blocks = 0;
  core::Duration lease{0};  // kv_lease_duration; 0 = off (no renewals)
  // A pull that gets no FINISH/ERROR by then settles as a timeout (blocks quarantined).
  std::chrono::milliseconds pull_timeout{600000};
  std::chrono::milliseconds bootstrap_timeout{5000};
  std::size_t num_pullers = 8;
};

// One remote-prefill request as the router describes it (vLLM's kv_transfer_params).
struct RemoteSource {
  core::TransferId transfer_id;
  core::EngineId engine_id;       // remote_engine_id
  std::string bootstrap_address;  // remote_bootstrap_addr
};

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
};

struct DecodeWorkerStats {
  std::uint64_t pulls_sent = 0;
  std::uint64_t pull_timeouts = 0;
  std::uint64_t receives_ok = 0;
  std::uint64_t receives_failed = 0;
  std::uint64_t renewal_messages = 0;
  std::uint64_t renewals_accepted = 0;
  std::uint64_t renewals_rejected = 0;
  std::uint64_t renewal_failures = 0;
  std::uint64_t quarantined_blocks = 0;
  std::uint64_t tracked = 0;
};

class DecodeWorker {
 public:
  using WarningSink = control::WarningSink;

  [[nodiscard]] static Result<std::unique_ptr<DecodeWorker>> Start(
      DecodeWorkerOptions options, std::shared_ptr<transport::Engine> engine,
      WarningSink warn = {});
  // Stops the threads; pulls in flight end at their deadline at the latest.
  ~DecodeWorker();

  std::byte* kv() const { return region_.base; }
  const DecodeWorkerOptions& options() const { return options_; }

  void OnNewRequest(const core::RequestId& request, const RemoteSource& source);
  // Pulls the request's KV into `blocks` (in order). Returns at once; the outcome comes from
  // TakeFinished, exactly once. An empty `blocks` is a notify-only pull: nothing to wait for.
  // kAlreadyExists if the request is still loading (nothing is started then).
  [[nodiscard]] Status StartLoad(const core::RequestId& request, const RemoteSource& source,
                                 std::vector<core::BlockId> blocks);
  void RequestFinished(const core::RequestId& request);
  DecodeFinished TakeFinished();
  // Waits until TakeFinished has something or `deadline` passes.
  DecodeFinished WaitFinished(core::TimePoint deadline);

  DecodeWorkerStats Stats() const;

 private:
  struct PullJob {
    core::RequestId request;
    RemoteSource source;
    std::vector<core::BlockId> blocks;
  };
  // A P rank of one incarnation of an engine: a restarted P is a new peer, so quiescing the
  // old process never settles entries of the new one.
  struct PeerKey {
    core::EngineId engine;
    std::string incarnation;
    std::uint32_t rank;
    auto operator<=>(const PeerKey&) const = default;
  };
  struct RenewalCommand {
    enum class Kind : std::uint8_t { kTrack, kUntrack, kResetEngine } kind;
    core::TransferId transfer;
    core::EngineId engine;
  };

  DecodeWorker() = default;
  void PullerLoop();
  void RunPull(PullJob& job);
  void PullFromPeer(const core::RequestId& request, const core::EngineId& engine,
                    const wire::Pull& pull, const std::string& endpoint, core::PeerId peer);
  void RenewalLoop();
  core::PeerId PeerIdFor(const control::EngineInfo& info, std::uint32_t rank);  // mu_ held
  // Every lookup (pullers' and the renewal thread's) reports the incarnation it saw; a new one
  // quiesces the old process's peers and lets the engine be renewed again. mu_ held.
  void NoteIncarnation(const control::EngineInfo& info);
  void Complete(ReceiveResult result);  // mu_ held
  void CollectLedgerEvents();           // mu_ held
  Result<std::vector<std::string>> ResolveEndpoints(const core::EngineId& engine);
  std::unique_ptr<control::DecodeChannel> TakeChannel(const std::string& endpoint);
  void ReturnChannel(std::unique_ptr<control::DecodeChannel> channel);

  DecodeWorkerOptions options_;
  std::shared_ptr<transport::Engine> engine_;
  transport::Region region_;
  std::vector<std::uint8_t> descriptor_;
  WarningSink warn_;
  std::shared_ptr<control::SideChannelContext> context_;
  control::EngineDirectory directory_;

  mutable std::mutex mu_;  // guards everything below
  std::condition_variable cv_;
  bool stopping_ = false;
  std::deque<PullJob> jobs_;
  core::ReceiveLedger ledger_;
  std::map<PeerKey, core::PeerId> peer_ids_;
  std::unordered_map<std::string, std::string> bootstrap_of_engine_;
  std::unordered_map<core::RequestId, core::TransferId> tracked_;  // request -> transfer
  std::unordered_map<core::EngineId, std::string> incarnation_of_;
  std::unordered_set<core::RequestId> loading_;  // StartLoad until its completion
  std::vector<RenewalCommand> renewal_commands_;
  std::unordered_multimap<std::string, std::unique_ptr<control::DecodeChannel>> idle_channels_;
  DecodeFinished finished_;
  DecodeWorkerStats stats_;

  std::vector<std::thread> pullers_;
  std::thread renewal_thread_;
};

}  // namespace kvferry::runtime
