// StallWatch: a thread blocked in a phase is described while it blocks, with the system call
// and, for a socket, the TCP connection it waits on.
#include "stall_watch.h"

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

// What a StallWatch reports of a thread spinning in a phase (empty if nothing within 10 s).
std::string ReportOfASpin() {
  std::atomic<bool> release{false};
  std::promise<std::string> reported;
  StallWatch watch(200ms, [&](const std::string& what) { reported.set_value(what); });
  std::thread spinner([&] {
    watch.Attach();
    watch.Enter("a spin", StallWatch::Clock::now());
    while (!release.load()) {
    }
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
