// EndpointPool: a decoder's side channels to P workers, one per address, and which of them may
// close. Sans-IO: an endpoint here is an id and the caller's state for it; the pump opens the
// socket for an id on the first message to it and closes it when TakeClosed() names it.
//
// The rules it keeps (DecodeSession's, each with a test in decode_session_test.cc):
//  - At most `max_open` endpoints are open. Acquire() for a new address closes the least
//    recently idle one to make room; when every open one is busy it returns nullopt, and the
//    caller fails its message (nothing waits for a socket).
//  - An endpoint is idle once the caller says it may be (NoteMaybeIdle) and its `busy`
//    predicate is false at the next CloseIdle(). Idle ones form an LRU list; those beyond
//    `max_idle` close. A busy endpoint never closes: something in flight on it may still be
//    answered there.
//  - Ids are never reused. An endpoint closed and opened again for one address is another
//    socket, so nothing meant for the old one reaches the new one.
//  - The addresses of the last kRememberedClosed closed endpoints stay known (AddressOf): a
//    message's unsent report may come after its endpoint closed, and it still says that nobody
//    listens at that address.
//
// `State` is the caller's per-endpoint state; it has a `std::string address`, which the pool
// sets when it opens the endpoint. Not thread-safe: one owner calls everything.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvferry::protocol {

using EndpointId = std::uint32_t;

template <class State>
class EndpointPool {
 public:
  static constexpr std::size_t kRememberedClosed = 1024;

  EndpointPool(std::size_t max_open, std::size_t max_idle)
      : max_open_(max_open), max_idle_(max_idle) {}

  // The endpoint of `address`, opened if needed; an idle one is in use again. nullopt when
  // max_open are open and none is idle. Only endpoints already idle close here (the caller may
  // hold ids it just got); `on_close(id)` runs for each before it goes.
  template <class OnClose>
  [[nodiscard]] std::optional<EndpointId> Acquire(const std::string& address, OnClose&& on_close) {
    if (auto known = id_of_.find(address); known != id_of_.end()) {
      if (auto idle = idle_at_.find(known->second); idle != idle_at_.end()) {
        idle_.erase(idle->second);
        idle_at_.erase(idle);
      }
      return known->second;
    }
    if (open_.size() >= max_open_) {
      if (idle_.empty()) return std::nullopt;
      Close(idle_.back(), on_close);
    }
    const EndpointId id = next_id_++;
    id_of_.emplace(address, id);
    State state{};
    state.address = address;
    open_.emplace(id, std::move(state));
    return id;
  }

  // Something in flight on `id` ended: it may be idle now (CloseIdle decides).
  void NoteMaybeIdle(EndpointId id) { maybe_idle_.insert(id); }

  // Endpoints noted maybe idle whose `busy(state)` is false join the idle list; those beyond
  // max_idle close (least recently idle first), `on_close(id)` running for each.
  template <class Busy, class OnClose>
  void CloseIdle(Busy&& busy, OnClose&& on_close) {
    for (EndpointId id : std::exchange(maybe_idle_, {})) {
      const State* state = Find(id);
      if (state == nullptr || busy(*state) || idle_at_.count(id) != 0) continue;
      idle_.push_front(id);
      idle_at_[id] = idle_.begin();
    }
    while (idle_.size() > max_idle_) Close(idle_.back(), on_close);
  }

  // The endpoints closed since the last call, for the pump to close their sockets.
  [[nodiscard]] std::vector<EndpointId> TakeClosed() { return std::exchange(closed_out_, {}); }

  // An open endpoint's state, or nullptr.
  [[nodiscard]] State* Find(EndpointId id) {
    auto it = open_.find(id);
    return it == open_.end() ? nullptr : &it->second;
  }
  [[nodiscard]] const State* Find(EndpointId id) const {
    auto it = open_.find(id);
    return it == open_.end() ? nullptr : &it->second;
  }
  // An open endpoint's state; `id` must be open.
  [[nodiscard]] State& At(EndpointId id) { return open_.at(id); }
  // The open endpoint of `address`, if any.
  [[nodiscard]] std::optional<EndpointId> IdOf(const std::string& address) const {
    auto it = id_of_.find(address);
    return it == id_of_.end() ? std::nullopt : std::optional<EndpointId>(it->second);
  }
  // The address of an open endpoint or of one of the last kRememberedClosed closed; nullptr
  // for any other id.
  [[nodiscard]] const std::string* AddressOf(EndpointId id) const {
    if (auto it = open_.find(id); it != open_.end()) return &it->second.address;
    if (auto it = closed_address_.find(id); it != closed_address_.end()) return &it->second;
    return nullptr;
  }

  [[nodiscard]] std::size_t size() const { return open_.size(); }
  // The open endpoints, as (id, state) pairs.
  auto begin() { return open_.begin(); }
  auto end() { return open_.end(); }
  auto begin() const { return open_.begin(); }
  auto end() const { return open_.end(); }

 private:
  template <class OnClose>
  void Close(EndpointId id, OnClose& on_close) {
    on_close(id);
    idle_.erase(idle_at_.at(id));
    idle_at_.erase(id);
    auto it = open_.find(id);
    id_of_.erase(it->second.address);
    closed_address_.emplace(id, std::move(it->second.address));
    if (closed_address_.size() > kRememberedClosed) closed_address_.erase(closed_address_.begin());
    open_.erase(it);
    closed_out_.push_back(id);
  }

  const std::size_t max_open_;
  const std::size_t max_idle_;
  std::unordered_map<EndpointId, State> open_;
  std::unordered_map<std::string, EndpointId> id_of_;
  EndpointId next_id_ = 0;
  std::list<EndpointId> idle_;  // most recently idle first
  std::unordered_map<EndpointId, std::list<EndpointId>::iterator> idle_at_;
  std::set<EndpointId> maybe_idle_;
  // By id: ids only grow, so the oldest is begin().
  std::map<EndpointId, std::string> closed_address_;
  std::vector<EndpointId> closed_out_;
};

}  // namespace kvferry::protocol
