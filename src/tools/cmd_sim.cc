// `kvferry sim`: the deterministic simulator (src/sim, docs/simulation.md).
//
//   kvferry sim                          one run of scenario A's deployment with the lease
//   kvferry sim --scenario A|B|C|D|E|all the seed experiments beside the seed's figures, and E:
//                                        30% of clients cancel on D, with and without release
//   kvferry sim --explore N --seed S     N random faulty runs (seeds S..S+N-1), invariants on
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "commands.h"
#include "explore.h"
#include "scenarios.h"

namespace kvferry::tools {

namespace {

struct SimOptions {
  std::string scenario;
  std::uint64_t explore = 0;
  std::uint64_t seed = 1;
  std::string csv_dir;
  bool verbose = false;
  bool timeline = true;
};

int RunScenarios(const SimOptions& o) {
  const std::string s = o.scenario;
  const bool all = s == "all";
  if (!all && s != "A" && s != "B" && s != "C" && s != "D" && s != "E") {
    std::fprintf(stderr, "unknown scenario '%s' (A, B, C, D, E or all)\n", s.c_str());
    return 2;
  }
  const auto start = std::chrono::steady_clock::now();
  if (all || s == "A") {
    const sim::ScenarioA a = sim::RunScenarioA(o.seed);
    std::fputs(sim::ReportA(a).c_str(), stdout);
    if (o.timeline) {
      std::fputs("\n   P's KV usage over time (every 20 s):\n", stdout);
      std::fputs(sim::TimelineA(a, 20, false).c_str(), stdout);
    }
    if (!o.csv_dir.empty()) {
      std::error_code ec;
      std::filesystem::create_directories(o.csv_dir, ec);
      const std::string path = o.csv_dir + "/scenario_a_timeline.csv";
      std::ofstream out(path);
      out << sim::TimelineA(a, 1, true);
      if (!out) {
        std::fprintf(stderr, "cannot write %s\n", path.c_str());
        return 1;
      }
      std::printf("\n   wrote %s (1 s resolution)\n", path.c_str());
    }
    std::fputs("\n", stdout);
  }
  if (all || s == "B") std::printf("%s\n", sim::ReportB(sim::RunScenarioB(o.seed)).c_str());
  if (all || s == "C") std::printf("%s\n", sim::ReportC(sim::RunScenarioC(o.seed)).c_str());
  if (all || s == "D") std::printf("%s\n", sim::ReportD(sim::RunScenarioD(o.seed)).c_str());
  if (all || s == "E") {
    const sim::ScenarioE e = sim::RunScenarioE(o.seed);
    std::printf("%s\n", sim::ReportE(e).c_str());
    if (o.timeline) {
      std::fputs("   P's KV usage over time (every 20 s):\n", stdout);
      std::fputs(sim::TimelineE(e, 20, false).c_str(), stdout);
    }
    if (!o.csv_dir.empty()) {
      std::error_code ec;
      std::filesystem::create_directories(o.csv_dir, ec);
      const std::string path = o.csv_dir + "/scenario_e_timeline.csv";
      std::ofstream out(path);
      out << sim::TimelineE(e, 1, true);
      if (!out) {
        std::fprintf(stderr, "cannot write %s\n", path.c_str());
        return 1;
      }
      std::printf("\n   wrote %s (1 s resolution)\n", path.c_str());
    }
  }
  const double wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("(simulated with seed %llu in %.2f s of wall time)\n",
              static_cast<unsigned long long>(o.seed), wall);
  return 0;
}

int RunExplore(const SimOptions& o) {
  sim::ExploreOptions options;
  options.first_seed = o.seed;
  options.runs = o.explore;
  const auto start = std::chrono::steady_clock::now();
  const sim::ExploreReport report = sim::Explore(options);
  const double wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (const sim::ExploreFailure& f : report.failures) {
    std::printf("FAIL seed %llu: %s\n", static_cast<unsigned long long>(f.seed),
                f.description.c_str());
    for (const std::string& v : f.violations) std::printf("  %s\n", v.c_str());
    std::printf("  reproduce: %s\n", sim::ReproCommand(f.seed).c_str());
  }
  if (o.verbose && report.runs == 1 && report.failures.empty()) {
    std::printf("seed %llu: %s\n", static_cast<unsigned long long>(o.seed),
                sim::Describe(sim::RandomConfig(o.seed)).c_str());
  }
  std::printf(
      "explored %llu runs (seeds %llu..%llu): %llu requests (%llu ok, %llu failed with a "
      "reason, %llu aborted), %llu events, %zu failing runs, %.2f s wall\n",
      static_cast<unsigned long long>(report.runs), static_cast<unsigned long long>(o.seed),
      static_cast<unsigned long long>(o.seed + report.runs - 1),
      static_cast<unsigned long long>(report.requests), static_cast<unsigned long long>(report.ok),
      static_cast<unsigned long long>(report.failed),
      static_cast<unsigned long long>(report.aborted),
      static_cast<unsigned long long>(report.events), report.failures.size(), wall);
  std::printf(
      "  reached: %llu pull timeouts, %llu late replies, %llu fences, %llu duplicate pulls "
      "dropped by P, %llu hostile pulls answered, %llu messages to silent P engines, %llu "
      "never sent (P gone), %llu releases and %llu abort notices delivered (%llu requests "
      "failed by a notice), %llu writes unsettled (%llu of them landed later), %llu layer "
      "writes before a prefill ended, %llu P restarts "
      "(%llu pulls reached a restarted P), %llu answers to a side channel D had closed; %llu "
      "runs met the shared-write-key limit (docs/simulation.md)\n",
      static_cast<unsigned long long>(report.pull_timeouts),
      static_cast<unsigned long long>(report.late_replies),
      static_cast<unsigned long long>(report.fences),
      static_cast<unsigned long long>(report.duplicate_pulls_dropped),
      static_cast<unsigned long long>(report.hostile_pulls),
      static_cast<unsigned long long>(report.messages_to_silent_engines),
      static_cast<unsigned long long>(report.messages_unsent),
      static_cast<unsigned long long>(report.releases_delivered),
      static_cast<unsigned long long>(report.notices_delivered),
      static_cast<unsigned long long>(report.failed_by_notice),
      static_cast<unsigned long long>(report.unsettled_writes),
      static_cast<unsigned long long>(report.unsettled_writes_landed),
      static_cast<unsigned long long>(report.layer_writes),
      static_cast<unsigned long long>(report.p_restarts),
      static_cast<unsigned long long>(report.pulls_to_restarted),
      static_cast<unsigned long long>(report.replies_to_closed),
      static_cast<unsigned long long>(report.shared_key_quarantines));
  return report.failures.empty() ? 0 : 1;
}

int RunOne(const SimOptions& o) {
  sim::SimConfig config = sim::ScenarioAConfig(true, o.seed);
  config.faults.d_crash = core::kNever;
  const sim::SimResult r = sim::RunCluster(config);
  std::printf(
      "scenario A's deployment with a 30 s lease, no crash, seed %llu: %zu/%zu ok, %zu failed; "
      "%llu events; trace hash %016llx; %zu invariant violations\n",
      static_cast<unsigned long long>(o.seed), r.Count(sim::Outcome::kOk), r.requests.size(),
      r.Count(sim::Outcome::kFailed), static_cast<unsigned long long>(r.events),
      static_cast<unsigned long long>(r.trace_hash), r.violations.size());
  for (const std::string& v : r.violations) std::printf("  %s\n", v.c_str());
  return r.violations.empty() ? 0 : 1;
}

}  // namespace

void AddSimCommand(CLI::App& app, int& exit_code) {
  auto options = std::make_shared<SimOptions>();
  CLI::App* sub = app.add_subcommand(
      "sim", "Deterministic simulation: the seed experiments and randomized fault exploration");
  sub->add_option("--scenario", options->scenario,
                  "Seed experiment A, B, C, D, or E (cancellations and releases), or all");
  sub->add_option("--explore", options->explore, "Run N random faulty runs, checking invariants");
  sub->add_option("--seed", options->seed, "Seed (explore: the first run's seed)");
  sub->add_option("--csv", options->csv_dir, "Write scenario A's KV timeline as CSV into DIR");
  sub->add_flag("-v,--verbose", options->verbose, "Describe the configuration of a single run");
  sub->add_flag("!--no-timeline", options->timeline, "Omit scenario A's timeline table");
  sub->callback([options, &exit_code] {
    if (!options->scenario.empty() && options->explore > 0) {
      std::fprintf(stderr, "--scenario and --explore are exclusive\n");
      exit_code = 2;
      return;
    }
    if (!options->scenario.empty()) {
      exit_code = RunScenarios(*options);
    } else if (options->explore > 0) {
      exit_code = RunExplore(*options);
    } else {
      exit_code = RunOne(*options);
    }
  });
}

}  // namespace kvferry::tools
