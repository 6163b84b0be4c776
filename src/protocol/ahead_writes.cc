#include "protocol/ahead_writes.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

namespace kvferry::protocol {

bool AheadWrites::Note(const RequestRef& ref, std::span<const core::BlockId> blocks,
                       std::span<const std::uint32_t> planes,
                       std::shared_ptr<const std::vector<core::BlockId>>& shared) {
  Request& r = requests_[ref];
  if (r.blocks == nullptr) {
    if (shared == nullptr) {
      shared = std::make_shared<const std::vector<core::BlockId>>(blocks.begin(), blocks.end());
    }
    r.blocks = shared;
    r.planes.assign(num_planes_, false);
  } else if (!std::equal(r.blocks->begin(), r.blocks->end(), blocks.begin(), blocks.end())) {
    return false;  // other blocks than the first call's: PrefillDone's write covers every plane
  }
  if (r.outcome.end != WriteEnd::kLanded) return false;  // the request fails: nothing more
  for (std::uint32_t plane : planes) {
    const bool queued = std::find(r.queued.begin(), r.queued.end(), plane) != r.queued.end();
    if (!r.planes[plane] && !queued) r.queued.push_back(plane);
  }
  return r.in_flight == 0 && !r.queued.empty();
}

const std::vector<core::BlockId>* AheadWrites::Blocks(const RequestRef& ref) const {
  auto it = requests_.find(ref);
  return it == requests_.end() ? nullptr : it->second.blocks.get();
}

std::vector<std::uint32_t> AheadWrites::Begin(const RequestRef& ref,
                                              const core::TransferId& transfer) {
  auto it = requests_.find(ref);
  if (it == requests_.end() || it->second.queued.empty()) return {};
  Request& r = it->second;
  std::vector<std::uint32_t> planes = std::exchange(r.queued, {});
  std::sort(planes.begin(), planes.end());
  for (std::uint32_t plane : planes) r.planes[plane] = true;
  ++r.in_flight;
  ++reads_[transfer];
  return planes;
}

void AheadWrites::DropQueued(const RequestRef& ref) {
  auto it = requests_.find(ref);
  if (it != requests_.end()) it->second.queued.clear();
}

AheadWrites::Ended AheadWrites::End(const RequestRef& ref, const core::TransferId& transfer,
                                    const WriteOutcome& outcome) {
  Ended ended;
  auto reads = reads_.find(transfer);
  if (reads != reads_.end() && --reads->second == 0) {
    reads_.erase(reads);
    auto held = held_frees_.find(transfer);
    if (held != held_frees_.end()) {
      ended.freed = std::move(held->second);
      held_frees_.erase(held);
    }
  }
  auto it = requests_.find(ref);
  if (it == requests_.end()) return ended;  // unreachable: an entry goes once none is in flight
  ended.known = true;
  Request& r = it->second;
  --r.in_flight;
  if (outcome.end != WriteEnd::kLanded) {
    r.queued.clear();  // the request fails: what was computed meanwhile is never written
    // The reason kept is the first failure's, or the first unsettled one's: D must quarantine.
    const bool worse = r.outcome.end == WriteEnd::kLanded ||
                       (r.outcome.end == WriteEnd::kFailed && outcome.end == WriteEnd::kUnsettled);
    if (worse) {
      const Status& why = outcome.status;
      r.outcome = {
          outcome.end,
          Status(why.ok() ? ErrorCode::kInternal : why.code(),
                 fmt::format("write of {} (layers before the prefill's end) failed{}: {}", transfer,
                             outcome.end == WriteEnd::kUnsettled ? " and may still land" : "",
                             why.message()))};
    }
  }
  if (r.in_flight != 0) return ended;
  if (r.listing) {
    ended.then = Ended::Then::kList;
    ended.listing = std::move(r.listing);
    r.listing.reset();
  } else if (r.send_pending) {
    r.send_pending = false;
    ended.then = Ended::Then::kSend;  // its write covers the queued planes
  } else if (r.outcome.end == WriteEnd::kLanded && !r.queued.empty()) {
    ended.then = Ended::Then::kWriteMore;  // the layers computed while this one was written
  }
  return ended;
}

bool AheadWrites::InFlight(const RequestRef& ref) const {
  auto it = requests_.find(ref);
  return it != requests_.end() && it->second.in_flight > 0;
}

void AheadWrites::HoldSend(const RequestRef& ref) {
  auto it = requests_.find(ref);
  if (it != requests_.end() && it->second.in_flight > 0) it->second.send_pending = true;
}

bool AheadWrites::Defer(const RequestRef& ref, Listing listing) {
  auto it = requests_.find(ref);
  if (it == requests_.end() || it->second.in_flight == 0) return false;
  it->second.listing = std::move(listing);
  return true;
}

const WriteOutcome* AheadWrites::Failure(const RequestRef& ref) const {
  auto it = requests_.find(ref);
  if (it == requests_.end() || it->second.outcome.end == WriteEnd::kLanded) return nullptr;
  return &it->second.outcome;
}

std::optional<std::vector<std::uint32_t>> AheadWrites::PlanesLeft(
    const RequestRef& ref, std::span<const core::BlockId> source) const {
  std::vector<std::uint32_t> planes;
  auto it = requests_.find(ref);
  if (it == requests_.end()) return planes;
  const Request& r = it->second;
  if (r.blocks == nullptr ||
      !std::equal(r.blocks->begin(), r.blocks->end(), source.begin(), source.end())) {
    return planes;  // they read other blocks than PrefillDone named: every plane again
  }
  for (std::uint32_t p = 0; p < r.planes.size(); ++p) {
    if (!r.planes[p]) planes.push_back(p);
  }
  if (planes.empty()) return std::nullopt;               // every plane landed ahead
  if (planes.size() == r.planes.size()) planes.clear();  // every plane: the plain job
  return planes;
}

void AheadWrites::Forget(const RequestRef& ref) { requests_.erase(ref); }

bool AheadWrites::HoldFree(core::HoldEvent& event) {
  if (reads_.count(event.id) == 0) return false;
  held_frees_.emplace(event.id, std::move(event));
  return true;
}

}  // namespace kvferry::protocol
