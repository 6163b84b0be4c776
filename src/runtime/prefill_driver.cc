#include "runtime/prefill_driver.h"

#include <fmt/format.h>

#include <utility>

namespace kvferry::runtime {

PrefillDriver::PrefillDriver(std::vector<PrefillWorker*> ranks,
                             std::chrono::milliseconds ack_timeout)
    : ranks_(std::move(ranks)),
      ack_timeout_(ack_timeout),
      adapter_({.ranks = static_cast<std::uint32_t>(ranks_.size())}) {}

Status PrefillDriver::Admit(const core::TransferId& transfer, std::uint64_t handle) {
  return adapter_.Admit(transfer, handle);
}

Status PrefillDriver::PrefillDone(const core::TransferId& transfer,
                                  std::vector<core::BlockId> blocks) {
  return adapter_.PrefillDone(transfer, std::move(blocks));
}

bool PrefillDriver::LayersReady(const core::TransferId& transfer, std::uint64_t handle,
                                const std::vector<core::BlockId>& blocks,
                                const std::vector<std::uint32_t>& planes) {
  return adapter_.LayersReady(transfer, handle, blocks, planes);
}

void PrefillDriver::Finish(const core::TransferId& transfer) { adapter_.Finish(transfer); }

void PrefillDriver::Drop(const core::TransferId& transfer, const Status& why) {
  adapter_.Drop(transfer, why);
}

void PrefillDriver::OnHoldEvent(std::uint32_t rank, const core::HoldEvent& event) {
  adapter_.OnHoldEvent(rank, event);
}

Status PrefillDriver::Ack(std::future<Status> f, const char* what) {
  if (f.wait_for(ack_timeout_) != std::future_status::ready) {
    return Status(ErrorCode::kTimeout,
                  fmt::format("the hold table did not acknowledge {} within {} ms", what,
                              ack_timeout_.count()));
  }
  return f.get();
}

std::vector<protocol::PrefillAdapterEvent> PrefillDriver::Pump() {
  using Kind = protocol::PrefillRankCall::Kind;
  for (std::vector<protocol::PrefillRankCall> calls = adapter_.TakeCommands(); !calls.empty();
       calls = adapter_.TakeCommands()) {
    // Every rank's call goes out before any answer is awaited: the ranks work in parallel.
    std::vector<std::future<Status>> acks;
    acks.reserve(calls.size());
    for (const protocol::PrefillRankCall& call : calls) {
      PrefillWorker& worker = *ranks_.at(call.rank);
      switch (call.kind) {
        case Kind::kAdmit:
          acks.push_back(worker.Admit(call.transfer, call.handle));
          break;
        case Kind::kPrefillDone:
          acks.push_back(worker.PrefillDone(call.transfer, call.blocks));
          break;
        case Kind::kEngineFinished:
          acks.push_back(worker.EngineFinished(call.transfer));
          break;
        case Kind::kRefuse:
          acks.push_back(worker.Refuse(call.transfer, call.why));
          break;
        case Kind::kLayersReady:
          // A hint the engine gives mid-step (inside the model's forward): not waited for. The
          // listener takes commands in call order, so the PrefillDone after it sees it.
          acks.push_back(worker.LayersReady(call.transfer, call.blocks, call.planes));
          break;
      }
    }
    for (std::size_t i = 0; i < calls.size(); ++i) {
      const protocol::PrefillRankCall& call = calls[i];
      switch (call.kind) {
        case Kind::kAdmit:
          adapter_.OnAdmitted(call.rank, call.transfer, Ack(std::move(acks[i]), "Admit"));
          break;
        case Kind::kPrefillDone: {
          Status done = Ack(std::move(acks[i]), "PrefillDone");
          // Unknown outcome: the rank may hold it (see the header).
          if (done.code() == ErrorCode::kTimeout) done = Status::Ok();
          adapter_.OnPrefillDone(call.rank, call.transfer, done);
          break;
        }
        case Kind::kEngineFinished:
        case Kind::kRefuse:
          (void)Ack(std::move(acks[i]), "a release");  // best effort: leases bound the rest
          break;
        case Kind::kLayersReady:
          break;
      }
    }
  }
  return adapter_.TakeEvents();
}

}  // namespace kvferry::runtime
