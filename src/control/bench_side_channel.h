// `kvferry bench sidechannel`: what cluster authentication costs on the side channel. Two P
// listeners run in this process, one open and one with a cluster secret (CURVE + ZAP), each
// with a DecodeChannel over loopback TCP; the same round trips alternate between them in
// batches, so machine noise falls on both alike:
//  - a renewal of 1 transfer, and of 128 (a full renewal message),
//  - a pull of one request of 16 blocks, start to FINISH (the writer lands at once, so this is
//    the control path: D -> P, a sender thread, P -> D),
//  - the first renewal on a new channel (TCP connect + ZMTP handshake, CURVE's included).
// It prints p50 / p99 / mean per kind and mode, and the CURVE overhead at p50.
#pragma once

#include <cstddef>

namespace kvferry::control {

struct SideChannelBenchOptions {
  std::size_t round_trips = 20000;  // per kind and mode
  std::size_t new_channels = 500;   // first-renewal samples per mode
  std::size_t batch = 100;          // round trips per turn before switching mode
};

// Prints the table to stdout. 0 on success; 1 when a round trip failed or the authenticated
// listener refused its own cluster's channel.
int RunSideChannelBench(const SideChannelBenchOptions& options);

}  // namespace kvferry::control
