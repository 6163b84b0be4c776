#include "protocol/decode_adapter.h"

#include <fmt/format.h>

#include <utility>

namespace kvferry::protocol {

DecodeAdapter::DecodeAdapter(DecodeAdapterOptions options) : options_(options) {
  if (options_.ranks == 0) options_.ranks = 1;
}

Status DecodeAdapter::CheckNew(const core::RequestId& request, const RemoteSource& source) const {
  if (request.empty() || source.transfer_id.empty()) {
    return Status(ErrorCode::kInvalidArgument, "a remote-prefill request needs a request id and "
                                               "a transfer id");
  }
  if (entries_.size() >= options_.max_requests) {
    return Status(ErrorCode::kResourceExhausted,
                  fmt::format("{} requests tracked, the limit is {}", entries_.size(),
                              options_.max_requests));
  }
  return Status::Ok();
}

Status DecodeAdapter::Track(const core::RequestId& request, const RemoteSource& source) {
  if (auto it = entries_.find(request); it != entries_.end()) {
    return Status(ErrorCode::kAlreadyExists,
                  fmt::format("request {} is already tracked (transfer {})", request,
                              it->second.source.transfer_id));
  }
  if (Status s = CheckNew(request, source); !s.ok()) return s;
  Entry& entry = entries_[request];
  entry.source = source;
  entry.ranks.assign(options_.ranks, RankState::kIdle);
  Call(DecodeRankCall::Kind::kTrack, request, entry, nullptr);
  return Status::Ok();
}

Status DecodeAdapter::StartLoad(const core::RequestId& request, const RemoteSource& source,
                                std::vector<core::BlockId> blocks) {
  auto it = entries_.find(request);
  if (it == entries_.end()) {
    if (Status s = CheckNew(request, source); !s.ok()) return s;
    it = entries_.emplace(request, Entry{}).first;
    it->second.source = source;
    it->second.ranks.assign(options_.ranks, RankState::kIdle);
  } else if (it->second.load_started) {
    return Status(ErrorCode::kAlreadyExists,
                  fmt::format("request {} is loading or loaded already", request));
  }
  Entry& entry = it->second;
  entry.load_started = true;
  if (entry.dropped) {
    // P serves no pull for it: nothing is sent, so nothing can write its blocks.
    entry.load_done = true;
    events_.push_back(LoadDone{
        request,
        Status(entry.drop_reason.code(),
               "KV transfer aborted by the prefill instance: " + entry.drop_reason.message()),
        false});
    Settle(request);
    return Status::Ok();
  }
  entry.source = source;
  entry.ranks.assign(options_.ranks, RankState::kLoading);
  entry.ranks_loading = options_.ranks;
  Call(DecodeRankCall::Kind::kStartLoad, request, entry, &blocks);
  return Status::Ok();
}

void DecodeAdapter::Finish(const core::RequestId& request) {
  auto it = entries_.find(request);
  if (it == entries_.end() || it->second.finished) return;
  it->second.finished = true;
  Call(DecodeRankCall::Kind::kFinish, request, it->second, nullptr);
  Settle(request);
}

void DecodeAdapter::Refuse(const RemoteSource& source) {
  if (source.transfer_id.empty()) return;
  for (std::uint32_t r = 0; r < options_.ranks; ++r) {
    commands_.push_back(DecodeRankCall{r, DecodeRankCall::Kind::kRelease, {}, source, {}});
  }
}

void DecodeAdapter::OnStartFailed(std::uint32_t rank, const core::RequestId& request,
                                  const Status& why) {
  Entry* entry = Loading(rank, request);
  if (entry != nullptr) RankEnded(request, *entry, rank, false, why, false);
}

void DecodeAdapter::OnReceiveDone(std::uint32_t rank, const core::RequestId& request, bool ok,
                                  const Status& error, bool quarantined) {
  Entry* entry = Loading(rank, request);
  if (entry != nullptr) RankEnded(request, *entry, rank, ok, error, quarantined);
}

void DecodeAdapter::OnReleased(std::uint32_t rank, const core::RequestId& request) {
  auto it = entries_.find(request);
  if (it == entries_.end() || rank >= options_.ranks ||
      it->second.ranks[rank] != RankState::kQuarantined) {
    ++stray_results_;
    return;
  }
  it->second.ranks[rank] = RankState::kEnded;
  --it->second.ranks_quarantined;
  Settle(request);
}

void DecodeAdapter::OnTransferAborted(std::uint32_t rank, const core::RequestId& request,
                                      const Status& why) {
  (void)rank;  // every rank hears P's notice; the first one decides
  auto it = entries_.find(request);
  if (it == entries_.end() || it->second.load_started || it->second.dropped) return;
  it->second.dropped = true;
  it->second.drop_reason = why;
  ++dropped_;
  events_.push_back(TransferDropped{request, why});
}

DecodeAdapterStopReport DecodeAdapter::Stop() {
  DecodeAdapterStopReport report;
  for (const auto& [request, entry] : entries_) {
    if (entry.ranks_loading > 0) ++report.loading;
    if (entry.ranks_quarantined > 0) ++report.quarantined;
  }
  entries_.clear();
  commands_.clear();
  events_.clear();
  return report;
}

std::vector<DecodeRankCall> DecodeAdapter::TakeCommands() { return std::exchange(commands_, {}); }

std::vector<AdapterEvent> DecodeAdapter::TakeEvents() { return std::exchange(events_, {}); }

DecodeAdapterStats DecodeAdapter::stats() const {
  DecodeAdapterStats s;
  s.tracked = entries_.size();
  for (const auto& [request, entry] : entries_) {
    if (entry.ranks_loading > 0) ++s.loading;
    if (entry.load_done && entry.ranks_quarantined > 0) ++s.quarantined;
  }
  s.stray_results = stray_results_;
  s.dropped = dropped_;
  return s;
}

void DecodeAdapter::Call(DecodeRankCall::Kind kind, const core::RequestId& request, const Entry& entry,
                         const std::vector<core::BlockId>* blocks) {
  for (std::uint32_t r = 0; r < options_.ranks; ++r) {
    DecodeRankCall call{r, kind, request, entry.source, {}};
    if (blocks != nullptr) call.blocks = *blocks;
    commands_.push_back(std::move(call));
  }
}

DecodeAdapter::Entry* DecodeAdapter::Loading(std::uint32_t rank, const core::RequestId& request) {
  auto it = entries_.find(request);
  if (it == entries_.end() || rank >= options_.ranks ||
      it->second.ranks[rank] != RankState::kLoading) {
    ++stray_results_;
    return nullptr;
  }
  return &it->second;
}

void DecodeAdapter::RankEnded(const core::RequestId& request, Entry& entry, std::uint32_t rank,
                              bool ok, const Status& error, bool quarantined) {
  entry.ranks[rank] = quarantined ? RankState::kQuarantined : RankState::kEnded;
  if (quarantined) ++entry.ranks_quarantined;
  --entry.ranks_loading;
  if (!ok && entry.first_error.ok()) {
    entry.first_error = error.ok() ? Status(ErrorCode::kInternal,
                                            fmt::format("rank {} failed without a reason", rank))
                                   : error;
  }
  if (entry.ranks_loading > 0) return;
  entry.load_done = true;
  entry.quarantined_at_done = entry.ranks_quarantined > 0;
  events_.push_back(LoadDone{request, entry.first_error, entry.quarantined_at_done});
  Settle(request);
}

void DecodeAdapter::Settle(const core::RequestId& request) {
  auto it = entries_.find(request);
  if (it == entries_.end()) return;
  Entry& entry = it->second;
  if (entry.load_done && !entry.reusable && entry.ranks_quarantined == 0) {
    entry.reusable = true;
    events_.push_back(BlocksReusable{request, entry.quarantined_at_done});
  }
  if (entry.finished && (!entry.load_started || entry.reusable)) entries_.erase(it);
}

}  // namespace kvferry::protocol
