#include "harness/serve.h"

#include <fmt/format.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#include "control/bootstrap_server.h"
#include "control/call_deadline.h"
#include "control/etcd_registry.h"
#include "harness/http_front.h"
#include "harness/serve_config.h"
#include "harness/trace_file.h"

namespace kvferry::harness {

namespace {

// How often D polls etcd: a dead P is noticed within its lease TTL plus this (and etcd's own
// expiry granularity, 0.5 s). Four small range requests a second per D are nothing to etcd.
constexpr std::chrono::milliseconds kEtcdPollInterval{250};

// The etcd registry's counters for /metrics: P's lease renewals, D's view of etcd.
std::string EtcdMetrics(const control::EtcdRegistrar* registrar,
                        const control::EtcdWatcher* watcher) {
  std::string out;
  auto one = [&out](const char* name, const char* type, const char* help, double value) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n{} {}\n", name, help, name, type, name, value);
  };
  if (registrar) {
    const control::EtcdRegistrar::Stats s = registrar->stats();
    one("kvferry_etcd_keepalive_failures_total", "counter",
        "P: lease renewals that got no answer from etcd", static_cast<double>(s.failures));
    one("kvferry_etcd_republished_total", "counter",
        "P: leases lost (expired in etcd) and published again", static_cast<double>(s.republished));
  }
  if (watcher) {
    const control::EtcdWatcher::Stats s = watcher->stats();
    one("kvferry_etcd_healthy", "gauge", "D: 1 if the last poll of etcd succeeded",
        s.healthy ? 1.0 : 0.0);
    one("kvferry_etcd_poll_failures_total", "counter", "D: polls of etcd that failed",
        static_cast<double>(s.poll_failures));
    one("kvferry_etcd_engines_down_total", "counter",
        "D: P engines that left etcd (lease expired or revoked)",
        static_cast<double>(s.engines_down));
    one("kvferry_etcd_records_refused_total", "counter",
        "D: etcd records ignored because they are not signed with the cluster secret (per poll)",
        static_cast<double>(s.records_refused));
    one("kvferry_etcd_engines_replaced_total", "counter",
        "D: P engines whose keys came to name another incarnation (a restart within the TTL)",
        static_cast<double>(s.engines_replaced));
  }
  return out;
}

std::string RandomHex() {
  std::random_device rd;
  return fmt::format("{:08x}{:08x}", rd(), rd());
}

// Writes `content` to `path` atomically (tmp + rename), so a reader never sees half of it.
Status WriteFileAtomic(const std::string& path, const std::string& content) {
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) return Status(ErrorCode::kUnavailable, fmt::format("cannot write {}", tmp));
  const bool ok = std::fwrite(content.data(), 1, content.size(), f) == content.size();
  if (std::fclose(f) != 0 || !ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    return Status(ErrorCode::kUnavailable, fmt::format("cannot write {}", path));
  }
  return Status::Ok();
}

int Fail(const std::string& message) {
  std::fprintf(stderr, "kvferry serve: %s\n", message.c_str());
  return 1;
}

}  // namespace

int RunServe(const ServeOptions& options) {
  // Before any thread starts: every thread inherits the mask, and only sigwait sees the signals.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  // A client that disappears must not kill the server through a write.
  signal(SIGPIPE, SIG_IGN);

  auto config =
      ParseKvTransferConfig(options.kv_transfer_config, runtime::ProcessEnvironment());
  if (!config) return Fail(config.error().ToString());
  for (const std::string& warning : config->warnings) spdlog::warn("{}", warning);
  if (config->role && *config->role != options.role) {
    return Fail(fmt::format("--role {} contradicts kv_role in --kv-transfer-config",
                            ToString(options.role)));
  }
  if (options.kv_heads == 0 || options.kv_bytes_per_token % options.kv_heads != 0 ||
      options.kv_bytes_per_token == 0) {
    return Fail(fmt::format("--kv-bytes-per-token {} must be a positive multiple of --kv-heads {}",
                            options.kv_bytes_per_token, options.kv_heads));
  }
  if (options.fault_err_after_write < 0 || options.fault_err_after_write > 1) {
    return Fail("--fault-err-after-write must be in [0, 1]");
  }
  for (const auto* ranks :
       {&options.fault_ranks, &options.fault_err_ranks, &options.fault_delay_ranks}) {
    for (std::uint32_t rank : *ranks) {
      if (rank >= options.tp) {
        return Fail(fmt::format("fault ranks: {} >= tp {}", rank, options.tp));
      }
    }
  }

  // Cluster authentication: opt-in, and said once either way (docs/security.md).
  std::shared_ptr<const control::ClusterSecret> secret;
  if (!config->extra.cluster_secret_file.empty()) {
    auto loaded = control::LoadClusterSecret(config->extra.cluster_secret_file);
    if (!loaded) return Fail(loaded.error().ToString());
    secret = std::make_shared<const control::ClusterSecret>(std::move(*loaded));
    spdlog::info("cluster authentication on: secret file {} (fingerprint {})",
                 config->extra.cluster_secret_file, secret->fingerprint());
  } else {
    spdlog::warn(
        "cluster authentication is off, the cluster is open: anyone who reaches a bootstrap or "
        "side-channel port can register engines, renew, pull or release transfers. Set "
        "kv_connector_extra_config.cluster_secret_file on every P and D (docs/security.md)");
  }

  EngineOptions eo;
  eo.role = options.role;
  eo.cluster_secret = secret;
  eo.engine_id = !config->engine_id.empty() ? config->engine_id
                 : options.port != 0 ? fmt::format("{}-{}", ToString(options.role), options.port)
                                     : fmt::format("{}-{}", ToString(options.role), getpid());
  eo.geometry.tp = options.tp;
  eo.geometry.kv_heads = options.kv_heads;
  eo.geometry.block_tokens = options.block_tokens;
  eo.geometry.head_bytes_per_token = options.kv_bytes_per_token / options.kv_heads;
  eo.num_blocks = options.num_blocks;
  eo.costs = options.costs;
  eo.max_waiting = options.max_waiting;
  eo.hold.lease = config->extra.lease;
  eo.hold.abort_request_timeout = config->extra.abort_request_timeout;
  eo.lease = config->extra.lease;
  eo.send_releases = config->extra.release;
  eo.fence_writes = config->extra.fence_writes.value_or(!config->extra.etcd_endpoints.empty());
  eo.incarnation = RandomHex();
  eo.faults.err_after_write_fraction = options.fault_err_after_write;
  eo.faults.max_write_delay = std::chrono::milliseconds(options.fault_write_delay_ms);
  eo.faults.seed = options.fault_seed;
  eo.fault_err_ranks =
      options.fault_err_ranks.empty() ? options.fault_ranks : options.fault_err_ranks;
  eo.fault_delay_ranks =
      options.fault_delay_ranks.empty() ? options.fault_ranks : options.fault_delay_ranks;
  eo.pull_timeout =
      options.pull_timeout_s > 0
          ? std::chrono::milliseconds(static_cast<std::int64_t>(options.pull_timeout_s * 1000))
          : std::chrono::ceil<std::chrono::milliseconds>(config->extra.abort_request_timeout) +
                eo.write_bound + std::chrono::seconds(5);
  eo.ucx_name = eo.engine_id;
  if (!options.trace_file.empty()) {
    auto trace = TraceFile::Open(options.trace_file);
    if (!trace) return Fail(trace.error().ToString());
    eo.trace = std::move(*trace);
  }

  // P: the bootstrap service, embedded (SPEC §1); every rank registers with it.
  std::unique_ptr<control::BootstrapServer> bootstrap;
  int bootstrap_port = 0;
  if (options.role == Role::kPrefill) {
    control::BootstrapServerOptions bo;
    bo.log = [](std::string_view line) { spdlog::info("bootstrap: {}", line); };
    bo.cluster_secret = secret;
    // This process is the engine's only incarnation while its bootstrap runs.
    bo.own_engine = control::EngineIncarnation{eo.engine_id, eo.incarnation};
    bootstrap = std::make_unique<control::BootstrapServer>(bo);
    auto port = bootstrap->Start(options.host, config->extra.bootstrap_port);
    if (!port) return Fail("bootstrap service: " + port.error().ToString());
    bootstrap_port = *port;
    eo.bootstrap_address = fmt::format("{}:{}", options.host, bootstrap_port);
    eo.side_channel_host = options.host;
    // `bootstrap` outlives the engine (declared first), whose /metrics read this.
    eo.bootstrap_auth_refusals = [server = bootstrap.get()] { return server->auth_refusals(); };
  }

  // The etcd registry (opt-in). D: engines are looked up there, and one that leaves etcd fails
  // its waiting loads at once. The watcher outlives the engine; `down_target` is set while the
  // engine runs.
  control::EtcdOptions etcd;
  etcd.endpoints = config->extra.etcd_endpoints;
  etcd.prefix = config->extra.etcd_prefix;
  etcd.cluster_secret = secret;  // P signs what it publishes; D believes only signed records
  std::unique_ptr<control::EtcdWatcher> watcher;
  auto down_target = std::make_shared<std::atomic<ServingEngine*>>(nullptr);
  if (!etcd.endpoints.empty() && options.role == Role::kDecode) {
    auto started = control::EtcdWatcher::Start(
        etcd, kEtcdPollInterval,
        [down_target](const std::string& engine_id, const std::string& incarnation,
                      const std::string& successor, const Status& why) {
          ServingEngine* target = down_target->load();
          if (target == nullptr) return;
          if (successor.empty()) {
            target->EngineDown(engine_id, why);
          } else {
            target->ProcessGone(engine_id, incarnation, why);
          }
        },
        [](std::string_view line) { spdlog::info("{}", line); });
    if (!started) return Fail("etcd: " + started.error().ToString());
    watcher = std::move(*started);
    control::EtcdWatcher* w = watcher.get();
    eo.registry_lookup = [w](const std::string& engine_id) { return w->Lookup(engine_id); };
  }

  auto engine = ServingEngine::Start(eo);
  if (!engine) return Fail("engine: " + engine.error().ToString());
  down_target->store(engine->get());
  // P: its workers go into etcd under a lease kept alive while it runs.
  std::unique_ptr<control::EtcdRegistrar> registrar;
  if (!etcd.endpoints.empty() && options.role == Role::kPrefill) {
    auto started = control::EtcdRegistrar::Start(
        etcd, (*engine)->Registrations(), config->extra.etcd_lease_ttl,
        [](std::string_view line) { spdlog::info("{}", line); });
    if (!started) {
      (*engine)->Shutdown();
      return Fail("etcd: " + started.error().ToString());
    }
    registrar = std::move(*started);
  }

  nlohmann::json info = {
      {"role", ToString(options.role)},
      {"engine_id", eo.engine_id},
      {"tp", options.tp},
      {"num_blocks", options.num_blocks},
      {"block_tokens", options.block_tokens},
      {"kv_lease_duration", core::ToSeconds(config->extra.lease)},
      {"abort_request_timeout", core::ToSeconds(config->extra.abort_request_timeout)},
      {"pid", getpid()},
  };
  if (options.role == Role::kPrefill) {
    info["bootstrap_port"] = bootstrap_port;
    info["bootstrap_addr"] = fmt::format("http://{}:{}", options.host, bootstrap_port);
  }
  HttpFrontOptions ho;
  ho.host = options.host;
  ho.port = options.port;
  ho.threads = options.http_threads;
  ho.max_model_len = options.max_model_len;
  ho.served_model = options.served_model;
  ho.request_timeout = std::chrono::seconds(static_cast<std::int64_t>(options.request_timeout_s));
  ho.health_json = info.dump();
  if (bootstrap) {
    control::BootstrapServer* server = bootstrap.get();
    ho.more_http_stats = [server] {
      return std::vector<std::pair<std::string, control::HttpServerStats>>{
          {"bootstrap", server->http_stats()}};
    };
  }
  if (registrar || watcher) {
    ho.more_metrics = [r = registrar.get(), w = watcher.get()] { return EtcdMetrics(r, w); };
  }
  auto http = HttpFront::Start(ho, engine->get());
  if (!http) {
    (*engine)->Shutdown();
    return Fail("http: " + http.error().ToString());
  }
  info["port"] = (*http)->port();
  spdlog::info("kvferry serve: {} {} tp {} on http://{}:{}{}", ToString(options.role), eo.engine_id,
               options.tp, options.host, (*http)->port(),
               bootstrap ? fmt::format(", bootstrap http://{}:{}", options.host, bootstrap_port)
                         : std::string());
  if (!options.ready_file.empty()) {
    Status written = WriteFileAtomic(options.ready_file, info.dump() + "\n");
    if (!written.ok()) spdlog::error("{}", written.ToString());
  }

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  spdlog::info("kvferry serve: signal {}, shutting down", signal_number);
  // The shutdown is bounded (see ServeOptions::shutdown_timeout_s): past it, exit without what
  // is still in flight.
  std::optional<control::CallDeadline> bounded_shutdown;
  bounded_shutdown.emplace(
      std::chrono::steady_clock::now() +
          std::chrono::milliseconds(static_cast<std::int64_t>(options.shutdown_timeout_s * 1000)),
      [&options] {
        spdlog::warn(
            "kvferry serve: shutdown still waiting after {} s (pulls in flight); "
            "exiting without them",
            options.shutdown_timeout_s);
        spdlog::default_logger()->flush();
        std::_Exit(0);
      });
  // D: no engine-down callback may run into the engine while it shuts down (Stop joins the
  // watcher's thread; lookups never report downs).
  down_target->store(nullptr);
  if (watcher) watcher->Stop();
  (*http)->Stop();
  (*engine)->Shutdown();
  // P: out of etcd only once drained, so decoders do not give up on writes that still finish;
  // then they see the engine gone at once rather than a TTL later.
  if (registrar) registrar->Stop();
  if (bootstrap) bootstrap->Stop();
  bounded_shutdown.reset();
  spdlog::info("kvferry serve: stopped");
  return 0;
}

}  // namespace kvferry::harness
