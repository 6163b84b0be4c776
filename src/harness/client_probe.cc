#include "client_probe.h"

#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "client_load.h"

namespace kvferry::harness {

Prober::Prober(ProbeOptions o) : o_(std::move(o)) {}

Prober::~Prober() { Stop(0); }

void Prober::Start(SteadyClock::time_point t0) {
  t0_ = t0;
  loop_ = std::thread([this] { Loop(); });
}

void Prober::Loop() {
  LoopBody();
  std::lock_guard<std::mutex> lock(mu_);
  loop_done_ = true;
  cv_.notify_all();
}

void Prober::LoopBody() {
  std::mt19937_64 rng(std::random_device{}());
  for (int i = 0;; ++i) {
    const auto due = t0_ + std::chrono::duration_cast<SteadyClock::duration>(
                               std::chrono::duration<double>(o_.every_s * i));
    if (o_.every_s * i > o_.duration_s + 1e-9) return;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_until(lock, due, [&] { return stop_; });
      if (stop_) return;
      auto rec = std::make_shared<ProbeRecord>();
      rec->index = i;
      rec->sent_s = SecondsSince(t0_);
      rec->sent_unix_s =
          std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
              .count();
      records_.push_back(rec);
      ++outstanding_;
      const std::string body =
          CompletionBody(RandomPrompt(rng, o_.prompt_tokens), o_.max_tokens, false, false);
      threads_.emplace_back([this, rec, body] {
        CompletionCall call{o_.url, body, false, o_.timeout_s, &cancel_};
        CompletionOutcome out = PostCompletion(call);
        std::lock_guard<std::mutex> guard(mu_);
        rec->outcome = std::move(out);
        rec->finished = true;
        --outstanding_;
        if (on_probe_) on_probe_(*rec);
        cv_.notify_all();
      });
    }
    if (o_.every_s <= 0) return;
  }
}

void Prober::Wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return loop_done_ && outstanding_ == 0; });
}

void Prober::Stop(double grace_s) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    cv_.notify_all();
  }
  if (loop_.joinable()) loop_.join();
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::duration<double>(std::max(grace_s, 0.0)),
                 [&] { return outstanding_ == 0; });
  }
  cancel_.CancelAll();
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(mu_);
    threads.swap(threads_);
  }
  for (auto& t : threads) t.join();
}

std::vector<ProbeRecord> Prober::Records() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<ProbeRecord> out;
  for (const auto& r : records_) out.push_back(*r);
  return out;
}

std::string FormatProbeRecord(const ProbeRecord& r) {
  char buf[320];
  if (!r.finished) {
    std::snprintf(buf, sizeof buf, "probe %3d  sent t=%8.2fs  still waiting", r.index, r.sent_s);
  } else if (r.outcome.ok) {
    std::snprintf(buf, sizeof buf, "probe %3d  sent t=%8.2fs  latency %9.3f s  ok", r.index,
                  r.sent_s, r.outcome.latency_s);
  } else {
    std::snprintf(buf, sizeof buf, "probe %3d  sent t=%8.2fs  latency %9.3f s  FAILED: %s", r.index,
                  r.sent_s, r.outcome.latency_s, r.outcome.error.c_str());
  }
  return buf;
}

std::string ProbeRecordJson(const ProbeRecord& r) {
  nlohmann::json j{{"index", r.index},
                   {"sent_s", r.sent_s},
                   {"sent_unix_s", r.sent_unix_s},
                   {"finished", r.finished},
                   {"ok", r.outcome.ok},
                   {"latency_s", r.outcome.latency_s},
                   {"http_status", r.outcome.http_status},
                   {"error", r.outcome.error}};
  return j.dump();
}

}  // namespace kvferry::harness
