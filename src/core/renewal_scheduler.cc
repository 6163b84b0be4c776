#include "kvferry/core/renewal_scheduler.h"

#include <algorithm>

namespace kvferry::core {

RenewalScheduler::RenewalScheduler(Duration lease, std::size_t max_ids_per_batch)
    : lease_(lease), max_ids_per_batch_(std::max<std::size_t>(1, max_ids_per_batch)) {}

std::uint32_t RenewalScheduler::EngineIndex(const EngineId& engine) {
  auto [it, inserted] =
      engine_index_.try_emplace(engine, static_cast<std::uint32_t>(engines_.size()));
  if (inserted) engines_.push_back({engine, 0, false});
  return it->second;
}

void RenewalScheduler::Track(const TransferId& transfer, const EngineId& engine) {
  if (lease_.count() == 0) return;
  const std::uint32_t index = EngineIndex(engine);
  if (by_transfer_.try_emplace(transfer, index).second) ++engines_[index].tracked;
}

void RenewalScheduler::Untrack(const TransferId& transfer) {
  auto it = by_transfer_.find(transfer);
  if (it == by_transfer_.end()) return;
  --engines_[it->second].tracked;
  by_transfer_.erase(it);
}

std::vector<RenewalBatch> RenewalScheduler::Poll(TimePoint now) {
  std::vector<RenewalBatch> out;
  if (lease_.count() == 0 || now < next_due_) return out;
  next_due_ = now + interval();
  if (by_transfer_.empty()) return out;

  // One open batch per engine; a full batch is moved out and a new one started.
  std::vector<std::int64_t> open(engines_.size(), -1);
  for (const auto& [transfer, index] : by_transfer_) {
    if (engines_[index].rejected) continue;
    std::int64_t& slot = open[index];
    if (slot < 0 || out[static_cast<std::size_t>(slot)].ids.size() >= max_ids_per_batch_) {
      slot = static_cast<std::int64_t>(out.size());
      out.push_back({engines_[index].name, {}});
      out.back().ids.reserve(std::min(max_ids_per_batch_, engines_[index].tracked));
    }
    out[static_cast<std::size_t>(slot)].ids.push_back(FingerprintOf(transfer));
  }
  return out;
}

bool RenewalScheduler::NoteRejected(const EngineId& engine) {
  EngineState& state = engines_[EngineIndex(engine)];
  const bool first = !state.rejected;
  state.rejected = true;
  return first;
}

void RenewalScheduler::ResetEngine(const EngineId& engine) {
  engines_[EngineIndex(engine)].rejected = false;
}

}  // namespace kvferry::core
