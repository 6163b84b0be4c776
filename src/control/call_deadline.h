// A hard deadline for one blocking call. cpp-httplib's socket timeouts bound each connect, read
// and write, not the whole call, so a peer that trickles bytes could stretch a call without
// end; a CallDeadline makes the caller's deadline hard.
//
// Contract: constructing it starts a thread that waits until `deadline` or until the guard is
// destroyed, whichever comes first. At the deadline it runs `abort` once, on that thread (for
// httplib: the client's stop(), its documented cross-thread abort, which shuts the socket down
// so the blocked call returns an error). The destructor returns only after the thread ended,
// so `abort` never runs after it: scope the guard around the call, inside the client's life.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

namespace kvferry::control {

class CallDeadline {
 public:
  CallDeadline(std::chrono::steady_clock::time_point deadline, std::function<void()> abort)
      : abort_(std::move(abort)), thread_([this, deadline] {
          std::unique_lock<std::mutex> lock(mu_);
          if (!cv_.wait_until(lock, deadline, [this] { return done_; })) abort_();
        }) {}
  ~CallDeadline() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  CallDeadline(const CallDeadline&) = delete;
  CallDeadline& operator=(const CallDeadline&) = delete;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::function<void()> abort_;
  std::thread thread_;  // last: starts after the members it uses exist
};

}  // namespace kvferry::control
