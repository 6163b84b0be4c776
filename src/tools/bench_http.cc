// `kvferry bench http`: the front-door comparison behind docs/performance.md "Front doors".
// The same /health route on two servers, side by side in one run: cpp-httplib as kvferry used it
// before (a 512-thread pool, one thread per open connection, a 30 s read timeout, the listen
// backlog raised to 4,096) and control::HttpServer
// (libmicrohttpd, epoll). For each, N idle connections (half of them stuck mid-header) are
// opened, then fresh /health requests are timed (a 3 s deadline each) and the server's RSS read.
// Each server runs in a child process of its own, so client and server descriptors do not share
// one limit.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <chrono>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "commands.h"
#include "control/http_server.h"

namespace kvferry::tools {
namespace {

using Clock = std::chrono::steady_clock;

enum class Kind { kThreadPerConnection, kEventDriven };

// Runs the server in a child; returns its pid and writes its port. The child exits when the
// parent closes `*control`.
pid_t StartServer(Kind kind, int* port, int* control) {
  int to_child[2];
  int from_child[2];
  if (::pipe(to_child) != 0 || ::pipe(from_child) != 0) return -1;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(to_child[1]);
    ::close(from_child[0]);
    control::RaiseOpenFileLimit();
    int bound = -1;
    std::unique_ptr<httplib::Server> old_server;
    std::thread old_thread;
    std::unique_ptr<control::HttpServer> new_server;
    if (kind == Kind::kThreadPerConnection) {
      old_server = std::make_unique<httplib::Server>();
      old_server->new_task_queue = [] { return new httplib::ThreadPool(512); };
      old_server->set_read_timeout(std::chrono::seconds(30));
      old_server->Get("/health", [](const httplib::Request&, httplib::Response& res) {
        res.set_content("{\"status\":\"ok\"}", "application/json");
      });
      bound = old_server->bind_to_any_port("127.0.0.1");
      // As `kvferry serve` and the proxy did: Debian's httplib listens with a backlog of 5, so
      // they listened again with 4,096 (the child's only listening socket is the server's).
      for (int fd = 3; fd < 1024; ++fd) {
        int listening = 0;
        socklen_t len = sizeof(listening);
        if (::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) == 0 && listening) {
          ::listen(fd, 4096);
        }
      }
      old_thread = std::thread([&] { old_server->listen_after_bind(); });
      while (!old_server->is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    } else {
      new_server = std::make_unique<control::HttpServer>(control::HttpServerOptions{});
      new_server->Route("GET", "/health", control::InlineHandler([](const control::HttpRequest&) {
                          control::HttpResponse r;
                          r.body = "{\"status\":\"ok\"}";
                          return r;
                        }));
      auto started = new_server->Start("127.0.0.1", 0);
      bound = started ? *started : -1;
    }
    if (::write(from_child[1], &bound, sizeof(bound)) != sizeof(bound)) ::_exit(1);
    char byte;
    while (::read(to_child[0], &byte, 1) > 0) {
    }
    ::_exit(0);  // no orderly stop: the old server would wait for its idle connections
  }
  ::close(to_child[0]);
  ::close(from_child[1]);
  *control = to_child[1];
  if (::read(from_child[0], port, sizeof(*port)) != sizeof(*port)) *port = -1;
  ::close(from_child[0]);
  return pid;
}

// A connection, or -1 if it was not accepted within 500 ms (a full accept queue: Debian's
// cpp-httplib listens with a backlog of 5).
int Connect(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 &&
      errno != EINPROGRESS) {
    ::close(fd);
    return -1;
  }
  pollfd p{fd, POLLOUT, 0};
  int error = 0;
  socklen_t len = sizeof(error);
  if (::poll(&p, 1, 500) != 1 || ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len) != 0 ||
      error != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Latency of one fresh /health, or a negative value if it did not answer within 3 s.
double HealthMs(int port) {
  const auto start = Clock::now();
  httplib::Client cli("127.0.0.1", port);
  cli.set_connection_timeout(3);
  cli.set_read_timeout(3);
  auto res = cli.Get("/health");
  if (!res || res->status != 200) return -1;
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

long RssMiB(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6)) / 1024;
  }
  return -1;
}

struct Row {
  int connections;
  int held;  // connections the server accepted
  int answered;
  int probes;
  double median_ms;
  double worst_ms;
  long rss_mib;
};

Row Measure(Kind kind, int connections, int probes) {
  int port = -1;
  int control_fd = -1;
  const pid_t pid = StartServer(kind, &port, &control_fd);
  Row row{connections, 0, 0, probes, -1, -1, -1};
  if (pid <= 0 || port <= 0) return row;
  std::vector<int> fds;
  fds.reserve(static_cast<std::size_t>(connections));
  static constexpr char kHalf[] = "GET /health HTTP/1.1\r\nHost: x\r\nX-Half: ";
  // Stop after 20 connects in a row that were not accepted in time, or after 20 s: the server
  // is not taking more (and the row says how many it held).
  const auto open_deadline = Clock::now() + std::chrono::seconds(20);
  for (int i = 0, misses = 0; i < connections && misses < 20 && Clock::now() < open_deadline;
       ++i) {
    const int fd = Connect(port);
    if (fd < 0) {
      ++misses;
      continue;
    }
    misses = 0;
    if (fds.size() % 2 == 1) (void)::send(fd, kHalf, sizeof(kHalf) - 1, MSG_NOSIGNAL);
    fds.push_back(fd);
  }
  row.held = static_cast<int>(fds.size());
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  std::vector<double> latencies;
  for (int i = 0; i < probes; ++i) {
    const double ms = HealthMs(port);
    if (ms >= 0) latencies.push_back(ms);
  }
  row.answered = static_cast<int>(latencies.size());
  if (!latencies.empty()) {
    std::sort(latencies.begin(), latencies.end());
    row.median_ms = latencies[latencies.size() / 2];
    row.worst_ms = latencies.back();
  }
  row.rss_mib = RssMiB(pid);
  for (int fd : fds) ::close(fd);
  ::close(control_fd);
  ::waitpid(pid, nullptr, 0);
  return row;
}

std::string Ms(double v) { return v < 0 ? "-" : fmt::format("{:.2f}", v); }

int RunHttpBench(const std::vector<int>& counts, int probes) {
  control::RaiseOpenFileLimit();
  fmt::print("# /health beside N idle connections (half stuck mid-header); {} probes, 3 s "
             "deadline each\n",
             probes);
  fmt::print("| server | N tried | N held | /health answered | median ms | worst ms | server RSS "
             "MiB |\n");
  fmt::print("|---|---:|---:|---:|---:|---:|---:|\n");
  for (int n : counts) {
    for (Kind kind : {Kind::kThreadPerConnection, Kind::kEventDriven}) {
      const Row r = Measure(kind, n, probes);
      fmt::print("| {} | {} | {} | {}/{} | {} | {} | {} |\n",
                 kind == Kind::kThreadPerConnection ? "cpp-httplib, 512 threads (before)"
                                                    : "HttpServer, libmicrohttpd epoll",
                 r.connections, r.held, r.answered, r.probes, Ms(r.median_ms), Ms(r.worst_ms),
                 r.rss_mib);
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace

void AddHttpBenchCommand(CLI::App& bench, int& exit_code) {
  auto counts = std::make_shared<std::vector<int>>(std::vector<int>{0, 600, 10000});
  auto probes = std::make_shared<int>(20);
  CLI::App* http = bench.add_subcommand(
      "http", "Front doors: /health latency beside idle connections, old server vs new");
  http->add_option("--connections", *counts, "idle connection counts to try")
      ->capture_default_str();
  http->add_option("--probes", *probes, "timed /health requests per row")->capture_default_str();
  http->callback([counts, probes, &exit_code] { exit_code = RunHttpBench(*counts, *probes); });
}

}  // namespace kvferry::tools
