// Benchmarks of the sans-IO core (docs/performance.md records the results and the command).
//
//   build/bench/bench_core --benchmark_counters_tabular=true
//
// - Renewal handling cost per transfer id.
// - The expiry pass at 1e4, 1e5 and 1e6 held transfers, against a naive full scan in the same
//   run (the `ratio` counter of the naive rows is naive time / heap time for the same size).
// - Memory per held entry (with its tombstone) and per tracked request in the renewal scheduler.
#include <benchmark/benchmark.h>
#include <malloc.h>

#include <cstdio>
#include <map>
#include <memory>
#include <unordered_map>
#include <vector>

#include "kvferry/core/hold_table.h"
#include "kvferry/core/renewal_scheduler.h"

namespace kvferry::core {
namespace {

using std::chrono::seconds;

std::string IdOf(std::uint64_t i) {
  // The shape of vLLM's router ids: "xfer-" + a 32-hex-digit uuid.
  char buf[48];
  std::snprintf(buf, sizeof buf, "xfer-%016llx%016llx", static_cast<unsigned long long>(i),
                static_cast<unsigned long long>(i * 0x9e3779b97f4a7c15ull));
  return buf;
}

std::size_t HeapBytesInUse() { return mallinfo2().uordblks; }

HoldConfig Lease30() {
  HoldConfig c;
  c.lease = seconds(30);
  c.abort_request_timeout = seconds(480);
  return c;
}

void BM_RenewPerTransferId(benchmark::State& state) {
  const auto n = static_cast<std::uint64_t>(state.range(0));
  HoldTable table(Lease30());
  const TimePoint t0 = TimePoint{} + seconds(1);
  std::vector<Fingerprint> fps;
  for (std::uint64_t i = 0; i < n; ++i) {
    const TransferId id = IdOf(i);
    (void)table.Admit(id, i, t0);
    (void)table.PrefillDone(id, 8, t0);
    fps.push_back(FingerprintOf(id));
  }
  std::size_t next = 0;
  TimePoint now = t0;
  for (auto _ : state) {
    // One renewal message: 128 ids.
    std::span<const Fingerprint> batch(fps.data() + next, 128);
    auto r = table.Renew(batch, now);
    benchmark::DoNotOptimize(r);
    next = (next + 128) % (n - 128);
    now += std::chrono::microseconds(1);
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * 128);
  state.counters["ns_per_id"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * 128,
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_RenewPerTransferId)->Arg(100000);

// Steady state for the expiry pass: n held transfers whose deadlines are spread evenly over
// 100 s; each pass advances one second, so 1% are due; released ones are replaced (outside the
// timed region) so n stays constant. Half of the entries are renewed between passes (untimed),
// which is what reorders deadlines and what an ordered reaper gets wrong.
void BM_ExpiryPassHeap(benchmark::State& state) {
  const auto n = static_cast<std::uint64_t>(state.range(0));
  HoldConfig config = Lease30();
  config.lease = seconds(100);
  config.max_tombstones = 0;  // measure the pass itself
  HoldTable table(config);
  TimePoint now = TimePoint{} + seconds(1000);
  std::uint64_t next_id = 0;
  for (; next_id < n; ++next_id) {
    const TransferId id = IdOf(next_id);
    (void)table.Admit(id, next_id, now);
    (void)table.PrefillDone(id, 1, now - seconds(static_cast<int>(next_id % 100)));
  }
  std::uint64_t released = 0;
  for (auto _ : state) {
    now += seconds(1);
    table.Expire(now);
    state.PauseTiming();
    auto events = table.TakeEvents();
    released += events.size();
    for (std::size_t i = 0; i < events.size(); ++i, ++next_id) {
      const TransferId id = IdOf(next_id);
      (void)table.Admit(id, next_id, now);
      (void)table.PrefillDone(id, 1, now);
    }
    state.ResumeTiming();
  }
  state.counters["released_per_pass"] =
      static_cast<double>(released) / static_cast<double>(state.iterations());
}
BENCHMARK(BM_ExpiryPassHeap)->Arg(10000)->Arg(100000)->Arg(1000000)->Unit(benchmark::kMicrosecond);

// The naive variant: what vLLM's Mooncake P does (and what fixed NIXL's #58222): scan every
// entry on every pass.
void BM_ExpiryPassNaiveScan(benchmark::State& state) {
  const auto n = static_cast<std::uint64_t>(state.range(0));
  struct NaiveEntry {
    TransferId id;
    TimePoint expire;
  };
  std::unordered_map<Fingerprint, NaiveEntry> entries;
  TimePoint now = TimePoint{} + seconds(1000);
  std::uint64_t next_id = 0;
  for (; next_id < n; ++next_id) {
    const TransferId id = IdOf(next_id);
    entries[FingerprintOf(id)] = {id, now + seconds(100 - static_cast<int>(next_id % 100))};
  }
  std::vector<Fingerprint> due;
  for (auto _ : state) {
    now += seconds(1);
    due.clear();
    for (const auto& [fp, e] : entries) {
      if (e.expire <= now) due.push_back(fp);
    }
    for (Fingerprint fp : due) entries.erase(fp);
    state.PauseTiming();
    for (std::size_t i = 0; i < due.size(); ++i, ++next_id) {
      const TransferId id = IdOf(next_id);
      entries[FingerprintOf(id)] = {id, now + seconds(100)};
    }
    state.ResumeTiming();
  }
}
BENCHMARK(BM_ExpiryPassNaiveScan)
    ->Arg(10000)
    ->Arg(100000)
    ->Arg(1000000)
    ->Unit(benchmark::kMicrosecond);

// Bytes of heap per held transfer at n entries, and per tombstone once they are all released.
void BM_MemoryPerHeldEntry(benchmark::State& state) {
  const auto n = static_cast<std::uint64_t>(state.range(0));
  double per_entry = 0, per_tombstone = 0;
  for (auto _ : state) {
    const std::size_t before = HeapBytesInUse();
    auto table = std::make_unique<HoldTable>(Lease30());
    const TimePoint t0 = TimePoint{} + seconds(1);
    for (std::uint64_t i = 0; i < n; ++i) {
      const TransferId id = IdOf(i);
      (void)table->Admit(id, i, t0);
      (void)table->PrefillDone(id, 8, t0);
    }
    const std::size_t held = HeapBytesInUse();
    table->Expire(t0 + seconds(31));  // every entry becomes a tombstone
    (void)table->TakeEvents();
    const std::size_t tombstoned = HeapBytesInUse();
    per_entry = static_cast<double>(held - before) / static_cast<double>(n);
    per_tombstone = static_cast<double>(tombstoned - before) / static_cast<double>(n);
  }
  state.counters["bytes_per_entry"] = per_entry;
  state.counters["bytes_per_tombstone"] = per_tombstone;
  state.counters["entry_plus_tombstone"] = per_entry + per_tombstone;
}
BENCHMARK(BM_MemoryPerHeldEntry)->Arg(1000000)->Iterations(1)->Unit(benchmark::kMillisecond);

void BM_MemoryPerTrackedRequest(benchmark::State& state) {
  const auto n = static_cast<std::uint64_t>(state.range(0));
  double per_request = 0;
  for (auto _ : state) {
    const std::size_t before = HeapBytesInUse();
    auto scheduler = std::make_unique<RenewalScheduler>(seconds(30));
    for (std::uint64_t i = 0; i < n; ++i)
      scheduler->Track(IdOf(i), "engine-" + std::to_string(i % 4));
    per_request = static_cast<double>(HeapBytesInUse() - before) / static_cast<double>(n);
  }
  state.counters["bytes_per_request"] = per_request;
}
BENCHMARK(BM_MemoryPerTrackedRequest)->Arg(100000)->Iterations(1)->Unit(benchmark::kMillisecond);

void BM_RenewalPollPerTrackedRequest(benchmark::State& state) {
  const auto n = static_cast<std::uint64_t>(state.range(0));
  RenewalScheduler scheduler(seconds(30));
  for (std::uint64_t i = 0; i < n; ++i) scheduler.Track(IdOf(i), "engine-" + std::to_string(i % 4));
  TimePoint now = TimePoint{} + seconds(1);
  for (auto _ : state) {
    auto batches = scheduler.Poll(now);
    benchmark::DoNotOptimize(batches);
    now += seconds(5);
  }
  state.counters["ns_per_id"] =
      benchmark::Counter(static_cast<double>(state.iterations() * n),
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_RenewalPollPerTrackedRequest)->Arg(10000)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace kvferry::core

BENCHMARK_MAIN();
