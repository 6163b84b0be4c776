#include "kvferry/core/receive_ledger.h"

#include <fmt/format.h>

#include <algorithm>

namespace kvferry::core {

Status ReceiveLedger::Begin(const RequestId& request, std::vector<BlockId> blocks,
                            std::span<const PeerId> peers, Status no_peer_error) {
  if (blocks.empty()) return Status::Ok();  // notify-only pull: nothing can be written
  if (requests_.count(request) != 0) {
    return Status(ErrorCode::kAlreadyExists,
                  fmt::format("request {} is already receiving", request));
  }
  for (std::size_t i = 0; i < peers.size(); ++i) {
    for (std::size_t j = i + 1; j < peers.size(); ++j) {
      if (peers[i] == peers[j]) {
        return Status(ErrorCode::kInvalidArgument,
                      fmt::format("request {}: peer {} listed twice", request, peers[i]));
      }
    }
  }
  auto [it, inserted] = requests_.try_emplace(request);
  Receive& r = it->second;
  r.blocks = std::move(blocks);
  r.peers.reserve(peers.size());
  for (PeerId p : peers) r.peers.push_back({p, EntryState::kPending});
  r.pending = static_cast<std::uint32_t>(peers.size());
  if (peers.empty()) {
    r.failed = true;
    r.first_error = no_peer_error.ok() ? Status(ErrorCode::kUnavailable, "no prefill peer")
                                       : std::move(no_peer_error);
    MaybeComplete(it);
  }
  return Status::Ok();
}

Status ReceiveLedger::Forget(const RequestId& request) {
  auto it = requests_.find(request);
  if (it == requests_.end()) {
    return Status(ErrorCode::kNotFound, fmt::format("request {} is not receiving", request));
  }
  const Receive& r = it->second;
  if (r.pending != r.peers.size() || r.peers.empty()) {
    return Status(ErrorCode::kAlreadyExists,
                  fmt::format("request {}: a peer already answered or was given up on", request));
  }
  requests_.erase(it);
  return Status::Ok();
}

SettleOutcome ReceiveLedger::Settle(const RequestId& request, PeerId peer, core::Settle how,
                                    Status reason) {
  auto it = requests_.find(request);
  if (it == requests_.end()) return SettleOutcome::kUnknownRequest;
  Receive& r = it->second;
  auto entry = std::find_if(r.peers.begin(), r.peers.end(),
                            [peer](const PeerEntry& e) { return e.peer == peer; });
  if (entry == r.peers.end()) return SettleOutcome::kNotAPeer;
  if (entry->state == EntryState::kUnknownWriter && how != core::Settle::kTimeout) {
    // The peer answered after we gave up on it: whatever it says, it no longer writes.
    entry->state = how == core::Settle::kOk ? EntryState::kOk : EntryState::kFailed;
    --r.unknown_writers;
    MaybeRelease(it);
    return SettleOutcome::kResolvedQuarantine;
  }
  if (entry->state != EntryState::kPending) return SettleOutcome::kAlreadySettled;
  SettleEntry(it, *entry, how, reason);
  MaybeComplete(it);
  return SettleOutcome::kSettled;
}

void ReceiveLedger::SettlePeer(PeerId peer, core::Settle how, const Status& reason) {
  for (auto it = requests_.begin(); it != requests_.end();) {
    auto next = std::next(it);
    for (PeerEntry& entry : it->second.peers) {
      if (entry.peer == peer && entry.state == EntryState::kPending) {
        SettleEntry(it, entry, how, reason);
        MaybeComplete(it);  // may erase `it`
        break;
      }
    }
    it = next;
  }
}

void ReceiveLedger::PeerQuiesced(PeerId peer) {
  for (auto it = requests_.begin(); it != requests_.end();) {
    auto next = std::next(it);
    Receive& r = it->second;
    for (PeerEntry& entry : r.peers) {
      if (entry.peer != peer) continue;
      if (entry.state == EntryState::kPending) {
        // A dead peer will never answer: settle it as failed (its writer is known stopped).
        SettleEntry(it, entry, core::Settle::kErr,
                    Status(ErrorCode::kUnavailable, fmt::format("prefill peer {} is gone", peer)));
        MaybeComplete(it);  // may erase `it`
      } else if (entry.state == EntryState::kUnknownWriter) {
        entry.state = EntryState::kFailed;
        --r.unknown_writers;
        MaybeRelease(it);  // may erase `it`
      }
      break;
    }
    it = next;
  }
}

void ReceiveLedger::SettleEntry(Map::iterator it, PeerEntry& entry, core::Settle how,
                                const Status& reason) {
  Receive& r = it->second;
  --r.pending;
  if (how == core::Settle::kOk) {
    entry.state = EntryState::kOk;
    return;
  }
  if (how == core::Settle::kTimeout) {
    entry.state = EntryState::kUnknownWriter;
    ++r.unknown_writers;
  } else {
    entry.state = EntryState::kFailed;
  }
  if (r.failed) {
    ++duplicate_failures_;
    return;
  }
  r.failed = true;
  r.first_error = reason.ok()
                      ? Status(ErrorCode::kUnavailable,
                               fmt::format("prefill peer {} failed the transfer", entry.peer))
                      : reason;
}

void ReceiveLedger::MaybeComplete(Map::iterator it) {
  Receive& r = it->second;
  if (r.pending > 0 || r.completed) return;
  r.completed = true;
  LedgerEvent ev{LedgerEvent::Kind::kCompleted, it->first, !r.failed, r.first_error, {}, false};
  if (r.failed) ev.blocks = r.blocks;
  ev.quarantined = r.unknown_writers > 0;
  if (ev.quarantined) quarantined_blocks_ += r.blocks.size();
  events_.push_back(std::move(ev));
  if (r.unknown_writers == 0) requests_.erase(it);
}

void ReceiveLedger::MaybeRelease(Map::iterator it) {
  Receive& r = it->second;
  if (r.unknown_writers > 0) return;
  if (!r.completed) return;  // completion will hand the blocks back
  quarantined_blocks_ -= r.blocks.size();
  events_.push_back(
      {LedgerEvent::Kind::kBlocksReleased, it->first, false, {}, std::move(r.blocks), false});
  requests_.erase(it);
}

std::vector<LedgerEvent> ReceiveLedger::TakeEvents() {
  std::vector<LedgerEvent> out;
  out.swap(events_);
  return out;
}

bool ReceiveLedger::IsPending(const RequestId& request, PeerId peer) const {
  auto it = requests_.find(request);
  if (it == requests_.end()) return false;
  for (const PeerEntry& e : it->second.peers) {
    if (e.peer == peer) return e.state == EntryState::kPending;
  }
  return false;
}

}  // namespace kvferry::core
