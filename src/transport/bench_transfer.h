// `kvferry bench transfer`: data-plane bandwidth next to its baselines on this machine.
//
// For each transport (shm, cma, tcp), it spawns a receiver process (kvferry_transport_peer),
// writes 64 KiB ... 64 MiB transfers as one contiguous op and as scattered 64 KiB blocks,
// verifies the received bytes, and prints a table beside ucx_perftest (same transport, same
// sizes, spawned as two processes), memcpy, and single-stream iperf3 (tcp; when installed).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace kvferry::transport {

struct BenchOptions {
  bool quick = false;  // fewer sizes and shorter runs: about 20 s instead of about 2 minutes
  // Subset of {"shm", "cma", "tcp", "shmF", "tcpF"} (F: the receiver fences its writers);
  // empty = all but cma (cma only on request: UCX 1.13
  // does not use it on peer-error-mode endpoints, so kvferry falls back to tcp there).
  std::vector<std::string> transports;
  // The receiver binary; empty = kvferry_transport_peer next to the running executable.
  std::string peer_binary;
  bool baselines = true;  // run ucx_perftest, memcpy and iperf3
  double seconds_per_point = 0.3;
  // Batches kept in flight per point; 0: 64 MiB's worth, between 2 and 16 (the data plane's
  // throughput). 1 is what one handoff sees: a pull waits for its write before the reply, so
  // its baseline is the data plane's latency, not its pipelined bandwidth.
  std::size_t in_flight = 0;
};

// Prints the table to stdout. Returns 0 on success, 1 if a transfer failed or a verification
// found a wrong byte.
int RunTransferBench(const BenchOptions& options);

// Parses `kvferry bench transfer` style flags (--quick, --transport=shm,tcp, --peer=PATH,
// --no-baselines, --seconds=S, --in-flight=N) into options; false (with a message on stderr) on
// a bad flag.
bool ParseBenchFlags(int argc, char** argv, BenchOptions* options);

}  // namespace kvferry::transport
