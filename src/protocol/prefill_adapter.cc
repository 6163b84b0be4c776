#include "protocol/prefill_adapter.h"

#include <fmt/format.h>

#include <utility>

namespace kvferry::protocol {

PrefillAdapter::PrefillAdapter(PrefillAdapterOptions options) : options_(options) {
  if (options_.ranks == 0) options_.ranks = 1;
}

Status PrefillAdapter::Admit(const core::TransferId& transfer, std::uint64_t handle) {
  if (transfer.empty()) return Status(ErrorCode::kInvalidArgument, "empty transfer id");
  if (entries_.count(transfer) != 0) {
    return Status(ErrorCode::kAlreadyExists,
                  fmt::format("transfer {} is in use by another request", transfer));
  }
  if (entries_.size() >= options_.max_transfers) {
    return Status(ErrorCode::kResourceExhausted,
                  fmt::format("{} transfers known, the limit is {}", entries_.size(),
                              options_.max_transfers));
  }
  Entry& entry = entries_[transfer];
  entry.handle = handle;
  entry.ranks.assign(options_.ranks, RankState::kPending);
  entry.pending = options_.ranks;
  Call(PrefillRankCall::Kind::kAdmit, transfer, entry, RankState::kPending, nullptr);
  return Status::Ok();
}

Status PrefillAdapter::PrefillDone(const core::TransferId& transfer,
                                   std::vector<core::BlockId> blocks) {
  auto it = entries_.find(transfer);
  if (it == entries_.end()) {
    return Status(ErrorCode::kNotFound, fmt::format("transfer {} is not admitted", transfer));
  }
  Entry& entry = it->second;
  if (entry.phase == Phase::kRefused) {
    // Nothing holds it on any rank: the blocks are the engine's again.
    events_.push_back(FreeBlocks{transfer, entry.handle, core::ReleaseReason::kAbortedByEngine});
    entries_.erase(it);
    return Status::Ok();
  }
  if (entry.phase != Phase::kAdmitted) {
    return Status(ErrorCode::kAlreadyExists,
                  fmt::format("transfer {} is {}", transfer,
                              entry.phase == Phase::kAdmitting ? "still being admitted"
                                                               : "handed off already"));
  }
  entry.phase = Phase::kHandingOff;
  for (RankState& r : entry.ranks) {
    if (r == RankState::kAdmitted) {
      r = RankState::kPending;
      ++entry.pending;
    }
  }
  Call(PrefillRankCall::Kind::kPrefillDone, transfer, entry, RankState::kPending, &blocks);
  if (entry.pending == 0) HandOffDone(transfer, entry);  // every rank let it go meanwhile
  return Status::Ok();
}

bool PrefillAdapter::LayersReady(const core::TransferId& transfer, std::uint64_t handle,
                                 const std::vector<core::BlockId>& blocks,
                                 const std::vector<std::uint32_t>& planes) {
  auto it = entries_.find(transfer);
  if (it == entries_.end()) return false;
  const Entry& entry = it->second;
  if (entry.handle != handle || entry.phase != Phase::kAdmitted || entry.finished) return false;
  for (std::uint32_t r = 0; r < options_.ranks; ++r) {
    PrefillRankCall call{r, PrefillRankCall::Kind::kLayersReady, transfer, handle, blocks, {}};
    call.planes = planes;
    commands_.push_back(std::move(call));
  }
  return true;
}

void PrefillAdapter::Finish(const core::TransferId& transfer) {
  auto it = entries_.find(transfer);
  if (it == entries_.end() || it->second.finished) return;
  Entry& entry = it->second;
  entry.finished = true;
  switch (entry.phase) {
    case Phase::kAdmitting:
      // Every rank hears it after its Admit (calls to a rank keep their order); later answers
      // are strays.
      Call(PrefillRankCall::Kind::kEngineFinished, transfer, entry, RankState::kPending, nullptr);
      entries_.erase(it);
      return;
    case Phase::kAdmitted:
      Call(PrefillRankCall::Kind::kEngineFinished, transfer, entry, RankState::kAdmitted, nullptr);
      entries_.erase(it);
      return;
    case Phase::kRefused:
      entries_.erase(it);
      return;
    case Phase::kHandingOff:
    case Phase::kHeld:
      // The hold tables own the blocks: each rank lets go once no write reads them, and the
      // last kFreeBlocks frees them (pending answers are told when they come).
      Call(PrefillRankCall::Kind::kEngineFinished, transfer, entry, RankState::kHolding, nullptr);
      return;
  }
}

void PrefillAdapter::Drop(const core::TransferId& transfer, const Status& why) {
  if (transfer.empty() || entries_.count(transfer) != 0) return;
  for (std::uint32_t r = 0; r < options_.ranks; ++r) {
    commands_.push_back(PrefillRankCall{r, PrefillRankCall::Kind::kRefuse, transfer, 0, {}, why});
  }
}

void PrefillAdapter::OnAdmitted(std::uint32_t rank, const core::TransferId& transfer,
                                const Status& result) {
  Entry* entry = Expecting(rank, transfer, Phase::kAdmitting);
  if (entry == nullptr) return;
  entry->ranks[rank] = result.ok() ? RankState::kAdmitted : RankState::kNone;
  if (!result.ok() && entry->first_error.ok()) entry->first_error = result;
  if (--entry->pending == 0) AdmissionDone(transfer, *entry);
}

void PrefillAdapter::OnPrefillDone(std::uint32_t rank, const core::TransferId& transfer,
                                   const Status& result) {
  Entry* entry = Expecting(rank, transfer, Phase::kHandingOff);
  if (entry == nullptr) return;
  if (result.ok()) {
    entry->ranks[rank] = RankState::kHolding;
    ++entry->holding;
    if (entry->finished) {
      // Finish came while this answer was due: this rank lets go too.
      commands_.push_back(
          PrefillRankCall{rank, PrefillRankCall::Kind::kEngineFinished, transfer, 0, {}, {}});
    }
  } else {
    entry->ranks[rank] = RankState::kNone;
    if (entry->first_error.ok()) entry->first_error = result;
  }
  if (--entry->pending == 0) HandOffDone(transfer, *entry);
}

void PrefillAdapter::OnHoldEvent(std::uint32_t rank, const core::HoldEvent& event) {
  auto it = entries_.find(event.id);
  if (it == entries_.end() || rank >= options_.ranks) {
    if (event.kind == core::HoldEvent::Kind::kFreeBlocks) ++stray_results_;
    return;
  }
  Entry& entry = it->second;
  switch (event.kind) {
    case core::HoldEvent::Kind::kFreeBlocks:
      if (entry.ranks[rank] != RankState::kHolding) {
        ++stray_results_;
        return;
      }
      entry.ranks[rank] = RankState::kNone;
      --entry.holding;
      entry.last_free = event.reason;
      MaybeFree(event.id);
      return;
    case core::HoldEvent::Kind::kAbortPrefill:
      // The rank dropped it while it prefilled (no decoder renewed it, or nobody pulled in
      // time): nobody can complete the transfer; the engine stops the request, once. After
      // the hand-off began, that rank's PrefillDone answer fails instead (HandOffFailed).
      if (entry.phase != Phase::kAdmitting && entry.phase != Phase::kAdmitted) return;
      if (entry.ranks[rank] == RankState::kAdmitted) entry.ranks[rank] = RankState::kNone;
      if (entry.first_error.ok()) {
        entry.first_error = Status(ErrorCode::kCancelled,
                                   fmt::format("P rank {} dropped transfer {} ({})", rank,
                                               event.id, core::ToString(event.reason)));
      }
      if (!entry.abort_told) {
        entry.abort_told = true;
        events_.push_back(AbortPrefill{event.id, entry.handle, event.reason});
      }
      return;
    case core::HoldEvent::Kind::kPullsReady:
    case core::HoldEvent::Kind::kPullsFailed:
    case core::HoldEvent::Kind::kReleased:
      return;  // the sessions answer pulls themselves
  }
}

std::size_t PrefillAdapter::Stop() {
  std::size_t held = 0;
  for (const auto& [transfer, entry] : entries_) {
    if (entry.holding > 0) ++held;
  }
  entries_.clear();
  commands_.clear();
  events_.clear();
  return held;
}

std::vector<PrefillRankCall> PrefillAdapter::TakeCommands() {
  return std::exchange(commands_, {});
}

std::vector<PrefillAdapterEvent> PrefillAdapter::TakeEvents() { return std::exchange(events_, {}); }

PrefillAdapterStats PrefillAdapter::stats() const {
  PrefillAdapterStats s;
  s.transfers = entries_.size();
  for (const auto& [transfer, entry] : entries_) {
    if (entry.phase == Phase::kHeld || entry.phase == Phase::kHandingOff) ++s.held;
  }
  s.stray_results = stray_results_;
  return s;
}

std::optional<std::uint64_t> PrefillAdapter::handle_of(const core::TransferId& transfer) const {
  auto it = entries_.find(transfer);
  if (it == entries_.end()) return std::nullopt;
  return it->second.handle;
}

bool PrefillAdapter::abort_told(const core::TransferId& transfer) const {
  auto it = entries_.find(transfer);
  return it != entries_.end() && it->second.abort_told;
}

void PrefillAdapter::Call(PrefillRankCall::Kind kind, const core::TransferId& transfer,
                          const Entry& entry, RankState only,
                          const std::vector<core::BlockId>* blocks) {
  for (std::uint32_t r = 0; r < options_.ranks; ++r) {
    if (entry.ranks[r] != only) continue;
    PrefillRankCall call{r, kind, transfer, entry.handle, {}, {}, {}};
    if (blocks != nullptr) call.blocks = *blocks;
    commands_.push_back(std::move(call));
  }
}

PrefillAdapter::Entry* PrefillAdapter::Expecting(std::uint32_t rank,
                                                 const core::TransferId& transfer, Phase phase) {
  auto it = entries_.find(transfer);
  if (it == entries_.end() || rank >= options_.ranks || it->second.phase != phase ||
      it->second.ranks[rank] != RankState::kPending) {
    ++stray_results_;
    return nullptr;
  }
  return &it->second;
}

void PrefillAdapter::AdmissionDone(const core::TransferId& transfer, Entry& entry) {
  if (entry.first_error.ok()) {
    entry.phase = Phase::kAdmitted;
    events_.push_back(Admitted{transfer, entry.handle});
    return;
  }
  // Rollback: the ranks that admitted it forget it; nothing is held anywhere.
  Call(PrefillRankCall::Kind::kEngineFinished, transfer, entry, RankState::kAdmitted, nullptr);
  for (RankState& r : entry.ranks) r = RankState::kNone;
  entry.phase = Phase::kRefused;
  events_.push_back(AdmitRefused{transfer, entry.handle, entry.first_error});
}

void PrefillAdapter::HandOffDone(const core::TransferId& transfer, Entry& entry) {
  entry.phase = Phase::kHeld;
  if (!entry.first_error.ok()) {
    events_.push_back(HandOffFailed{transfer, entry.handle, entry.first_error});
    // No D can complete it without that rank: the others let go (kFreeBlocks follows).
    if (!entry.finished) {
      Call(PrefillRankCall::Kind::kEngineFinished, transfer, entry, RankState::kHolding, nullptr);
    }
  }
  MaybeFree(transfer);
}

void PrefillAdapter::MaybeFree(const core::TransferId& transfer) {
  auto it = entries_.find(transfer);
  if (it == entries_.end()) return;
  Entry& entry = it->second;
  if (entry.phase != Phase::kHeld || entry.holding > 0) return;
  events_.push_back(FreeBlocks{transfer, entry.handle, entry.last_free});
  entries_.erase(it);
}

}  // namespace kvferry::protocol
