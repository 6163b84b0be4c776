// StallWatch: a thread blocked in a phase is described while it blocks, with the system call
// and, for a socket, the TCP connection it waits on.
#include "stall_watch.h"

#include <signal.h>
#include <sys/syscall.h>

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "support/raw_socket.h"
#include "thread_stack.h"

namespace kvferry::transport {
namespace {

using namespace std::chrono_literals;

// A connected TCP pair on 127.0.0.1: {client, server side}.
std::pair<int, int> TcpPair() {
  kvferry::testing::SilentListener listener(1);
  const int client = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<std::uint16_t>(listener.port()));
  EXPECT_EQ(connect(client, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  return {client, accept(listener.fd(), nullptr, nullptr)};
}

}  // namespace
}  // namespace kvferry::transport

// The loop the spin tests catch, exported (the test binary has ENABLE_EXPORTS) so that dladdr
// names it in a stack sample, and never inlined into its caller.
extern "C" __attribute__((noinline)) void KvferryTestSpinUntil(const std::atomic<bool>* release) {
  while (!release->load()) {
  }
}

namespace kvferry::transport {
namespace {

// What a StallWatch reports of a thread spinning in a phase (empty if nothing within 10 s).
std::string ReportOfASpin() {
  std::atomic<bool> release{false};
  std::promise<std::string> reported;
  StallWatch watch(200ms, [&](const std::string& what) { reported.set_value(what); });
  std::thread spinner([&] {
    watch.Attach();
    watch.Enter("a spin", StallWatch::Clock::now());
    KvferryTestSpinUntil(&release);
    watch.Leave();
  });
  std::future<std::string> got = reported.get_future();
  const bool ready = got.wait_for(10s) == std::future_status::ready;
  release.store(true);
  spinner.join();
  return ready ? got.get() : std::string();
}

TEST(StallWatch, ABlockedPhaseIsReportedOnceWithTheSocketItWaitsOn) {
  auto [client, server] = TcpPair();
  std::mutex mu;
  std::vector<std::string> reports;
  std::promise<void> reported;
  {
    StallWatch watch(200ms, [&](const std::string& what) {
      std::lock_guard<std::mutex> lock(mu);
      reports.push_back(what);
      if (reports.size() == 1) reported.set_value();
    });
    std::thread blocked([&] {
      watch.Attach();
      watch.Enter("a test read", StallWatch::Clock::now());
      char byte = 0;
      ASSERT_EQ(recv(client, &byte, 1, 0), 1);  // blocks until the server side writes
      watch.Leave();
    });
    ASSERT_EQ(reported.get_future().wait_for(10s), std::future_status::ready);
    std::this_thread::sleep_for(1500ms);  // the watcher looks again: no second report
    const char byte = 1;
    ASSERT_EQ(send(server, &byte, 1, 0), 1);
    blocked.join();
  }
  close(client);
  close(server);
  ASSERT_EQ(reports.size(), 1u);
  const std::string& r = reports[0];
  EXPECT_NE(r.find("a test read"), std::string::npos) << r;
  EXPECT_NE(r.find("recvfrom"), std::string::npos) << r;
  EXPECT_NE(r.find("127.0.0.1"), std::string::npos) << r;
  EXPECT_NE(r.find("ESTABLISHED"), std::string::npos) << r;
}

// The case CI met: the watched thread spins inside the call (a lock) while another thread of
// the process sits in a socket call; the report names the spin and that other thread.
TEST(StallWatch, ASpinningPhaseIsReportedWithTheOtherThreadsWaitingOnSockets) {
  auto [client, server] = TcpPair();
  std::thread holder([client = client] {
    char byte = 0;
    (void)recv(client, &byte, 1, 0);  // "holds the lock" until the test writes
  });
  const std::string r = ReportOfASpin();
  EXPECT_NE(r.find("running, not in a system call"), std::string::npos) << r;
  EXPECT_NE(r.find("recvfrom"), std::string::npos) << r;
  EXPECT_NE(r.find("ESTABLISHED"), std::string::npos) << r;
  const char byte = 1;
  ASSERT_EQ(send(server, &byte, 1, 0), 1);
  holder.join();
  close(client);
  close(server);
}

TEST(StallWatch, ASpinningPhaseIsReportedWithSamplesOfItsStackThatNameTheLoop) {
  const std::string r = ReportOfASpin();
  for (const char* sample : {"stack sample 1 of 3:", "stack sample 3 of 3:"}) {
    EXPECT_NE(r.find(sample), std::string::npos) << r;
  }
  // Each sample's innermost frame is the loop itself, in the test binary.
  std::size_t at = 0;
  int innermost_in_loop = 0;
  while ((at = r.find("#0 ", at)) != std::string::npos) {
    const std::size_t end = r.find('\n', at);
    if (r.substr(at, end - at).find("KvferryTestSpinUntil+") != std::string::npos) ++innermost_in_loop;
    at = end;
  }
  EXPECT_EQ(innermost_in_loop, 3) << r;
}

TEST(StallWatch, AStackSampleOfAThreadThatIsNotThereIsAnErrorAndSendsNothing) {
  // No thread of this process has this id: a kernel pid is at most 2^22.
  Result<std::vector<std::string>> frames = SampleStack(1 << 23, 500ms);
  ASSERT_FALSE(frames.has_value());
  EXPECT_EQ(frames.error().code(), ErrorCode::kNotFound) << frames.error().message();
}

TEST(StallWatch, AStackSampleOfAThreadBlockingTheSignalTimesOutAndALateHandlerRecordsNothing) {
  // Install the handler first (the first sample does), then block every signal in a thread.
  ASSERT_TRUE(SampleStack(static_cast<pid_t>(::syscall(SYS_gettid)), 500ms).has_value());
  std::atomic<pid_t> tid{0};
  std::atomic<bool> unblock{false};
  std::thread blocked([&] {
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, nullptr);
    tid.store(static_cast<pid_t>(::syscall(SYS_gettid)));
    while (!unblock.load()) std::this_thread::sleep_for(1ms);
    pthread_sigmask(SIG_UNBLOCK, &all, nullptr);  // the pending signal's handler runs here
  });
  while (tid.load() == 0) std::this_thread::sleep_for(1ms);
  Result<std::vector<std::string>> frames = SampleStack(tid.load(), 100ms);
  ASSERT_FALSE(frames.has_value());
  EXPECT_EQ(frames.error().code(), ErrorCode::kTimeout) << frames.error().message();
  unblock.store(true);
  blocked.join();
  // The late handler left the slot alone: the next sample is this thread's own.
  Result<std::vector<std::string>> mine = SampleStack(static_cast<pid_t>(::syscall(SYS_gettid)), 500ms);
  ASSERT_TRUE(mine.has_value()) << mine.error().message();
  EXPECT_FALSE(mine->empty());
}

TEST(StallWatch, ASpinningPhaseNamesTheSocketWaiterAheadOfManyLockWaiters) {
  // A vLLM worker parks dozens of torch threads in futexes; started first (lower thread ids,
  // listed first by /proc), they must not crowd the thread in a socket call out of the report.
  std::mutex mu;
  std::condition_variable cv;
  bool go = false;
  std::vector<std::thread> parked;
  for (int i = 0; i < 16; ++i) {
    parked.emplace_back([&] {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return go; });
    });
  }
  auto [client, server] = TcpPair();
  std::thread holder([client = client] {
    char byte = 0;
    (void)recv(client, &byte, 1, 0);
  });
  const std::string r = ReportOfASpin();
  const std::size_t socket_at = r.find("recvfrom");
  EXPECT_NE(socket_at, std::string::npos) << r;
  EXPECT_LT(socket_at, r.find("futex")) << r;
  EXPECT_NE(r.find("more)"), std::string::npos) << r;  // 16 parked: over the listed 12
  const char byte = 1;
  ASSERT_EQ(send(server, &byte, 1, 0), 1);
  holder.join();
  {
    std::lock_guard<std::mutex> lock(mu);
    go = true;
  }
  cv.notify_all();
  for (auto& t : parked) t.join();
  close(client);
  close(server);
}

TEST(StallWatch, PhasesShorterThanTheBoundAreNeverReported) {
  int reports = 0;
  {
    StallWatch watch(5s, [&](const std::string&) { ++reports; });
    watch.Attach();
    for (int i = 0; i < 1000; ++i) {
      watch.Enter("short", StallWatch::Clock::now());
      watch.Leave();
    }
    std::this_thread::sleep_for(1200ms);
  }
  EXPECT_EQ(reports, 0);
}

}  // namespace
}  // namespace kvferry::transport
