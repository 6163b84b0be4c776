// `kvferry proxy`: the disaggregated-serving router (src/harness/client_proxy.h).
//
//   kvferry proxy --port 8000 --prefill http://127.0.0.1:8010 --prefill-bootstrap 127.0.0.1:8998
//                 --prefill-engine-id p0 --decode http://127.0.0.1:8020
//
// --prefill, --prefill-bootstrap and --prefill-engine-id may be repeated (the i-th of each make
// one P instance), as may --decode; requests go round-robin. Stops on SIGINT/SIGTERM.
#include <signal.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>
#include <vector>

#include "client_proxy.h"
#include "commands.h"

namespace kvferry::tools {

namespace {

struct ProxyCli {
  int port = 8000;
  std::vector<std::string> prefill, bootstrap, engine_id, decode;
  double prefill_timeout_s = 900, decode_timeout_s = 900;
  int threads = 512;
};

int RunProxy(const ProxyCli& c) {
  if (c.prefill.empty() || c.decode.empty()) {
    std::fprintf(stderr, "proxy: need at least one --prefill and one --decode\n");
    return 2;
  }
  if (c.bootstrap.size() != c.prefill.size() || c.engine_id.size() != c.prefill.size()) {
    std::fprintf(stderr,
                 "proxy: give one --prefill-bootstrap and one --prefill-engine-id per --prefill "
                 "(%zu prefill, %zu bootstrap, %zu engine id)\n",
                 c.prefill.size(), c.bootstrap.size(), c.engine_id.size());
    return 2;
  }
  harness::ProxyOptions o;
  o.port = c.port;
  for (std::size_t i = 0; i < c.prefill.size(); ++i) {
    o.prefills.push_back({c.prefill[i], c.bootstrap[i], c.engine_id[i]});
  }
  o.decodes = c.decode;
  o.prefill_timeout_s = c.prefill_timeout_s;
  o.decode_timeout_s = c.decode_timeout_s;
  o.threads = c.threads;

  // Signals are taken synchronously by this thread; every thread the proxy starts inherits
  // the blocked mask.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  signal(SIGINT, SIG_DFL);  // an ignored signal is discarded even while blocked
  signal(SIGTERM, SIG_DFL);
  signal(SIGPIPE, SIG_IGN);

  harness::Proxy proxy(o);
  std::string error;
  if (!proxy.Start(&error)) {
    std::fprintf(stderr, "proxy: %s\n", error.c_str());
    return 1;
  }
  std::fprintf(stderr, "proxy: listening on 127.0.0.1:%d (%zu prefill, %zu decode)\n", proxy.port(),
               o.prefills.size(), o.decodes.size());
  int sig = 0;
  sigwait(&set, &sig);
  std::fprintf(stderr, "proxy: signal %d, stopping\n", sig);
  proxy.Stop();
  const harness::ProxyStats s = proxy.stats();
  std::fprintf(stderr, "proxy: %llu requests, %llu prefill failures, %llu decode failures\n",
               static_cast<unsigned long long>(s.requests),
               static_cast<unsigned long long>(s.prefill_failed),
               static_cast<unsigned long long>(s.decode_failed));
  return 0;
}

}  // namespace

void AddProxyCommand(CLI::App& app, int& exit_code) {
  auto c = std::make_shared<ProxyCli>();
  CLI::App* cmd = app.add_subcommand("proxy",
                                     "P/D router: P's copy in the background, D's "
                                     "answer streamed back");
  cmd->add_option("--port", c->port, "listen on 127.0.0.1:PORT")->capture_default_str();
  cmd->add_option("--prefill", c->prefill, "P's URL, e.g. http://127.0.0.1:8010 (repeatable)")
      ->required();
  cmd->add_option("--prefill-bootstrap", c->bootstrap,
                  "P's bootstrap address, e.g. 127.0.0.1:8998 (one per --prefill)")
      ->required();
  cmd->add_option("--prefill-engine-id", c->engine_id, "P's engine_id (one per --prefill)")
      ->required();
  cmd->add_option("--decode", c->decode, "D's URL, e.g. http://127.0.0.1:8020 (repeatable)")
      ->required();
  cmd->add_option("--prefill-timeout", c->prefill_timeout_s, "deadline of P's request (s)")
      ->capture_default_str();
  cmd->add_option("--decode-timeout", c->decode_timeout_s, "read deadline of D's request (s)")
      ->capture_default_str();
  cmd->add_option("--threads", c->threads, "concurrent client connections")->capture_default_str();
  cmd->callback([c, &exit_code] { exit_code = RunProxy(*c); });
}

}  // namespace kvferry::tools
