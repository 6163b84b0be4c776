// Internal: a receiver process for the multi-process tests and the transfer benchmark.
//
// The child (RunTransferPeer, built as `kvferry_transport_peer`) creates a UCX engine with one
// zeroed region, prints "DESC <hex descriptor>" on stdout, then answers one-line commands on
// stdin, one line of reply each:
//   PING                              -> OK
//   CHECK <dst_off> <len> <src_off> <seed>
//                                     -> OK | BAD <first mismatching dst offset>
//                                        (bytes must equal PatternByte(seed, src_off + i))
//   ZERO                              -> OK
//   EXIT                              -> OK, then a clean shutdown
// EOF on stdin (the parent died or closed the pipe) also shuts it down, and the child asks the
// kernel to SIGKILL it when its parent dies.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kvferry/status.h"
#include "kvferry/transport/transport.h"

namespace kvferry::transport::internal {

// The deterministic test pattern: byte `index` of the stream for `seed`.
inline std::uint8_t PatternByte(std::uint64_t seed, std::uint64_t index) {
  std::uint64_t x = (index >> 3) + seed * 0x9E3779B97F4A7C15ull;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<std::uint8_t>(x >> (8 * (index & 7)));
}
void FillPattern(std::byte* dst, std::size_t length, std::uint64_t seed, std::uint64_t index);
// Offset of the first byte that differs from the pattern, or -1.
std::int64_t FindPatternMismatch(const std::byte* p, std::size_t length, std::uint64_t seed,
                                 std::uint64_t index);

std::string HexEncode(const std::vector<std::byte>& bytes);
Result<std::vector<std::byte>> HexDecode(const std::string& hex);

// The child's entry point: `kvferry_transport_peer --region-bytes N [--mode auto|put|am]`.
int RunTransferPeer(int argc, char** argv);

// Parent side: spawns and talks to a peer process. The destructor SIGKILLs and reaps it.
class PeerProcess {
 public:
  PeerProcess() = default;
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;
  PeerProcess(PeerProcess&& other) noexcept { *this = std::move(other); }
  PeerProcess& operator=(PeerProcess&& other) noexcept;
  ~PeerProcess() { Kill(); }

  // Starts `binary args...` with the current environment plus `env` ("NAME=value" entries
  // override), and waits for its descriptor line until `deadline`.
  static Result<PeerProcess> Spawn(const std::string& binary, const std::vector<std::string>& args,
                                   const std::vector<std::string>& env, TimePoint deadline);

  const std::vector<std::byte>& descriptor() const { return descriptor_; }
  pid_t pid() const { return pid_; }

  // Sends one command line and returns the reply line (kTimeout, kUnavailable if it died).
  Result<std::string> Command(const std::string& line, TimePoint deadline);
  // SIGKILL + waitpid (idempotent).
  void Kill();

 private:
  Result<std::string> ReadLine(TimePoint deadline);

  pid_t pid_ = -1;
  int to_child_ = -1;
  int from_child_ = -1;
  std::string buffer_;
  std::vector<std::byte> descriptor_;
};

}  // namespace kvferry::transport::internal
