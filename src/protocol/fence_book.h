// FenceBook: a decoder's ledger peers — one epoch of one P process reached through one
// endpoint — and the fences that prove an epoch's writers stopped. Sans-IO: a fence here is an id;
// the caller asks the data plane for it (FenceRequest) and reports the result.
//
// The rules it keeps (DecodeSession's, each with a test in fence_book_test.cc or
// decode_session_test.cc):
//  - One peer id per (endpoint, incarnation, epoch), never reused: a new epoch (bumped when a
//    fence is asked for) or another process behind the same address is another writer, and no
//    proof about one may release the blocks of another.
//  - A peer is fenced at most once at a time, and never again once a fence proved it stopped
//    (Quiesced): Start() returns nullopt then.
//  - A fence that timed out (writes still landing) is asked again after 1 s, then 2, 4, ... up to
//    60 s (ScheduleRetry); any other outcome, or proof, clears the back-off.
//  - Closing an endpoint forgets its peers (ForgetEndpoint). The caller keeps an endpoint open
//    while a fence of it is in flight, so no fence in flight names a forgotten peer; a retry due
//    for one is dropped by the caller (its pulls are gone with the endpoint).
//
// Not thread-safe: one owner calls everything.
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "kvferry/core/receive_ledger.h"
#include "kvferry/core/time.h"
#include "protocol/endpoint_pool.h"

namespace kvferry::protocol {

class FenceBook {
 public:
  // A ledger peer: one epoch of one P rank of one incarnation, reached through one endpoint.
  struct PeerKey {
    EndpointId endpoint;
    std::string incarnation;
    std::uint32_t epoch;
    auto operator<=>(const PeerKey&) const = default;
  };
  // A fence in flight: the endpoint it goes through and the epoch it covers.
  struct Fence {
    EndpointId endpoint;
    core::PeerId peer;
  };

  // How long a fence that timed out waits before it is asked again: the first wait, doubled per
  // timeout up to the last. Why these values: decode_session.cc, kFenceRetry*.
  FenceBook(core::Duration retry_first, core::Duration retry_max)
      : retry_first_(retry_first), retry_max_(retry_max) {}

  // The peer of `key`, made on first use.
  core::PeerId PeerFor(const PeerKey& key);
  // The key of a peer PeerFor made and ForgetEndpoint has not forgotten; nullptr otherwise.
  const PeerKey* Find(core::PeerId peer) const;
  // The key of a peer Find knows (a precondition: std::out_of_range otherwise).
  const PeerKey& At(core::PeerId peer) const { return keys_.at(peer); }
  // Forgets every peer of `endpoint` (it closed), with their proof and back-off.
  void ForgetEndpoint(EndpointId endpoint);

  // Starts a fence of `peer` (which Find knows): its id, or nullopt when the peer is proved
  // stopped or a fence of it is in flight already.
  std::optional<std::uint64_t> Start(core::PeerId peer);
  // The fence `id` ended: what it covered (no longer in flight), or nullopt if `id` is unknown.
  std::optional<Fence> Finish(std::uint64_t id);
  // A fence proved `peer` stopped: nothing of its epoch can land any more.
  void MarkQuiesced(core::PeerId peer);
  bool Quiesced(core::PeerId peer) const { return quiesced_.count(peer) != 0; }

  // A fence of `peer` timed out at `now`: it is due again after the next back-off.
  void ScheduleRetry(core::PeerId peer, core::TimePoint now);
  // No retry of `peer` is needed any more (answered, or a fence that can never succeed).
  void ClearBackoff(core::PeerId peer) { backoff_.erase(peer); }
  // The peers whose retry is due at `now`, taken out in due order.
  std::vector<core::PeerId> TakeDueRetries(core::TimePoint now);
  // When the next retry is due; kNever if none is scheduled.
  core::TimePoint NextRetry() const;

  std::size_t fences_in_flight() const { return fences_.size(); }

 private:
  const core::Duration retry_first_;
  const core::Duration retry_max_;
  std::map<PeerKey, core::PeerId> peers_;
  std::unordered_map<core::PeerId, PeerKey> keys_;
  core::PeerId next_peer_ = 0;
  std::unordered_set<core::PeerId> quiesced_;
  std::map<std::uint64_t, Fence> fences_;     // in flight, by id
  std::unordered_set<core::PeerId> fencing_;  // peers with a fence in flight
  std::uint64_t next_fence_ = 1;
  std::set<std::pair<core::TimePoint, core::PeerId>> retries_;
  std::unordered_map<core::PeerId, core::Duration> backoff_;
};

}  // namespace kvferry::protocol
