// `kvferry probe`: a small plain completion (no kv_transfer_params) sent straight to P every
// k seconds, each on its own thread so that a stuck probe does not delay the next; reports the
// send time and latency of every probe.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "client_http.h"

namespace kvferry::harness {

struct ProbeOptions {
  std::string url;      // P's server
  double every_s = 10;  // one probe every k seconds, the first at t = 0
  int prompt_tokens = 512;
  int max_tokens = 1;
  double duration_s = 60;  // no new probe after this
  double timeout_s = 900;  // per probe
};

struct ProbeRecord {
  int index = 0;
  double sent_s = 0;       // relative to Start()
  double sent_unix_s = 0;  // wall clock, for lining up with other logs
  bool finished = false;   // false: still outstanding when collected
  CompletionOutcome outcome;
};

class Prober {
 public:
  explicit Prober(ProbeOptions o);
  ~Prober();
  Prober(const Prober&) = delete;
  Prober& operator=(const Prober&) = delete;

  // Starts sending probes (relative times count from here, or from `t0` when given).
  void Start(SteadyClock::time_point t0 = SteadyClock::now());
  // Stops sending; waits up to `grace_s` for outstanding probes, then cancels them. Joins.
  void Stop(double grace_s);
  // Blocks until duration_s has passed and every probe ended (each has its own deadline).
  // Safe to call while another thread calls Stop().
  void Wait();
  std::vector<ProbeRecord> Records() const;
  // Called on each probe's completion, from the probe's thread and under the prober's lock:
  // it must not call back into the Prober. Set it before Start().
  void OnProbe(std::function<void(const ProbeRecord&)> fn) { on_probe_ = std::move(fn); }

 private:
  void Loop();
  void LoopBody();
  ProbeOptions o_;
  SteadyClock::time_point t0_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool loop_done_ = false;
  int outstanding_ = 0;
  std::vector<std::shared_ptr<ProbeRecord>> records_;
  std::vector<std::thread> threads_;
  std::thread loop_;
  CancelGroup cancel_;
  std::function<void(const ProbeRecord&)> on_probe_;
};

std::string FormatProbeRecord(const ProbeRecord& r);
std::string ProbeRecordJson(const ProbeRecord& r);

}  // namespace kvferry::harness
