// ControlNetwork: the simulated side channel between D's ranks and P's ranks.
//
// Each (P process, direction, D rank, P rank) is one FIFO link, as one TCP connection is; a
// message costs latency + its estimated size / bandwidth, plus the NetConfig's jitter. A message
// is lost, duplicated, held up or reordered as NetConfig says, each decided by one draw from the
// run's Rng, in send order, so a run stays a pure function of its seed. Delivery is an event of
// the run's EventLoop that hands the message to the callback given at construction.
//
// What the network does not do: read or judge messages. The codec, the sessions and the checks
// belong to the simulator (cluster.cc); this class only decides when, and whether, a message
// arrives.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <variant>

#include "cluster.h"
#include "event_loop.h"
#include "protocol/endpoint_pool.h"
#include "protocol/prefill_session.h"
#include "rng.h"
#include "wire/messages.h"

namespace kvferry::sim {

// A side-channel message on a simulated link: the wire struct itself. With NetConfig::codec on
// (the default), P's session gets the encoded bytes (OnMessage) and D decodes what P sent, so
// the codec runs on every message of every run.
struct Msg {
  using Body = std::variant<wire::Pull, wire::Renewal, wire::PullResponse, wire::RenewalReply,
                            wire::Release, wire::ReleaseReply, wire::AbortNotice>;
  std::uint32_t d_rank = 0;
  std::uint32_t p_rank = 0;
  std::uint32_t p_gen = 0;               // the P process at the link's end (Faults::p_restarts)
  protocol::EndpointId d_endpoint = 0;  // D's socket at the link's end
  Body body;

  // Bytes on the wire, estimated (for the link's transmit time).
  std::uint64_t Bytes() const;
};
using MsgPtr = std::shared_ptr<const Msg>;

// One connection: D rank `d_rank`'s socket `d_endpoint` to P rank `p_rank` of P process
// `p_gen`.
struct Link {
  std::uint32_t d_rank = 0;
  std::uint32_t p_rank = 0;
  std::uint32_t p_gen = 0;
  protocol::EndpointId d_endpoint = 0;
};

class ControlNetwork {
 public:
  // `deliver(to_p, message)` runs at each arrival, as an event of kind `deliver_kind`.
  using Deliver = std::function<void(bool to_p, const Msg&)>;
  ControlNetwork(const NetConfig& config, Rng& rng, EventLoop& loop, std::uint32_t deliver_kind,
                 Deliver deliver)
      : config_(config), rng_(rng), loop_(loop), deliver_kind_(deliver_kind),
        deliver_(std::move(deliver)) {}
  ControlNetwork(const ControlNetwork&) = delete;
  ControlNetwork& operator=(const ControlNetwork&) = delete;

  // Sends `body` over `to` (towards P if `to_p`, else towards D). Releases and AbortNotices
  // are best effort: they are also lost with NetConfig::release_loss.
  void Send(bool to_p, const Link& to, Msg::Body body);

 private:
  const NetConfig& config_;
  Rng& rng_;
  EventLoop& loop_;
  const std::uint32_t deliver_kind_;
  const Deliver deliver_;
  // Per link: the latest arrival so far, which a FIFO message may not overtake.
  std::unordered_map<std::uint64_t, core::TimePoint> link_last_;
};

// How P's session names the D socket a message came by ("d<rank>/<endpoint>"), and back.
protocol::PeerAddress PeerOf(const Msg& m);
std::pair<std::uint32_t, protocol::EndpointId> SocketOf(const protocol::PeerAddress& peer);
// The P rank an address of the simulated cluster names ("p<rank>").
std::uint32_t PRankOf(const std::string& address);

}  // namespace kvferry::sim
