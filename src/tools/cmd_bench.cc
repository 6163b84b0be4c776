// `kvferry bench transfer`: data-plane bandwidth beside ucx_perftest, memcpy and iperf3;
// `kvferry bench handoff`: one request's KV from P to D through the runtime, beside memcpy;
// `kvferry bench http`: the front doors beside idle connections, old server and new;
// `kvferry bench sidechannel`: side-channel round trips with and without cluster authentication
// (docs/performance.md). The core's micro-benchmarks are Google Benchmark binaries
// (build/bench/bench_core, build/bench/bench_wire).
#include <CLI/CLI.hpp>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#ifdef KVFERRY_HAVE_TRANSFER_BENCH
#include "bench_transfer.h"
#endif
#ifdef KVFERRY_HAVE_SIDECHANNEL_BENCH
#include "control/bench_side_channel.h"
#endif
#ifdef KVFERRY_HAVE_HANDOFF_BENCH
#include "runtime/bench_handoff.h"
#endif

namespace kvferry::tools {

void AddBenchCommand(CLI::App& app, int& exit_code) {
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks that compare against baselines");
  bench->require_subcommand(1);
#ifdef KVFERRY_HAVE_TRANSFER_BENCH
  auto options = std::make_shared<transport::BenchOptions>();
  auto transports = std::make_shared<std::vector<std::string>>();
  CLI::App* transfer = bench->add_subcommand(
      "transfer", "Data-plane bandwidth, 64 KiB..64 MiB, beside ucx_perftest/memcpy/iperf3");
  transfer->add_flag("--quick", options->quick, "Fewer sizes, shorter runs");
  transfer->add_option("--transport", *transports, "shm, cma and/or tcp (default shm,tcp)")
      ->delimiter(',');
  transfer->add_option("--peer", options->peer_binary, "Receiver binary (kvferry_transport_peer)");
  transfer->add_option("--seconds", options->seconds_per_point, "Seconds per measured point");
  transfer->add_option("--in-flight", options->in_flight,
                       "Batches kept in flight (default: 64 MiB's worth, 2..16; 1: latency)")
      ->check(CLI::Range(0, 1024));
  auto no_baselines = std::make_shared<bool>(false);
  transfer->add_flag("--no-baselines", *no_baselines, "Skip ucx_perftest, memcpy and iperf3");
  transfer->callback([options, transports, no_baselines, &exit_code] {
    options->transports = *transports;
    options->baselines = !*no_baselines;
    exit_code = transport::RunTransferBench(*options);
  });
#endif
#ifdef KVFERRY_HAVE_HANDOFF_BENCH
  auto handoff = std::make_shared<runtime::HandoffBenchOptions>();
  CLI::App* hand = bench->add_subcommand(
      "handoff", "One request's KV from P to D through the runtime, beside memcpy and iperf3");
  hand->add_option("--layers", handoff->layers, "Model layers (planes: K and V of each)")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1024u));
  hand->add_option("--blocks", handoff->blocks, "Blocks of the request")
      ->capture_default_str()
      ->check(CLI::Range(1u, 65536u));
  hand->add_option("--block-bytes", handoff->block_bytes, "Bytes of one block in one plane")
      ->capture_default_str()
      ->check(CLI::Range(std::uint64_t{64}, std::uint64_t{16} << 20));
  hand->add_option("--transport", handoff->transports, "shm and/or tcp")
      ->delimiter(',')
      ->capture_default_str();
  hand->add_option("--runs", handoff->runs, "Measured handoffs per layout")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1000u));
  auto hand_no_baselines = std::make_shared<bool>(false);
  hand->add_flag("--no-baselines", *hand_no_baselines, "Skip iperf3 (memcpy always runs)");
  hand->callback([handoff, hand_no_baselines, &exit_code] {
    handoff->baselines = !*hand_no_baselines;
    exit_code = runtime::RunHandoffBench(*handoff);
  });
#endif
  AddHttpBenchCommand(*bench, exit_code);
#ifdef KVFERRY_HAVE_SIDECHANNEL_BENCH
  auto side = std::make_shared<control::SideChannelBenchOptions>();
  CLI::App* sidechannel = bench->add_subcommand(
      "sidechannel",
      "Renewal, pull and connect round trips over loopback: CURVE + ZAP beside an open channel");
  sidechannel->add_option("--round-trips", side->round_trips, "Per kind and mode")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 24));
  sidechannel->add_option("--new-channels", side->new_channels, "Connect samples per mode")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 20));
  sidechannel->add_option("--batch", side->batch, "Round trips per turn before switching mode")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 20));
  sidechannel->callback([side, &exit_code] { exit_code = control::RunSideChannelBench(*side); });
#endif
}

}  // namespace kvferry::tools
