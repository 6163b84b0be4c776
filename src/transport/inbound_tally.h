// InboundTally: the receiving engine's count of how much of each inbound batch has landed, so
// that the batch's one ACK (ucx_am_protocol.h) goes out when its last op lands or is refused.
//
// Batches are keyed by (sender uid, batch id) as the senders' headers say, and a sender can open
// batches it never finishes (a lost message, a bug, or a peer that means harm: the data plane
// takes any process that has this worker's address). So the tally is bounded: at most
// `max_open` batches are open at once, and opening one more forgets the longest-open batch,
// which then gets no ACK. Its sender times it out and reports it unsettled, which is what a
// write whose fate is unknown must be (D quarantines its blocks until a fence), so forgetting
// costs latency, never correctness. A healthy receiver is far below the bound: each sender keeps
// a few batches in flight (a P rank's writer, one per sender thread).
//
// Plain data, no UCX and no clock: the engine's progress thread owns it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <optional>
#include <utility>

#include "kvferry/status.h"

namespace kvferry::transport::internal {

class InboundTally {
 public:
  // 64 Ki open batches: ~100 bytes each, ~6.5 MB at most; hundreds of senders with their
  // batches in flight fit many times over.
  static constexpr std::size_t kDefaultMaxOpen = 1 << 16;

  explicit InboundTally(std::size_t max_open = kDefaultMaxOpen);

  // `ops` ops of batch `batch` from `sender`, a batch of `op_count` ops (> 0), landed with
  // `code` (kOk, or why they were refused). Returns the batch's verdict once every op is
  // accounted for: the first error among its ops, or kOk; nullopt while ops are still to come.
  // A batch with no open entry is opened first, forgetting the longest-open one when max_open
  // are open (counted in forgotten()). `op_count` as the batch's latest message says.
  std::optional<ErrorCode> Landed(std::uint64_t sender, std::uint64_t batch,
                                  std::uint32_t op_count, ErrorCode code, std::uint32_t ops = 1);

  // A sender gone (its goodbye, or its endpoint back failed): its open batches are dropped.
  void ForgetSender(std::uint64_t sender);

  // How far an open batch is (for logs): ops landed so far and the batch's op count.
  struct Progress {
    std::uint64_t landed;
    std::uint32_t op_count;
  };
  std::optional<Progress> Find(std::uint64_t sender, std::uint64_t batch) const;

  std::size_t open() const { return open_.size(); }
  // Batches forgotten to stay within max_open since this tally was made.
  std::uint64_t forgotten() const { return forgotten_; }

 private:
  using Key = std::pair<std::uint64_t, std::uint64_t>;  // sender uid, batch id
  struct Batch {
    std::uint64_t landed = 0;  // 64 bits: `ops` can add up past op_count's range
    std::uint32_t op_count = 0;
    ErrorCode code = ErrorCode::kOk;
    std::list<Key>::iterator age;  // where it is in age_
  };
  std::size_t max_open_;
  std::map<Key, Batch> open_;  // ordered: ForgetSender finds a sender's batches as a range
  std::list<Key> age_;         // open batches, longest-open first
  std::uint64_t forgotten_ = 0;
};

}  // namespace kvferry::transport::internal
