#include "stall_watch.h"

#include <fmt/format.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "kvferry/core/thread_name.h"
#include "thread_stack.h"

namespace kvferry::transport {
namespace {

// Stack samples of a spinning thread in its report, and the time between them.
constexpr int kStackSamples = 3;
constexpr auto kStackSampleGap = std::chrono::milliseconds(100);

std::string ReadFirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// x86-64 and aarch64 numbers of the calls a blocked progress thread can sit in; others are
// printed by number.
std::string_view SyscallName(long nr) {
#if defined(__x86_64__)
  switch (nr) {
    case 0: return "read";
    case 1: return "write";
    case 7: return "poll";
    case 19: return "readv";
    case 20: return "writev";
    case 42: return "connect";
    case 43: return "accept";
    case 44: return "sendto";
    case 45: return "recvfrom";
    case 46: return "sendmsg";
    case 47: return "recvmsg";
    case 202: return "futex";
    case 232: return "epoll_wait";
    case 270: return "pselect6";
    case 271: return "ppoll";
    case 281: return "epoll_pwait";
    case 288: return "accept4";
    default: return "";
  }
#else
  (void)nr;
  return "";
#endif
}

// Calls whose first argument is a file descriptor worth resolving to a connection.
bool TakesFd(std::string_view name) {
  return name == "read" || name == "write" || name == "readv" || name == "writev" ||
         name == "connect" || name == "accept" || name == "accept4" || name == "sendto" ||
         name == "recvfrom" || name == "sendmsg" || name == "recvmsg";
}

std::string_view TcpState(unsigned st) {
  static constexpr std::array<std::string_view, 12> kNames = {
      "?",         "ESTABLISHED", "SYN_SENT",   "SYN_RECV", "FIN_WAIT1", "FIN_WAIT2",
      "TIME_WAIT", "CLOSE",       "CLOSE_WAIT", "LAST_ACK", "LISTEN",    "CLOSING"};
  return st < kNames.size() ? kNames[st] : "?";
}

// "0100007F:9C40" (IPv4, as /proc/net/tcp prints it) -> "127.0.0.1:40000"; other forms as is.
std::string Address(const std::string& hex) {
  const auto colon = hex.find(':');
  if (colon != 8) return hex;
  const unsigned long ip = std::strtoul(hex.substr(0, 8).c_str(), nullptr, 16);
  const unsigned long port = std::strtoul(hex.substr(colon + 1).c_str(), nullptr, 16);
  return fmt::format("{}.{}.{}.{}:{}", ip & 0xff, (ip >> 8) & 0xff, (ip >> 16) & 0xff,
                     (ip >> 24) & 0xff, port);
}

// The TCP connection of socket `inode`, from /proc/self/net/tcp{,6}; empty if not found.
std::string TcpConnection(const std::string& inode) {
  for (const char* table : {"/proc/self/net/tcp", "/proc/self/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string sl, local, remote, st, queues, tr, retr, uid, timeout, ino;
      fields >> sl >> local >> remote >> st >> queues >> tr >> retr >> uid >> timeout >> ino;
      if (ino != inode) continue;
      const auto colon = queues.find(':');
      const unsigned long tx = std::strtoul(queues.substr(0, colon).c_str(), nullptr, 16);
      const unsigned long rx =
          colon == std::string::npos ? 0 : std::strtoul(queues.substr(colon + 1).c_str(), nullptr, 16);
      return fmt::format("tcp {} -> {} {} tx_queue {} rx_queue {}", Address(local),
                         Address(remote), TcpState(std::strtoul(st.c_str(), nullptr, 16)), tx, rx);
    }
  }
  return {};
}

std::string DescribeFd(long fd) {
  std::array<char, 256> target{};
  const std::string link = fmt::format("/proc/self/fd/{}", fd);
  const ssize_t n = readlink(link.c_str(), target.data(), target.size() - 1);
  if (n <= 0) return fmt::format("fd {}", fd);
  const std::string what(target.data(), static_cast<std::size_t>(n));
  constexpr std::string_view kSocket = "socket:[";
  if (what.rfind(kSocket, 0) == 0 && what.back() == ']') {
    const std::string tcp = TcpConnection(what.substr(kSocket.size(), what.size() - kSocket.size() - 1));
    if (!tcp.empty()) return fmt::format("fd {} ({})", fd, tcp);
  }
  return fmt::format("fd {} ({})", fd, what);
}

}  // namespace

StallWatch::StallWatch(Clock::duration report_after,
                       std::function<void(const std::string&)> report)
    : report_after_(report_after), report_(std::move(report)), thread_([this] {
        core::NameThisThread("kvf-stallwatch");
        Run();
      }) {}

StallWatch::~StallWatch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void StallWatch::Attach() { tid_.store(static_cast<pid_t>(::syscall(SYS_gettid))); }

namespace {

// {syscall name or "", description} of thread `tid`'s current wait.
std::pair<std::string, std::string> Wait(pid_t tid) {
  const std::string task = fmt::format("/proc/self/task/{}/", tid);
  const std::string line = ReadFirstLine(task + "syscall");
  const std::string wchan = ReadFirstLine(task + "wchan");
  const std::string in_kernel = wchan.empty() || wchan == "0" ? "" : ", kernel wait " + wchan;
  if (line.empty()) return {"", "in an unknown state (no /proc/self/task/<tid>/syscall)"};
  if (line == "running") return {"", "running, not in a system call"};
  std::istringstream fields(line);
  long nr = -1;
  std::string arg0;
  fields >> nr >> arg0;
  if (nr < 0) return {"", "not in a system call" + in_kernel};
  const std::string name(SyscallName(nr));
  std::string out = name.empty() ? fmt::format("in syscall {}", nr)
                                 : fmt::format("in syscall {} ({})", nr, name);
  if (TakesFd(name)) out += " on " + DescribeFd(std::strtol(arg0.c_str(), nullptr, 16));
  return {name, out + in_kernel};
}

}  // namespace

std::string StallWatch::DescribeWait(pid_t tid) {
  auto [name, what] = Wait(tid);
  if (what != "running, not in a system call") return what;
  // Spinning inside the call (a lock, a retry loop): say which other threads of the process
  // sit in a socket call, an event wait or a lock, e.g. UCX's async thread holding its lock in a
  // connect. Socket calls first, then event waits (where UCX's async thread idles), then other
  // spinning threads, then lock waits: a vLLM worker has dozens of torch threads parked in
  // futexes, and listed in /proc's order they filled the list (a clean-clone CI run's report of
  // a 5.5 s spin named eight gloo threads and nothing of UCX's).
  what += " (a spin or a long computation)";
  // Where it spins: a few samples of its stack, apart enough to tell a loop (the same frames
  // each time, the innermost one moving) from one long call.
  for (int i = 0; i < kStackSamples; ++i) {
    if (i > 0) std::this_thread::sleep_for(kStackSampleGap);
    Result<std::vector<std::string>> frames = SampleStack(tid, std::chrono::milliseconds(500));
    if (!frames) {
      what += fmt::format("; no stack sample: {}", frames.error().message());
      break;
    }
    what += fmt::format("; stack sample {} of {}:", i + 1, kStackSamples);
    for (std::size_t f = 0; f < frames->size(); ++f) what += fmt::format("\n    #{} {}", f, (*frames)[f]);
  }
  struct Other {
    int rank;
    std::string line;
  };
  std::vector<Other> others;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task", ec)) {
    const std::string id = entry.path().filename().string();
    const pid_t other = static_cast<pid_t>(std::strtol(id.c_str(), nullptr, 10));
    if (other == tid || other <= 0) continue;
    auto [other_name, other_what] = Wait(other);
    int rank;
    if (TakesFd(other_name)) {
      rank = 0;
    } else if (other_name == "poll" || other_name == "ppoll" || other_name == "epoll_wait" ||
               other_name == "epoll_pwait" || other_name == "pselect6") {
      rank = 1;
    } else if (other_what.rfind("running", 0) == 0) {
      rank = 2;
    } else if (other_name == "futex") {
      rank = 3;
    } else {
      continue;
    }
    const std::string comm = ReadFirstLine(fmt::format("/proc/self/task/{}/comm", other));
    others.push_back({rank, fmt::format("{} [{}] {}", comm, other, other_what)});
  }
  std::stable_sort(others.begin(), others.end(),
                   [](const Other& a, const Other& b) { return a.rank < b.rank; });
  constexpr std::size_t kListed = 12;
  if (!others.empty()) {
    what += "; meanwhile";
    for (std::size_t i = 0; i < others.size() && i < kListed; ++i) what += "\n    " + others[i].line;
    if (others.size() > kListed) what += fmt::format("\n    ({} more)", others.size() - kListed);
  }
  return what;
}

void StallWatch::Run() {
  Clock::rep reported = 0;
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, std::chrono::seconds(1), [this] { return stop_; })) {
    const Clock::rep since = since_.load(std::memory_order_acquire);
    if (since == 0 || since == reported) continue;
    const Clock::duration running = Clock::now().time_since_epoch() - Clock::duration(since);
    if (running < report_after_) continue;
    reported = since;
    const char* phase = phase_.load(std::memory_order_relaxed);
    const pid_t tid = tid_.load();
    report_(fmt::format("{} for {} s so far, {}", phase != nullptr ? phase : "a phase",
                        std::chrono::duration_cast<std::chrono::seconds>(running).count(),
                        tid != 0 ? DescribeWait(tid) : std::string("an unattached thread")));
  }
}

}  // namespace kvferry::transport
