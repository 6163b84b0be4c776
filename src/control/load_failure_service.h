// LoadFailureService: D's answer to a router asking why the KV load of a transfer failed.
//
// vLLM answers a request whose KV load failed with a bare HTTP 500 ("Internal server error");
// the reason — P freed the transfer (TOMBSTONED), P dropped it and why, a lease mismatch naming
// both values, P gone — stays in D's log, since vLLM carries nothing of a failed load to its
// API server. D's connector records each failed load's reason here, by transfer id, and
// `kvferry proxy` asks for it when D answers a request with an error, and hands it to the
// client. Opt-in (`load_failure_port` in D's kv_connector_extra_config).
//
//   GET /load_failure?transfer_id=ID   200 {"transfer_id": ID, "reason": "..."}, or 404
//   GET /health                        200 {"status": "ok"}
//
// Bounded: the last `max_entries` reasons (older ones are forgotten first), each cut to
// kMaxReasonBytes; ids longer than kMaxIdBytes are not recorded (and asking for one is a 400).
// Every request is answered inline from memory (control::HttpServer's limits apply to the
// rest). Thread-safe.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>

#include "control/http_server.h"
#include "kvferry/status.h"

namespace kvferry::control {

class LoadFailureService {
 public:
  static constexpr std::size_t kMaxReasonBytes = 1024;
  static constexpr std::size_t kMaxIdBytes = 256;

  explicit LoadFailureService(std::size_t max_entries = 4096);
  ~LoadFailureService();  // Stop()s
  LoadFailureService(const LoadFailureService&) = delete;
  LoadFailureService& operator=(const LoadFailureService&) = delete;

  // Binds host:port (0: a free port) and serves; the bound port. Errors as HttpServer::Start.
  [[nodiscard]] Result<int> Start(const std::string& host, int port);
  void Stop();  // idempotent
  [[nodiscard]] int port() const;

  // Records (or replaces) the reason the load of `transfer_id` failed.
  void Record(const std::string& transfer_id, const std::string& reason);
  [[nodiscard]] std::optional<std::string> Find(const std::string& transfer_id) const;
  [[nodiscard]] std::size_t size() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvferry::control
