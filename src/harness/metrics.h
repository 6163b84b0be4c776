// Prometheus text exposition helpers for `kvferry serve`'s /metrics: a fixed-bucket histogram
// and a writer that emits each family's HELP/TYPE once.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

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
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

}  // namespace kvferry::harness
