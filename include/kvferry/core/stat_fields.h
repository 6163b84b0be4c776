// Counters declared once. A stats struct of kvferry (protocol::DecodeStats, PrefillStats,
// control::ListenerStats) is a plain struct of std::uint64_t fields; next to it, a table of
// StatField names each field once, with its kind and its meaning. Everything that shows the
// counters reads that table — the Python binding's stats() dicts, `kvferry serve`'s /metrics,
// the sum over ranks — so a counter added to a struct is exported everywhere by one table row,
// and a row forgotten is a compile error (each table's header checks the struct's size against
// its row count).
//
// Names:
//   key     the field's name: the Python dict's key, and the Prometheus family's stem
//           (kvferry_<key>, with _total for a counter) unless `metric` says otherwise.
//   metric  an explicit Prometheus family, for names users already scrape. Consecutive rows
//           with one `metric` and a `label` each are the samples of one labelled family (the
//           first row's help and kind stand for it).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "kvferry/core/enum_array.h"

namespace kvferry::core {

enum class StatKind : std::uint8_t {
  kCounter,  // only grows (Prometheus counter, _total)
  kGauge,    // a level at the moment of the snapshot
};

template <class Stats>
struct StatField {
  std::string_view key;
  std::uint64_t Stats::*member;
  StatKind kind;
  std::string_view help;
  std::string_view metric = {};                              // empty: kvferry_<key>[_total]
  std::pair<std::string_view, std::string_view> label = {};  // {name, value}; empty: none
};

// The Prometheus family a row belongs to.
template <class Stats>
std::string MetricName(const StatField<Stats>& f) {
  if (!f.metric.empty()) return std::string(f.metric);
  std::string name = "kvferry_";
  name += f.key;
  if (f.kind == StatKind::kCounter) name += "_total";
  return name;
}

// `into` += `from`, field by field: counters and gauges of several ranks or workers add up.
template <class Stats>
void AddStats(Stats& into, const Stats& from, std::span<const StatField<Stats>> fields) {
  for (const StatField<Stats>& f : fields) into.*(f.member) += from.*(f.member);
}

// A counter or gauge kept per enumerator in an EnumArray field (hold-table entries by phase,
// releases by reason): one Prometheus family `metric` with a sample per enumerator labelled
// `label`=ToString(enumerator), and one Python dict under `key` mapping ToString(enumerator) to
// its value. `all` lists the enumerators in order (the enum's kAll... array).
template <class Stats, class Enum, std::size_t N>
struct StatFamily {
  std::string_view key;
  EnumArray<Enum, std::uint64_t, N> Stats::*member;
  StatKind kind;
  std::string_view help;
  std::string_view metric;
  std::string_view label;
  const std::array<Enum, N>& all;
};

// Calls visit(ToString(enumerator), value) for every enumerator of a family, in enum order.
template <class Stats, class Enum, std::size_t N, class Visit>
void ForEachInFamily(const Stats& stats, const StatFamily<Stats, Enum, N>& family, Visit&& visit) {
  for (Enum e : family.all) visit(std::string_view(ToString(e)), (stats.*(family.member))[e]);
}

// `into` += `from` for every enumerator of a family.
template <class Stats, class Enum, std::size_t N>
void AddFamily(Stats& into, const Stats& from, const StatFamily<Stats, Enum, N>& family) {
  for (Enum e : family.all) (into.*(family.member))[e] += (from.*(family.member))[e];
}

// Calls visit(key, value) for every row, in table order.
template <class Stats, class Visit>
void ForEachStat(const Stats& stats, std::span<const StatField<Stats>> fields, Visit&& visit) {
  for (const StatField<Stats>& f : fields) visit(f.key, stats.*(f.member));
}

}  // namespace kvferry::core
