// `kvferry load`: N concurrent streaming completions sent at once (the seed's load), with random
// prompt token ids. Reports progress every second and a summary (successes, failures by reason,
// latency and time-to-first-token percentiles), optionally as JSON.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "client_http.h"

namespace kvferry::harness {

struct LoadOptions {
  std::string url;  // the proxy (or any OpenAI-style server)
  int requests = 128;
  int prompt_tokens = 3000;
  int max_tokens = 1000;
  bool ignore_eos = true;
  bool stream = true;
  double timeout_s = 900;         // per request
  std::uint64_t seed = 0;         // 0: random
  double progress_every_s = 1.0;  // 0: no progress lines
  std::string label = "load";     // prefix of the progress lines
};

struct LoadRecord {
  int index = 0;
  double sent_s = 0;  // relative to the start of the load
  CompletionOutcome outcome;
};

struct LoadSummary {
  int total = 0, succeeded = 0, failed = 0;
  std::map<std::string, int> failure_reasons;  // normalized reason → count
  double wall_s = 0;
  double latency_p50 = -1, latency_p90 = -1, latency_p99 = -1, latency_max = -1;  // successes
  double ttft_p50 = -1, ttft_p90 = -1, ttft_p99 = -1, ttft_max = -1;              // successes
  double failed_latency_max = -1;
  long long tokens = 0;
};

struct LoadResult {
  std::vector<LoadRecord> records;
  LoadSummary summary;
};

// Runs the load to completion (every request ends: ok, failed or timed out) or until `cancel`
// is cancelled. `progress` (optional) gets each once-a-second line instead of stderr.
LoadResult RunLoad(const LoadOptions& o, CancelGroup* cancel = nullptr,
                   const std::function<void(const std::string&)>& progress = {});

LoadSummary Summarize(const std::vector<LoadRecord>& records, double wall_s);
std::string FormatLoadSummary(const LoadSummary& s);
std::string LoadResultJson(const LoadOptions& o, const LoadResult& r);

// The JSON body of one completion.
std::string CompletionBody(const std::vector<int>& prompt, int max_tokens, bool stream,
                           bool ignore_eos);

}  // namespace kvferry::harness
