// Ledger: the operations DecodeSession performs on D's receive ledger, behind an interface so
// that the simulator's mutation checks can hand the session the seed's buggy ledger (an
// exploration that cannot fail proves nothing). CoreLedger, a forwarder to core::ReceiveLedger,
// is the only production implementation and the default. The contracts are
// core::ReceiveLedger's (kvferry/core/receive_ledger.h); the methods mirror its public API.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "kvferry/core/receive_ledger.h"

namespace kvferry::protocol {

class Ledger {
 public:
  virtual ~Ledger() = default;
  virtual Status Begin(const core::RequestId& request, std::vector<core::BlockId> blocks,
                       std::span<const core::PeerId> peers, Status no_peer_error) = 0;
  virtual core::SettleOutcome Settle(const core::RequestId& request, core::PeerId peer,
                                     core::Settle how, Status reason) = 0;
  virtual void PeerQuiesced(core::PeerId peer) = 0;
  virtual Status Forget(const core::RequestId& request) = 0;
  virtual bool IsPending(const core::RequestId& request, core::PeerId peer) const = 0;
  virtual std::vector<core::LedgerEvent> TakeEvents() = 0;
  virtual std::size_t active() const = 0;
  virtual std::uint64_t quarantined_blocks() const = 0;
};

// Not final: a mutation check derives from it and overrides only what it breaks.
class CoreLedger : public Ledger {
 public:
  Status Begin(const core::RequestId& request, std::vector<core::BlockId> blocks,
               std::span<const core::PeerId> peers, Status no_peer_error) override {
    return ledger_.Begin(request, std::move(blocks), peers, std::move(no_peer_error));
  }
  core::SettleOutcome Settle(const core::RequestId& request, core::PeerId peer, core::Settle how,
                             Status reason) override {
    return ledger_.Settle(request, peer, how, std::move(reason));
  }
  void PeerQuiesced(core::PeerId peer) override { ledger_.PeerQuiesced(peer); }
  Status Forget(const core::RequestId& request) override { return ledger_.Forget(request); }
  bool IsPending(const core::RequestId& request, core::PeerId peer) const override {
    return ledger_.IsPending(request, peer);
  }
  std::vector<core::LedgerEvent> TakeEvents() override { return ledger_.TakeEvents(); }
  std::size_t active() const override { return ledger_.active(); }
  std::uint64_t quarantined_blocks() const override { return ledger_.quarantined_blocks(); }

 private:
  core::ReceiveLedger ledger_;
};

// How a session builds its ledger (the simulator's mutation checks pass broken variants).
using LedgerFactory = std::function<std::unique_ptr<Ledger>()>;

}  // namespace kvferry::protocol
