// HttpServer: the one HTTP/1.1 server behind every kvferry front door (P's bootstrap service,
// `kvferry serve`, `kvferry proxy`). An event-driven core (GNU libmicrohttpd, one epoll thread)
// holds every connection, so idle, half-sent and slow clients cost a few KiB each and never a
// thread; request handlers that may block run on a bounded pool of handler threads.
//
// Why not cpp-httplib (used before): it gives each open connection a pool thread for as long as
// the connection lives. 600 idle sockets against the 512 threads of `kvferry serve` froze it for
// 30 s (issue 11); here 10,000 idle connections leave /health answering in about a millisecond
// (tests/control/http_server_test.cc, docs/performance.md "Front doors").
//
// Limits, each answered with a 4xx and a reason, never with a crash, a hang or unbounded memory:
//   - connections: at most `max_connections` open; beyond it new ones are closed at accept;
//   - `idle_timeout`: a connection that sends and receives nothing for this long is closed, at
//     any stage (before its first byte, mid-header, mid-body, between keep-alive requests);
//   - request line + headers: at most `max_header_bytes` (431 from the library);
//   - bodies: a declared Content-Length above `max_body_bytes` gets 413 and nothing of it is
//     kept (up to 16 MiB over the limit is read and dropped, so the client hears the 413; beyond
//     that the connection is closed after the 413 without reading on); a chunked or length-less POST/PUT/PATCH body gets 411 (a length is required so the
//     limit holds before reading); a malformed Content-Length gets 400 from the library;
//   - handler work: at most `handler_threads` blocking handlers run and `max_queued` wait; a
//     request beyond that gets 503 at once;
//   - bodies in progress together: at most `max_total_body_bytes` declared (503 beyond), so many
//     slow uploads cannot add up to unbounded memory;
//   - a streamed response buffers at most `max_buffered_bytes` for a slow reader, and a writer
//     that cannot get below it within `write_timeout` finds the client gone. A stream cut short
//     (client gone, too slow, server stopping) ends without its terminating chunk, so the
//     client sees it broken, never complete.
// Not bounded: the total time a client may take to send its headers while it keeps sending
// within `idle_timeout` (libmicrohttpd 0.9.75 has no such deadline); such a client holds one
// connection slot and at most `max_header_bytes`.
//
// Thread model: Start() runs the library's event thread; inline handlers run on it (they must
// not block: /health, /metrics, bootstrap lookups). Blocking handlers run on handler threads;
// their connection is suspended in the event loop meanwhile and resumed when they answer.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvferry/status.h"

namespace kvferry::control {

using HttpFields = std::vector<std::pair<std::string, std::string>>;

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string path;    // without the query string
  std::string body;
  std::string remote_addr;
  HttpFields headers;  // names lower-cased
  HttpFields params;   // decoded query arguments, in order

  // The first header (name compared case-insensitively) or query argument with that name,
  // or nullptr.
  [[nodiscard]] const std::string* Header(std::string_view name) const;
  [[nodiscard]] const std::string* Param(std::string_view name) const;
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  HttpFields headers;
};

// A request being answered from a handler thread. Exactly one of Reply() or
// BeginStream()...EndStream() answers it; a handler that returns without answering answers 500.
// Thread-safe; the handler may hand it to another thread as long as that thread is done with it
// before the handler returns.
class HttpExchange {
 public:
  virtual ~HttpExchange() = default;
  // Sends a whole response. Later calls (and calls after BeginStream) are ignored.
  virtual void Reply(HttpResponse response) = 0;
  // Starts a chunked response; `body` is ignored. Returns false if it was already answered.
  virtual bool BeginStream(HttpResponse head) = 0;
  // Queues bytes of a streamed response. Waits while more than max_buffered_bytes are waiting
  // for a slow client, up to write_timeout. False once the client is gone, the write timed out
  // or the server is stopping: the caller should stop producing (and may abort its work).
  [[nodiscard]] virtual bool Write(std::string_view bytes) = 0;
  // Ends a streamed response (idempotent).
  virtual void EndStream() = 0;
  // The client closed the connection, a write timed out or the server is stopping. While the
  // handler works the event loop does not watch the connection; this call looks at the socket
  // (EOF counts as gone: a client that half-closes its side while it waits is taken as gone —
  // HTTP clients do not do that).
  [[nodiscard]] virtual bool client_gone() = 0;
};

// Runs on the event thread; must not block.
using InlineHandler = std::function<HttpResponse(const HttpRequest&)>;
// Runs on a handler thread and may block (on an engine, an upstream server).
using BlockingHandler = std::function<void(const HttpRequest&, HttpExchange&)>;
// Formats a server-generated error (404, 405, 411, 413, 503, a handler's 500) in the
// embedding service's error shape.
using HttpErrorFormatter = std::function<HttpResponse(int status, const std::string& reason)>;

struct HttpServerOptions {
  std::string name = "http";  // in log lines
  std::size_t max_connections = 16384;
  std::chrono::seconds idle_timeout{30};
  std::size_t max_header_bytes = 16 * 1024;
  std::size_t max_body_bytes = 1 << 20;
  // The declared bodies of all requests in progress together (each counted from its headers
  // until the library is done with it); beyond it a request gets 503 before its body is read.
  std::uint64_t max_total_body_bytes = std::uint64_t{256} << 20;
  std::size_t handler_threads = 64;  // started on demand, kept once started
  std::size_t max_queued = 1024;     // blocking requests waiting for a handler thread
  std::size_t max_buffered_bytes = 1 << 20;
  std::chrono::milliseconds write_timeout{30000};
  // Stop(): how long running handlers may take to answer before their exchanges are failed.
  std::chrono::milliseconds drain_timeout{5000};
  HttpErrorFormatter error_format;                   // default: {"error": reason}
  std::function<void(std::string_view line)> log;  // library messages, handler exceptions
};

struct HttpServerStats {
  std::uint64_t connections_open = 0;
  std::uint64_t requests = 0;        // requests whose headers arrived
  std::uint64_t refused_busy = 0;    // 503: handler threads and queue full
  std::uint64_t refused_limits = 0;  // 411/413 answered by this server
  std::uint64_t refused_connections = 0;  // closed at accept: max_connections were open
  std::uint64_t handler_errors = 0;  // handler threw or returned without answering
};

class HttpServer {
 public:
  explicit HttpServer(HttpServerOptions options);
  ~HttpServer();  // Stop()s
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Routes match the exact path. Register before Start(). A path registered for another method
  // answers 405; an unknown path 404.
  void Route(std::string method, std::string path, InlineHandler handler);
  void Route(std::string method, std::string path, BlockingHandler handler);

  // Binds host:port (0: a free port) and serves. Returns the bound port. kInvalidArgument for a
  // host that is not an address, kUnavailable if the bind fails, kAlreadyExists if running.
  [[nodiscard]] Result<int> Start(const std::string& host, int port);

  // Stops accepting, waits up to drain_timeout for running handlers, fails what is left (a
  // 503 or the end of a stream), joins every thread and closes every connection. Idempotent.
  void Stop();

  [[nodiscard]] int port() const;
  [[nodiscard]] HttpServerStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Prometheus text for the servers of one process, labelled server="<name>":
// kvferry_http_connections_open, kvferry_http_requests_total,
// kvferry_http_refusals_total{reason="busy"|"limits"|"connections"},
// kvferry_http_handler_errors_total.
[[nodiscard]] std::string RenderHttpMetrics(
    const std::vector<std::pair<std::string, HttpServerStats>>& servers);

// Raises this process's soft RLIMIT_NOFILE to its hard limit (a server holding 16,384
// connections needs that many descriptors; Linux starts processes at a soft limit of 1,024).
// Returns the soft limit now in force.
std::uint64_t RaiseOpenFileLimit();

}  // namespace kvferry::control
