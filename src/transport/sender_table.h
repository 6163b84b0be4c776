// SenderTable: a receiving engine's record of the engines that write to it, each with the one
// endpoint back to it (for acks) and the connections it has open.
//
// Why connections and not a count: the record used to count HELLOs and BYEs, and a record
// dropped while some of the sender's connections were open (its endpoint back failed: UCX had
// paired it with one of the sender's connections, and closing that one reset it; the endpoints
// back now live on a worker of their own, ucx_engine.cc) left those connections' BYEs to arrive later and
// count down the record of the sender's next connection: at zero that record went, and every
// ack of the connection still open was dropped (the sender's batches timed out with every op
// landed). A BYE now names its connection (the nonce of its HELLO), and a BYE of a connection
// the record does not hold changes nothing.
//
// Contract (sans-IO: no UCX call here; `Ep` is the caller's endpoint handle, default-constructed
// meaning none): Hello counts connection `nonce` of sender `uid` and says whether the caller must
// open the endpoint back (then SetEndpoint, or Forget if it cannot). A sender holds at most
// kMaxConnections open connections; a HELLO beyond them is refused (kRefused: no answer, so the
// sender's Connect times out) and changes nothing. Bye forgets one connection and, with the
// last, the sender, returning its endpoint for the caller to close. EndpointFailed and Forget
// drop a sender whatever it holds, returning what to close. Ids are the peer's words: any value
// is accepted, and the table is bounded both ways: at most kMaxConnections per sender, and at
// most `max_senders` senders (a HELLO of a new sender beyond them is kRefused too), since each
// sender costs the caller a UCX endpoint back and a peer can claim a new uid per HELLO.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace kvferry::transport {

template <typename Ep>
class SenderTable {
 public:
  static constexpr std::size_t kMaxConnections = 1024;
  // Every P rank of a cluster writing to one D rank is one sender: 4,096 is 8 times a cluster of
  // 64 prefill engines of TP 8, and each costs an endpoint (a socket over tcp).
  static constexpr std::size_t kMaxSenders = 4096;

  enum class HelloResult { kKnown, kOpenEndpoint, kRefused };

  explicit SenderTable(std::size_t max_senders = kMaxSenders) : max_senders_(max_senders) {}

  HelloResult Hello(std::uint64_t uid, std::uint64_t nonce) {
    if (senders_.size() >= max_senders_ && senders_.count(uid) == 0) return HelloResult::kRefused;
    Sender& s = senders_[uid];
    if (s.connections.size() >= kMaxConnections && s.connections.count(nonce) == 0) {
      if (s.connections.empty()) senders_.erase(uid);
      return HelloResult::kRefused;
    }
    s.connections.insert(nonce);
    return s.ep == Ep{} ? HelloResult::kOpenEndpoint : HelloResult::kKnown;
  }

  void SetEndpoint(std::uint64_t uid, Ep ep) {
    auto it = senders_.find(uid);
    if (it != senders_.end()) it->second.ep = ep;
  }

  // The endpoint back to `uid`, or none.
  Ep Endpoint(std::uint64_t uid) const {
    auto it = senders_.find(uid);
    return it == senders_.end() ? Ep{} : it->second.ep;
  }

  // When `nonce` was the sender's last connection: the sender is forgotten, and its endpoint
  // back (possibly none) comes back for the caller to close. nullopt otherwise: connections
  // remain, or the table does not hold this one.
  std::optional<Ep> Bye(std::uint64_t uid, std::uint64_t nonce) {
    auto it = senders_.find(uid);
    if (it == senders_.end() || it->second.connections.erase(nonce) == 0) return std::nullopt;
    if (!it->second.connections.empty()) return std::nullopt;
    Ep ep = it->second.ep;
    senders_.erase(it);
    return ep;
  }

  // The sender whose endpoint back is `ep`, forgotten; nullopt when no sender has it (one
  // forgotten already, whose close is under way).
  std::optional<std::uint64_t> EndpointFailed(Ep ep) {
    if (ep == Ep{}) return std::nullopt;
    for (auto it = senders_.begin(); it != senders_.end(); ++it) {
      if (it->second.ep != ep) continue;
      const std::uint64_t uid = it->first;
      senders_.erase(it);
      return uid;
    }
    return std::nullopt;
  }

  // Drops `uid`; returns its endpoint back (or none) for the caller to close.
  Ep Forget(std::uint64_t uid) {
    auto it = senders_.find(uid);
    if (it == senders_.end()) return Ep{};
    Ep ep = it->second.ep;
    senders_.erase(it);
    return ep;
  }

  // Every endpoint back, and the table emptied (shutdown).
  std::vector<Ep> Clear() {
    std::vector<Ep> eps;
    for (auto& [uid, s] : senders_) {
      if (s.ep != Ep{}) eps.push_back(s.ep);
    }
    senders_.clear();
    return eps;
  }

  std::size_t size() const { return senders_.size(); }
  std::size_t connections(std::uint64_t uid) const {
    auto it = senders_.find(uid);
    return it == senders_.end() ? 0 : it->second.connections.size();
  }

 private:
  struct Sender {
    Ep ep{};
    std::unordered_set<std::uint64_t> connections;  // HELLO nonces not yet said goodbye to
  };
  std::size_t max_senders_;
  std::unordered_map<std::uint64_t, Sender> senders_;
};

// AckMemory: the verdicts a receiving engine sent lately, so that a sender whose ACK was lost can
// ask again (ucx_am_protocol.h, QUERY) and get the same verdict.
//
// Contract (sans-IO): Remember records the verdict `code` of batch `batch` of sender `uid`;
// Find returns it while it is among the last `capacity` keys remembered, nullopt otherwise
// (never remembered, or pushed out by newer keys). Remembering a key again replaces its verdict
// and keeps its place. Memory is bounded by `capacity` whatever the ids: they are the peer's
// words.
class AckMemory {
 public:
  explicit AckMemory(std::size_t capacity) : capacity_(capacity) {}

  void Remember(std::uint64_t uid, std::uint64_t batch, std::uint32_t code) {
    const Key key{uid, batch};
    auto [it, inserted] = verdicts_.insert_or_assign(key, code);
    if (!inserted) return;  // keeps its place in the order
    order_.push_back(key);
    while (order_.size() > capacity_) {
      verdicts_.erase(order_.front());
      order_.pop_front();
    }
  }

  std::optional<std::uint32_t> Find(std::uint64_t uid, std::uint64_t batch) const {
    auto it = verdicts_.find(Key{uid, batch});
    if (it == verdicts_.end()) return std::nullopt;
    return it->second;
  }

  std::size_t size() const { return verdicts_.size(); }

 private:
  struct Key {
    std::uint64_t uid;
    std::uint64_t batch;
    bool operator==(const Key&) const = default;
  };
  struct KeyHash {
    std::size_t operator()(const Key& k) const {
      return std::hash<std::uint64_t>()(k.uid) ^ (std::hash<std::uint64_t>()(k.batch) * 31);
    }
  };
  std::size_t capacity_;
  std::unordered_map<Key, std::uint32_t, KeyHash> verdicts_;
  std::deque<Key> order_;
};

}  // namespace kvferry::transport
