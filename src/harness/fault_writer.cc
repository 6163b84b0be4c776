#include "harness/fault_writer.h"

#include <fmt/format.h>

#include <thread>
#include <utility>

namespace kvferry::harness {

FaultInjectingWriter::FaultInjectingWriter(std::shared_ptr<control::KvWriter> inner,
                                           WriteFaults faults)
    : inner_(std::move(inner)), faults_(faults), state_(faults.seed) {}

double FaultInjectingWriter::Next() {
  std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return static_cast<double>((z ^ (z >> 31)) >> 11) / 9007199254740992.0;
}

protocol::WriteOutcome FaultInjectingWriter::Write(const protocol::PullContext& context,
                                                   const protocol::WriteJob& job) {
  bool fail_after_write = false;
  std::chrono::milliseconds delay{0};
  {
    std::lock_guard<std::mutex> lock(mu_);  // both draws together: the stream stays in order
    fail_after_write = Next() < faults_.err_after_write_fraction;
    delay = std::chrono::milliseconds(static_cast<std::int64_t>(
        Next() * static_cast<double>(faults_.max_write_delay.count() + 1)));
  }
  if (delay.count() > 0) std::this_thread::sleep_for(delay);
  protocol::WriteOutcome outcome = inner_->Write(context, job);
  if (outcome.end == protocol::WriteEnd::kLanded && fail_after_write) {
    return protocol::WriteOutcome::Failed(
        Status(ErrorCode::kInternal,
               fmt::format("injected failure after a successful write of {}", job.transfer_id)));
  }
  return outcome;
}

}  // namespace kvferry::harness
