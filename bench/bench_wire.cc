// Wire codec micro-benchmarks: what P's side-channel listener pays to dispatch and decode a
// message, and what D pays to build a renewal.
//
// The seed (Python, msgspec) measured the listener's "is this a renewal?" check at 0.7 us for a
// steady pull, 1.3 us for a pull carrying the layout and 21 us for an 18 KB pull of 32 requests;
// the goal is >= 10x faster. Counter `x_seed` = seed time / our time (kIsRate trick: the counter
// holds seed_seconds * iterations, and Google Benchmark divides it by the measured seconds).
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "wire/messages.h"

namespace {

using namespace kvferry;
using namespace kvferry::wire;

constexpr double kSeedSteadyUs = 0.7;
constexpr double kSeedLayoutUs = 1.3;
constexpr double kSeedLargeUs = 21.0;

std::string Uuid(int i) {
  std::string s = "0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0";
  s[s.size() - 1] = static_cast<char>('0' + i % 10);
  s[s.size() - 2] = static_cast<char>('0' + i / 10 % 10);
  return s;
}

Pull BasePull() {
  Pull p;
  p.d_engine_id = "5f0c6f1e-8a44-4d5e-9b7a-2f1d3c4b5a69";
  p.d_tp_size = 2;
  p.d_tp_rank = 1;
  p.d_lease_ms = 30000;
  p.block_len = 2 << 20;
  p.num_blocks = 20000;
  return p;
}

// 1 request, a few blocks, no descriptor (P already has D's region).
Pull SteadyPull() {
  Pull p = BasePull();
  p.requests.push_back({"cmpl-" + Uuid(0), "xfer-" + Uuid(0), {1201, 1202, 1203, 1204}});
  return p;
}

// The same, carrying the region descriptor (a few hundred bytes from the transport layer).
Pull LayoutPull() {
  Pull p = SteadyPull();
  p.region_descriptor = std::vector<std::uint8_t>(320, 0x5a);
  return p;
}

// 32 requests of 118 blocks each, with the descriptor: ~18 KB.
Pull LargePull() {
  Pull p = LayoutPull();
  p.requests.clear();
  for (int i = 0; i < 32; ++i) {
    std::vector<core::BlockId> blocks;
    for (int b = 0; b < 118; ++b) blocks.push_back(static_cast<core::BlockId>(i * 200 + b));
    p.requests.push_back({"cmpl-" + Uuid(i), "xfer-" + Uuid(i), blocks});
  }
  return p;
}

void SetCounters(benchmark::State& state, std::size_t bytes, double seed_us) {
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["x_seed"] = benchmark::Counter(
      seed_us * 1e-6 * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

void BM_Peek(benchmark::State& state, Pull (*make)(), double seed_us) {
  const std::vector<std::uint8_t> frame = Encode(make());
  for (auto _ : state) {
    auto t = PeekType(frame.data(), frame.size());
    benchmark::DoNotOptimize(t);
  }
  SetCounters(state, frame.size(), seed_us);
}
BENCHMARK_CAPTURE(BM_Peek, steady_pull, SteadyPull, kSeedSteadyUs);
BENCHMARK_CAPTURE(BM_Peek, layout_pull, LayoutPull, kSeedLayoutUs);
BENCHMARK_CAPTURE(BM_Peek, large_pull_32req, LargePull, kSeedLargeUs);

// PeekType when "t"/"v" are not the first keys (a foreign encoder): scans keys, skips values.
void BM_PeekSlowPath(benchmark::State& state) {
  std::vector<std::uint8_t> frame = Encode(LargePull());
  // Rename "t" and "v" (the 2nd and 5th byte) and append them at the end as new keys.
  frame[2] = 'T';
  frame[5] = 'V';
  frame.insert(frame.end(), {0xa1, 't', 1, 0xa1, 'v', 1});
  frame[0] = static_cast<std::uint8_t>(frame[0] + 2);  // fixmap count
  for (auto _ : state) {
    auto t = PeekType(frame.data(), frame.size());
    benchmark::DoNotOptimize(t);
  }
  SetCounters(state, frame.size(), kSeedLargeUs);
}
BENCHMARK(BM_PeekSlowPath);

void BM_DecodePull(benchmark::State& state, Pull (*make)(), double seed_us) {
  const std::vector<std::uint8_t> frame = Encode(make());
  for (auto _ : state) {
    auto p = DecodePull(frame.data(), frame.size());
    benchmark::DoNotOptimize(p);
  }
  SetCounters(state, frame.size(), seed_us);
}
BENCHMARK_CAPTURE(BM_DecodePull, steady_pull, SteadyPull, kSeedSteadyUs);
BENCHMARK_CAPTURE(BM_DecodePull, layout_pull, LayoutPull, kSeedLayoutUs);
BENCHMARK_CAPTURE(BM_DecodePull, large_pull_32req, LargePull, kSeedLargeUs);

void BM_EncodePull(benchmark::State& state, Pull (*make)()) {
  const Pull p = make();
  std::size_t bytes = 0;
  for (auto _ : state) {
    auto frame = Encode(p);
    bytes = frame.size();
    benchmark::DoNotOptimize(frame);
  }
  state.counters["bytes"] = static_cast<double>(bytes);
}
BENCHMARK_CAPTURE(BM_EncodePull, large_pull_32req, LargePull);

Renewal Renewal128() {
  std::vector<core::TransferId> ids;
  for (int i = 0; i < 128; ++i) ids.push_back("xfer-" + Uuid(i));
  return {"5f0c6f1e-8a44-4d5e-9b7a-2f1d3c4b5a69", 30000, FingerprintsOf(ids)};
}

void BM_EncodeRenewal128(benchmark::State& state) {
  const Renewal r = Renewal128();
  std::size_t bytes = 0;
  for (auto _ : state) {
    auto frame = Encode(r);
    bytes = frame.size();
    benchmark::DoNotOptimize(frame);
  }
  state.counters["bytes"] = static_cast<double>(bytes);
}
BENCHMARK(BM_EncodeRenewal128);

// D side, from ids: fingerprinting 128 transfer ids plus encoding.
void BM_FingerprintAndEncodeRenewal128(benchmark::State& state) {
  std::vector<core::TransferId> ids;
  for (int i = 0; i < 128; ++i) ids.push_back("xfer-" + Uuid(i));
  for (auto _ : state) {
    auto frame =
        Encode(Renewal{"5f0c6f1e-8a44-4d5e-9b7a-2f1d3c4b5a69", 30000, FingerprintsOf(ids)});
    benchmark::DoNotOptimize(frame);
  }
}
BENCHMARK(BM_FingerprintAndEncodeRenewal128);

void BM_DecodeRenewal128(benchmark::State& state) {
  const std::vector<std::uint8_t> frame = Encode(Renewal128());
  for (auto _ : state) {
    auto r = DecodeRenewal(frame.data(), frame.size());
    benchmark::DoNotOptimize(r);
  }
  state.counters["bytes"] = static_cast<double>(frame.size());
}
BENCHMARK(BM_DecodeRenewal128);

}  // namespace

BENCHMARK_MAIN();
