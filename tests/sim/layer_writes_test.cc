// Layer writes in the simulator (issue 22): the real sessions and adapters, P's engine saying
// each plane is computed in the step that completes a prompt. Virtual time, deterministic.
#include <gtest/gtest.h>

#include <chrono>

#include "cluster.h"
#include "explore.h"

namespace kvferry::sim {
namespace {

using namespace std::chrono_literals;

// Eight requests a second apart (no queueing on either side), each 3,000 tokens of a
// Llama-8B-shaped KV (32 layers × 8 heads × 128 × bf16 × K and V = 128 KiB a token, 393 MB a
// request) over a 100 Gb/s data plane: ~31 ms to move after a ~214 ms prefill.
SimConfig Handoffs(std::uint32_t layer_planes) {
  SimConfig c;
  c.seed = 7;
  c.model.block_tokens = 16;
  c.model.kv_heads = 8;
  c.model.kv_bytes_per_token_per_head = 2ull * 32 * 128 * 2;
  c.p.jitter = 0;  // both runs compute alike, whatever else draws from the run's generator
  c.p.layer_planes = layer_planes;
  c.dp.bytes_per_s = 12.5e9;
  for (int i = 0; i < 8; ++i) {
    c.load.requests.push_back({kT0 + std::chrono::seconds(i), 3000, 1, core::kNever});
  }
  c.horizon = kT0 + 2h;
  return c;
}

double MeanLatencyMs(const SimResult& r) {
  double total = 0;
  for (const RequestResult& q : r.requests) {
    EXPECT_EQ(q.outcome, Outcome::kOk);
    total += std::chrono::duration<double, std::milli>(q.end - q.arrival).count();
  }
  return total / static_cast<double>(r.requests.size());
}

TEST(LayerWrites, PlanesSentAsComputedLeaveOnlyTheLastOneToMoveAfterThePrefill) {
  const SimResult after = RunCluster(Handoffs(0));
  const SimResult ahead = RunCluster(Handoffs(32));
  for (const SimResult* r : {&after, &ahead}) {
    for (const std::string& v : r->violations) ADD_FAILURE() << v;
  }
  EXPECT_EQ(after.layer_writes, 0u);
  EXPECT_GT(ahead.layer_writes, 0u);
  // 31 of 32 planes left during the prefill: of the ~31 ms handoff, about one plane's ~1 ms is
  // left after it. What the requests feel is at least 25 ms less (the rest is decode, alike).
  const double saved = MeanLatencyMs(after) - MeanLatencyMs(ahead);
  EXPECT_GT(saved, 25.0) << "after " << MeanLatencyMs(after) << " ms, ahead "
                         << MeanLatencyMs(ahead) << " ms";
  EXPECT_LT(saved, 32.0);
}

// Faults around layer writes: every seed of a stretch of exploration, with layer writes on.
TEST(LayerWrites, ExploredSeedsWithLayerWritesKeepEveryInvariant) {
  std::uint64_t layer_writes = 0;
  for (std::uint64_t seed = 1; seed <= 400; ++seed) {
    SimConfig config = RandomConfig(seed);
    config.p.layer_planes = 4;
    const SimResult run = RunCluster(config);
    layer_writes += run.layer_writes;
    for (const std::string& v : run.violations) {
      ADD_FAILURE() << "seed " << seed << " with 4 layer planes: " << v;
    }
  }
  EXPECT_GT(layer_writes, 0u);
}

}  // namespace
}  // namespace kvferry::sim
