#include "peer_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>

#include "descriptor.h"
#include "kvferry/transport/ucx.h"

extern char** environ;

namespace kvferry::transport::internal {

void FillPattern(std::byte* dst, std::size_t length, std::uint64_t seed, std::uint64_t index) {
  for (std::size_t i = 0; i < length; ++i) {
    dst[i] = static_cast<std::byte>(PatternByte(seed, index + i));
  }
}

std::int64_t FindPatternMismatch(const std::byte* p, std::size_t length, std::uint64_t seed,
                                 std::uint64_t index) {
  for (std::size_t i = 0; i < length; ++i) {
    if (p[i] != static_cast<std::byte>(PatternByte(seed, index + i))) {
      return static_cast<std::int64_t>(i);
    }
  }
  return -1;
}

std::string HexEncode(const std::vector<std::byte>& bytes) {
  static const char* kDigits = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (std::byte b : bytes) {
    out.push_back(kDigits[static_cast<unsigned>(b) >> 4]);
    out.push_back(kDigits[static_cast<unsigned>(b) & 15]);
  }
  return out;
}

Result<std::vector<std::byte>> HexDecode(const std::string& hex) {
  if (hex.size() % 2 != 0) return Err(ErrorCode::kProtocol, "odd hex length");
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  std::vector<std::byte> out(hex.size() / 2);
  for (std::size_t i = 0; i < out.size(); ++i) {
    int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return Err(ErrorCode::kProtocol, "bad hex digit");
    out[i] = static_cast<std::byte>(hi * 16 + lo);
  }
  return out;
}

int RunTransferPeer(int argc, char** argv) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  std::size_t region_bytes = 64 << 20;
  UcxOptions options;
  options.name = "kvferry-peer";
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--region-bytes") {
      region_bytes = std::strtoull(value.c_str(), nullptr, 10);
    } else if (flag == "--mode") {
      options.mode = value == "put" ? UcxMode::kPut : value == "am" ? UcxMode::kAm : UcxMode::kAuto;
    } else if (flag == "--fence-writes") {
      options.fence_writes = value == "1";
    } else {
      std::fprintf(stderr, "usage: %s --region-bytes N [--mode auto|put|am] [--fence-writes 1]\n",
                   argv[0]);
      return 2;
    }
  }
  // The protocol gets the original stdout to itself; anything else that writes to fd 1 (UCX's
  // log does by default) goes to stderr instead.
  int protocol_fd = dup(1);
  dup2(2, 1);
  FILE* out = fdopen(protocol_fd, "w");
  if (out == nullptr) return 1;
  auto reply = [out](const std::string& line) {
    std::fprintf(out, "%s\n", line.c_str());
    std::fflush(out);
  };
  auto engine = MakeUcxEngine(options);
  if (!engine) {
    std::fprintf(stderr, "peer: %s\n", engine.error().ToString().c_str());
    return 1;
  }
  auto region = (*engine)->AllocateRegion(region_bytes);
  if (!region) {
    std::fprintf(stderr, "peer: %s\n", region.error().ToString().c_str());
    return 1;
  }
  auto desc = (*engine)->ExportDescriptor({});
  if (!desc) return 1;
  reply("DESC " + HexEncode(*desc));
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "PING") {
      reply("OK");
    } else if (cmd == "ZERO") {
      std::memset(region->base, 0, region->length);
      reply("OK");
    } else if (cmd == "CHECK") {
      std::uint64_t dst = 0, len = 0, src = 0, seed = 0;
      in >> dst >> len >> src >> seed;
      if (!in || !RangeFits(dst, len, region->length)) {
        reply("ERR bad range");
        continue;
      }
      std::int64_t bad = FindPatternMismatch(region->base + dst, len, seed, src);
      if (bad < 0) {
        reply("OK");
      } else {
        reply("BAD " + std::to_string(dst + static_cast<std::uint64_t>(bad)));
      }
    } else if (cmd == "EXIT") {
      reply("OK");
      break;
    } else {
      reply("ERR unknown command");
    }
  }
  engine->reset();
  return 0;
}

PeerProcess& PeerProcess::operator=(PeerProcess&& other) noexcept {
  if (this != &other) {
    Kill();
    pid_ = std::exchange(other.pid_, -1);
    to_child_ = std::exchange(other.to_child_, -1);
    from_child_ = std::exchange(other.from_child_, -1);
    buffer_ = std::move(other.buffer_);
    descriptor_ = std::move(other.descriptor_);
  }
  return *this;
}

Result<PeerProcess> PeerProcess::Spawn(const std::string& binary,
                                       const std::vector<std::string>& args,
                                       const std::vector<std::string>& env, TimePoint deadline) {
  // Everything exec needs is built before fork: the child of a threaded parent may only make
  // async-signal-safe calls.
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry(*e);
    std::string name = entry.substr(0, entry.find('='));
    bool overridden = false;
    for (const auto& o : env) overridden |= o.substr(0, o.find('=')) == name;
    if (!overridden) env_strings.push_back(entry);
  }
  env_strings.insert(env_strings.end(), env.begin(), env.end());
  std::vector<char*> envp, argvp;
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_strings{binary};
  argv_strings.insert(argv_strings.end(), args.begin(), args.end());
  for (auto& a : argv_strings) argvp.push_back(a.data());
  argvp.push_back(nullptr);

  // A write to a peer that died must come back as an error, not kill us.
  signal(SIGPIPE, SIG_IGN);
  int in_pipe[2], out_pipe[2];
  if (pipe2(in_pipe, O_CLOEXEC) != 0) return Err(ErrorCode::kInternal, "pipe failed");
  if (pipe2(out_pipe, O_CLOEXEC) != 0) {
    close(in_pipe[0]);
    close(in_pipe[1]);
    return Err(ErrorCode::kInternal, "pipe failed");
  }
  pid_t pid = fork();
  if (pid < 0) return Err(ErrorCode::kInternal, "fork failed");
  if (pid == 0) {
    dup2(in_pipe[0], 0);
    dup2(out_pipe[1], 1);
    execve(binary.c_str(), argvp.data(), envp.data());
    _exit(127);
  }
  close(in_pipe[0]);
  close(out_pipe[1]);
  PeerProcess p;
  p.pid_ = pid;
  p.to_child_ = in_pipe[1];
  p.from_child_ = out_pipe[0];
  auto line = p.ReadLine(deadline);
  if (!line) return tl::unexpected(line.error());
  if (line->rfind("DESC ", 0) != 0) return Err(ErrorCode::kProtocol, "peer said: " + *line);
  auto desc = HexDecode(line->substr(5));
  if (!desc) return tl::unexpected(desc.error());
  p.descriptor_ = std::move(*desc);
  return p;
}

Result<std::string> PeerProcess::Command(const std::string& line, TimePoint deadline) {
  if (pid_ < 0) return Err(ErrorCode::kUnavailable, "peer process is not running");
  std::string out = line + "\n";
  if (write(to_child_, out.data(), out.size()) != static_cast<ssize_t>(out.size())) {
    return Err(ErrorCode::kUnavailable, "peer process closed its stdin");
  }
  return ReadLine(deadline);
}

Result<std::string> PeerProcess::ReadLine(TimePoint deadline) {
  for (;;) {
    auto nl = buffer_.find('\n');
    if (nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      return line;
    }
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return Err(ErrorCode::kTimeout, "peer process did not answer");
    pollfd fd{from_child_, POLLIN, 0};
    int r = poll(&fd, 1, static_cast<int>(std::min<long long>(left.count(), 1000)));
    if (r <= 0) continue;
    char buf[65536];
    ssize_t n = read(from_child_, buf, sizeof(buf));
    if (n <= 0) return Err(ErrorCode::kUnavailable, "peer process exited");
    buffer_.append(buf, static_cast<std::size_t>(n));
  }
}

void PeerProcess::Kill() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
  }
  if (to_child_ >= 0) close(to_child_);
  if (from_child_ >= 0) close(from_child_);
  to_child_ = from_child_ = -1;
}

}  // namespace kvferry::transport::internal
