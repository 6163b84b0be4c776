// Prometheus text exposition helpers for `kvferry serve`'s /metrics: a fixed-bucket histogram
// and a writer that emits each family's HELP/TYPE once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvferry/core/stat_fields.h"

namespace kvferry::harness {

// Cumulative-bucket histogram in seconds. Not thread-safe: guard it with the owner's mutex.
class Histogram {
 public:
  Histogram();
  void Observe(double seconds);
  const std::vector<double>& bounds() const { return bounds_; }
  const std::vector<std::uint64_t>& counts() const { return counts_; }  // per bucket, +Inf last
  double sum() const { return sum_; }
  std::uint64_t count() const { return count_; }

 private:
  std::vector<double> bounds_;
  std::vector<std::uint64_t> counts_;
  double sum_ = 0;
  std::uint64_t count_ = 0;
};

using Labels = std::vector<std::pair<std::string, std::string>>;

class PromWriter {
 public:
  // Starts a family; `type` is "counter", "gauge" or "histogram".
  void Family(std::string_view name, std::string_view type, std::string_view help);
  void Sample(std::string_view name, double value, const Labels& labels = {});
  // A family with one unlabelled sample.
  void Single(std::string_view name, std::string_view type, std::string_view help, double value) {
    Family(name, type, help);
    Sample(name, value);
  }
  void Histo(std::string_view name, const Histogram& h, const Labels& labels = {});
  // Every row of a stats table (kvferry/core/stat_fields.h): one family per run of rows with
  // one metric name, one sample per row.
  template <class Stats>
  void Fields(const Stats& stats, std::span<const core::StatField<Stats>> fields) {
    std::string family;
    for (const core::StatField<Stats>& f : fields) {
      std::string name = core::MetricName(f);
      if (name != family) {
        Family(name, f.kind == core::StatKind::kCounter ? "counter" : "gauge", f.help);
        family = name;
      }
      Labels labels;
      if (!f.label.first.empty()) labels.emplace_back(f.label.first, f.label.second);
      Sample(name, static_cast<double>(stats.*(f.member)), labels);
    }
  }
  // One family of a stats struct's per-enumerator field (core::StatFamily).
  template <class Stats, class Enum, std::size_t N>
  void EnumFamily(const Stats& stats, const core::StatFamily<Stats, Enum, N>& family) {
    Family(family.metric, family.kind == core::StatKind::kCounter ? "counter" : "gauge",
           family.help);
    core::ForEachInFamily(stats, family, [&](std::string_view name, std::uint64_t value) {
      Sample(family.metric, static_cast<double>(value),
             {{std::string(family.label), std::string(name)}});
    });
  }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

}  // namespace kvferry::harness
