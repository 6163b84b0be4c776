// HttpFront: the OpenAI-style HTTP face of `kvferry serve`, on control::HttpServer (event-driven:
// idle and slow clients hold no thread; completions run on handler threads).
//
//   POST /v1/completions  {model, prompt: [token ids] | "text", max_tokens, stream, ignore_eos,
//                          kv_transfer_params} → a completion JSON, or SSE chunks (one token
//                          per chunk, the last with finish_reason, a usage chunk with no choices,
//                          then `data: [DONE]`). Bad input → 4xx with {"object":"error",...};
//                          engine failures → 500/503 before streaming starts, or an in-stream
//                          `data: {"error": {...}}` followed by `data: [DONE]` after.
//   GET  /metrics         Prometheus text (ServingEngine::RenderMetrics).
//   GET  /health          {"status":"ok", role, engine_id, tp, ...}.
//
// A streaming response begins at once and writes an SSE comment every second while it waits, so
// a client that went away is noticed (and its request aborted) even while it is still queued.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "control/http_server.h"
#include "harness/engine.h"
#include "kvferry/status.h"

namespace kvferry::harness {

struct HttpFrontOptions {
  std::string host = "127.0.0.1";
  int port = 8000;            // 0: any free port (see HttpFront::port)
  std::size_t threads = 512;  // handler threads: one per completion in progress
  std::size_t max_connections = 16384;
  std::chrono::seconds idle_timeout{30};  // a connection silent this long is closed
  std::size_t max_body_bytes = 8 << 20;
  std::uint32_t max_model_len = 8192;  // prompt + max_tokens
  std::string served_model = "kvferry-synthetic";
  std::chrono::seconds request_timeout{3600};  // a request still open then is aborted (504)
  std::string health_json = "{}";              // extra fields merged into /health (a JSON object)
  // More HTTP servers of this process to list in /metrics (P's bootstrap service). May be empty.
  std::function<std::vector<std::pair<std::string, control::HttpServerStats>>()> more_http_stats;
  // More Prometheus text for /metrics (the etcd registry's counters). May be empty.
  std::function<std::string()> more_metrics;
};

// A parsed /v1/completions body (exposed for tests).
struct CompletionRequest {
  CompletionSpec spec;
  bool stream = false;
  std::string model;
};
// Errors: kInvalidArgument with a reason fit for the client. A body refused after its
// kv_transfer_params were read (too long for max_model_len, a bad field) still names a
// transfer: then `*refused` (when given) gets that transfer (kind, ids, remote engine), for the
// caller to settle with the other half (ServingEngine::Refused); otherwise it is left alone.
Result<CompletionRequest> ParseCompletionRequest(std::string_view body, Role role,
                                                 std::uint32_t max_model_len,
                                                 CompletionSpec* refused = nullptr);

class HttpFront {
 public:
  // Binds and serves on background threads; returns once the server accepts connections.
  [[nodiscard]] static Result<std::unique_ptr<HttpFront>> Start(HttpFrontOptions options,
                                                                ServingEngine* engine);
  ~HttpFront();  // Stop()s
  HttpFront(const HttpFront&) = delete;
  HttpFront& operator=(const HttpFront&) = delete;

  int port() const;
  // Stops accepting; requests in progress end with 503 (or an in-stream error), since every
  // handler checks the stopping flag at least once a second. Idempotent.
  void Stop();

 private:
  struct Impl;
  HttpFront();
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvferry::harness
