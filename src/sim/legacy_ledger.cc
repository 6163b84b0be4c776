#include "legacy_ledger.h"

#include <fmt/format.h>

namespace kvferry::sim {

Status LegacyLedger::Begin(const core::RequestId& request, std::vector<core::BlockId> blocks,
                           std::span<const core::PeerId> peers, Status no_peer_error) {
  if (blocks.empty()) return Status::Ok();
  auto [it, inserted] = receives_.try_emplace(request);
  if (!inserted) return Status(ErrorCode::kAlreadyExists, "already receiving");
  it->second.blocks = std::move(blocks);
  it->second.pending.insert(peers.begin(), peers.end());
  if (peers.empty()) Complete(it, false, std::move(no_peer_error));
  return Status::Ok();
}

core::SettleOutcome LegacyLedger::Settle(const core::RequestId& request, core::PeerId peer,
                                         core::Settle how, Status reason) {
  auto it = receives_.find(request);
  if (it == receives_.end()) return core::SettleOutcome::kUnknownRequest;
  if (it->second.pending.erase(peer) == 0) return core::SettleOutcome::kAlreadySettled;
  if (how != core::Settle::kOk) {
    // The bug: the first failure completes the request although other peers are pending.
    Complete(it, false,
             reason.ok() ? Status(ErrorCode::kUnavailable,
                                  fmt::format("prefill peer {} failed the transfer", peer))
                         : std::move(reason));
  } else if (it->second.pending.empty()) {
    Complete(it, true, {});
  }
  return core::SettleOutcome::kSettled;
}

void LegacyLedger::PeerQuiesced(core::PeerId peer) {
  for (auto it = receives_.begin(); it != receives_.end();) {
    auto next = std::next(it);
    if (it->second.pending.count(peer) != 0) {
      Complete(it, false, Status(ErrorCode::kUnavailable, fmt::format("peer {} is gone", peer)));
    }
    it = next;
  }
}

bool LegacyLedger::IsPending(const core::RequestId& request, core::PeerId peer) const {
  auto it = receives_.find(request);
  return it != receives_.end() && it->second.pending.count(peer) != 0;
}

void LegacyLedger::Complete(std::map<core::RequestId, Receive>::iterator it, bool ok,
                            Status error) {
  core::LedgerEvent ev{
      core::LedgerEvent::Kind::kCompleted, it->first, ok, std::move(error), {}, false};
  if (!ok) ev.blocks = it->second.blocks;
  events_.push_back(std::move(ev));
  receives_.erase(it);
}

std::vector<core::LedgerEvent> LegacyLedger::TakeEvents() {
  std::vector<core::LedgerEvent> out;
  out.swap(events_);
  return out;
}

}  // namespace kvferry::sim
