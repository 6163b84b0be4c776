// `kvferry bench transfer`: data-plane bandwidth beside ucx_perftest, memcpy and iperf3, and
// `kvferry bench http`: the front doors beside idle connections (docs/performance.md). The core's micro-benchmarks are Google Benchmark binaries
// (build/bench/bench_core, build/bench/bench_wire).
#include <CLI/CLI.hpp>
#include <memory>
#include <string>
#include <vector>

#include "bench_transfer.h"
#include "commands.h"

namespace kvferry::tools {

void AddBenchCommand(CLI::App& app, int& exit_code) {
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks that compare against baselines");
  bench->require_subcommand(1);
  auto options = std::make_shared<transport::BenchOptions>();
  auto transports = std::make_shared<std::vector<std::string>>();
  CLI::App* transfer = bench->add_subcommand(
      "transfer", "Data-plane bandwidth, 64 KiB..64 MiB, beside ucx_perftest/memcpy/iperf3");
  transfer->add_flag("--quick", options->quick, "Fewer sizes, shorter runs");
  transfer->add_option("--transport", *transports, "shm, cma and/or tcp (default shm,tcp)")
      ->delimiter(',');
  transfer->add_option("--peer", options->peer_binary, "Receiver binary (kvferry_transport_peer)");
  transfer->add_option("--seconds", options->seconds_per_point, "Seconds per measured point");
  auto no_baselines = std::make_shared<bool>(false);
  transfer->add_flag("--no-baselines", *no_baselines, "Skip ucx_perftest, memcpy and iperf3");
  transfer->callback([options, transports, no_baselines, &exit_code] {
    options->transports = *transports;
    options->baselines = !*no_baselines;
    exit_code = transport::RunTransferBench(*options);
  });
  AddHttpBenchCommand(*bench, exit_code);
}

}  // namespace kvferry::tools
