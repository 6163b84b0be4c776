// `kvferry proxy`: the disaggregated-serving router (SPEC §1). For every /v1/completions it
// assigns transfer_id = "xfer-<uuid>", sends P's copy (max_tokens=1, do_remote_decode; streamed
// so that P notices when the proxy drops it) in the background and D's copy (do_remote_prefill,
// remote_engine_id, remote_bootstrap_addr, transfer_id) at the same time, and passes D's answer
// (SSE or JSON) back to the client. Several P and D instances are used round-robin.
//
// The two halves are paired: if P refuses or fails its copy before D answers, the client gets
// P's error at once ("prefill <url> failed: ...", also as the error event of a stream D has
// already begun) and D's copy is dropped (its connection closed); if D refuses or fails its
// copy, P's copy is cancelled, so P aborts a prefill still running instead of finishing it for
// nobody (once P has answered, its KV is D's to release, or the lease's), and the client gets
// D's error.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kvferry::harness {

struct PrefillTarget {
  std::string url;        // http://127.0.0.1:P
  std::string bootstrap;  // 127.0.0.1:B (sent to D as remote_bootstrap_addr)
  std::string engine_id;  // P's engine_id (sent to D as remote_engine_id)
};

struct ProxyOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: any free port (see Proxy::port())
  std::vector<PrefillTarget> prefills;
  std::vector<std::string> decodes;
  double prefill_timeout_s = 900;  // deadline of P's background request
  double decode_timeout_s = 900;   // per-read deadline of D's request
  int threads = 512;               // concurrent client connections served
  // A client body beyond this gets 413 before it is read further (a prompt of 8,192 token ids
  // is ~60 KB of JSON).
  std::size_t max_body_bytes = std::size_t{8} << 20;
  bool verbose = false;
};

struct ProxyStats {
  std::uint64_t requests = 0;
  std::uint64_t prefill_failed = 0;
  std::uint64_t decode_failed = 0;
  std::uint64_t in_flight = 0;
  std::uint64_t twins_aborted = 0;  // requests whose other half the proxy dropped
  // prefill_failed counts P's own failures; these, P copies the proxy cancelled (D failed).
  std::uint64_t prefill_cancelled = 0;
};

// What the proxy sends to P and to D for one client request (exposed for tests).
std::string BuildPrefillBody(const std::string& client_body, const std::string& transfer_id);
std::string BuildDecodeBody(const std::string& client_body, const std::string& transfer_id,
                            const PrefillTarget& p);

class Proxy {
 public:
  explicit Proxy(ProxyOptions options);
  ~Proxy();
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

  // Binds and starts serving on a background thread. False (with `error`) when it cannot bind.
  bool Start(std::string* error);
  int port() const;
  // Cancels in-flight backend calls, stops the server and joins every thread it started.
  void Stop();
  ProxyStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvferry::harness
