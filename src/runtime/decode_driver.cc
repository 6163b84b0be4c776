#include "runtime/decode_driver.h"

#include <utility>

namespace kvferry::runtime {

DecodeDriver::DecodeDriver(std::vector<DecodeWorker*> ranks, std::size_t max_requests)
    : ranks_(std::move(ranks)),
      adapter_({.ranks = static_cast<std::uint32_t>(ranks_.size()), .max_requests = max_requests}) {
}

Status DecodeDriver::Track(const core::RequestId& request, const RemoteSource& source) {
  return adapter_.Track(request, source);
}

Status DecodeDriver::StartLoad(const core::RequestId& request, const RemoteSource& source,
                               std::vector<core::BlockId> blocks) {
  return adapter_.StartLoad(request, source, std::move(blocks));
}

void DecodeDriver::Finish(const core::RequestId& request) { adapter_.Finish(request); }

void DecodeDriver::Refuse(const RemoteSource& source) { adapter_.Refuse(source); }

void DecodeDriver::OnFinished(std::uint32_t rank, const DecodeFinished& finished) {
  for (const ReceiveResult& result : finished.received) {
    adapter_.OnReceiveDone(rank, result.request, result.ok, result.error, result.quarantined);
  }
  for (const auto& [request, blocks] : finished.released) adapter_.OnReleased(rank, request);
  for (const auto& [request, why] : finished.aborted) {
    adapter_.OnTransferAborted(rank, request, why);
  }
}

std::vector<protocol::AdapterEvent> DecodeDriver::Pump() {
  for (std::vector<protocol::DecodeRankCall> calls = adapter_.TakeCommands(); !calls.empty();
       calls = adapter_.TakeCommands()) {
    for (const protocol::DecodeRankCall& call : calls) {
      DecodeWorker& worker = *ranks_.at(call.rank);
      switch (call.kind) {
        case protocol::DecodeRankCall::Kind::kTrack:
          worker.OnNewRequest(call.request, call.source);
          break;
        case protocol::DecodeRankCall::Kind::kStartLoad:
          if (Status started = worker.StartLoad(call.request, call.source, call.blocks);
              !started.ok()) {
            adapter_.OnStartFailed(call.rank, call.request, started);
          }
          break;
        case protocol::DecodeRankCall::Kind::kFinish:
          worker.RequestFinished(call.request);
          break;
        case protocol::DecodeRankCall::Kind::kRelease:
          worker.ReleaseTransfer(call.source);
          break;
      }
    }
  }
  return adapter_.TakeEvents();
}

}  // namespace kvferry::runtime
