#include "client_load.h"

#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

namespace kvferry::harness {

std::string CompletionBody(const std::vector<int>& prompt, int max_tokens, bool stream,
                           bool ignore_eos) {
  nlohmann::json j;
  j["prompt"] = prompt;
  j["max_tokens"] = max_tokens;
  j["stream"] = stream;
  j["ignore_eos"] = ignore_eos;
  j["temperature"] = 0;
  return j.dump();
}

LoadSummary Summarize(const std::vector<LoadRecord>& records, double wall_s) {
  LoadSummary s;
  s.total = static_cast<int>(records.size());
  s.wall_s = wall_s;
  std::vector<double> lat, ttft;
  for (const auto& r : records) {
    s.tokens += r.outcome.tokens;
    if (r.outcome.ok) {
      ++s.succeeded;
      lat.push_back(r.outcome.latency_s);
      if (r.outcome.ttft_s >= 0) ttft.push_back(r.outcome.ttft_s);
    } else {
      ++s.failed;
      ++s.failure_reasons[NormalizeReason(r.outcome.error)];
      s.failed_latency_max = std::max(s.failed_latency_max, r.outcome.latency_s);
    }
  }
  s.latency_p50 = Percentile(lat, 50);
  s.latency_p90 = Percentile(lat, 90);
  s.latency_p99 = Percentile(lat, 99);
  s.latency_max = Percentile(lat, 100);
  s.ttft_p50 = Percentile(ttft, 50);
  s.ttft_p90 = Percentile(ttft, 90);
  s.ttft_p99 = Percentile(ttft, 99);
  s.ttft_max = Percentile(ttft, 100);
  return s;
}

LoadResult RunLoad(const LoadOptions& o, CancelGroup* cancel,
                   const std::function<void(const std::string&)>& progress) {
  LoadResult result;
  const int n = std::max(o.requests, 0);
  result.records.resize(static_cast<std::size_t>(n));
  std::mt19937_64 rng(o.seed != 0 ? o.seed : std::random_device{}());
  std::vector<std::string> bodies;
  bodies.reserve(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) {
    bodies.push_back(
        CompletionBody(RandomPrompt(rng, o.prompt_tokens), o.max_tokens, o.stream, o.ignore_eos));
  }

  std::mutex mu;
  std::condition_variable cv;
  int completed = 0, failed = 0, running = 0;
  const auto t0 = SteadyClock::now();
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      {
        std::lock_guard<std::mutex> lock(mu);
        ++running;
      }
      LoadRecord& rec = result.records[static_cast<std::size_t>(i)];
      rec.index = i;
      rec.sent_s = SecondsSince(t0);
      CompletionCall call{o.url, bodies[static_cast<std::size_t>(i)], o.stream, o.timeout_s,
                          cancel};
      rec.outcome = PostCompletion(call);
      std::lock_guard<std::mutex> lock(mu);
      --running;
      if (rec.outcome.ok) {
        ++completed;
      } else {
        ++failed;
      }
      cv.notify_all();
    });
  }
  auto line = [&] {
    char buf[160];
    std::snprintf(buf, sizeof buf, "[%s] t=%6.1fs  completed %d  failed %d  running %d  of %d",
                  o.label.c_str(), SecondsSince(t0), completed, failed, running, n);
    return std::string(buf);
  };
  {
    std::unique_lock<std::mutex> lock(mu);
    const auto every = std::chrono::duration_cast<SteadyClock::duration>(
        std::chrono::duration<double>(o.progress_every_s > 0 ? o.progress_every_s : 3600));
    auto next = SteadyClock::now() + every;
    while (completed + failed < n) {
      cv.wait_until(lock, next, [&] { return completed + failed >= n; });
      if (SteadyClock::now() >= next) {
        next += every;
        if (o.progress_every_s > 0) {
          const std::string l = line();
          if (progress) {
            progress(l);
          } else {
            std::fprintf(stderr, "%s\n", l.c_str());
          }
        }
      }
    }
  }
  // Every request has ended (each has its own deadline), so these joins are bounded.
  for (auto& t : threads) t.join();
  result.summary = Summarize(result.records, SecondsSince(t0));
  return result;
}

std::string FormatLoadSummary(const LoadSummary& s) {
  std::string out;
  char buf[256];
  std::snprintf(buf, sizeof buf, "requests: %d   succeeded: %d   failed: %d   wall: %.2f s\n",
                s.total, s.succeeded, s.failed, s.wall_s);
  out += buf;
  for (const auto& [reason, count] : s.failure_reasons) {
    std::snprintf(buf, sizeof buf, "  failed %4d x  %s\n", count, reason.c_str());
    out += buf;
  }
  if (s.succeeded > 0) {
    std::snprintf(buf, sizeof buf,
                  "latency (s):  p50 %.3f  p90 %.3f  p99 %.3f  max %.3f\n"
                  "ttft (s):     p50 %.3f  p90 %.3f  p99 %.3f  max %.3f\n",
                  s.latency_p50, s.latency_p90, s.latency_p99, s.latency_max, s.ttft_p50,
                  s.ttft_p90, s.ttft_p99, s.ttft_max);
    out += buf;
  }
  std::snprintf(buf, sizeof buf, "tokens received: %lld\n", s.tokens);
  out += buf;
  return out;
}

std::string LoadResultJson(const LoadOptions& o, const LoadResult& r) {
  using nlohmann::json;
  const LoadSummary& s = r.summary;
  json j;
  j["options"] = {{"url", o.url},
                  {"requests", o.requests},
                  {"prompt_tokens", o.prompt_tokens},
                  {"max_tokens", o.max_tokens},
                  {"ignore_eos", o.ignore_eos},
                  {"timeout_s", o.timeout_s}};
  j["summary"] = {
      {"total", s.total},
      {"succeeded", s.succeeded},
      {"failed", s.failed},
      {"failure_reasons", s.failure_reasons},
      {"wall_s", s.wall_s},
      {"latency_s",
       {{"p50", s.latency_p50},
        {"p90", s.latency_p90},
        {"p99", s.latency_p99},
        {"max", s.latency_max}}},
      {"ttft_s",
       {{"p50", s.ttft_p50}, {"p90", s.ttft_p90}, {"p99", s.ttft_p99}, {"max", s.ttft_max}}},
      {"tokens", s.tokens}};
  json reqs = json::array();
  for (const auto& rec : r.records) {
    reqs.push_back({{"index", rec.index},
                    {"sent_s", rec.sent_s},
                    {"ok", rec.outcome.ok},
                    {"http_status", rec.outcome.http_status},
                    {"error", rec.outcome.error},
                    {"latency_s", rec.outcome.latency_s},
                    {"ttft_s", rec.outcome.ttft_s},
                    {"tokens", rec.outcome.tokens}});
  }
  j["requests"] = reqs;
  return j.dump(2);
}

}  // namespace kvferry::harness
