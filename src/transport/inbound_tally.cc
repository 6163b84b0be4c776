#include "inbound_tally.h"

#include <algorithm>

namespace kvferry::transport::internal {

InboundTally::InboundTally(std::size_t max_open) : max_open_(std::max<std::size_t>(1, max_open)) {}

std::optional<ErrorCode> InboundTally::Landed(std::uint64_t sender, std::uint64_t batch,
                                              std::uint32_t op_count, ErrorCode code,
                                              std::uint32_t ops) {
  const Key key{sender, batch};
  auto it = open_.find(key);
  if (it == open_.end()) {
    while (open_.size() >= max_open_) {
      open_.erase(age_.front());
      age_.pop_front();
      ++forgotten_;
    }
    age_.push_back(key);
    it = open_.emplace(key, Batch{0, 0, ErrorCode::kOk, std::prev(age_.end())}).first;
  }
  Batch& b = it->second;
  b.landed += ops;
  b.op_count = op_count;
  if (b.code == ErrorCode::kOk) b.code = code;
  if (b.landed < b.op_count) return std::nullopt;
  const ErrorCode verdict = b.code;
  age_.erase(b.age);
  open_.erase(it);
  return verdict;
}

std::optional<InboundTally::Progress> InboundTally::Find(std::uint64_t sender,
                                                         std::uint64_t batch) const {
  const auto it = open_.find({sender, batch});
  if (it == open_.end()) return std::nullopt;
  return Progress{it->second.landed, it->second.op_count};
}

void InboundTally::ForgetSender(std::uint64_t sender) {
  for (auto it = open_.lower_bound({sender, 0}); it != open_.end() && it->first.first == sender;) {
    age_.erase(it->second.age);
    it = open_.erase(it);
  }
}

}  // namespace kvferry::transport::internal
