// `kvferry demo`: the seed experiments (SPEC §8 A–D) with real processes on loopback
// (src/harness/demo_runner.h). The README's main job.
//
//   kvferry demo [--quick] [--out DIR] [--scenario A|B|C|D|all] [--scale 10] [-v]
//                [--p-netns NS --p-address ADDR --d-netns NS --d-address ADDR] [--etcd URL...]
//
// Exit code: 0 when every check passed, 1 when one failed, 2 when the demo could not run,
// 128+signal when interrupted (every child process is stopped first).
#include <CLI/CLI.hpp>
#include <string>

#include "commands.h"
#include "demo_process.h"
#include "demo_runner.h"

namespace kvferry::tools {

void AddDemoCommand(CLI::App& app, int& exit_code) {
  auto o = std::make_shared<harness::DemoOptions>();
  CLI::App* cmd = app.add_subcommand(
      "demo", "Reproduce the seed experiments A-D with real serve/proxy processes (scaled time)");
  cmd->add_flag("--quick", o->quick, "much shorter runs (each case well under a minute)");
  cmd->add_option("--out", o->out_dir, "output folder: tables' CSV/PNG, logs, traces")
      ->capture_default_str();
  cmd->add_option("--scenario", o->scenarios, "A, B, C, D, several (e.g. AB) or all")
      ->capture_default_str();
  cmd->add_option("--scale", o->scale, "seed time / demo time (full demo)")->capture_default_str();
  cmd->add_option("--kvferry", o->kvferry_bin,
                  "binary with `serve` and `proxy` (default: this one)");
  cmd->add_flag("-v,--verbose", o->verbose, "progress of load and probes on stderr");
  // Across test hosts (scripts/demo-hosts.sh sets these up and runs the demo on a third host).
  cmd->add_option("--p-netns", o->p_host.netns, "run P in this network namespace (a test host)");
  cmd->add_option("--p-address", o->p_host.address, "P's address there")->capture_default_str();
  cmd->add_option("--d-netns", o->d_host.netns, "run D in this network namespace (a test host)");
  cmd->add_option("--d-address", o->d_host.address, "D's address there")->capture_default_str();
  cmd->add_option("--etcd", o->etcd_endpoints,
                  "etcd endpoints (http://host:port) every serve registers with / looks up in");
  cmd->callback([o, &exit_code] {
    // Before any thread exists: SIGINT/SIGTERM stop every child process group, then exit.
    harness::InstallSignalWatcher();
    exit_code = harness::RunDemo(*o);
  });
}

}  // namespace kvferry::tools
