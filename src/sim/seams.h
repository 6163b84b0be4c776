// Seams: the two core classes the simulator drives, behind interfaces so that tests can swap in
// broken variants (mutation checks: an exploration that cannot fail proves nothing).
//
// P's hold table is reached through protocol::Hold, the seam of protocol::PrefillSession (the
// session the simulator drives); D's ledger through Ledger below. The production wiring is
// protocol::CoreHold / CoreLedger, thin forwarders to core::HoldTable and core::ReceiveLedger:
// the simulator runs the SAME lifetime rules as real processes. The interfaces mirror those
// classes' public APIs one to one; their contracts are the core's.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "kvferry/core/hold_table.h"
#include "kvferry/core/receive_ledger.h"
#include "protocol/hold.h"

namespace kvferry::sim {

// One D worker's receive settlement (core::ReceiveLedger's API).
class Ledger {
 public:
  virtual ~Ledger() = default;
  virtual Status Begin(const core::RequestId& request, std::vector<core::BlockId> blocks,
                       std::span<const core::PeerId> peers, Status no_peer_error) = 0;
  virtual core::SettleOutcome Settle(const core::RequestId& request, core::PeerId peer,
                                     core::Settle how, Status reason) = 0;
  virtual void PeerQuiesced(core::PeerId peer) = 0;
  virtual bool IsPending(const core::RequestId& request, core::PeerId peer) const = 0;
  virtual std::vector<core::LedgerEvent> TakeEvents() = 0;
  virtual std::size_t active() const = 0;
};

class CoreLedger final : public Ledger {
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
  bool IsPending(const core::RequestId& request, core::PeerId peer) const override {
    return ledger_.IsPending(request, peer);
  }
  std::vector<core::LedgerEvent> TakeEvents() override { return ledger_.TakeEvents(); }
  std::size_t active() const override { return ledger_.active(); }

 private:
  core::ReceiveLedger ledger_;
};

// How the simulator builds its holds and ledgers. Default: the real core classes.
struct Variants {
  protocol::HoldFactory make_hold;
  std::function<std::unique_ptr<Ledger>()> make_ledger;

  std::unique_ptr<protocol::Hold> NewHold(const core::HoldConfig& config) const {
    return make_hold ? make_hold(config) : std::make_unique<protocol::CoreHold>(config);
  }
  std::unique_ptr<Ledger> NewLedger() const {
    return make_ledger ? make_ledger() : std::make_unique<CoreLedger>();
  }
};

}  // namespace kvferry::sim
