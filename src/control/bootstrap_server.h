// BootstrapServer: the HTTP/JSON service that maps a P engine id to its workers' side-channel
// and data-plane addresses (SPEC §1). It runs embedded in P's rank-0 process by default and
// standalone with RunBootstrapServer (the `kvferry bootstrap` subcommand).
//
//   POST /register           a WorkerRegistration   -> 200 {"status":"ok","outcome":...}
//                                                      400 malformed, 409 conflict, 503 full,
//                                                      401 unsigned/forged (with a secret)
//   GET  /query?engine_id=X  one engine (EngineInfo) -> 200, 400 bad id, 404 unknown engine
//   GET  /query              every engine by dp rank -> 200 {"<dp_rank>": {<engine>,
//                            "worker_addr": ...}}: vLLM's Mooncake bootstrap's shape
//   GET  /health             {"status":"ok"}         -> 200
// Every 4xx/5xx answer is {"error": reason}. The registration rules are BootstrapRegistry's;
// wire formats and limits are in docs/bootstrap.md. The HTTP side is control::HttpServer
// (event-driven: idle or slow clients cannot stop lookups), every route answered inline from
// memory; a body over kMaxBodyBytes gets 413, a chunked one 411. With a cluster secret,
// registrations must be signed and /query answers are signed (BootstrapAuth; docs/security.md).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "control/bootstrap_types.h"
#include "control/http_server.h"
#include "control/cluster_auth.h"
#include "kvferry/status.h"

namespace kvferry::control {

struct BootstrapServerOptions {
  // Total registered workers across engines; registrations beyond it get 503.
  std::size_t max_workers = 16384;
  // Called, from a server thread, with one line per state change (a new engine, a P restart)
  // and per rejected registration, for the embedding process's log. May be empty.
  std::function<void(std::string_view line)> log;
  // Cluster authentication (docs/security.md). With a secret, POST /register must carry a valid
  // Authorization signature (else 401 {"error": reason}, counted in auth_refusals()) and every
  // /query answer carries X-Kvferry-Signature. Null: the service is open, as before.
  std::shared_ptr<const ClusterSecret> cluster_secret;
  // The P engine incarnation of the process that embeds this server: no other incarnation of
  // that engine may register while it runs (BootstrapRegistry rule 2). None when standalone.
  std::optional<EngineIncarnation> own_engine;
};

class BootstrapServer {
 public:
  explicit BootstrapServer(BootstrapServerOptions options = {});
  ~BootstrapServer();  // Stop()s
  BootstrapServer(const BootstrapServer&) = delete;
  BootstrapServer& operator=(const BootstrapServer&) = delete;

  // Binds host:port (port 0: a free port chosen by the OS), starts serving on background
  // threads and returns the bound port once the server accepts connections. Bind errors are
  // returned here, not discovered later. kAlreadyExists if already started. Start after Stop
  // serves the same registry again.
  [[nodiscard]] Result<int> Start(const std::string& host, int port);

  // Stops accepting, closes every connection and joins the server's thread. Idempotent.
  void Stop();

  bool running() const;
  // The bound port while running, else 0.
  int port() const;

  // The HTTP server's counters (zero while stopped), for the embedding process's /metrics.
  [[nodiscard]] HttpServerStats http_stats() const;

  // Snapshot of the registry, for the embedding process (metrics, tests).
  [[nodiscard]] std::vector<EngineInfo> Engines() const;

  // Registrations refused for authentication (401) since construction.
  std::uint64_t auth_refusals() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Runs a standalone bootstrap server on host:port until SIGINT or SIGTERM, then stops it and
// returns 0 (1 if it could not start; the reason goes to stderr). Prints the bound address and
// state changes to stderr. Call it from the main thread before any other thread starts: it
// blocks both signals in the calling thread (server threads inherit that mask) and sigwait()s.
// `options.log` defaults to stderr.
int RunBootstrapServer(const std::string& host, int port, BootstrapServerOptions options = {});

}  // namespace kvferry::control
