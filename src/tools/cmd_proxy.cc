// `kvferry proxy`: the disaggregated-serving router (src/harness/client_proxy.h). It takes the
// command line of vLLM's example Mooncake proxy as well as kvferry's own:
//
//   kvferry proxy --host 127.0.0.1 --port 8000 --prefill http://10.0.0.1:8010 [8998|none]
//                 --prefill http://10.0.0.2:8010 --decode http://10.0.0.3:8020
//   kvferry proxy --port 8000 --prefill http://127.0.0.1:8010 --prefill-bootstrap 127.0.0.1:8998
//                 --prefill-engine-id p0 --decode http://127.0.0.1:8020
//
// --prefill and --decode may be repeated. The value after a --prefill URL is P's bootstrap port
// on the URL's host (8998 when absent; `none`: P has no bootstrap). --prefill-bootstrap and
// --prefill-engine-id, when given, are given once per --prefill (the i-th of each belongs to
// the i-th P); a P's bootstrap named twice, or a count of either that does not match the Ps,
// is refused at start with the rule (harness::PrefillTargetsFromFlags, which states them all).
// A P without --prefill-engine-id has its engine ids learned from its bootstrap once it
// answers /health: until every P is ready, completions get 503 with the reason. Requests go
// round-robin over (P, dp rank) and over D. Exits 2 on a refused command line, 1 when it cannot
// start; stops on SIGINT/SIGTERM.
#include <signal.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "client_proxy.h"
#include "commands.h"

namespace kvferry::tools {

namespace {

struct ProxyCli {
  std::string host = "127.0.0.1";
  int port = 8000;
  harness::ProxyPrefillFlags prefill;
  std::vector<std::vector<std::string>> decode;  // each --decode: URL [LOAD_FAILURE_PORT]
  double prefill_timeout_s = 900, decode_timeout_s = 900;
  int threads = 512;
  double ready_attempt_timeout_s = 2, ready_retry_interval_s = 1, ready_log_interval_s = 10;
  std::string cluster_secret_file;
};

int RunProxy(const ProxyCli& c) {
  auto prefills = harness::PrefillTargetsFromFlags(c.prefill);
  if (!prefills) {
    std::fprintf(stderr, "proxy: %s\n", prefills.error().message().c_str());
    return 2;
  }
  if (c.decode.empty()) {
    std::fprintf(stderr, "proxy: give at least one --decode URL\n");
    return 2;
  }
  if (!(c.ready_attempt_timeout_s > 0) || !(c.ready_retry_interval_s > 0) ||
      !(c.ready_log_interval_s > 0)) {
    std::fprintf(stderr,
                 "proxy: --ready-attempt-timeout, --ready-retry-interval and "
                 "--ready-log-interval must be positive\n");
    return 2;
  }
  harness::ProxyOptions o;
  o.host = c.host;
  o.port = c.port;
  o.prefills = std::move(*prefills);
  for (const std::vector<std::string>& d : c.decode) {
    o.decodes.push_back(d.at(0));
    if (d.size() < 2) continue;
    int port = 0;
    try {
      std::size_t used = 0;
      port = std::stoi(d[1], &used);
      if (used != d[1].size()) port = 0;
    } catch (const std::exception&) {
      port = 0;
    }
    if (port < 1 || port > 65535) {
      std::fprintf(stderr, "proxy: --decode %s %s: the load-failure port must be 1..65535\n",
                   d[0].c_str(), d[1].c_str());
      return 2;
    }
    o.load_failure_ports[d[0]] = port;
  }
  o.prefill_timeout_s = c.prefill_timeout_s;
  o.decode_timeout_s = c.decode_timeout_s;
  o.threads = c.threads;
  o.ready_attempt_timeout_s = c.ready_attempt_timeout_s;
  o.ready_retry_interval_s = c.ready_retry_interval_s;
  o.ready_log_interval_s = c.ready_log_interval_s;
  o.cluster_secret_file = c.cluster_secret_file;

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
  const bool v6 = o.host.find(':') != std::string::npos;
  std::fprintf(stderr, "proxy: listening on %s%s%s:%d (%zu prefill, %zu decode)%s\n", v6 ? "[" : "",
               o.host.c_str(), v6 ? "]" : "", proxy.port(), o.prefills.size(), o.decodes.size(),
               proxy.readiness().ready ? "" : "; learning prefill engine ids, 503 until ready");
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
  cmd->add_option("--host", c->host, "listen on this address")->capture_default_str();
  cmd->add_option("--port", c->port, "listen on this port")->capture_default_str();
  // Each occurrence is kept apart: `--prefill URL 8998 --prefill URL2` is two Ps.
  cmd->add_option("--prefill", c->prefill.prefill,
                  "P's URL and, optionally, its bootstrap port on the URL's host (default 8998) "
                  "or 'none' (repeatable): --prefill http://10.0.0.1:8010 [8998|none]")
      ->expected(1, 2)
      ->required();
  cmd->add_option("--prefill-bootstrap", c->prefill.bootstrap,
                  "P's bootstrap address, e.g. 127.0.0.1:8998 (one per --prefill, or none)");
  cmd->add_option("--prefill-engine-id", c->prefill.engine_id,
                  "P's engine_id (one per --prefill, or none: learned from P's bootstrap)");
  cmd->add_option("--decode", c->decode,
                  "D's URL and, optionally, the port of its load-failure service on the URL's "
                  "host (D's load_failure_port), whose reasons the proxy gives clients when a "
                  "KV load fails (repeatable): --decode http://10.0.0.2:8020 [8999]")
      ->expected(1, 2)
      ->required();
  cmd->add_option("--prefill-timeout", c->prefill_timeout_s, "deadline of P's request (s)")
      ->capture_default_str();
  cmd->add_option("--decode-timeout", c->decode_timeout_s, "read deadline of D's request (s)")
      ->capture_default_str();
  cmd->add_option("--threads", c->threads, "concurrent client connections")->capture_default_str();
  cmd->add_option("--ready-attempt-timeout", c->ready_attempt_timeout_s,
                  "learning engine ids: deadline of each P /health and bootstrap query (s)")
      ->capture_default_str();
  cmd->add_option("--ready-retry-interval", c->ready_retry_interval_s,
                  "learning engine ids: pause between attempts (s)")
      ->capture_default_str();
  cmd->add_option("--ready-log-interval", c->ready_log_interval_s,
                  "learning engine ids: how often a P still not ready is logged again (s)")
      ->capture_default_str();
  cmd->add_option("--cluster-secret-file", c->cluster_secret_file,
                  "believe only bootstrap answers signed with this cluster secret "
                  "(docs/security.md)");
  cmd->callback([c, &exit_code] { exit_code = RunProxy(*c); });
}

}  // namespace kvferry::tools
