// `kvferry load`: N concurrent streaming completions sent at once (src/harness/client_load.h).
//
//   kvferry load --url http://127.0.0.1:8000 --requests 128 --prompt-tokens 3000
//                --max-tokens 1000 --ignore-eos [--timeout S] [--json out.json]
//
// Progress (completed / failed / running) goes to stderr every second, the summary to stdout.
// Exit code: 0 when every request succeeded, 1 when some failed, 130 on SIGINT.
#include <signal.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>

#include "client_load.h"
#include "commands.h"

namespace kvferry::tools {

namespace {

int RunLoadCli(const harness::LoadOptions& o, const std::string& json_path) {
  if (o.requests <= 0 || o.prompt_tokens <= 0 || o.max_tokens <= 0 || o.timeout_s <= 0) {
    std::fprintf(stderr,
                 "load: --requests, --prompt-tokens, --max-tokens and --timeout must "
                 "be positive\n");
    return 2;
  }
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  signal(SIGINT, SIG_DFL);  // an ignored signal is discarded even while blocked
  signal(SIGTERM, SIG_DFL);
  signal(SIGPIPE, SIG_IGN);
  harness::CancelGroup cancel;
  static std::atomic<int> interrupted{0};
  // Cancels the load on the first signal; the load then ends promptly and is summarized.
  std::thread([set, &cancel] {
    int sig = 0;
    if (sigwait(&set, &sig) == 0) {
      interrupted = sig;
      cancel.CancelAll();
    }
  }).detach();

  const harness::LoadResult r = harness::RunLoad(o, &cancel);
  std::fputs(harness::FormatLoadSummary(r.summary).c_str(), stdout);
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << harness::LoadResultJson(o, r) << "\n";
    if (!out) {
      std::fprintf(stderr, "load: cannot write %s\n", json_path.c_str());
      return 1;
    }
  }
  std::fflush(stdout);
  if (interrupted.load() != 0) std::_Exit(128 + interrupted.load());  // the waiter is detached
  return r.summary.failed == 0 ? 0 : 1;
}

}  // namespace

void AddLoadCommand(CLI::App& app, int& exit_code) {
  auto o = std::make_shared<harness::LoadOptions>();
  auto json_path = std::make_shared<std::string>();
  o->ignore_eos = false;
  CLI::App* cmd = app.add_subcommand("load", "N concurrent streaming completions, sent at once");
  cmd->add_option("--url", o->url, "server (the proxy), e.g. http://127.0.0.1:8000")->required();
  cmd->add_option("--requests", o->requests, "number of requests")->capture_default_str();
  cmd->add_option("--prompt-tokens", o->prompt_tokens, "random prompt token ids per request")
      ->capture_default_str();
  cmd->add_option("--max-tokens", o->max_tokens, "max_tokens per request")->capture_default_str();
  cmd->add_flag("--ignore-eos", o->ignore_eos, "set ignore_eos");
  cmd->add_option("--timeout", o->timeout_s, "per-request deadline (s)")->capture_default_str();
  cmd->add_option("--seed", o->seed, "prompt PRNG seed (0: random)")->capture_default_str();
  cmd->add_option("--json", *json_path, "also write the summary and every request as JSON");
  cmd->callback([o, json_path, &exit_code] { exit_code = RunLoadCli(*o, *json_path); });
}

}  // namespace kvferry::tools
