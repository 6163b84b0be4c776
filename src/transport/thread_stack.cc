#include "thread_stack.h"

#include <fmt/format.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>

#if defined(__linux__)
#include <cxxabi.h>
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#endif

namespace kvferry::transport {

#if defined(__linux__)
namespace {

// Frames recorded; the handler's own two (itself and the signal trampoline) come first.
constexpr int kHandlerFrames = 2;
constexpr int kMaxFrames = 32 + kHandlerFrames;

// The one sample in progress. `want` is the thread asked for: its handler claims the slot by
// swapping it to kClaimed (a late handler, after the caller gave up, finds 0 and records
// nothing), writes the frames, then publishes their count.
constexpr pid_t kClaimed = -1;
std::atomic<pid_t> g_want{0};
std::atomic<int> g_count{-1};
void* g_frames[kMaxFrames];

void OnSample(int, siginfo_t*, void*) {
  const int saved = errno;
  pid_t expected = static_cast<pid_t>(::syscall(SYS_gettid));
  if (g_want.compare_exchange_strong(expected, kClaimed, std::memory_order_acq_rel)) {
    g_count.store(backtrace(g_frames, kMaxFrames), std::memory_order_release);
  }
  errno = saved;
}

// The signal installed, or an error. Real-time signals from the top down, skipping any that
// already has a handler (glibc keeps its own below SIGRTMIN; Python and torch install none).
Result<int> InstallHandler() {
  static std::once_flag once;
  static Result<int> installed = Err(ErrorCode::kInternal, "not installed");
  std::call_once(once, [] {
    // backtrace() loads libgcc's unwinder on its first call (dlopen, malloc): never in a handler.
    void* prime[1];
    (void)backtrace(prime, 1);
    for (int sig = SIGRTMAX - 1; sig >= SIGRTMIN + 2; --sig) {
      struct sigaction old {};
      if (sigaction(sig, nullptr, &old) != 0) continue;
      const bool taken = (old.sa_flags & SA_SIGINFO) != 0 ? old.sa_sigaction != nullptr
                                                          : old.sa_handler != SIG_DFL;
      if (taken) continue;
      struct sigaction sa {};
      sa.sa_sigaction = OnSample;
      sa.sa_flags = SA_SIGINFO | SA_RESTART;
      sigemptyset(&sa.sa_mask);
      if (sigaction(sig, &sa, nullptr) == 0) {
        installed = sig;
        return;
      }
    }
    installed = Err(ErrorCode::kResourceExhausted,
                    "every real-time signal has a handler already: none left to sample stacks");
  });
  return installed;
}

std::string Describe(void* address) {
  Dl_info info{};
  if (dladdr(address, &info) == 0 || info.dli_fname == nullptr) {
    return fmt::format("{} (no object)", address);
  }
  std::string object = info.dli_fname;
  if (const auto slash = object.rfind('/'); slash != std::string::npos) object.erase(0, slash + 1);
  const auto at = reinterpret_cast<std::uintptr_t>(address);
  std::string out =
      fmt::format("{}+{:#x}", object, at - reinterpret_cast<std::uintptr_t>(info.dli_fbase));
  if (info.dli_sname != nullptr && info.dli_saddr != nullptr) {
    int status = -1;
    char* demangled = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status);
    out += fmt::format(" {}+{:#x}", status == 0 ? demangled : info.dli_sname,
                       at - reinterpret_cast<std::uintptr_t>(info.dli_saddr));
    std::free(demangled);
  }
  return out;
}

}  // namespace

Result<std::vector<std::string>> SampleStack(pid_t tid, std::chrono::milliseconds wait) {
  static std::mutex one_at_a_time;
  std::lock_guard<std::mutex> lock(one_at_a_time);
  Result<int> sig = InstallHandler();
  if (!sig) return tl::unexpected(sig.error());
  if (tid <= 0) return Err(ErrorCode::kInvalidArgument, fmt::format("no thread {}", tid));
  g_count.store(-1, std::memory_order_relaxed);
  g_want.store(tid, std::memory_order_release);
  if (::syscall(SYS_tgkill, ::getpid(), tid, *sig) != 0) {
    const int err = errno;
    g_want.store(0, std::memory_order_release);
    return Err(ErrorCode::kNotFound,
               fmt::format("thread {} of this process: {}", tid, std::strerror(err)));
  }
  const auto deadline = std::chrono::steady_clock::now() + wait;
  int count = -1;
  for (;;) {
    count = g_count.load(std::memory_order_acquire);
    if (count >= 0) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      pid_t expected = tid;
      if (g_want.compare_exchange_strong(expected, 0, std::memory_order_acq_rel)) {
        return Err(ErrorCode::kTimeout,
                   fmt::format("thread {} did not take the signal within {} ms (blocked?)", tid,
                               wait.count()));
      }
      // Claimed meanwhile: its handler is writing the frames; they follow at once.
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  g_want.store(0, std::memory_order_release);
  std::vector<std::string> frames;
  for (int i = kHandlerFrames; i < count; ++i) frames.push_back(Describe(g_frames[i]));
  return frames;
}

#else

Result<std::vector<std::string>> SampleStack(pid_t, std::chrono::milliseconds) {
  return Err(ErrorCode::kInvalidArgument, "stack samples need Linux");
}

#endif

}  // namespace kvferry::transport
