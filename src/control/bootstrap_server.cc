#include "control/bootstrap_server.h"

#include <fmt/format.h>
#include <httplib.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>

#include "control/bootstrap_auth.h"
#include "control/bootstrap_json.h"
#include "control/bootstrap_registry.h"

namespace kvferry::control {
namespace {

constexpr const char* kJson = "application/json";

// Server socket timeouts. They bound how long Stop() can wait for a worker thread: an idle
// keep-alive connection is dropped after kKeepAliveSeconds, a client that stalls mid-request
// after kIoTimeout. Bootstrap requests are tiny, so short timeouts cost nothing.
constexpr time_t kKeepAliveSeconds = 1;
constexpr std::chrono::seconds kIoTimeout{2};
// Registration is rare and cheap; a few threads suffice and bound what a flood can take.
constexpr std::size_t kServerThreads = 4;
// How long Start() waits for the accept loop to come up.
constexpr std::chrono::seconds kStartTimeout{10};

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

void ReplyError(httplib::Response& res, int status, std::string_view reason) {
  res.status = status;
  res.set_content(EncodeError(reason), kJson);
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

  void InstallRoutes(httplib::Server& http);
  void HandleRegister(const httplib::Request& req, httplib::Response& res);
  void HandleQuery(const httplib::Request& req, httplib::Response& res);

  BootstrapServerOptions options;

  mutable std::mutex mu;  // guards registry; held only for in-memory work, never for I/O
  BootstrapRegistry registry;
  BootstrapAuth auth;  // thread-safe

  // Owned by the thread calling Start/Stop.
  std::unique_ptr<httplib::Server> http;
  std::thread thread;
  std::atomic<bool> listen_returned{false};
  std::atomic<int> port{0};
};

void BootstrapServer::Impl::InstallRoutes(httplib::Server& server) {
  server.Post("/register", [this](const httplib::Request& req, httplib::Response& res) {
    HandleRegister(req, res);
  });
  server.Get("/query", [this](const httplib::Request& req, httplib::Response& res) {
    HandleQuery(req, res);
    // Every answer, errors included, so D can tell it came from a cluster member. httplib
    // leaves the status at -1 until after the handler when it is 200.
    std::string signature = auth.SignAnswer(res.status < 0 ? 200 : res.status, req.path, res.body);
    if (!signature.empty()) res.set_header(std::string(kSignatureHeader), signature);
  });
  server.Get("/health", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(EncodeObject({{"status", "ok"}}), kJson);
  });

  // Every error answer carries {"error": reason}, including httplib's own (unknown path,
  // body over the limit). httplib answers an oversized body with 413; the contract is 400.
  server.set_error_handler(httplib::Server::HandlerWithResponse([](const httplib::Request& req,
                                                                   httplib::Response& res) {
    if (res.status == 413) {
      res.status = 400;
      res.set_content(EncodeError(fmt::format("request too large: a body is limited to {} bytes",
                                              kMaxBodyBytes)),
                      kJson);
      return httplib::Server::HandlerResponse::Handled;
    }
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    std::string reason = res.status == 404 ? fmt::format("no endpoint {} {}", req.method, req.path)
                                           : fmt::format("HTTP {}", res.status);
    res.set_content(EncodeError(reason), kJson);
    return httplib::Server::HandlerResponse::Handled;
  }));
  // httplib caps a body by Content-Length only; a chunked or length-less body would be read
  // into memory without bound. Refuse both before any body is read.
  server.set_pre_routing_handler([](const httplib::Request& req, httplib::Response& res) {
    const bool chunked = req.has_header("Transfer-Encoding");
    if (chunked || (req.method == "POST" && !req.has_header("Content-Length"))) {
      ReplyError(res, 400,
                 chunked ? "chunked bodies are not accepted; send Content-Length"
                         : "a POST needs Content-Length");
      res.set_header("Connection", "close");
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  server.set_exception_handler(
      [this](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "unknown exception";
        try {
          if (ep) std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        Log(fmt::format("bootstrap: internal error on {} {}: {}", req.method, req.path, what));
        ReplyError(res, 500, "internal error: " + what);
      });

  // httplib's default sets SO_REUSEPORT, which lets a second server bind the same port and
  // silently take half the traffic (say, a stale bootstrap beside a restarted P). Bind
  // exclusively; SO_REUSEADDR still allows a quick restart on a port in TIME_WAIT.
  server.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  server.set_payload_max_length(kMaxBodyBytes);
  server.set_keep_alive_timeout(kKeepAliveSeconds);
  server.set_read_timeout(kIoTimeout);
  server.set_write_timeout(kIoTimeout);
  server.new_task_queue = [] { return new httplib::ThreadPool(kServerThreads); };
}

void BootstrapServer::Impl::HandleRegister(const httplib::Request& req, httplib::Response& res) {
  if (Status authn =
          auth.CheckRequest(req.get_header_value("Authorization"), req.method, req.path, req.body);
      !authn.ok()) {
    Log(fmt::format("bootstrap: refused registration from {}: {}", req.remote_addr,
                    authn.message()));
    ReplyError(res, 401, authn.message());
    return;
  }
  auto reg = DecodeRegistration(req.body);
  if (!reg) {
    Log(fmt::format("bootstrap: rejected registration from {}: {}", req.remote_addr,
                    reg.error().message()));
    ReplyError(res, 400, reg.error().message());
    return;
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
    ReplyError(res, HttpStatusFor(outcome.error().code()), outcome.error().message());
    return;
  }
  if (*outcome != BootstrapRegistry::Outcome::kUnchanged) {
    Log(
        fmt::format("bootstrap: engine {} incarnation {} ({}): dp {} tp {}/{} pp {}/{} at {} "
                    "data_plane '{}', lease {}, protocol {}",
                    reg->engine_id, reg->incarnation, ToString(*outcome), reg->dp_rank,
                    reg->tp_rank, reg->tp_size, reg->pp_rank, reg->pp_size, reg->side_channel,
                    reg->data_plane, LeaseText(reg->kv_lease_duration), reg->protocol_version));
  }
  res.set_content(EncodeObject({{"status", "ok"}, {"outcome", ToString(*outcome)}}), kJson);
}

void BootstrapServer::Impl::HandleQuery(const httplib::Request& req, httplib::Response& res) {
  if (!req.has_param("engine_id")) {
    std::vector<EngineInfo> all;
    {
      std::lock_guard<std::mutex> lock(mu);
      all = registry.QueryAll();
    }
    res.set_content(EncodeEngines(all), kJson);
    return;
  }
  const std::string id = req.get_param_value("engine_id");
  if (!IsValidEngineId(id)) {
    ReplyError(res, 400,
               fmt::format("engine_id must be 1 to {} bytes of printable ASCII", kMaxStringBytes));
    return;
  }
  Result<EngineInfo> info;
  {
    std::lock_guard<std::mutex> lock(mu);
    info = registry.Query(id);
  }
  if (!info) {
    ReplyError(res, HttpStatusFor(info.error().code()), info.error().message());
    return;
  }
  res.set_content(EncodeEngine(*info), kJson);
}

BootstrapServer::BootstrapServer(BootstrapServerOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}

BootstrapServer::~BootstrapServer() { Stop(); }

Result<int> BootstrapServer::Start(const std::string& host, int port) {
  if (impl_->http) return Err(ErrorCode::kAlreadyExists, "bootstrap server already started");
  if (port < 0 || port > 65535) {
    return Err(ErrorCode::kInvalidArgument, fmt::format("port {} is not in [0, 65535]", port));
  }
  auto http = std::make_unique<httplib::Server>();
  impl_->InstallRoutes(*http);

  errno = 0;
  int bound =
      port == 0 ? http->bind_to_any_port(host) : (http->bind_to_port(host, port) ? port : -1);
  if (bound < 0) {
    const int err = errno;
    return Err(ErrorCode::kUnavailable,
               fmt::format("cannot bind bootstrap server to {}:{}: {}", host, port,
                           err != 0 ? std::strerror(err) : "bind failed"));
  }

  impl_->listen_returned = false;
  impl_->http = std::move(http);
  httplib::Server* server = impl_->http.get();
  impl_->thread = std::thread([this, server] {
    server->listen_after_bind();
    impl_->listen_returned = true;
  });

  // Stop() only works once the accept loop runs (httplib ignores stop() before that), so
  // report the port only when the server is really up.
  const auto deadline = std::chrono::steady_clock::now() + kStartTimeout;
  while (!server->is_running() && !impl_->listen_returned) {
    if (std::chrono::steady_clock::now() >= deadline) {
      Stop();
      return Err(ErrorCode::kTimeout, "bootstrap server did not start within 10 s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (impl_->listen_returned) {
    Stop();
    return Err(ErrorCode::kUnavailable,
               fmt::format("bootstrap server on {}:{} stopped at once", host, bound));
  }
  impl_->port = bound;
  return bound;
}

void BootstrapServer::Stop() {
  if (!impl_->http) return;
  // stop() is a no-op until the accept loop has set its running flag, so repeat it until the
  // loop has returned (normally the first call suffices).
  while (!impl_->listen_returned) {
    impl_->http->stop();
    if (impl_->listen_returned) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (impl_->thread.joinable()) impl_->thread.join();
  impl_->http.reset();
  impl_->port = 0;
}

bool BootstrapServer::running() const { return impl_->http && impl_->http->is_running(); }

int BootstrapServer::port() const { return impl_->port; }

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
