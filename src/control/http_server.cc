#include "control/http_server.h"

#include <fmt/format.h>
#include <microhttpd.h>
#include <netdb.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdarg>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

namespace kvferry::control {
namespace {

// The library's connection limit sits this far above max_connections, which this server keeps
// itself (see on_accept in Start): connections accepted while others are being closed stay
// under it, so the library never stops accepting.
constexpr std::size_t kLibraryConnectionSlack = 256;

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) ==
                  std::tolower(static_cast<unsigned char>(y));
         });
}

const std::string* Find(const HttpFields& fields, std::string_view name) {
  for (const auto& [key, value] : fields) {
    if (EqualsIgnoreCase(key, name)) return &value;
  }
  return nullptr;
}

HttpResponse DefaultErrorFormat(int status, const std::string& reason) {
  HttpResponse r;
  r.status = status;
  r.body = nlohmann::json{{"error", reason}}.dump(-1, ' ', false,
                                                  nlohmann::json::error_handler_t::replace);
  return r;
}

std::string ToAddress(const struct sockaddr* sa) {
  if (sa == nullptr) return "";
  char host[NI_MAXHOST] = {0};
  char serv[NI_MAXSERV] = {0};
  const socklen_t len = sa->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
  if (getnameinfo(sa, len, host, sizeof(host), serv, sizeof(serv),
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return "";
  }
  return host;
}

// Only body-carrying methods need a declared length: without one HTTP/1.1 has no body, and a
// chunked body could only be bounded after reading it.
// How much of a body over the limit is read and dropped so that its client hears the 413.
constexpr std::uint64_t kMaxDiscardedBodyBytes = 16 << 20;

bool CarriesBody(const std::string& method) {
  return method == "POST" || method == "PUT" || method == "PATCH";
}

}  // namespace

const std::string* HttpRequest::Header(std::string_view name) const {
  return Find(headers, name);
}
const std::string* HttpRequest::Param(std::string_view name) const { return Find(params, name); }

// ---- The exchange: a blocking handler's answer, handed between a handler thread and the event
// thread. Its mutex orders suspend (event thread) before resume (handler thread): `suspended` is
// set under it in the same critical section as MHD_suspend_connection, and a resume happens only
// when it is set and the connection still exists (`closed` is set under it by the completion
// callback), as libmicrohttpd requires.
class Exchange final : public HttpExchange {
 public:
  // `failure` (a handler that did not answer) and `stopping` (Stop() came first) are the
  // server's, rendered once; they outlive every exchange.
  Exchange(MHD_Connection* connection, std::size_t max_buffered,
           std::chrono::milliseconds write_timeout, const HttpResponse& failure,
           const HttpResponse& stopping)
      : connection_(connection),
        max_buffered_(max_buffered),
        write_timeout_(write_timeout),
        failure_(failure),
        stopping_(stopping) {
    if (const auto* info = MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CONNECTION_FD)) {
      fd_ = info->connect_fd;
    }
  }

  enum class Answer : std::uint8_t { kNone, kWhole, kStream };

  void Reply(HttpResponse response) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (answer_ != Answer::kNone) return;
    answer_ = Answer::kWhole;
    response_ = std::move(response);
    ResumeLocked();
  }

  bool BeginStream(HttpResponse head) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (answer_ != Answer::kNone) return false;
    answer_ = Answer::kStream;
    response_ = std::move(head);
    response_.body.clear();
    ResumeLocked();
    return true;
  }

  bool Write(std::string_view bytes) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (answer_ != Answer::kStream || ended_) return false;
    const auto deadline = std::chrono::steady_clock::now() + write_timeout_;
    while (!gone_ && !closed_ && pending_.size() > max_buffered_) {
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout &&
          pending_.size() > max_buffered_) {
        gone_ = true;  // too slow a reader: give up on it, the stream ends with an error
        ResumeLocked();
        return false;
      }
    }
    if (gone_ || closed_ || PeerClosedLocked()) return false;
    pending_.append(bytes);
    ResumeLocked();
    return true;
  }

  void EndStream() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (answer_ != Answer::kStream || ended_) return;
    ended_ = true;
    ResumeLocked();
  }

  bool client_gone() override {
    std::lock_guard<std::mutex> lock(mu_);
    return gone_ || closed_ || PeerClosedLocked();
  }

  void set_self(const std::shared_ptr<Exchange>& self) { self_ = self; }

  // Event thread: hands the exchange to a handler thread (`submit`, which returns false when the
  // pool refuses it) and suspends the connection, both under the lock, so no answer can try to
  // resume it before it is suspended. False (nothing suspended) when the exchange is already
  // answered (Stop() failed it) or the pool refused it (it is then answered with the stopping
  // response): the caller queues the answer at once.
  template <typename F>
  bool LockAndSuspend(F&& submit) {
    std::lock_guard<std::mutex> lock(mu_);
    if (answer_ != Answer::kNone) return false;
    if (!submit()) {
      answer_ = Answer::kWhole;
      response_ = stopping_;
      return false;
    }
    SuspendLocked();
    return true;
  }

  // True once Reply/BeginStream (or Stop's Fail) answered it.
  bool answered() const {
    std::lock_guard<std::mutex> lock(mu_);
    return answer_ != Answer::kNone;
  }

  // Event thread: park the connection until the handler answers (or more stream bytes come).
  void SuspendLocked() {
    suspended_ = true;
    MHD_suspend_connection(connection_);
  }

  // Handler finished: make sure the client gets something and the connection is not left
  // suspended.
  void Finish(bool* handler_error) {
    std::lock_guard<std::mutex> lock(mu_);
    if (answer_ == Answer::kNone) {
      *handler_error = true;
      answer_ = Answer::kWhole;
      response_ = failure_;
      ResumeLocked();
    } else if (answer_ == Answer::kStream && !ended_) {
      ended_ = true;
      ResumeLocked();
    }
  }

  // Stop(): the server is going away.
  void Fail() {
    std::lock_guard<std::mutex> lock(mu_);
    gone_ = true;
    if (answer_ == Answer::kNone) {
      answer_ = Answer::kWhole;
      response_ = stopping_;
    } else if (answer_ == Answer::kStream) {
      ended_ = true;
    }
    cv_.notify_all();
    ResumeLocked();
  }

  // The completion callback: the connection is gone; never touch it again.
  void Closed(bool ok) {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    if (!ok) gone_ = true;
    connection_ = nullptr;
    cv_.notify_all();
  }


  // Event thread, on re-entry into the access handler: queue the answer, or suspend again.
  MHD_Result QueueOrSuspend(MHD_Connection* connection);

  // The stream's content reader (event thread).
  ssize_t Read(char* buf, std::size_t max);

 private:
  // A suspended connection is not watched by the event loop, so a client that hung up is only
  // seen at the second write after it left (the first one only draws a reset). Peek instead:
  // EOF means the client closed (HTTP clients do not half-close while awaiting an answer). Safe
  // while suspended: the library does not touch a suspended connection's socket, and only this
  // exchange can resume it.
  bool PeerClosedLocked() {
    if (gone_ || !suspended_ || closed_ || fd_ < 0) return gone_;
    char byte;
    const ssize_t n = ::recv(fd_, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      gone_ = true;
      // Resumed, the connection meets its end in the event loop (the stream ends in error).
      ResumeLocked();
    }
    return gone_;
  }

  void ResumeLocked() {
    cv_.notify_all();
    if (suspended_ && !closed_) {
      suspended_ = false;
      MHD_resume_connection(connection_);
    }
  }

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::weak_ptr<Exchange> self_;
  MHD_Connection* connection_;
  const std::size_t max_buffered_;
  const std::chrono::milliseconds write_timeout_;
  Answer answer_ = Answer::kNone;
  HttpResponse response_;
  const HttpResponse& failure_;
  const HttpResponse& stopping_;
  std::string pending_;  // stream bytes not yet taken by the library
  bool ended_ = false;
  bool suspended_ = false;
  bool closed_ = false;
  bool gone_ = false;
  int fd_ = -1;
  bool queued_ = false;
};

namespace {

MHD_Result QueueResponse(MHD_Connection* connection, const HttpResponse& r) {
  MHD_Response* response = MHD_create_response_from_buffer(
      r.body.size(), const_cast<char*>(r.body.data()), MHD_RESPMEM_MUST_COPY);
  if (response == nullptr) return MHD_NO;
  if (!r.content_type.empty()) {
    MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, r.content_type.c_str());
  }
  for (const auto& [key, value] : r.headers) {
    MHD_add_response_header(response, key.c_str(), value.c_str());
  }
  const MHD_Result result =
      MHD_queue_response(connection, static_cast<unsigned int>(r.status), response);
  MHD_destroy_response(response);
  return result;
}

ssize_t ReadStreamThunk(void* cls, std::uint64_t, char* buf, std::size_t max) {
  return (*static_cast<std::shared_ptr<Exchange>*>(cls))->Read(buf, max);
}

void FreeStreamThunk(void* cls) { delete static_cast<std::shared_ptr<Exchange>*>(cls); }

}  // namespace

MHD_Result Exchange::QueueOrSuspend(MHD_Connection* connection) {
  std::lock_guard<std::mutex> lock(mu_);
  if (answer_ == Answer::kNone) {
    SuspendLocked();
    return MHD_YES;
  }
  if (queued_) return MHD_YES;
  queued_ = true;
  if (answer_ == Answer::kWhole) return QueueResponse(connection, response_);
  // The response owns a reference: the library may read it after the handler is done.
  auto* holder = new std::shared_ptr<Exchange>(self_.lock());
  MHD_Response* response = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024,
                                                              &ReadStreamThunk, holder,
                                                              &FreeStreamThunk);
  if (response == nullptr) {
    delete holder;
    return MHD_NO;
  }
  if (!response_.content_type.empty()) {
    MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE,
                            response_.content_type.c_str());
  }
  for (const auto& [key, value] : response_.headers) {
    MHD_add_response_header(response, key.c_str(), value.c_str());
  }
  const MHD_Result result =
      MHD_queue_response(connection, static_cast<unsigned int>(response_.status), response);
  MHD_destroy_response(response);
  return result;
}

ssize_t Exchange::Read(char* buf, std::size_t max) {
  std::lock_guard<std::mutex> lock(mu_);
  // Cut short (client gone, too slow, server stopping): no terminating chunk, so the client
  // sees a broken stream, not a complete one.
  if (gone_) return MHD_CONTENT_READER_END_WITH_ERROR;
  if (!pending_.empty()) {
    const std::size_t n = std::min(max, pending_.size());
    std::memcpy(buf, pending_.data(), n);
    pending_.erase(0, n);
    cv_.notify_all();
    return static_cast<ssize_t>(n);
  }
  if (ended_) return MHD_CONTENT_READER_END_OF_STREAM;
  SuspendLocked();  // nothing to send yet: Write or EndStream resumes
  return 0;
}

// ---- The handler pool: grows on demand up to `max_threads`; at most max_threads + max_queued
// requests in flight (the event thread checks HasRoom before it suspends a connection).
class HandlerPool {
 public:
  HandlerPool(std::size_t max_threads, std::size_t max_queued)
      : max_threads_(std::max<std::size_t>(1, max_threads)), max_queued_(max_queued) {}
  ~HandlerPool() { Join(); }

  bool HasRoom() {
    std::lock_guard<std::mutex> lock(mu_);
    return !stopping_ && queue_.size() + busy_ < max_threads_ + max_queued_;
  }

  // False once Join() began: the task is not taken.
  [[nodiscard]] bool Submit(std::function<void()> task) {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return false;
    queue_.push_back(std::move(task));
    if (idle_ < queue_.size() && threads_.size() < max_threads_) {
      threads_.emplace_back([this] { Loop(); });
    }
    cv_.notify_one();
    return true;
  }

  void Join() {
    std::vector<std::thread> threads;
    {
      std::unique_lock<std::mutex> lock(mu_);
      idle_cv_.wait(lock, [this] { return queue_.empty() && busy_ == 0; });
      stopping_ = true;
      threads.swap(threads_);
    }
    cv_.notify_all();
    for (auto& t : threads) t.join();
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      ++idle_;
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      --idle_;
      if (queue_.empty()) return;  // stopping
      auto task = std::move(queue_.front());
      queue_.pop_front();
      ++busy_;
      lock.unlock();
      task();
      task = nullptr;
      lock.lock();
      --busy_;
      if (queue_.empty() && busy_ == 0) idle_cv_.notify_all();
    }
  }

  const std::size_t max_threads_;
  const std::size_t max_queued_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;
  std::deque<std::function<void()>> queue_;
  std::vector<std::thread> threads_;
  std::size_t idle_ = 0;
  std::size_t busy_ = 0;
  bool stopping_ = false;
};

// ---- The server.
struct HttpServer::Impl {
  explicit Impl(HttpServerOptions opts) : options(std::move(opts)) {
    if (!options.error_format) options.error_format = DefaultErrorFormat;
    handler_failed = Error(500, "internal error: the handler did not answer");
    stopping_answer = Error(503, "server is stopping");
  }

  struct RouteEntry {
    InlineHandler inline_handler;
    BlockingHandler blocking_handler;
  };
  // One per request (libmicrohttpd's per-request context pointer).
  struct RequestState {
    HttpRequest request;
    const RouteEntry* route = nullptr;
    std::shared_ptr<Exchange> exchange;  // set once handed to a handler thread
    std::optional<HttpResponse> refusal;  // answered once the (dropped) body has arrived
    // The body bytes this request counts against max_total_body_bytes, given back when the
    // library is done with it.
    std::uint64_t body_budget = 0;
    std::atomic<std::uint64_t>* budget = nullptr;
    ~RequestState() {
      if (budget != nullptr) budget->fetch_sub(body_budget);
    }
  };

  HttpResponse Error(int status, const std::string& reason) const {
    HttpResponse r = options.error_format(status, reason);
    r.status = status;
    return r;
  }

  void Log(std::string_view line) const {
    if (options.log) options.log(line);
  }

  MHD_Result OnAccess(MHD_Connection* c, const char* url, const char* method,
                      const char* upload_data, std::size_t* upload_size, void** state_ptr);
  MHD_Result OnHeaders(MHD_Connection* c, RequestState& st);
  MHD_Result Dispatch(MHD_Connection* c, RequestState& st);
  void RunHandler(const std::shared_ptr<Exchange>& ex, RequestState* st_copy);

  HttpServerOptions options;
  HttpResponse handler_failed;   // for every exchange whose handler returned without answering
  HttpResponse stopping_answer;  // for every exchange Stop() answers
  std::map<std::string, std::map<std::string, RouteEntry>> routes;  // path -> method -> handler
  MHD_Daemon* daemon = nullptr;
  int listen_fd = -1;  // once quiesced, ours to close
  int bound_port = 0;
  std::unique_ptr<HandlerPool> pool;
  std::atomic<bool> stopping{false};

  // Exchanges from dispatch until the library is done with their request (answer sent, or the
  // connection gone): Stop() waits for them, then fails what is left.
  std::mutex live_mu;
  std::condition_variable live_cv;
  std::set<std::shared_ptr<Exchange>> live;

  std::atomic<std::uint64_t> connections_open{0};
  std::atomic<std::uint64_t> requests{0};
  std::atomic<std::uint64_t> refused_busy{0};
  std::atomic<std::uint64_t> refused_connections{0};
  std::atomic<std::uint64_t> refused_limits{0};
  std::atomic<std::uint64_t> handler_errors{0};
  std::atomic<std::uint64_t> body_bytes{0};  // declared bodies of requests in progress
  std::atomic<std::int64_t> last_log_ms{0};
};

MHD_Result HttpServer::Impl::OnHeaders(MHD_Connection* c, RequestState& st) {
  HttpRequest& req = st.request;
  MHD_get_connection_values(
      c, MHD_HEADER_KIND,
      [](void* cls, MHD_ValueKind, const char* key, const char* value) -> MHD_Result {
        std::string name(key != nullptr ? key : "");
        std::transform(name.begin(), name.end(), name.begin(),
                       [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
        static_cast<HttpFields*>(cls)->emplace_back(std::move(name), value ? value : "");
        return MHD_YES;
      },
      &req.headers);
  MHD_get_connection_values(
      c, MHD_GET_ARGUMENT_KIND,
      [](void* cls, MHD_ValueKind, const char* key, const char* value) -> MHD_Result {
        static_cast<HttpFields*>(cls)->emplace_back(key != nullptr ? key : "",
                                                    value ? value : "");
        return MHD_YES;
      },
      &req.params);
  if (const auto* info = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS)) {
    req.remote_addr = ToAddress(info->client_addr);
  }

  if (stopping) return QueueResponse(c, stopping_answer);
  auto path = routes.find(req.path);
  if (path == routes.end()) {
    return QueueResponse(c, Error(404, fmt::format("no endpoint {} {}", req.method, req.path)));
  }
  auto route = path->second.find(req.method);
  if (route == path->second.end()) {
    return QueueResponse(c, Error(405, fmt::format("{} does not take {}", req.path, req.method)));
  }
  st.route = &route->second;

  // A body must declare its length, and the length must fit, before a byte of it is read.
  if (req.Header("transfer-encoding") != nullptr) {
    ++refused_limits;
    return QueueResponse(c, Error(411, "chunked request bodies are not accepted: send "
                                       "Content-Length"));
  }
  const std::string* length = req.Header("content-length");
  for (const auto& [name, value] : req.headers) {
    // Two lengths that disagree frame the body two ways (request smuggling): RFC 9112 §6.3.
    if (name == "content-length" && value != *length) {
      ++refused_limits;
      return QueueResponse(c, Error(400, "conflicting Content-Length headers"));
    }
  }
  if (length == nullptr) {
    if (CarriesBody(req.method)) {
      ++refused_limits;
      return QueueResponse(c, Error(411, "a request body needs a Content-Length"));
    }
    return MHD_YES;
  }
  // libmicrohttpd has already answered 400 to a Content-Length that is not a number.
  const bool digits = !length->empty() && length->size() <= 19 &&
                      length->find_first_not_of("0123456789") == std::string::npos;
  if (!digits) {
    ++refused_limits;
    return QueueResponse(c, Error(400, "Content-Length is not a non-negative integer"));
  }
  if (std::stoull(*length) > options.max_body_bytes) {
    ++refused_limits;
    st.refusal = Error(413, fmt::format("request body of {} bytes is over the limit of {} bytes",
                                        *length, options.max_body_bytes));
    // Answering before the body is read makes the library close the connection under a client
    // still sending, which then sees a reset instead of the 413. A moderate excess is read and
    // dropped (no memory kept) so the client hears why; a huge one is cut off at once.
    if (std::stoull(*length) - options.max_body_bytes > kMaxDiscardedBodyBytes) {
      return QueueResponse(c, *st.refusal);
    }
    return MHD_YES;
  }
  // Every connection may hold a body up to max_body_bytes while it arrives: bound their sum, or
  // 16,384 clients sending 8 MiB bodies slowly would hold 128 GiB.
  const std::uint64_t declared = std::stoull(*length);
  std::uint64_t held = body_bytes.load();
  do {
    if (held + declared > options.max_total_body_bytes) {
      ++refused_busy;
      return QueueResponse(c, Error(503, fmt::format("server busy: {} bytes of request bodies are "
                                                     "in progress (limit {})",
                                                     held, options.max_total_body_bytes)));
    }
  } while (!body_bytes.compare_exchange_weak(held, held + declared));
  st.body_budget = declared;
  st.budget = &body_bytes;
  return MHD_YES;
}

MHD_Result HttpServer::Impl::OnAccess(MHD_Connection* c, const char* url, const char* method,
                                      const char* upload_data, std::size_t* upload_size,
                                      void** state_ptr) {
  auto* st = static_cast<RequestState*>(*state_ptr);
  if (st == nullptr) {  // the headers are in
    ++requests;
    st = new RequestState;
    *state_ptr = st;
    st->request.method = method != nullptr ? method : "";
    st->request.path = url != nullptr ? url : "";
    return OnHeaders(c, *st);
  }
  if (*upload_size != 0) {  // a piece of the body; its total was checked against the limit
    if (st->refusal) {
      *upload_size = 0;  // dropped: the request is refused anyway
      return MHD_YES;
    }
    if (st->request.body.size() + *upload_size > options.max_body_bytes) return MHD_NO;
    st->request.body.append(upload_data, *upload_size);
    *upload_size = 0;
    return MHD_YES;
  }
  if (st->exchange) return st->exchange->QueueOrSuspend(c);  // back from a handler thread
  if (st->refusal) return QueueResponse(c, *st->refusal);
  // Answered at its headers (404, 405, 503 while stopping, a limit) yet called again: the
  // library may do so when that answer could not be queued (say, while the daemon shuts
  // down). There is nothing to run; close the connection.
  if (st->route == nullptr) return MHD_NO;
  return Dispatch(c, *st);
}

MHD_Result HttpServer::Impl::Dispatch(MHD_Connection* c, RequestState& st) {
  if (st.route->inline_handler) {
    HttpResponse r;
    try {
      r = st.route->inline_handler(st.request);
    } catch (const std::exception& e) {
      ++handler_errors;
      Log(fmt::format("{}: {} {} failed: {}", options.name, st.request.method, st.request.path,
                      e.what()));
      r = Error(500, std::string("internal error: ") + e.what());
    }
    return QueueResponse(c, r);
  }
  if (!pool->HasRoom()) {
    ++refused_busy;
    return QueueResponse(c, Error(503, "server busy: too many requests in progress"));
  }
  auto ex = std::make_shared<Exchange>(c, options.max_buffered_bytes, options.write_timeout,
                                       handler_failed, stopping_answer);
  ex->set_self(ex);
  {
    // Under live_mu with Stop()'s flag: an exchange is either seen by Stop's Fail pass or
    // refused here, never lost between them.
    std::lock_guard<std::mutex> lock(live_mu);
    if (stopping) {
      ++refused_busy;
      return QueueResponse(c, stopping_answer);
    }
    live.insert(ex);
  }
  st.exchange = ex;
  const bool handed = ex->LockAndSuspend([&] {
    return pool->Submit([this, ex, request = std::move(st.request), route = st.route]() {
      if (!ex->answered()) {  // Stop() may have answered it while it queued: skip the work
        try {
          route->blocking_handler(request, *ex);
        } catch (const std::exception& e) {
          Log(fmt::format("{}: {} {} failed: {}", options.name, request.method, request.path,
                          e.what()));
        }
      }
      bool error = false;
      ex->Finish(&error);
      if (error) ++handler_errors;
    });
  });
  return handed ? MHD_YES : ex->QueueOrSuspend(c);
}

HttpServer::HttpServer(HttpServerOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}

HttpServer::~HttpServer() { Stop(); }

void HttpServer::Route(std::string method, std::string path, InlineHandler handler) {
  impl_->routes[std::move(path)][std::move(method)].inline_handler = std::move(handler);
}

void HttpServer::Route(std::string method, std::string path, BlockingHandler handler) {
  impl_->routes[std::move(path)][std::move(method)].blocking_handler = std::move(handler);
}

Result<int> HttpServer::Start(const std::string& host, int port) {
  Impl& m = *impl_;
  if (m.daemon != nullptr) return Err(ErrorCode::kAlreadyExists, m.options.name + " already runs");
  if (port < 0 || port > 65535) {
    return Err(ErrorCode::kInvalidArgument, fmt::format("port {} is not in [0, 65535]", port));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port_text = std::to_string(port);
  if (int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port_text.c_str(), &hints,
                           &found);
      rc != 0 || found == nullptr) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("{}: cannot resolve host '{}': {}", m.options.name, host,
                           rc != 0 ? gai_strerror(rc) : "no address"));
  }
  sockaddr_storage addr{};
  std::memcpy(&addr, found->ai_addr, found->ai_addrlen);
  const bool v6 = found->ai_family == AF_INET6;
  freeaddrinfo(found);

  RaiseOpenFileLimit();
  m.stopping = false;
  m.pool = std::make_unique<HandlerPool>(m.options.handler_threads, m.options.max_queued);

  auto on_access = [](void* cls, MHD_Connection* c, const char* url, const char* method,
                      const char*, const char* upload_data, std::size_t* upload_size,
                      void** state) -> MHD_Result {
    // Nothing may unwind through the C library: an exception closes this connection only.
    try {
      return static_cast<Impl*>(cls)->OnAccess(c, url, method, upload_data, upload_size, state);
    } catch (const std::exception& e) {
      static_cast<Impl*>(cls)->Log(std::string("http: request dropped: ") + e.what());
      return MHD_NO;
    }
  };
  auto on_completed = [](void* cls, MHD_Connection*, void** state,
                         MHD_RequestTerminationCode toe) {
    auto* st = static_cast<Impl::RequestState*>(*state);
    if (st == nullptr) return;
    if (st->exchange) {
      st->exchange->Closed(toe == MHD_REQUEST_TERMINATED_COMPLETED_OK);
      auto* impl = static_cast<Impl*>(cls);
      std::lock_guard<std::mutex> lock(impl->live_mu);
      impl->live.erase(st->exchange);
      impl->live_cv.notify_all();
    }
    delete st;
    *state = nullptr;
  };
  auto on_connection = [](void* cls, MHD_Connection*, void**, MHD_ConnectionNotificationCode code) {
    auto* impl = static_cast<Impl*>(cls);
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
      ++impl->connections_open;
    } else {
      --impl->connections_open;
    }
  };
  auto logger = [](void* cls, const char* format, va_list ap) {
    auto* impl = static_cast<Impl*>(cls);
    // At most one library message a second: a flood of refused connections must not flood logs.
    const auto now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                            std::chrono::steady_clock::now().time_since_epoch())
                            .count();
    auto last = impl->last_log_ms.load();
    if (now_ms - last < 1000 || !impl->last_log_ms.compare_exchange_strong(last, now_ms)) return;
    char line[512];
    std::vsnprintf(line, sizeof(line), format, ap);
    std::string text(line);
    while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
    impl->Log(fmt::format("{}: {}", impl->options.name, text));
  };

  // Over max_connections a new connection is closed at accept. The library's own limit cannot
  // do that: at its limit it takes the listening socket out of its epoll set, so new
  // connections wait in the kernel's backlog, unanswered, until an open one closes (measured:
  // 616 idle connections over a 16,384 limit stopped /health and /metrics for 26-28 s, until
  // the idle timeout closed some). So the library's limit sits above ours and this policy,
  // called on the library's thread right after each accept, closes what is over ours.
  auto on_accept = [](void* cls, const sockaddr*, socklen_t) -> MHD_Result {
    auto* impl = static_cast<Impl*>(cls);
    if (impl->connections_open.load() >= impl->options.max_connections) {
      ++impl->refused_connections;
      return MHD_NO;
    }
    return MHD_YES;
  };

  unsigned int flags = MHD_USE_EPOLL_INTERNAL_THREAD | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG;
  if (v6) flags |= MHD_USE_IPv6;
  // The pool holds the request line, the headers and the I/O buffers; headers beyond it get 431.
  const std::size_t memory = m.options.max_header_bytes + 16 * 1024;
  errno = 0;
  m.daemon = MHD_start_daemon(
      flags, static_cast<std::uint16_t>(port), static_cast<MHD_AcceptPolicyCallback>(on_accept),
      &m, static_cast<MHD_AccessHandlerCallback>(on_access), &m,
      // The logger first: the library logs to stderr until it is set.
      MHD_OPTION_EXTERNAL_LOGGER, static_cast<MHD_LogCallback>(logger), &m, MHD_OPTION_SOCK_ADDR,
      reinterpret_cast<sockaddr*>(&addr), MHD_OPTION_CONNECTION_LIMIT,
      static_cast<unsigned int>(m.options.max_connections + kLibraryConnectionSlack),
      MHD_OPTION_CONNECTION_TIMEOUT,
      static_cast<unsigned int>(std::max<std::int64_t>(1, m.options.idle_timeout.count())),
      MHD_OPTION_CONNECTION_MEMORY_LIMIT, memory, MHD_OPTION_LISTEN_BACKLOG_SIZE, 4096u,
      MHD_OPTION_NOTIFY_COMPLETED, static_cast<MHD_RequestCompletedCallback>(on_completed),
      &m, MHD_OPTION_NOTIFY_CONNECTION,
      static_cast<MHD_NotifyConnectionCallback>(on_connection), &m, MHD_OPTION_END);
  if (m.daemon == nullptr) {
    const int err = errno;
    m.pool.reset();
    return Err(ErrorCode::kUnavailable,
               fmt::format("cannot bind {} to {}:{}: {}", m.options.name, host, port,
                           err != 0 ? std::strerror(err) : "the HTTP library refused to start"));
  }
  const MHD_DaemonInfo* info = MHD_get_daemon_info(m.daemon, MHD_DAEMON_INFO_BIND_PORT);
  m.bound_port = info != nullptr ? info->port : port;
  return m.bound_port;
}

void HttpServer::Stop() {
  Impl& m = *impl_;
  if (m.daemon == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(m.live_mu);
    m.stopping = true;
  }
  // Stop accepting; the listening socket is ours to close from here on.
  m.listen_fd = MHD_quiesce_daemon(m.daemon);
  {
    // Requests in progress may finish and their answers go out. Then those still running get a
    // 503 or the end of their stream, and every connection they suspended is resumed (the
    // library must not stop with one suspended).
    std::unique_lock<std::mutex> lock(m.live_mu);
    m.live_cv.wait_until(lock, std::chrono::steady_clock::now() + m.options.drain_timeout,
                         [&m] { return m.live.empty(); });
    for (const auto& ex : m.live) ex->Fail();
  }
  m.pool->Join();  // handlers return: Write fails from here on, each honours its own deadline
  {
    // Backstop: whatever is still live is answered and resumed before the library stops (it
    // must not stop with a connection suspended).
    std::lock_guard<std::mutex> lock(m.live_mu);
    for (const auto& ex : m.live) ex->Fail();
  }
  MHD_stop_daemon(m.daemon);
  m.daemon = nullptr;
  if (m.listen_fd >= 0) ::close(m.listen_fd);
  m.listen_fd = -1;
  m.pool.reset();
  m.bound_port = 0;
}

int HttpServer::port() const { return impl_->bound_port; }

HttpServerStats HttpServer::stats() const {
  HttpServerStats s;
  s.connections_open = impl_->connections_open.load();
  s.requests = impl_->requests.load();
  s.refused_busy = impl_->refused_busy.load();
  s.refused_connections = impl_->refused_connections.load();
  s.refused_limits = impl_->refused_limits.load();
  s.handler_errors = impl_->handler_errors.load();
  return s;
}

std::string RenderHttpMetrics(
    const std::vector<std::pair<std::string, HttpServerStats>>& servers) {
  std::string out;
  auto family = [&](const char* name, const char* type, const char* help, auto value,
                    const char* extra_label = "") {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
    for (const auto& [server, stats] : servers) {
      out += fmt::format("{}{{server=\"{}\"{}}} {}\n", name, server, extra_label, value(stats));
    }
  };
  family("kvferry_http_connections_open", "gauge", "Open HTTP connections.",
         [](const HttpServerStats& s) { return s.connections_open; });
  family("kvferry_http_requests_total", "counter", "HTTP requests whose headers arrived.",
         [](const HttpServerStats& s) { return s.requests; });
  out += "# HELP kvferry_http_refusals_total Requests refused: busy (503) or over a limit "
         "(411/413/400), or connections closed at accept over max_connections.\n# TYPE kvferry_http_refusals_total counter\n";
  for (const auto& [server, stats] : servers) {
    out += fmt::format("kvferry_http_refusals_total{{server=\"{}\",reason=\"busy\"}} {}\n",
                       server, stats.refused_busy);
    out += fmt::format("kvferry_http_refusals_total{{server=\"{}\",reason=\"limits\"}} {}\n",
                       server, stats.refused_limits);
    out += fmt::format(
        "kvferry_http_refusals_total{{server=\"{}\",reason=\"connections\"}} {}\n", server,
        stats.refused_connections);
  }
  family("kvferry_http_handler_errors_total", "counter",
         "Handlers that threw or returned without answering (answered 500).",
         [](const HttpServerStats& s) { return s.handler_errors; });
  return out;
}

std::uint64_t RaiseOpenFileLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return 0;
  if (limit.rlim_cur < limit.rlim_max) {
    rlimit raised = limit;
    raised.rlim_cur = limit.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) return raised.rlim_cur;
  }
  return limit.rlim_cur;
}

}  // namespace kvferry::control
