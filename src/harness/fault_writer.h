// FaultInjectingWriter: the serving harness's faults on P's writes (SPEC §8 C), as a decorator
// around the real writer, so that production code carries no fault injection: the write happens
// and is then reported failed (err_after_write_fraction), and/or each write starts after a
// random delay (max_write_delay). Decisions are drawn from a seeded splitmix64 stream, so a run
// with the same seed injects the same faults in the same order of writes.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>

#include "control/side_channel_listener.h"

namespace kvferry::harness {

struct WriteFaults {
  double err_after_write_fraction = 0;           // [0, 1]
  std::chrono::milliseconds max_write_delay{0};  // uniform in [0, max]
  std::uint64_t seed = 1;

  bool any() const { return err_after_write_fraction > 0 || max_write_delay.count() > 0; }
};

class FaultInjectingWriter final : public control::KvWriter {
 public:
  FaultInjectingWriter(std::shared_ptr<control::KvWriter> inner, WriteFaults faults);

  protocol::WriteOutcome Write(const protocol::PullContext& context,
                               const protocol::WriteJob& job) override;
  void CancelWrites() override { inner_->CancelWrites(); }

 private:
  double Next();  // [0, 1), mu_ held

  const std::shared_ptr<control::KvWriter> inner_;
  const WriteFaults faults_;
  std::mutex mu_;  // senders write in parallel
  std::uint64_t state_;
};

}  // namespace kvferry::harness
