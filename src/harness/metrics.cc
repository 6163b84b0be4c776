#include "harness/metrics.h"

#include <fmt/format.h>

namespace kvferry::harness {

Histogram::Histogram()
    : bounds_{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
              0.5,    1,     2.5,    5,     10,   30,    60,   120, 300},
      counts_(bounds_.size() + 1, 0) {}

void Histogram::Observe(double seconds) {
  std::size_t i = 0;
  while (i < bounds_.size() && seconds > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += seconds;
  ++count_;
}

namespace {

std::string LabelText(const Labels& labels, std::string_view extra_key = {},
                      std::string_view extra_value = {}) {
  if (labels.empty() && extra_key.empty()) return {};
  std::string out = "{";
  bool first = true;
  auto add = [&](std::string_view k, std::string_view v) {
    if (!first) out += ',';
    first = false;
    out += fmt::format("{}=\"", k);
    for (char c : v) {
      if (c == '\\' || c == '"') out += '\\';
      if (c == '\n') {
        out += "\\n";
        continue;
      }
      out += c;
    }
    out += '"';
  };
  for (const auto& [k, v] : labels) add(k, v);
  if (!extra_key.empty()) add(extra_key, extra_value);
  out += '}';
  return out;
}

std::string Number(double v) {
  if (v == static_cast<double>(static_cast<std::int64_t>(v)) && v < 9e15 && v > -9e15) {
    return fmt::format("{}", static_cast<std::int64_t>(v));
  }
  return fmt::format("{}", v);
}

}  // namespace

void PromWriter::Family(std::string_view name, std::string_view type, std::string_view help) {
  out_ += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
}

void PromWriter::Sample(std::string_view name, double value, const Labels& labels) {
  out_ += fmt::format("{}{} {}\n", name, LabelText(labels), Number(value));
}

void PromWriter::Histo(std::string_view name, const Histogram& h, const Labels& labels) {
  std::uint64_t cumulative = 0;
  for (std::size_t i = 0; i < h.counts().size(); ++i) {
    cumulative += h.counts()[i];
    const std::string le = i < h.bounds().size() ? fmt::format("{}", h.bounds()[i]) : "+Inf";
    out_ += fmt::format("{}_bucket{} {}\n", name, LabelText(labels, "le", le), cumulative);
  }
  out_ += fmt::format("{}_sum{} {}\n", name, LabelText(labels), h.sum());
  out_ += fmt::format("{}_count{} {}\n", name, LabelText(labels), h.count());
}

}  // namespace kvferry::harness
