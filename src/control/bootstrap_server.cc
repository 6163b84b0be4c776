#include "control/bootstrap_server.h"

#include <fmt/format.h>
#include <pthread.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <mutex>

#include "control/bootstrap_auth.h"
#include "control/bootstrap_json.h"
#include "control/bootstrap_registry.h"
#include "control/http_server.h"

namespace kvferry::control {
namespace {

constexpr const char* kJson = "application/json";

// Bootstrap requests are tiny and answered in memory on the server's event thread; a client
// that sends nothing for this long is dropped.
constexpr std::chrono::seconds kIdleTimeout{10};

int HttpStatusFor(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument:
      return 400;
    case ErrorCode::kNotFound:
      return 404;
    case ErrorCode::kAlreadyExists:
      return 409;
    case ErrorCode::kResourceExhausted:
      return 503;
    default:
      return 500;
  }
}

HttpResponse ErrorResponse(int status, std::string_view reason) {
  HttpResponse r;
  r.status = status;
  r.body = EncodeError(reason);
  return r;
}

HttpResponse JsonResponse(std::string body) {
  HttpResponse r;
  r.content_type = kJson;
  r.body = std::move(body);
  return r;
}

// The same rule as a registration's engine_id: an id that could never have registered is a
// malformed query (400), not an unknown engine (404).
bool IsValidEngineId(const std::string& id) {
  if (id.empty() || id.size() > kMaxStringBytes) return false;
  for (char c : id) {
    if (c < 0x20 || c > 0x7e) return false;
  }
  return true;
}

}  // namespace

struct BootstrapServer::Impl {
  explicit Impl(BootstrapServerOptions opts)
      : options(std::move(opts)),
        registry(options.max_workers, options.own_engine),
        auth(options.cluster_secret) {}

  void Log(std::string_view line) const {
    if (options.log) options.log(line);
  }

  void InstallRoutes(HttpServer& http);
  HttpResponse HandleRegister(const HttpRequest& req);
  HttpResponse HandleQuery(const HttpRequest& req);

  BootstrapServerOptions options;

  mutable std::mutex mu;  // guards registry; held only for in-memory work, never for I/O
  BootstrapRegistry registry;
  BootstrapAuth auth;  // thread-safe

  // Owned by the thread calling Start/Stop.
  std::unique_ptr<HttpServer> http;
};

void BootstrapServer::Impl::InstallRoutes(HttpServer& server) {
  // Every route is an in-memory lookup: inline on the event thread, never behind a pool.
  server.Route("POST", "/register",
               InlineHandler([this](const HttpRequest& req) { return HandleRegister(req); }));
  server.Route("GET", "/query", InlineHandler([this](const HttpRequest& req) {
                 HttpResponse res = HandleQuery(req);
                 // Every answer, errors included, so D can tell it came from a cluster member.
                 std::string signature = auth.SignAnswer(res.status, req.path, res.body);
                 if (!signature.empty()) {
                   res.headers.emplace_back(std::string(kSignatureHeader), std::move(signature));
                 }
                 return res;
               }));
  server.Route("GET", "/health", InlineHandler([](const HttpRequest&) {
                 return JsonResponse(EncodeObject({{"status", "ok"}}));
               }));
}

HttpResponse BootstrapServer::Impl::HandleRegister(const HttpRequest& req) {
  // A signature covers the path alone: a target with a query string is not what was signed.
  if (!req.params.empty()) return ErrorResponse(400, "POST /register takes no query string");
  const std::string* authorization = req.Header("authorization");
  if (Status authn = auth.CheckRequest(authorization != nullptr ? *authorization : "", req.method,
                                       req.path, req.body);
      !authn.ok()) {
    // Logged at the 1st, 10th, 100th... refusal: an unauthenticated flood must not flood the log.
    const std::uint64_t refused = auth.refusals();
    std::uint64_t power = 1;
    while (power < refused && power <= UINT64_MAX / 10) power *= 10;
    if (power == refused) {
      Log(fmt::format("bootstrap: refused registration from {} ({} refused so far): {}",
                      req.remote_addr, refused, authn.message()));
    }
    return ErrorResponse(401, authn.message());
  }
  auto reg = DecodeRegistration(req.body);
  if (!reg) {
    Log(fmt::format("bootstrap: rejected registration from {}: {}", req.remote_addr,
                    reg.error().message()));
    return ErrorResponse(400, reg.error().message());
  }
  Result<BootstrapRegistry::Outcome> outcome;
  {
    std::lock_guard<std::mutex> lock(mu);
    outcome = registry.Register(*reg);
  }
  if (!outcome) {
    Log(fmt::format("bootstrap: rejected registration of engine {} tp {} pp {} from {}: {}",
                    reg->engine_id, reg->tp_rank, reg->pp_rank, req.remote_addr,
                    outcome.error().ToString()));
    return ErrorResponse(HttpStatusFor(outcome.error().code()), outcome.error().message());
  }
  if (*outcome != BootstrapRegistry::Outcome::kUnchanged) {
    Log(
        fmt::format("bootstrap: engine {} incarnation {} ({}): dp {} tp {}/{} pp {}/{} at {} "
                    "data_plane '{}', lease {}, protocol {}",
                    reg->engine_id, reg->incarnation, ToString(*outcome), reg->dp_rank,
                    reg->tp_rank, reg->tp_size, reg->pp_rank, reg->pp_size, reg->side_channel,
                    reg->data_plane, LeaseText(reg->kv_lease_duration), reg->protocol_version));
  }
  return JsonResponse(EncodeObject({{"status", "ok"}, {"outcome", ToString(*outcome)}}));
}

HttpResponse BootstrapServer::Impl::HandleQuery(const HttpRequest& req) {
  const std::string* id = req.Param("engine_id");
  if (id == nullptr) {
    std::vector<EngineInfo> all;
    {
      std::lock_guard<std::mutex> lock(mu);
      all = registry.QueryAll();
    }
    return JsonResponse(EncodeEngines(all));
  }
  if (!IsValidEngineId(*id)) {
    return ErrorResponse(
        400, fmt::format("engine_id must be 1 to {} bytes of printable ASCII", kMaxStringBytes));
  }
  Result<EngineInfo> info;
  {
    std::lock_guard<std::mutex> lock(mu);
    info = registry.Query(*id);
  }
  if (!info) return ErrorResponse(HttpStatusFor(info.error().code()), info.error().message());
  return JsonResponse(EncodeEngine(*info));
}

BootstrapServer::BootstrapServer(BootstrapServerOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}

BootstrapServer::~BootstrapServer() { Stop(); }

Result<int> BootstrapServer::Start(const std::string& host, int port) {
  if (impl_->http) return Err(ErrorCode::kAlreadyExists, "bootstrap server already started");
  HttpServerOptions http;
  http.name = "bootstrap";
  http.max_body_bytes = kMaxBodyBytes;
  http.idle_timeout = kIdleTimeout;
  http.error_format = [](int status, const std::string& reason) {
    return ErrorResponse(status, reason);
  };
  http.log = [this](std::string_view line) { impl_->Log(line); };
  auto server = std::make_unique<HttpServer>(std::move(http));
  impl_->InstallRoutes(*server);
  auto bound = server->Start(host, port);
  if (!bound) {
    return Err(bound.error().code(),
               fmt::format("cannot start bootstrap server on {}:{}: {}", host, port,
                           bound.error().message()));
  }
  impl_->http = std::move(server);
  return *bound;
}

void BootstrapServer::Stop() {
  if (!impl_->http) return;
  impl_->http->Stop();
  impl_->http.reset();
}

bool BootstrapServer::running() const { return impl_->http != nullptr; }

int BootstrapServer::port() const { return impl_->http ? impl_->http->port() : 0; }

HttpServerStats BootstrapServer::http_stats() const {
  return impl_->http ? impl_->http->stats() : HttpServerStats{};
}

std::vector<EngineInfo> BootstrapServer::Engines() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->registry.QueryAll();
}

std::uint64_t BootstrapServer::auth_refusals() const { return impl_->auth.refusals(); }

int RunBootstrapServer(const std::string& host, int port, BootstrapServerOptions options) {
  sigset_t signals;
  sigset_t previous;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  // Blocked before the server threads exist, so they inherit the mask and only sigwait() below
  // sees the signals.
  pthread_sigmask(SIG_BLOCK, &signals, &previous);

  if (!options.log) {
    options.log = [](std::string_view line) {
      std::fprintf(stderr, "%.*s\n", static_cast<int>(line.size()), line.data());
    };
  }
  int rc = 0;
  {
    BootstrapServer server(std::move(options));
    auto bound = server.Start(host, port);
    if (!bound) {
      std::fprintf(stderr, "kvferry bootstrap: %s\n", bound.error().ToString().c_str());
      rc = 1;
    } else {
      const bool v6 = host.find(':') != std::string::npos;
      std::fprintf(stderr, "kvferry bootstrap: listening on http://%s%s%s:%d\n", v6 ? "[" : "",
                   host.c_str(), v6 ? "]" : "", *bound);
      int sig = 0;
      while (sigwait(&signals, &sig) != 0) {
      }
      std::fprintf(stderr, "kvferry bootstrap: %s received, stopping\n",
                   sig == SIGINT ? "SIGINT" : "SIGTERM");
      server.Stop();
    }
  }
  pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  return rc;
}

}  // namespace kvferry::control
