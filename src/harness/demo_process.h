// Child processes of the demo: each runs in its own process group, with stdout/stderr in a log
// file, and is stopped by signalling the whole group (SIGTERM, then SIGKILL after a deadline).
// A process-wide registry lets a signal watcher stop every live child on SIGINT/SIGTERM, and
// children get PR_SET_PDEATHSIG so that they die with the demo even if it is SIGKILLed.
#pragma once

#include <sys/types.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace kvferry::harness {

class ChildProcess {
 public:
  // Starts argv[0] (a path, or a name looked up in PATH) with `argv`, `extra_env` added to the environment, output appended
  // to `log_path`. Returns nullptr (with `error`) when it cannot start.
  static std::unique_ptr<ChildProcess> Spawn(const std::vector<std::string>& argv,
                                             const std::string& log_path,
                                             const std::map<std::string, std::string>& extra_env,
                                             std::string* error);
  ~ChildProcess();  // Stop(2 s) if still running
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  const std::string& log_path() const { return log_path_; }
  // True while the process has not exited (reaps it if it has).
  bool Running();
  // SIGKILL to the whole process group at once (the "D crash"); reaps the leader.
  void Kill();
  // SIGTERM to the group, SIGKILL after `grace_s`; always reaps the leader and SIGKILLs the
  // group's remaining members. Returns the exit status as from waitpid (or -1).
  int Stop(double grace_s);
  // The last `max_bytes` of the log (for error messages).
  std::string LogTail(std::size_t max_bytes) const;

 private:
  ChildProcess(pid_t pid, std::string log_path) : pid_(pid), log_path_(std::move(log_path)) {}
  bool Reap(bool block);
  pid_t pid_;
  std::string log_path_;
  bool reaped_ = false;
  int status_ = -1;
};

// Blocks SIGINT/SIGTERM/SIGHUP in the calling thread (call first thing in main, before any
// thread is created, so every thread inherits the mask) and starts a thread that waits for
// them: on the first, it SIGKILLs the process group of every live ChildProcess, runs
// `on_signal` (optional) and then exits the process with 128 + signal.
void InstallSignalWatcher(std::function<void(int)> on_signal = {});

// Waits until `ready()` returns true or `timeout_s` passes, polling every `poll_s`; also gives
// up when `alive()` (optional) returns false. Returns ready().
bool WaitFor(const std::function<bool()>& ready, double timeout_s, double poll_s = 0.05,
             const std::function<bool()>& alive = {});

// A free TCP port on 127.0.0.1 (bound and released; good enough for a demo on loopback).
int FreePort();

}  // namespace kvferry::harness
