// `kvferry bench handoff`: the time from P finishing a prefill to D holding the request's KV,
// through the real runtime (PrefillWorker, DecodeWorker, the side channel, the bootstrap and a
// UCX data plane, both workers in this process), beside memcpy of the same bytes in the same
// run (docs/performance.md "Handoff"). Issue 22's yardstick: a Llama-8B-shaped request by
// default, 32 layers × K and V = 64 planes × 188 blocks × 32 KiB = 394 MB.
//
// Each measured handoff: P admits a transfer and reports its prefill done (its blocks), D starts
// the load, and the clock stops when D's receive completes; the first handoff of each layout
// (lookup, side-channel and UCX connections) is a warm-up and not counted. Layouts: blocks
// contiguous on both sides, and every other block (how block tables look after churn).
// Baselines, same bytes: one memcpy per plane (contiguous), one memcpy per block (scattered);
// for tcp, one iperf3 stream on loopback (a kvferry endpoint writes over one tcp connection).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvferry::runtime {

struct HandoffBenchOptions {
  std::uint32_t layers = 32;           // planes = 2 × layers (K and V)
  std::uint32_t blocks = 188;          // blocks of the request (3,000 tokens at 16 per block)
  std::uint64_t block_bytes = 32768;   // one block in one plane
  std::vector<std::string> transports = {"shm", "tcp"};  // shm: posix,sysv; tcp: loopback
  std::uint32_t runs = 5;              // measured handoffs per layout and transport
  bool baselines = true;               // iperf3 beside the tcp rows (memcpy always runs)
};

// Prints the table; 0 when every handoff succeeded and every byte matched.
int RunHandoffBench(const HandoffBenchOptions& options);

}  // namespace kvferry::runtime
