#include "control_network.h"

#include <fmt/format.h>

#include <algorithm>

namespace kvferry::sim {

std::uint64_t Msg::Bytes() const {
  struct Size {
    std::uint64_t operator()(const wire::Pull& m) const {
      std::uint64_t n = 96;
      for (const wire::PullRequest& r : m.requests) n += 24 + 4 * r.block_ids.size();
      return n;
    }
    std::uint64_t operator()(const wire::Renewal& m) const {
      return 48 + 7 * m.fingerprints.size();
    }
    std::uint64_t operator()(const wire::PullResponse& m) const {
      return 32 + 16 * (m.ok.size() + m.err.size());
    }
    std::uint64_t operator()(const wire::RenewalReply&) const { return 48; }
    std::uint64_t operator()(const wire::Release& m) const {
      return 48 + 7 * m.fingerprints.size();
    }
    std::uint64_t operator()(const wire::ReleaseReply&) const { return 48; }
    std::uint64_t operator()(const wire::AbortNotice& m) const {
      std::uint64_t n = 32;
      for (const wire::AbortedTransfer& a : m.aborted)
        n += 8 + a.transfer_id.size() + a.reason.size();
      return n;
    }
  };
  return std::visit(Size{}, body);
}

// Link ids (FIFO order): P process · 2^21 + direction · 2^20 + d_rank · 2^10 + p_rank.
void ControlNetwork::Send(bool to_p, const Link& to, Msg::Body body) {
  const std::uint32_t d_rank = to.d_rank;
  const std::uint32_t p_rank = to.p_rank;
  auto m = std::make_shared<Msg>();
  m->d_rank = d_rank;
  m->p_rank = p_rank;
  m->p_gen = to.p_gen;
  m->d_endpoint = to.d_endpoint;
  m->body = std::move(body);
  const NetConfig& n = config_;
  const bool best_effort = std::holds_alternative<wire::Release>(m->body) ||
                           std::holds_alternative<wire::AbortNotice>(m->body);
  if (rng_.Chance(n.loss) || (best_effort && rng_.Chance(n.release_loss))) {
    loop_.Note(0x1055, static_cast<std::uint64_t>(m->body.index()));
    return;
  }
  const int copies = 1 + (rng_.Chance(n.duplicate) ? 1 : 0);
  const std::uint64_t link = (std::uint64_t{to.p_gen} << 21) | (to_p ? 1u << 20 : 0u) |
                             (d_rank << 10) | p_rank;
  for (int i = 0; i < copies; ++i) {
    core::TimePoint t =
        loop_.now() + n.latency + core::Seconds(static_cast<double>(m->Bytes()) / n.bytes_per_s);
    if (n.jitter.count() > 0) t += rng_.Span(Duration{0}, n.jitter);
    if (rng_.Chance(n.delay_prob)) t += rng_.Span(Duration{0}, n.delay_max);
    if (!rng_.Chance(n.reorder)) {
      core::TimePoint& last = link_last_[link];
      t = std::max(t, last);
      last = t;
    }
    loop_.Schedule(t, deliver_kind_, link, [this, to_p, m] { deliver_(to_p, *m); });
  }
}

protocol::PeerAddress PeerOf(const Msg& m) {
  return fmt::format("d{}/{}", m.d_rank, m.d_endpoint);
}

std::pair<std::uint32_t, protocol::EndpointId> SocketOf(const protocol::PeerAddress& peer) {
  const std::size_t slash = peer.find('/');
  return {static_cast<std::uint32_t>(std::stoul(peer.substr(1, slash - 1))),
          static_cast<protocol::EndpointId>(std::stoul(peer.substr(slash + 1)))};
}

std::uint32_t PRankOf(const std::string& address) {
  return static_cast<std::uint32_t>(std::stoul(address.substr(1)));
}

}  // namespace kvferry::sim
