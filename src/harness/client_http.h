// Small HTTP helpers shared by the serving harness's clients (proxy, load, probe, demo):
// URL parsing, an incremental SSE parser, streaming completions with deadlines, Prometheus
// text parsing and random ids. Everything binds/connects to explicit addresses only.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace kvferry::harness {

using SteadyClock = std::chrono::steady_clock;

// "http://127.0.0.1:8000" or "127.0.0.1:8000" → host + port. Returns nullopt on garbage.
struct HostPort {
  std::string host;
  int port = 0;
};
std::optional<HostPort> ParseUrl(const std::string& url);

// A random RFC 4122 version-4 uuid ("xxxxxxxx-xxxx-4xxx-yxxx-xxxxxxxxxxxx").
std::string RandomUuid();

// Splits an SSE byte stream into events. Feed() accepts arbitrary chunks; every complete
// `data: ...` line is passed to the callback without the prefix (CR/LF stripped).
class SseParser {
 public:
  explicit SseParser(std::function<void(const std::string& data)> on_data)
      : on_data_(std::move(on_data)) {}
  void Feed(const char* data, std::size_t len);

 private:
  std::function<void(const std::string&)> on_data_;
  std::string line_;
};

// Random prompt token ids in [low, high).
std::vector<int> RandomPrompt(std::mt19937_64& rng, int tokens, int low = 100, int high = 30000);

// One completion, streamed or not, with an overall deadline.
struct CompletionOutcome {
  bool ok = false;
  int http_status = 0;    // 0: no HTTP response at all
  std::string error;      // empty when ok
  double ttft_s = -1;     // first generated token (streaming: first data event with text)
  double latency_s = 0;   // send → last byte (or failure)
  int tokens = 0;         // data events carrying a choice (streaming) / 1 (non-streaming ok)
  bool saw_done = false;  // `data: [DONE]` arrived
  std::string body;       // non-streaming body (or error body), at most 64 KiB kept
};
// Cancels in-flight HTTP calls from another thread: every call registered with the group is
// shut down (its socket closed) by CancelAll(), and calls registered afterwards fail at once.
class CancelGroup {
 public:
  // Returns a registration id, or 0 when the group is already cancelled.
  std::uint64_t Add(std::function<void()> stop);
  void Remove(std::uint64_t id);
  void CancelAll();
  bool cancelled() const { return cancelled_.load(); }

 private:
  std::mutex mu_;
  std::map<std::uint64_t, std::function<void()>> stops_;
  std::uint64_t next_ = 1;
  std::atomic<bool> cancelled_{false};
};

// Serializes connection set-up per server. `kvferry serve` (and any cpp-httplib 0.11.4 server
// from Debian's compiled library) listens with a backlog of 5, so when the proxy opens 128
// connections to P and 128 to D at once the accept queue overflows and connects stall for
// seconds in SYN retransmission (or fail). Through the gate a call first opens its keep-alive
// connection with `GET /health`, one at a time per server, then sends its request on it.
class ConnectGate {
 public:
  std::mutex& For(const std::string& host_port);

 private:
  std::mutex mu_;
  std::map<std::string, std::unique_ptr<std::mutex>> gates_;
};

struct CompletionCall {
  std::string url;   // base URL of the server, e.g. http://127.0.0.1:8000
  std::string body;  // JSON request body
  bool stream = false;
  double timeout_s = 600;         // overall deadline (also the per-read timeout)
  CancelGroup* cancel = nullptr;  // optional: CancelAll() aborts the call
  ConnectGate* gate = nullptr;    // optional: connect through the gate (see ConnectGate)
  std::string path = "/v1/completions";                           // or /v1/chat/completions
  std::vector<std::pair<std::string, std::string>> headers = {};  // sent besides Content-Type
};
CompletionOutcome PostCompletion(const CompletionCall& call);

// Turns an error message into a reason for counting: numbers, hex ids and uuids are
// replaced so that the same failure in different requests counts once.
std::string NormalizeReason(const std::string& reason);

// Prometheus text exposition: metric name (labels dropped) → sum over its series.
std::map<std::string, double> ParsePrometheus(const std::string& text);

// GET url+path with a deadline; nullopt on any failure (status != 200 included).
std::optional<std::string> HttpGet(const std::string& url, const std::string& path,
                                   double timeout_s);

// Seconds since `t0`.
inline double SecondsSince(SteadyClock::time_point t0) {
  return std::chrono::duration<double>(SteadyClock::now() - t0).count();
}

// Percentile (nearest-rank, p in [0,100]) of an unsorted sample; -1 when empty.
double Percentile(std::vector<double> v, double p);

}  // namespace kvferry::harness
