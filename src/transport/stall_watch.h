// StallWatch: tells, while it lasts, what a thread stuck in one phase of its loop waits in.
//
// Why: UCX 1.13's ucp_worker_progress has blocked a P's progress thread for 25-100 s in the
// real-vLLM tier (docs/vllm.md, known issue), stalling every write of that P; the duration
// (UcxEngine::WarnIfBlocked) was logged only once the call returned, which said nothing of the
// cause. The watcher reads the blocked thread's current system call from /proc while it blocks
// (its number and name, and for a socket call the connection's addresses, state and queue
// sizes from /proc/net/tcp), which separates a blocking send to a peer that does not read, a
// connect whose SYNs go unanswered and a lock wait.
//
// Contract: Attach() on the watched thread once, before its first Enter. Enter(phase, now) and
// Leave() bracket each watched phase on that thread (two relaxed atomic stores; the loop that
// spins calls them every turn). A phase still running `report_after` after its Enter is
// reported once, through `report`, on the watcher's own thread, then not again until the next
// phase. The destructor stops the watcher (within its 1 s period) and never calls `report`
// afterwards. Linux-only in what it reads; elsewhere the report says the state is unknown.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace kvferry::transport {

class StallWatch {
 public:
  using Clock = std::chrono::steady_clock;
  StallWatch(Clock::duration report_after, std::function<void(const std::string&)> report);
  ~StallWatch();
  StallWatch(const StallWatch&) = delete;
  StallWatch& operator=(const StallWatch&) = delete;

  void Attach();
  void Enter(const char* phase, Clock::time_point now) {
    phase_.store(phase, std::memory_order_relaxed);
    since_.store(now.time_since_epoch().count(), std::memory_order_release);
  }
  void Leave() { since_.store(0, std::memory_order_release); }

  // What thread `tid` of this process waits in now: "in syscall 44 (sendto) on fd 31 (tcp
  // 127.0.0.1:40512 -> 127.0.0.1:38111 ESTABLISHED tx_queue 2626560 rx_queue 0)", or, for a
  // thread running outside any system call (a spin, e.g. on a lock), that, followed by the
  // other threads of the process that sit in a socket call or a futex. Exposed for its test.
  static std::string DescribeWait(pid_t tid);

 private:
  void Run();

  const Clock::duration report_after_;
  const std::function<void(const std::string&)> report_;
  std::atomic<pid_t> tid_{0};
  std::atomic<const char*> phase_{nullptr};
  std::atomic<Clock::rep> since_{0};  // 0: not in a watched phase
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members it uses exist
};

}  // namespace kvferry::transport
