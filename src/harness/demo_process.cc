#include "demo_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <mutex>
#include <set>
#include <thread>

extern char** environ;

namespace kvferry::harness {

namespace {

std::mutex g_registry_mu;
std::set<pid_t>& Registry() {
  static std::set<pid_t> pids;
  return pids;
}

}  // namespace

std::unique_ptr<ChildProcess> ChildProcess::Spawn(
    const std::vector<std::string>& argv, const std::string& log_path,
    const std::map<std::string, std::string>& extra_env, std::string* error) {
  if (argv.empty()) {
    if (error) *error = "empty command";
    return nullptr;
  }
  const int log_fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log_fd < 0) {
    if (error) *error = "cannot open " + log_path + ": " + std::strerror(errno);
    return nullptr;
  }
  // Everything the child needs is prepared before fork (no allocation after it).
  std::vector<char*> cargv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  std::vector<std::string> env_store;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string kv = *e;
    const auto eq = kv.find('=');
    if (eq != std::string::npos && extra_env.count(kv.substr(0, eq)) != 0) continue;
    env_store.push_back(kv);
  }
  for (const auto& [k, v] : extra_env) env_store.push_back(k + "=" + v);
  std::vector<char*> cenv;
  for (auto& s : env_store) cenv.push_back(s.data());
  cenv.push_back(nullptr);
  const pid_t parent = ::getpid();

  std::lock_guard<std::mutex> lock(g_registry_mu);  // the signal watcher sees it or not at all
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(log_fd);
    if (error) *error = std::string("fork: ") + std::strerror(errno);
    return nullptr;
  }
  if (pid == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::signal(SIGPIPE, SIG_DFL);
    const int null_fd = ::open("/dev/null", O_RDONLY);
    if (null_fd >= 0) ::dup2(null_fd, 0);
    ::dup2(log_fd, 1);
    ::dup2(log_fd, 2);
    ::execvpe(cargv[0], cargv.data(), cenv.data());  // a name without '/' is looked up in PATH
    const char msg[] = "exec failed\n";
    [[maybe_unused]] auto w = ::write(2, msg, sizeof msg - 1);
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also here, so that the group exists before we ever signal it
  ::close(log_fd);
  Registry().insert(pid);
  return std::unique_ptr<ChildProcess>(new ChildProcess(pid, log_path));
}

ChildProcess::~ChildProcess() { Stop(2.0); }

bool ChildProcess::Reap(bool block) {
  if (reaped_) return true;
  int status = 0;
  const pid_t r = ::waitpid(pid_, &status, block ? 0 : WNOHANG);
  if (r == pid_ || (r < 0 && errno == ECHILD)) {
    reaped_ = true;
    status_ = r == pid_ ? status : -1;
    std::lock_guard<std::mutex> lock(g_registry_mu);
    Registry().erase(pid_);
    return true;
  }
  return false;
}

bool ChildProcess::Running() { return !Reap(false); }

void ChildProcess::Kill() {
  if (!reaped_) ::kill(-pid_, SIGKILL);
  Reap(true);
}

int ChildProcess::Stop(double grace_s) {
  if (!reaped_) {
    ::kill(-pid_, SIGTERM);
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              std::chrono::duration<double>(grace_s));
    while (!Reap(false) && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (!reaped_) {
      ::kill(-pid_, SIGKILL);
      Reap(true);
    }
  }
  ::kill(-pid_, SIGKILL);  // members of the group that outlived the leader (ESRCH when none)
  return status_;
}

std::string ChildProcess::LogTail(std::size_t max_bytes) const {
  std::ifstream in(log_path_, std::ios::binary | std::ios::ate);
  if (!in) return {};
  const std::streamoff size = in.tellg();
  const std::streamoff start = size > static_cast<std::streamoff>(max_bytes)
                                   ? size - static_cast<std::streamoff>(max_bytes)
                                   : 0;
  in.seekg(start);
  std::string out(static_cast<std::size_t>(size - start), '\0');
  in.read(out.data(), static_cast<std::streamsize>(out.size()));
  return out;
}

void InstallSignalWatcher(std::function<void(int)> on_signal) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGHUP);
  ::pthread_sigmask(SIG_BLOCK, &set, nullptr);
  // A signal whose action is SIG_IGN is discarded even while blocked, so sigwait would never
  // see it (a shell starts background jobs with SIGINT ignored). Blocked, SIG_DFL is safe.
  ::signal(SIGINT, SIG_DFL);
  ::signal(SIGTERM, SIG_DFL);
  ::signal(SIGHUP, SIG_DFL);
  ::signal(SIGPIPE, SIG_IGN);
  std::thread([set, fn = std::move(on_signal)] {
    int sig = 0;
    if (::sigwait(&set, &sig) != 0) return;
    {
      std::lock_guard<std::mutex> lock(g_registry_mu);
      for (pid_t pid : Registry()) ::kill(-pid, SIGKILL);
      for (pid_t pid : Registry()) ::waitpid(pid, nullptr, 0);
      Registry().clear();
    }
    if (fn) fn(sig);
    std::fprintf(stderr, "\ninterrupted (signal %d): every child process stopped\n", sig);
    ::_exit(128 + sig);
  }).detach();
}

bool WaitFor(const std::function<bool()>& ready, double timeout_s, double poll_s,
             const std::function<bool()>& alive) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout_s));
  while (true) {
    if (ready()) return true;
    if (alive && !alive()) return ready();
    if (std::chrono::steady_clock::now() >= deadline) return ready();
    std::this_thread::sleep_for(std::chrono::duration<double>(poll_s));
  }
}

int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
    socklen_t len = sizeof addr;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
      port = ntohs(addr.sin_port);
    }
  }
  ::close(fd);
  return port;
}

}  // namespace kvferry::harness
