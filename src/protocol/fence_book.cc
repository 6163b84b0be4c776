#include "protocol/fence_book.h"

#include <algorithm>

namespace kvferry::protocol {

core::PeerId FenceBook::PeerFor(const PeerKey& key) {
  auto [it, inserted] = peers_.try_emplace(key, 0);
  if (inserted) {
    it->second = next_peer_++;
    keys_.emplace(it->second, key);
  }
  return it->second;
}

const FenceBook::PeerKey* FenceBook::Find(core::PeerId peer) const {
  auto it = keys_.find(peer);
  return it == keys_.end() ? nullptr : &it->second;
}

void FenceBook::ForgetEndpoint(EndpointId endpoint) {
  for (auto peer = peers_.lower_bound(PeerKey{endpoint, "", 0});
       peer != peers_.end() && peer->first.endpoint == endpoint;) {
    keys_.erase(peer->second);
    quiesced_.erase(peer->second);
    backoff_.erase(peer->second);
    peer = peers_.erase(peer);
  }
}

std::optional<std::uint64_t> FenceBook::Start(core::PeerId peer) {
  if (quiesced_.count(peer) != 0 || fencing_.count(peer) != 0) return std::nullopt;
  const EndpointId endpoint = keys_.at(peer).endpoint;  // a broken precondition changes nothing
  const std::uint64_t id = next_fence_++;
  fencing_.insert(peer);
  fences_.emplace(id, Fence{endpoint, peer});
  return id;
}

std::optional<FenceBook::Fence> FenceBook::Finish(std::uint64_t id) {
  auto it = fences_.find(id);
  if (it == fences_.end()) return std::nullopt;
  const Fence fence = it->second;
  fences_.erase(it);
  fencing_.erase(fence.peer);
  return fence;
}

void FenceBook::MarkQuiesced(core::PeerId peer) {
  backoff_.erase(peer);
  quiesced_.insert(peer);
}

void FenceBook::ScheduleRetry(core::PeerId peer, core::TimePoint now) {
  core::Duration& backoff = backoff_[peer];
  backoff = backoff.count() == 0 ? retry_first_ : std::min(2 * backoff, retry_max_);
  retries_.insert({now + backoff, peer});
}

std::vector<core::PeerId> FenceBook::TakeDueRetries(core::TimePoint now) {
  std::vector<core::PeerId> due;
  while (!retries_.empty() && retries_.begin()->first <= now) {
    due.push_back(retries_.begin()->second);
    retries_.erase(retries_.begin());
  }
  return due;
}

core::TimePoint FenceBook::NextRetry() const {
  return retries_.empty() ? core::kNever : retries_.begin()->first;
}

}  // namespace kvferry::protocol
