// `kvferry proxy`: the disaggregated-serving router (SPEC §1), wire-compatible with vLLM's
// example Mooncake proxy, so it fronts vLLM servers (running kvferry's connector, whose P embeds
// kvferry's bootstrap service) as well as `kvferry serve`. For every POST /v1/completions and
// /v1/chat/completions it assigns transfer_id = "xfer-<uuid>", sends P's copy (max_tokens=1,
// max_completion_tokens=1 when present, do_remote_decode; streamed so that P notices when the
// proxy drops it) in the background and D's copy (do_remote_prefill, remote_engine_id,
// remote_bootstrap_addr, transfer_id) at the same time, to the same path, and passes D's answer
// (SSE or JSON) back to the client. P routes (a P instance and, when learned, one of its dp
// ranks, sent to P as X-data-parallel-rank) and D instances are used round-robin.
//
// A P whose engine id is not configured is learned at start (Mooncake's proxy does the same):
// the proxy polls P's GET /health until 200, then lists the engines of P's bootstrap service
// (GET /query, control::BootstrapClient::QueryDpEngines: bounded, validated, verified with the
// cluster secret when one is configured) and routes to every dp rank's engine. Each attempt has
// a deadline and attempts repeat at an interval until the proxy stops. Until every P is ready
// the completion routes answer 503 naming a P that is not and why, and /health answers 503 with
// every P's state; the log names each P that is not ready, at every change of reason and again
// at an interval. A P whose engine id is configured is ready at once, as before. Engine ids are
// learned once: a P that comes back with another engine id needs a proxy restart.
//
// The two halves are paired: if P refuses or fails its copy before D answers, the client gets
// P's error at once ("prefill <url> failed: ...", also as the error event of a stream D has
// already begun) and D's copy is dropped (its connection closed); if D refuses or fails its
// copy, P's copy is cancelled, so P aborts a prefill still running instead of finishing it for
// nobody (once P has answered, its KV is D's to release, or the lease's), and the client gets
// D's error — with the reason its KV load failed when D runs a load-failure service
// (ProxyOptions::load_failure_ports).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/status.h"

namespace kvferry::harness {

struct PrefillTarget {
  std::string url;  // http://127.0.0.1:P
  // P's bootstrap service, "host:port" (sent to D as remote_bootstrap_addr, as
  // "http://host:port"). Empty: P has none the proxy may name; D's copy then carries no
  // remote_bootstrap_addr (a D that finds P another way, e.g. through etcd) and `engine_id`
  // must be set.
  std::string bootstrap;
  // P's engine_id (sent to D as remote_engine_id). Empty: learned at start from the bootstrap,
  // one route per dp rank it lists.
  std::string engine_id;
};

// `kvferry proxy`'s P flags as given, in order (src/tools/cmd_proxy.cc).
struct ProxyPrefillFlags {
  std::vector<std::vector<std::string>> prefill;  // each --prefill: URL [BOOTSTRAP_PORT|none]
  std::vector<std::string> bootstrap;             // every --prefill-bootstrap HOST:PORT
  std::vector<std::string> engine_id;             // every --prefill-engine-id ID
};

// The default bootstrap port of a P given as `--prefill URL` (vLLM's Mooncake default).
inline constexpr int kDefaultBootstrapPort = 8998;

// The P instances a command line names. Its rules, each refused with kInvalidArgument naming
// it when broken:
//  1. At least one --prefill. Each takes P's URL (http://host:port) and at most one more value,
//     a bootstrap port (1..65535) or `none` (any case): vLLM's Mooncake proxy's form.
//  2. --prefill-bootstrap is given once per --prefill (the i-th is the i-th P's) or never. With
//     it, no --prefill may carry a bootstrap port or `none`: both would name P's bootstrap.
//  3. --prefill-engine-id is given once per --prefill (the i-th is the i-th P's) or never (every
//     engine id is then learned at start). Any other count cannot be matched to the Ps.
//  4. P's bootstrap is its --prefill-bootstrap; else the host of its URL with the port after
//     the URL, or with kDefaultBootstrapPort. `none`: P has no bootstrap, so its engine id
//     cannot be learned and must be given (rule 3).
// kvferry's own form (--prefill URL --prefill-bootstrap B --prefill-engine-id E, repeated)
// keeps its meaning: rules 2 and 3 with one of each per P.
[[nodiscard]] Result<std::vector<PrefillTarget>> PrefillTargetsFromFlags(
    const ProxyPrefillFlags& flags);

struct ProxyOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: any free port (see Proxy::port())
  std::vector<PrefillTarget> prefills;
  std::vector<std::string> decodes;
  // D URL -> the port of its load-failure service on the URL's host (LoadFailureService; D's
  // `load_failure_port`). When D answers a request with an error (a 5xx, or an error event in
  // its stream), the proxy asks that service why the request's KV load failed and gives the
  // client that reason: vLLM's own answer is a bare "Internal server error".
  std::map<std::string, int> load_failure_ports;
  double prefill_timeout_s = 900;  // deadline of P's background request
  double decode_timeout_s = 900;   // per-read deadline of D's request
  int threads = 512;               // concurrent client connections served
  // A client body beyond this gets 413 before it is read further (a prompt of 8,192 token ids
  // is ~60 KB of JSON).
  std::size_t max_body_bytes = std::size_t{8} << 20;
  bool verbose = false;
  // Learning a P's engine ids (PrefillTarget::engine_id empty): the deadline of each GET
  // /health and of each bootstrap listing, the pause between attempts, and how often a P still
  // not ready is logged again (every change of its reason is logged at once).
  double ready_attempt_timeout_s = 2;
  double ready_retry_interval_s = 1;
  double ready_log_interval_s = 10;
  // The cluster secret file (docs/security.md). With it, a bootstrap listing is believed only
  // when signed with this secret; without it, any listing is read (signed or not). Loaded by
  // Start(), which fails with the reason when the file is refused.
  std::string cluster_secret_file;
  // One line per event (readiness changes, failed halves); empty: stderr, "[proxy] " prefixed.
  std::function<void(std::string_view line)> log;
};

struct ProxyStats {
  std::uint64_t requests = 0;
  std::uint64_t prefill_failed = 0;
  std::uint64_t decode_failed = 0;
  std::uint64_t in_flight = 0;
  std::uint64_t twins_aborted = 0;  // requests whose other half the proxy dropped
  // prefill_failed counts P's own failures; these, P copies the proxy cancelled (D failed).
  std::uint64_t prefill_cancelled = 0;
  std::uint64_t not_ready = 0;  // completion requests answered 503 before every P was ready
};

// What the proxy sends to P and to D for one client request (exposed for tests). Throw
// nlohmann::json's exceptions on a body that is not JSON (the proxy checks it first).
// `bootstrap` ("host:port") empty: no remote_bootstrap_addr.
std::string BuildPrefillBody(const std::string& client_body, const std::string& transfer_id);
std::string BuildDecodeBody(const std::string& client_body, const std::string& transfer_id,
                            const std::string& engine_id, const std::string& bootstrap);

// Whether every P is ready (its engine ids known), and why not.
struct ProxyReadiness {
  bool ready = false;
  std::string reason;  // empty when ready; else names a P that is not ready and why
};

class Proxy {
 public:
  explicit Proxy(ProxyOptions options);
  ~Proxy();
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

  // Binds and starts serving on a background thread, and starts learning the engine ids it
  // was not given. False (with `error`) when it cannot bind, a URL or bootstrap address does
  // not parse, or the cluster secret file is refused.
  bool Start(std::string* error);
  int port() const;
  // Cancels in-flight backend calls, stops the server and joins every thread it started (a
  // bootstrap listing in flight ends within ready_attempt_timeout_s).
  void Stop();
  ProxyStats stats() const;
  ProxyReadiness readiness() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvferry::harness
