// Bounded exploration: ~2,000 random faulty runs must keep every invariant.
#include "explore.h"

#include <gtest/gtest.h>

#include <chrono>

namespace kvferry::sim {
namespace {

TEST(Explore, TwoThousandSeedsKeepEveryInvariant) {
  ExploreOptions options;
  options.first_seed = 1;
  options.runs = 2000;
  const auto start = std::chrono::steady_clock::now();
  const ExploreReport report = Explore(options);
  const double wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (const ExploreFailure& f : report.failures) {
    std::string text = "seed " + std::to_string(f.seed) + ": " + f.description;
    for (const std::string& v : f.violations) text += "\n  " + v;
    ADD_FAILURE() << text << "\n  reproduce: " << ReproCommand(f.seed);
  }
  EXPECT_EQ(report.runs, 2000u);
  // The runs exercise every ending, or the invariants were checked on too little.
  EXPECT_GT(report.ok, report.requests / 4);
  EXPECT_GT(report.failed, report.requests / 10);
  EXPECT_GT(report.aborted, 0u);
  // ... and the paths that only faults reach: fences, and messages to a dead P that never left
  // (reported unsent, a plain failure: DecodeSession::OnSendFailed).
  EXPECT_GT(report.fences, 0u);
  EXPECT_GT(report.messages_unsent, 0u);
  RecordProperty("wall_seconds", std::to_string(wall));
  std::printf("explored %llu runs, %llu events in %.2f s\n",
              static_cast<unsigned long long>(report.runs),
              static_cast<unsigned long long>(report.events), wall);
}

// Seeds where a liveness source declared a live P down (advisory liveness) found two bugs: D
// stopped renewing, so P expired KV a live D still wanted (seed 11216), and a pull given up on
// was never fenced again once P really died, so its blocks stayed quarantined (seed 17639).
TEST(Explore, SeedsWithALiveEngineDeclaredDownKeepEveryInvariant) {
  for (std::uint64_t seed : {11216u, 17639u}) {
    ExploreOptions options;
    options.first_seed = seed;
    options.runs = 1;
    const ExploreReport report = Explore(options);
    ASSERT_EQ(report.runs, 1u);
    for (const ExploreFailure& f : report.failures) {
      std::string text = "seed " + std::to_string(f.seed) + ": " + f.description;
      for (const std::string& v : f.violations) text += "\n  " + v;
      ADD_FAILURE() << text;
    }
  }
}

TEST(Explore, ReproCommandNamesTheSeed) {
  EXPECT_EQ(ReproCommand(1234), "kvferry sim --explore 1 --seed 1234");
}

}  // namespace
}  // namespace kvferry::sim
