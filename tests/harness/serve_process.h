// Test support for real `kvferry serve` processes on 127.0.0.1 (tests/harness): a child process
// with its ready file and log, and small HTTP helpers. Every process is killed when its
// ServeProcess is destroyed. KVFERRY_BINARY names the kvferry executable.
#pragma once

#include <httplib.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "support/spawn.h"


namespace kvferry::serve_test {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

// One `kvferry serve` child process; SIGTERM then SIGKILL on destruction.
class ServeProcess {
 public:
  ServeProcess(const fs::path& dir, const std::string& name, std::vector<std::string> args)
      : dir_(dir), name_(name) {
    ready_ = dir / (name + ".ready.json");
    log_ = dir / (name + ".log");
    std::vector<std::string> argv = {KVFERRY_BINARY, "serve", "--ready-file", ready_.string()};
    // Any free port unless the test chose one (to start a P where a proxy already expects it).
    if (std::find(args.begin(), args.end(), "--port") == args.end()) {
      argv.insert(argv.end(), {"--port", "0"});
    }
    if (std::find(args.begin(), args.end(), "--http-threads") == args.end()) {
      argv.insert(argv.end(), {"--http-threads", "32"});
    }
    argv.insert(argv.end(), args.begin(), args.end());
    setenv("UCX_NET_DEVICES", "lo", 0);
    pid_ = testing::SpawnWithLog(std::move(argv), log_.string());
  }
  ~ServeProcess() { Kill(); }

  // Waits for the ready file; false after `timeout` or if the process died.
  bool WaitReady(std::chrono::seconds timeout = std::chrono::seconds(15)) {
    const auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline) {
      if (pid_ <= 0 || waitpid(pid_, &status_, WNOHANG) == pid_) {
        pid_ = -1;
        return false;
      }
      std::ifstream in(ready_);
      if (in) {
        info_ = json::parse(in, nullptr, false);
        if (info_.is_object()) return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }

  // SIGTERM and wait up to `timeout` for a clean exit; the exit status, or -1.
  int Terminate(std::chrono::seconds timeout = std::chrono::seconds(10)) {
    if (pid_ <= 0) return -1;
    kill(pid_, SIGTERM);
    const auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline) {
      if (waitpid(pid_, &status_, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status_) ? WEXITSTATUS(status_) : -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    Kill();
    return -1;
  }

  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, &status_, 0);
    pid_ = -1;
  }

  int port() const { return info_.value("port", 0); }
  pid_t pid() const { return pid_; }
  std::string engine_id() const { return info_.value("engine_id", ""); }
  std::string bootstrap_addr() const { return info_.value("bootstrap_addr", ""); }
  int bootstrap_port() const { return info_.value("bootstrap_port", 0); }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port()); }
  std::string Log() const {
    std::ifstream in(log_);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

 private:
  fs::path dir_;
  std::string name_;
  fs::path ready_;
  fs::path log_;
  pid_t pid_ = -1;
  int status_ = 0;
  json info_;
};

struct HttpResult {
  int status = 0;
  std::string body;
};

// One `kvferry proxy` child process on 127.0.0.1:`port`, its output in `name`.log; SIGKILL on
// destruction. It has no ready file: it listens once /health answers (503 while it learns
// engine ids, 200 once ready).
class ProxyProcess {
 public:
  ProxyProcess(const fs::path& dir, const std::string& name, int port,
               std::vector<std::string> args)
      : port_(port), log_(dir / (name + ".log")) {
    std::vector<std::string> argv = {KVFERRY_BINARY, "proxy", "--port", std::to_string(port)};
    argv.insert(argv.end(), args.begin(), args.end());
    pid_ = testing::SpawnWithLog(std::move(argv), log_.string());
  }
  ~ProxyProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }

  // GET /health: {0, ""} while nothing answers.
  HttpResult Health() const {
    httplib::Client cli("127.0.0.1", port_);
    cli.set_connection_timeout(std::chrono::seconds(2));
    cli.set_read_timeout(std::chrono::seconds(5));
    auto res = cli.Get("/health");
    return res ? HttpResult{res->status, res->body} : HttpResult{};
  }
  // Waits until /health answers `status`; false after `timeout` or if the process exited.
  bool WaitHealth(int status, std::chrono::seconds timeout = std::chrono::seconds(15)) {
    const auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline && Running()) {
      if (Health().status == status) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }
  bool Running() {
    if (pid_ <= 0) return false;
    if (waitpid(pid_, &status_, WNOHANG) == pid_) {
      pid_ = -1;
      return false;
    }
    return true;
  }
  // Waits for the process to exit; its exit code, or -1 (killed by a signal, or still running
  // after `timeout`).
  int WaitExit(std::chrono::seconds timeout = std::chrono::seconds(10)) {
    const auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline) {
      if (!Running()) return WIFEXITED(status_) ? WEXITSTATUS(status_) : -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }
  int port() const { return port_; }
  pid_t pid() const { return pid_; }
  std::string Log() const {
    std::ifstream in(log_);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

 private:
  int port_;
  fs::path log_;
  pid_t pid_ = -1;
  int status_ = 0;
};

inline HttpResult Post(int port, const json& body, double timeout_s = 15,
                       const std::string& path = "/v1/completions") {
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(std::chrono::milliseconds(static_cast<int>(timeout_s * 1000)));
  auto res = cli.Post(path.c_str(), body.dump(), "application/json");
  if (!res) return {};
  return {res->status, res->body};
}

inline std::string Get(int port, const std::string& path) {
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(std::chrono::seconds(5));
  auto res = cli.Get(path.c_str());
  return res && res->status == 200 ? res->body : std::string();
}

// Prometheus text → sum over each metric's series (labels dropped), for `name{...}` filters
// pass the full series text.
inline double Metric(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  std::string line;
  double sum = 0;
  bool found = false;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const auto space = line.rfind(' ');
    const std::string key = line.substr(0, space);
    const std::string bare = key.substr(0, key.find('{'));
    if (key == series || (series.find('{') == std::string::npos && bare == series)) {
      sum += std::stod(line.substr(space + 1));
      found = true;
    }
  }
  return found ? sum : -1;
}

// Waits until `series` on `port` equals `want` (or the deadline); returns the last value.
inline double WaitMetric(int port, const std::string& series, double want,
                  std::chrono::milliseconds timeout = std::chrono::milliseconds(5000)) {
  const auto deadline = Clock::now() + timeout;
  double v = -1;
  while (Clock::now() < deadline) {
    v = Metric(Get(port, "/metrics"), series);
    if (v == want) return v;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return v;
}

inline json Prompt(int n) {
  json p = json::array();
  for (int i = 0; i < n; ++i) p.push_back(100 + i);
  return p;
}

inline json PrefillBody(int prompt, const std::string& transfer) {
  return {{"model", "m"},
          {"prompt", Prompt(prompt)},
          {"max_tokens", 1},
          {"stream", false},
          {"kv_transfer_params",
           {{"do_remote_decode", true}, {"do_remote_prefill", false}, {"transfer_id", transfer}}}};
}

inline json DecodeBody(int prompt, int max_tokens, bool stream, const std::string& transfer,
                const ServeProcess& p) {
  return {{"model", "m"},
          {"prompt", Prompt(prompt)},
          {"max_tokens", max_tokens},
          {"stream", stream},
          {"ignore_eos", true},
          {"kv_transfer_params",
           {{"do_remote_prefill", true},
            {"do_remote_decode", false},
            {"transfer_id", transfer},
            {"remote_engine_id", p.engine_id()},
            {"remote_bootstrap_addr", p.bootstrap_addr()}}}};
}

}  // namespace kvferry::serve_test
