// Seams: the two core classes the simulator drives, behind interfaces so that tests can swap in
// broken variants (mutation checks: an exploration that cannot fail proves nothing).
//
// The production wiring is CoreHold / CoreLedger, thin forwarders to core::HoldTable and
// core::ReceiveLedger: the simulator runs the SAME lifetime rules as real processes. The
// interfaces mirror those classes' public APIs one to one; their contracts are the core's.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "kvferry/core/hold_table.h"
#include "kvferry/core/receive_ledger.h"

namespace kvferry::sim {

// One P worker's hold (core::HoldTable's API).
class Hold {
 public:
  virtual ~Hold() = default;
  virtual const core::HoldConfig& config() const = 0;
  virtual Status Admit(const core::TransferId& id, std::uint64_t handle, core::TimePoint now) = 0;
  virtual Status PrefillDone(const core::TransferId& id, std::uint32_t num_blocks,
                             core::TimePoint now) = 0;
  virtual void EngineFinished(const core::TransferId& id, core::TimePoint now) = 0;
  virtual Result<core::HoldTable::RenewResult> Renew(std::span<const core::Fingerprint> ids,
                                                     core::TimePoint now) = 0;
  virtual core::PullAdmission AdmitPull(const core::TransferId& id, std::uint32_t d_rank,
                                        std::uint32_t need_send,
                                        std::optional<core::Duration> d_lease,
                                        core::TimePoint now) = 0;
  virtual Status BeginSend(const core::TransferId& id, std::uint32_t d_rank,
                           core::TimePoint now) = 0;
  virtual Status EndSend(const core::TransferId& id, std::uint32_t d_rank, bool ok,
                         core::TimePoint now) = 0;
  virtual void Expire(core::TimePoint now) = 0;
  virtual std::vector<core::HoldEvent> TakeEvents() = 0;
  virtual bool Contains(const core::TransferId& id) const = 0;
  virtual std::size_t size() const = 0;
  virtual const core::HoldStats& stats() const = 0;
};

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

class CoreHold final : public Hold {
 public:
  explicit CoreHold(const core::HoldConfig& config) : table_(config) {}
  const core::HoldConfig& config() const override { return table_.config(); }
  Status Admit(const core::TransferId& id, std::uint64_t handle, core::TimePoint now) override {
    return table_.Admit(id, handle, now);
  }
  Status PrefillDone(const core::TransferId& id, std::uint32_t n, core::TimePoint now) override {
    return table_.PrefillDone(id, n, now);
  }
  void EngineFinished(const core::TransferId& id, core::TimePoint now) override {
    table_.EngineFinished(id, now);
  }
  Result<core::HoldTable::RenewResult> Renew(std::span<const core::Fingerprint> ids,
                                             core::TimePoint now) override {
    return table_.Renew(ids, now);
  }
  core::PullAdmission AdmitPull(const core::TransferId& id, std::uint32_t d_rank,
                                std::uint32_t need_send, std::optional<core::Duration> d_lease,
                                core::TimePoint now) override {
    return table_.AdmitPull(id, d_rank, need_send, d_lease, now);
  }
  Status BeginSend(const core::TransferId& id, std::uint32_t d_rank, core::TimePoint now) override {
    return table_.BeginSend(id, d_rank, now);
  }
  Status EndSend(const core::TransferId& id, std::uint32_t d_rank, bool ok,
                 core::TimePoint now) override {
    return table_.EndSend(id, d_rank, ok, now);
  }
  void Expire(core::TimePoint now) override { table_.Expire(now); }
  std::vector<core::HoldEvent> TakeEvents() override { return table_.TakeEvents(); }
  bool Contains(const core::TransferId& id) const override { return table_.Contains(id); }
  std::size_t size() const override { return table_.size(); }
  const core::HoldStats& stats() const override { return table_.stats(); }
  // For wrappers (e.g. a test's ordered reaper) that need the deadlines.
  const core::HoldTable& table() const { return table_; }

 private:
  core::HoldTable table_;
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
  std::function<std::unique_ptr<Hold>(const core::HoldConfig&)> make_hold;
  std::function<std::unique_ptr<Ledger>()> make_ledger;

  std::unique_ptr<Hold> NewHold(const core::HoldConfig& config) const {
    return make_hold ? make_hold(config) : std::make_unique<CoreHold>(config);
  }
  std::unique_ptr<Ledger> NewLedger() const {
    return make_ledger ? make_ledger() : std::make_unique<CoreLedger>();
  }
};

}  // namespace kvferry::sim
