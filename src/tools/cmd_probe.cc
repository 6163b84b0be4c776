// `kvferry probe`: a plain completion straight to P every k seconds (src/harness/client_probe.h).
//
//   kvferry probe --url http://127.0.0.1:8010 --every 10 --prompt-tokens 512 --max-tokens 1
//                 --duration 600 [--json out.jsonl]
//
// One line per probe on stdout as it completes (and one JSON object per line in --json).
// Exit code: 0 when every probe succeeded, 1 otherwise, 128+signal on SIGINT/SIGTERM.
#include <signal.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>

#include "client_probe.h"
#include "commands.h"

namespace kvferry::tools {

namespace {

int RunProbeCli(const harness::ProbeOptions& o, const std::string& json_path) {
  if (o.every_s <= 0 || o.duration_s < 0 || o.prompt_tokens <= 0 || o.max_tokens <= 0) {
    std::fprintf(stderr, "probe: --every, --prompt-tokens and --max-tokens must be positive\n");
    return 2;
  }
  std::ofstream json;
  if (!json_path.empty()) {
    json.open(json_path);
    if (!json) {
      std::fprintf(stderr, "probe: cannot write %s\n", json_path.c_str());
      return 1;
    }
  }
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  signal(SIGINT, SIG_DFL);  // an ignored signal is discarded even while blocked
  signal(SIGTERM, SIG_DFL);
  signal(SIGPIPE, SIG_IGN);

  harness::Prober prober(o);
  std::mutex out_mu;
  prober.OnProbe([&](const harness::ProbeRecord& r) {
    std::lock_guard<std::mutex> lock(out_mu);
    std::printf("%s\n", harness::FormatProbeRecord(r).c_str());
    std::fflush(stdout);
    if (json.is_open()) json << harness::ProbeRecordJson(r) << "\n" << std::flush;
  });
  std::atomic<int> interrupted{0};
  std::thread waiter([&] {
    int sig = 0;
    if (sigwait(&set, &sig) == 0) interrupted = sig;
  });
  prober.Start();
  // Wait for the run (or a signal): poll so that a signal ends the wait promptly.
  const auto end = harness::SteadyClock::now() +
                   std::chrono::duration_cast<harness::SteadyClock::duration>(
                       std::chrono::duration<double>(o.duration_s + o.timeout_s + 1));
  std::atomic<bool> done{false};
  std::thread finisher([&] {
    prober.Wait();
    done = true;
  });
  while (!done && interrupted.load() == 0 && harness::SteadyClock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  prober.Stop(0);
  finisher.join();
  if (interrupted.load() == 0) pthread_kill(waiter.native_handle(), SIGTERM);
  waiter.join();
  int failed = 0;
  for (const auto& r : prober.Records()) {
    if (!r.finished || !r.outcome.ok) ++failed;
  }
  if (interrupted.load() != 0 && interrupted.load() != SIGTERM) return 128 + interrupted.load();
  return failed == 0 ? 0 : 1;
}

}  // namespace

void AddProbeCommand(CLI::App& app, int& exit_code) {
  auto o = std::make_shared<harness::ProbeOptions>();
  auto json_path = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand("probe", "a small plain completion straight to P every k s");
  cmd->add_option("--url", o->url, "P's server, e.g. http://127.0.0.1:8010")->required();
  cmd->add_option("--every", o->every_s, "seconds between probes")->capture_default_str();
  cmd->add_option("--prompt-tokens", o->prompt_tokens, "prompt tokens")->capture_default_str();
  cmd->add_option("--max-tokens", o->max_tokens, "max_tokens")->capture_default_str();
  cmd->add_option("--duration", o->duration_s, "send probes for this long (s)")
      ->capture_default_str();
  cmd->add_option("--timeout", o->timeout_s, "per-probe deadline (s)")->capture_default_str();
  cmd->add_option("--json", *json_path, "one JSON object per probe (JSON lines)");
  cmd->callback([o, json_path, &exit_code] { exit_code = RunProbeCli(*o, *json_path); });
}

}  // namespace kvferry::tools
