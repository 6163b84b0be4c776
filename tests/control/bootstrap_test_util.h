// Helpers shared by the bootstrap tests.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>

#include "control/bootstrap_types.h"

namespace kvferry::control::testing {

// A worker of engine `engine` (TP `tp_size`, PP 1, no lease) at a made-up address derived from
// its rank, so each rank's address differs.
inline WorkerRegistration MakeWorker(const std::string& engine, std::uint32_t tp_rank,
                                     std::uint32_t tp_size = 2,
                                     const std::string& incarnation = "inc-a",
                                     std::uint32_t dp_rank = 0) {
  WorkerRegistration r;
  r.engine_id = engine;
  r.dp_rank = dp_rank;
  r.tp_rank = tp_rank;
  r.pp_rank = 0;
  r.tp_size = tp_size;
  r.pp_size = 1;
  r.side_channel = "tcp://127.0.0.1:" + std::to_string(5550 + tp_rank);
  r.data_plane = "inproc://" + engine + "/" + std::to_string(tp_rank);
  r.kv_lease_duration = 0;
  r.protocol_version = 1;
  r.incarnation = incarnation;
  return r;
}

// A TCP listener on 127.0.0.1 that never accepts: the kernel completes connections into the
// backlog, so a client connects and sends, then waits for an answer that never comes.
class SilentListener {
 public:
  SilentListener() {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    ::listen(fd_, 16);
    socklen_t len = sizeof(addr);
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
  }
  ~SilentListener() { ::close(fd_); }
  SilentListener(const SilentListener&) = delete;
  SilentListener& operator=(const SilentListener&) = delete;

  int fd() const { return fd_; }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// A port on 127.0.0.1 with nothing listening (bound once by the OS, then released).
inline int ClosedPort() {
  SilentListener l;
  return l.port();
}

inline std::chrono::milliseconds ElapsedSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                               start);
}

}  // namespace kvferry::control::testing
