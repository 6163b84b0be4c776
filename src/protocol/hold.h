// Hold: the operations PrefillSession performs on P's hold table, behind an interface so that
// the simulator's mutation checks can hand the session a deliberately broken table (an
// exploration that cannot fail proves nothing). CoreHold, a forwarder to core::HoldTable, is the
// only production implementation and the default. The contracts are core::HoldTable's
// (kvferry/core/hold_table.h); the methods mirror its public API one to one.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "kvferry/core/hold_table.h"

namespace kvferry::protocol {

class Hold {
 public:
  virtual ~Hold() = default;
  virtual const core::HoldConfig& config() const = 0;
  virtual Status Admit(const core::TransferId& id, std::uint64_t handle, core::TimePoint now) = 0;
  virtual Status PrefillDone(const core::TransferId& id, std::uint32_t num_blocks,
                             core::TimePoint now) = 0;
  virtual void EngineFinished(const core::TransferId& id, core::TimePoint now) = 0;
  virtual Status Refuse(const core::TransferId& id, Status why, core::TimePoint now) = 0;
  virtual Result<core::HoldTable::RenewResult> Renew(std::span<const core::Fingerprint> ids,
                                                     core::TimePoint now) = 0;
  virtual core::PullAdmission AdmitPull(const core::TransferId& id, std::uint32_t d_rank,
                                        std::uint32_t need_send,
                                        std::optional<core::Duration> d_lease,
                                        core::TimePoint now) = 0;
  virtual core::HoldTable::ReleaseOutcome ReleaseByDecoder(core::Fingerprint fp,
                                                           std::uint32_t d_rank,
                                                           std::uint32_t need_send,
                                                           core::TimePoint now) = 0;
  virtual Status BeginSend(const core::TransferId& id, std::uint32_t d_rank,
                           core::TimePoint now) = 0;
  virtual Status EndSend(const core::TransferId& id, std::uint32_t d_rank, bool ok,
                         core::TimePoint now) = 0;
  virtual void Expire(core::TimePoint now) = 0;
  virtual core::TimePoint NextDeadline() const = 0;
  virtual std::vector<core::HoldEvent> TakeEvents() = 0;
  virtual bool Contains(const core::TransferId& id) const = 0;
  virtual bool ContainsFingerprint(core::Fingerprint fp) const = 0;
  virtual std::optional<core::HoldPhase> PhaseOf(const core::TransferId& id) const = 0;
  virtual std::optional<core::TimePoint> DeadlineOf(const core::TransferId& id) const = 0;
  virtual bool IsTombstoned(const core::TransferId& id) const = 0;
  virtual std::size_t size() const = 0;
  virtual const core::HoldStats& stats() const = 0;
};

// Not final: a mutation check derives from it and overrides only what it breaks.
class CoreHold : public Hold {
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
  Status Refuse(const core::TransferId& id, Status why, core::TimePoint now) override {
    return table_.Refuse(id, std::move(why), now);
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
  core::HoldTable::ReleaseOutcome ReleaseByDecoder(core::Fingerprint fp, std::uint32_t d_rank,
                                                   std::uint32_t need_send,
                                                   core::TimePoint now) override {
    return table_.ReleaseByDecoder(fp, d_rank, need_send, now);
  }
  Status BeginSend(const core::TransferId& id, std::uint32_t d_rank, core::TimePoint now) override {
    return table_.BeginSend(id, d_rank, now);
  }
  Status EndSend(const core::TransferId& id, std::uint32_t d_rank, bool ok,
                 core::TimePoint now) override {
    return table_.EndSend(id, d_rank, ok, now);
  }
  void Expire(core::TimePoint now) override { table_.Expire(now); }
  core::TimePoint NextDeadline() const override { return table_.NextDeadline(); }
  std::vector<core::HoldEvent> TakeEvents() override { return table_.TakeEvents(); }
  bool Contains(const core::TransferId& id) const override { return table_.Contains(id); }
  bool ContainsFingerprint(core::Fingerprint fp) const override {
    return table_.ContainsFingerprint(fp);
  }
  std::optional<core::HoldPhase> PhaseOf(const core::TransferId& id) const override {
    return table_.PhaseOf(id);
  }
  std::optional<core::TimePoint> DeadlineOf(const core::TransferId& id) const override {
    return table_.DeadlineOf(id);
  }
  bool IsTombstoned(const core::TransferId& id) const override { return table_.IsTombstoned(id); }
  std::size_t size() const override { return table_.size(); }
  const core::HoldStats& stats() const override { return table_.stats(); }

 private:
  core::HoldTable table_;
};

// How a session builds its hold table (the simulator's mutation checks pass broken variants).
using HoldFactory = std::function<std::unique_ptr<Hold>(const core::HoldConfig&)>;

}  // namespace kvferry::protocol
