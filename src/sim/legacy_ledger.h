// LegacyLedger: THE SEED'S BUGGY BASELINE, kept only so scenario C (and the mutation test) can
// show the bug that core::ReceiveLedger fixes. Never use it for anything else.
//
// It reproduces the receive bookkeeping of vLLM's MooncakeConnector before the seed `002_…`:
// a request completes on its FIRST failure (reported by any peer), without waiting for the
// other peers that may still be writing into the destination blocks. D then frees the blocks,
// another request gets them, and a slow peer's WRITE lands in someone else's KV
// (write-after-free). A local timeout likewise completes at once and nothing is quarantined.
#pragma once

#include <map>
#include <set>

#include "seams.h"

namespace kvferry::sim {

class LegacyLedger final : public protocol::Ledger {
 public:
  Status Begin(const core::RequestId& request, std::vector<core::BlockId> blocks,
               std::span<const core::PeerId> peers, Status no_peer_error) override;
  core::SettleOutcome Settle(const core::RequestId& request, core::PeerId peer, core::Settle how,
                             Status reason) override;
  void PeerQuiesced(core::PeerId peer) override;
  // The seed had no retry: a receive is forgotten only while no peer answered, as the core's.
  Status Forget(const core::RequestId& request) override {
    auto it = receives_.find(request);
    if (it == receives_.end()) return Status(ErrorCode::kNotFound, "not receiving");
    receives_.erase(it);
    return Status::Ok();
  }
  bool IsPending(const core::RequestId& request, core::PeerId peer) const override;
  std::vector<core::LedgerEvent> TakeEvents() override;
  std::size_t active() const override { return receives_.size(); }
  std::uint64_t quarantined_blocks() const override { return 0; }  // it never quarantines

 private:
  struct Receive {
    std::vector<core::BlockId> blocks;
    std::set<core::PeerId> pending;
  };
  void Complete(std::map<core::RequestId, Receive>::iterator it, bool ok, Status error);

  std::map<core::RequestId, Receive> receives_;
  std::vector<core::LedgerEvent> events_;
};

}  // namespace kvferry::sim
