// `kvferry demo`: the seed experiments (SPEC §8 A–D) in real processes on loopback — `kvferry
// serve` P and D, `kvferry proxy`, and in-process load, probe and /metrics sampler — with every
// time scaled down (480 s → 48 s at the default scale 10) so the whole demo fits in minutes.
// Each case is printed as a table beside the seed's figures and checked; the figures are
// computed from the runs, never canned. A's P KV timeline goes to CSV and (with gnuplot) PNG.
#pragma once

#include <string>
#include <vector>

namespace kvferry::harness {

// Where a `kvferry serve` of the demo runs: on a test host (scripts/testhosts.sh), i.e. in
// network namespace `netns`, listening on `address`; empty netns: this process's namespace.
struct DemoHost {
  std::string netns;
  std::string address = "127.0.0.1";
};

struct DemoOptions {
  bool quick = false;  // a much shorter version of each case (for ctest)
  std::string out_dir = "out/demo";
  std::string scenarios = "all";  // "all" or any of "A", "B", "C", "D" (e.g. "AB")
  std::string kvferry_bin;        // the binary that has `serve` and `proxy` (default: this one)
  double scale = 10;              // seed time / demo time (full demo only)
  bool verbose = false;           // progress lines of load and probe on stderr
  // Across test hosts (scripts/demo-hosts.sh): P and D on hosts of their own, reached over the
  // hosts' links (UCX over tcp, as the environment of `testhosts.sh exec` sets it); the proxy,
  // the load, the probe and the sampler run where the demo runs (another host). Every serve is
  // given `etcd_endpoints` when set (discovery and liveness through etcd, and D fences writers).
  DemoHost p_host;
  DemoHost d_host;
  std::vector<std::string> etcd_endpoints;
};

// Runs the selected cases; returns 0 when every check passed, 1 when one failed, 2 on bad
// options or when the processes could not be started.
int RunDemo(const DemoOptions& options);

}  // namespace kvferry::harness
