// control::CallDeadline: the hard deadline around a blocking call (bootstrap client, proxy,
// serve's shutdown).
#include "control/call_deadline.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace kvferry::control {
namespace {

using std::chrono::milliseconds;
using std::chrono::steady_clock;

TEST(CallDeadline, AbortsOnceWhenTheCallOutlivesItsDeadline) {
  std::atomic<int> aborted{0};
  const auto start = steady_clock::now();
  {
    CallDeadline deadline(start + milliseconds(50), [&] { ++aborted; });
    while (aborted.load() == 0 && steady_clock::now() - start < milliseconds(5000)) {
      std::this_thread::sleep_for(milliseconds(1));  // the "call", until it is aborted
    }
  }
  EXPECT_EQ(aborted.load(), 1);
  EXPECT_GE(steady_clock::now() - start, milliseconds(50));
}

TEST(CallDeadline, ACallThatEndsInTimeIsNeverAbortedNorWaitedFor) {
  std::atomic<int> aborted{0};
  const auto start = steady_clock::now();
  { CallDeadline deadline(start + milliseconds(10000), [&] { ++aborted; }); }
  EXPECT_LT(steady_clock::now() - start, milliseconds(5000)) << "the guard waited for its deadline";
  std::this_thread::sleep_for(milliseconds(20));
  EXPECT_EQ(aborted.load(), 0);
}

TEST(CallDeadline, ADeadlineAlreadyPastAbortsAtOnce) {
  std::atomic<int> aborted{0};
  {
    CallDeadline deadline(steady_clock::now() - milliseconds(1), [&] { ++aborted; });
    const auto start = steady_clock::now();
    while (aborted.load() == 0 && steady_clock::now() - start < milliseconds(5000)) {
      std::this_thread::sleep_for(milliseconds(1));
    }
  }
  EXPECT_EQ(aborted.load(), 1);
}

}  // namespace
}  // namespace kvferry::control
