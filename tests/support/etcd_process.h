// A single-member etcd (Debian's etcd-server, /usr/bin/etcd) on 127.0.0.1 for tests: its own
// data directory and OS-chosen ports, killed (and its directory removed) on destruction.
#pragma once

#include <httplib.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "support/raw_socket.h"
#include "support/spawn.h"


namespace kvferry::testing {

class EtcdProcess {
 public:
  static constexpr const char* kBinary = "/usr/bin/etcd";
  static bool Available() { return std::filesystem::exists(kBinary); }

  // Starts etcd and waits (up to 10 s) until it answers; ok() says whether it did.
  explicit EtcdProcess(const std::filesystem::path& dir) : dir_(dir / "etcd") {
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    client_port_ = FreePort();
    const int peer_port = FreePort();
    const std::string client_url = url();
    const std::string peer_url = "http://127.0.0.1:" + std::to_string(peer_port);
    std::vector<std::string> argv = {kBinary,
                                     "--data-dir",
                                     (dir_ / "data").string(),
                                     "--listen-client-urls",
                                     client_url,
                                     "--advertise-client-urls",
                                     client_url,
                                     "--listen-peer-urls",
                                     peer_url,
                                     "--initial-advertise-peer-urls",
                                     peer_url,
                                     "--initial-cluster",
                                     "default=" + peer_url};
    pid_ = SpawnWithLog(std::move(argv), (dir_ / "etcd.log").string());
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (pid_ > 0 && std::chrono::steady_clock::now() < deadline) {
      httplib::Client cli("127.0.0.1", client_port_);
      cli.set_connection_timeout(std::chrono::milliseconds(200));
      auto res = cli.Post("/v3/kv/range", R"({"key":"AA=="})", "application/json");
      if (res && res->status == 200) {
        ok_ = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  ~EtcdProcess() {
    if (pid_ > 0) {
      ::kill(pid_, SIGCONT);
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    std::filesystem::remove_all(dir_);
  }
  EtcdProcess(const EtcdProcess&) = delete;
  EtcdProcess& operator=(const EtcdProcess&) = delete;

  bool ok() const { return ok_; }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(client_port_); }
  int client_port() const { return client_port_; }
  void Freeze() { ::kill(pid_, SIGSTOP); }
  void Thaw() { ::kill(pid_, SIGCONT); }

 private:
  std::filesystem::path dir_;
  pid_t pid_ = -1;
  int client_port_ = 0;
  bool ok_ = false;
};

}  // namespace kvferry::testing
