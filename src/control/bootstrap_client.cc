#include "control/bootstrap_client.h"

#include <fmt/format.h>
#include <httplib.h>
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <condition_variable>
#include <ctime>
#include <thread>

#include "control/bootstrap_json.h"
#include "control/call_deadline.h"
#include "control/bounded_answer.h"

namespace kvferry::control {
namespace {

using Clock = std::chrono::steady_clock;

// Answer size limits: one engine of kMaxWorkersPerEngine workers with maximal strings is about
// 600 KB; a full listing (kMaxListAnswerBytes, bootstrap_json.h) is bounded by kMaxRank such
// engines, far beyond any real deployment, so a smaller cap is fine.
constexpr std::size_t kMaxEngineAnswer = 1 << 20;
constexpr std::size_t kMaxSmallAnswer = 64 << 10;

bool IsPrintable(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c >= 0x20 && c <= 0x7e; });
}

std::string PercentEncode(std::string_view s) {
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out.push_back(static_cast<char>(c));
    } else {
      out += fmt::format("%{:02X}", c);
    }
  }
  return out;
}

// httplib's client writes without MSG_NOSIGNAL, so a server that closes early could raise
// SIGPIPE and kill a D process that never asked for it. SIGPIPE from a write is directed at the
// writing thread: block it here for the call, and swallow one raised meanwhile.
class ScopedSigpipeBlock {
 public:
  ScopedSigpipeBlock() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    sigset_t pending;
    sigpending(&pending);
    already_pending_ = sigismember(&pending, SIGPIPE) == 1;
    pthread_sigmask(SIG_BLOCK, &pipe_, &previous_);
  }
  ~ScopedSigpipeBlock() {
    if (!already_pending_) {
      const timespec zero{0, 0};
      while (sigtimedwait(&pipe_, nullptr, &zero) == -1 && errno == EINTR) {
      }
    }
    pthread_sigmask(SIG_SETMASK, &previous_, nullptr);
  }
  ScopedSigpipeBlock(const ScopedSigpipeBlock&) = delete;
  ScopedSigpipeBlock& operator=(const ScopedSigpipeBlock&) = delete;

 private:
  sigset_t pipe_;
  sigset_t previous_;
  bool already_pending_ = false;
};

struct HttpReply {
  int status = 0;
  std::string body;
  std::string signature;  // X-Kvferry-Signature, empty when absent
};

// One HTTP exchange with a hard deadline and an answer size cap. `authorization`, when not
// empty, is sent as the Authorization header. Errors: kTimeout (deadline), kUnavailable
// (transport), kProtocol (answer too large).
Result<HttpReply> Call(const BootstrapAddress& address, const char* method, const std::string& path,
                       const std::string* body, Clock::time_point deadline, std::size_t max_answer,
                       const std::string& authorization = {}) {
  const std::string what = fmt::format("bootstrap {} {} {}", address.ToString(), method, path);
  const auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now());
  if (left.count() <= 0) return Err(ErrorCode::kTimeout, what + ": deadline already passed");

  httplib::ClientImpl client(address.host, address.port);
  // httplib truncates socket timeouts to whole milliseconds, so a read could time out just
  // before the deadline and look like a transport failure. Pad them: the CallDeadline ends
  // the call at the deadline itself, and the outcome is then classified as a timeout.
  const auto socket_timeout = left + std::chrono::milliseconds(20);
  client.set_connection_timeout(socket_timeout);
  client.set_read_timeout(socket_timeout);
  client.set_write_timeout(socket_timeout);
  client.set_keep_alive(false);

  httplib::Request req;
  req.method = method;
  req.path = path;
  if (body != nullptr) {
    req.body = *body;
    req.set_header("Content-Type", "application/json");
  }
  if (!authorization.empty()) req.set_header("Authorization", authorization);
  std::string answer;
  bool too_large = false;
  req.content_receiver = BoundedAnswerReceiver(&answer, max_answer, &too_large);

  httplib::Response res;
  httplib::Error error = httplib::Error::Success;
  bool sent = false;
  {
    ScopedSigpipeBlock no_sigpipe;
    CallDeadline hard_deadline(deadline, [&client] { client.stop(); });
    sent = client.send(req, res, error);
  }
  if (!sent) {
    if (too_large) {
      return Err(ErrorCode::kProtocol,
                 fmt::format("{}: answer exceeds {} bytes", what, max_answer));
    }
    if (Clock::now() >= deadline || error == httplib::Error::ConnectionTimeout) {
      return Err(ErrorCode::kTimeout, fmt::format("{}: no answer in time", what));
    }
    return Err(ErrorCode::kUnavailable, fmt::format("{}: {}", what, httplib::to_string(error)));
  }
  // Bounded like the answer: a signature longer than its format allows is not one.
  std::string signature = res.get_header_value(std::string(kSignatureHeader));
  if (signature.size() > 256) signature.resize(256);
  return HttpReply{res.status, std::move(answer), std::move(signature)};
}

// Whether `reply` to GET `path` may be believed (BootstrapClient's class comment).
Status CheckAnswer(const std::shared_ptr<const ClusterSecret>& secret, const HttpReply& reply,
                   std::string_view path, std::string_view what, bool refuse_signed_if_open) {
  if (!secret) {
    if (refuse_signed_if_open && !reply.signature.empty()) {
      return Status(ErrorCode::kUnauthenticated,
                    fmt::format("{}: the bootstrap service signs its answers (its cluster "
                                "requires authentication) but this process has no cluster secret "
                                "(kv_connector_extra_config.cluster_secret_file)",
                                what));
    }
    return Status::Ok();
  }
  Status verified =
      VerifyResponse(*secret, reply.signature, reply.status, path, reply.body, UnixNowSeconds());
  if (!verified.ok()) {
    return Status(ErrorCode::kUnauthenticated,
                  fmt::format("{}: HTTP {} {}", what, reply.status, verified.message()));
  }
  return Status::Ok();
}

// The reason a non-200 answer gives, for error messages (bounded: it came from the network).
std::string ReasonOf(const HttpReply& reply) {
  std::string reason = DecodeError(reply.body);
  if (reason.empty()) reason = fmt::format("HTTP {}", reply.status);
  if (reason.size() > 512) reason.resize(512);
  return reason;
}

Status StatusForAnswer(const HttpReply& reply, std::string_view what) {
  ErrorCode code = ErrorCode::kProtocol;
  switch (reply.status) {
    case 400:
      code = ErrorCode::kInvalidArgument;
      break;
    case 401:
      code = ErrorCode::kUnauthenticated;
      break;
    case 404:
      code = ErrorCode::kNotFound;
      break;
    case 409:
      code = ErrorCode::kAlreadyExists;
      break;
    case 503:
      code = ErrorCode::kResourceExhausted;
      break;
    default:
      if (reply.status >= 500) code = ErrorCode::kUnavailable;
      break;
  }
  return Status(code, fmt::format("{}: {} (HTTP {})", what, ReasonOf(reply), reply.status));
}

bool ParsePort(std::string_view s, int& port) {
  if (s.empty() || s.size() > 5) return false;
  int value = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    value = value * 10 + (c - '0');
  }
  if (value < 1 || value > 65535) return false;
  port = value;
  return true;
}

}  // namespace

std::string BootstrapAddress::ToString() const {
  if (host.find(':') != std::string::npos) return fmt::format("[{}]:{}", host, port);
  return fmt::format("{}:{}", host, port);
}

Result<BootstrapAddress> ParseBootstrapAddress(std::string_view address) {
  auto bad = [&](std::string_view why) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("bootstrap address '{}': {}",
                           IsPrintable(address) && address.size() <= kMaxStringBytes
                               ? address
                               : std::string_view("<unprintable>"),
                           why));
  };
  if (address.size() > kMaxStringBytes || !IsPrintable(address)) {
    return bad("must be at most 256 bytes of printable ASCII");
  }
  std::string_view rest = address;
  if (rest.substr(0, 7) == "http://") {
    rest.remove_prefix(7);
  } else if (rest.find("://") != std::string_view::npos) {
    return bad("only http:// is supported");
  }
  if (!rest.empty() && rest.back() == '/') rest.remove_suffix(1);

  BootstrapAddress out;
  std::string_view port;
  if (!rest.empty() && rest.front() == '[') {
    const auto close = rest.find(']');
    if (close == std::string_view::npos || close + 1 >= rest.size() || rest[close + 1] != ':') {
      return bad("expected [host]:port");
    }
    out.host = std::string(rest.substr(1, close - 1));
    port = rest.substr(close + 2);
  } else {
    const auto colon = rest.rfind(':');
    if (colon == std::string_view::npos) return bad("missing :port");
    out.host = std::string(rest.substr(0, colon));
    port = rest.substr(colon + 1);
    if (out.host.find(':') != std::string::npos) return bad("an IPv6 host needs [brackets]");
  }
  if (out.host.empty() || out.host.find_first_of("/ ?#@") != std::string::npos) {
    return bad("bad host");
  }
  if (!ParsePort(port, out.port)) return bad("port must be 1-65535");
  return out;
}

Result<BootstrapClient> BootstrapClient::Create(std::string_view address,
                                                std::shared_ptr<const ClusterSecret> secret) {
  auto parsed = ParseBootstrapAddress(address);
  if (!parsed) return tl::unexpected(parsed.error());
  return BootstrapClient(std::move(*parsed), std::move(secret));
}

Status BootstrapClient::Register(const WorkerRegistration& registration, Timeout timeout,
                                 const RetryPolicy& retry) const {
  if (Status s = Validate(registration); !s.ok()) return s;
  const std::string body = EncodeRegistration(registration);
  const std::string what = fmt::format(
      "registering engine {} tp_rank {} pp_rank {} with bootstrap {}", registration.engine_id,
      registration.tp_rank, registration.pp_rank, address_.ToString());
  const auto start = Clock::now();
  const auto deadline = start + timeout;
  auto backoff = std::max(retry.initial_backoff, Timeout{1});
  Status last(ErrorCode::kTimeout, "no attempt made");
  // Whether some attempt was refused outright: then the service cannot be reached, even if the
  // last attempt, cut short by the deadline, merely timed out.
  bool refused = false;
  int attempts = 0;
  while (true) {
    ++attempts;
    const auto attempt_deadline = std::min(deadline, Clock::now() + retry.attempt_timeout);
    // Signed per attempt: a retry after a long backoff still carries a fresh timestamp.
    const std::string authorization =
        secret_ ? SignRequest(*secret_, "POST", "/register", body, UnixNowSeconds())
                : std::string();
    auto reply = Call(address_, "POST", "/register", &body, attempt_deadline, kMaxSmallAnswer,
                      authorization);
    if (reply) {
      if (reply->status == 200) return Status::Ok();
      Status answer = StatusForAnswer(*reply, what);
      // Only a server-side hiccup is worth repeating; 4xx and "registry full" are final.
      if (answer.code() != ErrorCode::kUnavailable) return answer;
      last = std::move(answer);
    } else {
      last = std::move(reply.error());
    }
    if (last.code() == ErrorCode::kUnavailable) refused = true;
    const auto now = Clock::now();
    if (deadline - now <= backoff) break;
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::max(retry.max_backoff, Timeout{1}));
  }
  const auto spent =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
  const ErrorCode code = last.code() == ErrorCode::kTimeout && !refused ? ErrorCode::kTimeout
                                                                        : ErrorCode::kUnavailable;
  return Status(code, fmt::format("{}: gave up after {} attempt(s) in {} ms; last: {}", what,
                                  attempts, spent, last.message()));
}

Result<EngineInfo> BootstrapClient::Query(const std::string& engine_id, Timeout timeout) const {
  if (engine_id.empty() || engine_id.size() > kMaxStringBytes || !IsPrintable(engine_id)) {
    return Err(ErrorCode::kInvalidArgument, "engine_id must be 1 to 256 bytes of printable ASCII");
  }
  const std::string path = "/query?engine_id=" + PercentEncode(engine_id);
  auto reply = Call(address_, "GET", path, nullptr, Clock::now() + timeout, kMaxEngineAnswer);
  if (!reply) return tl::unexpected(reply.error());
  const std::string what =
      fmt::format("querying engine {} at bootstrap {}", engine_id, address_.ToString());
  if (Status s = CheckAnswer(secret_, *reply, "/query", what, /*refuse_signed_if_open=*/true);
      !s.ok()) {
    return tl::unexpected(std::move(s));
  }
  if (reply->status != 200) return tl::unexpected(StatusForAnswer(*reply, what));
  auto info = DecodeEngine(reply->body);
  if (!info) {
    return Err(ErrorCode::kProtocol, fmt::format("{}: {}", what, info.error().message()));
  }
  if (info->engine_id != engine_id) {
    return Err(ErrorCode::kProtocol,
               fmt::format("{}: the answer is about engine {}", what, info->engine_id));
  }
  return info;
}

Result<std::string> BootstrapClient::Listing(Timeout timeout) const {
  auto reply =
      Call(address_, "GET", "/query", nullptr, Clock::now() + timeout, kMaxListAnswerBytes);
  if (!reply) return tl::unexpected(reply.error());
  const std::string what = fmt::format("listing engines at bootstrap {}", address_.ToString());
  if (Status s = CheckAnswer(secret_, *reply, "/query", what, /*refuse_signed_if_open=*/false);
      !s.ok()) {
    return tl::unexpected(std::move(s));
  }
  if (reply->status != 200) return tl::unexpected(StatusForAnswer(*reply, what));
  return std::move(reply->body);
}

Result<std::vector<EngineInfo>> BootstrapClient::QueryAll(Timeout timeout) const {
  auto body = Listing(timeout);
  if (!body) return tl::unexpected(body.error());
  auto engines = DecodeEngines(*body);
  if (!engines) {
    return Err(ErrorCode::kProtocol, fmt::format("listing engines at bootstrap {}: {}",
                                                 address_.ToString(), engines.error().message()));
  }
  return engines;
}

Result<std::vector<DpEngine>> BootstrapClient::QueryDpEngines(Timeout timeout) const {
  auto body = Listing(timeout);
  if (!body) return tl::unexpected(body.error());
  auto engines = DecodeDpEngines(*body);
  if (!engines) {
    return Err(ErrorCode::kProtocol, fmt::format("listing engines at bootstrap {}: {}",
                                                 address_.ToString(), engines.error().message()));
  }
  return engines;
}

Status BootstrapClient::Health(Timeout timeout) const {
  auto reply = Call(address_, "GET", "/health", nullptr, Clock::now() + timeout, kMaxSmallAnswer);
  if (!reply) return std::move(reply.error());
  const std::string what = fmt::format("health of bootstrap {}", address_.ToString());
  if (reply->status != 200) return StatusForAnswer(*reply, what);
  return Status::Ok();
}

// One query in flight for an engine; callers that want the same engine from the same address
// wait for it instead of sending their own.
struct EngineDirectory::Flight {
  std::string addr;
  bool done = false;
  Result<EngineLookup> result;
  std::condition_variable cv;
};

Result<EngineLookup> EngineDirectory::Lookup(const std::string& engine_id,
                                             const std::string& bootstrap_addr, Timeout timeout) {
  const auto deadline = Clock::now() + timeout;
  std::unique_lock<std::mutex> lock(mu_);
  Entry& entry = entries_[engine_id];
  if (entry.info && entry.info_addr == bootstrap_addr) return EngineLookup{entry.info, false, ""};

  if (entry.flight && entry.flight->addr == bootstrap_addr) {
    std::shared_ptr<Flight> flight = entry.flight;
    if (!flight->cv.wait_until(lock, deadline, [&] { return flight->done; })) {
      return Err(ErrorCode::kTimeout,
                 fmt::format("lookup of engine {} at {}: the query in flight did not finish in "
                             "{} ms",
                             engine_id, bootstrap_addr, timeout.count()));
    }
    return flight->result;
  }

  // This caller queries. A flight to another address (rare: two requests naming different
  // bootstrap addresses for one engine) is left alone; this query then runs on its own.
  auto flight = std::make_shared<Flight>();
  flight->addr = bootstrap_addr;
  const bool shared = entry.flight == nullptr;
  if (shared) entry.flight = flight;
  const std::uint64_t epoch = entry.epoch;
  ++queries_sent_;
  lock.unlock();

  Result<EngineInfo> answer = [&]() -> Result<EngineInfo> {
    auto client = BootstrapClient::Create(bootstrap_addr, secret_);
    if (!client) return tl::unexpected(client.error());
    const auto left = std::chrono::duration_cast<Timeout>(deadline - Clock::now());
    return client->Query(engine_id, left);
  }();

  lock.lock();
  Entry& e = entries_[engine_id];  // entries are never erased while a flight is registered
  Result<EngineLookup> out;
  if (!answer) {
    out = tl::unexpected(answer.error());
  } else if (!answer->complete) {
    out = Err(ErrorCode::kUnavailable,
              fmt::format("engine {} incarnation {} is incomplete: {} of {} workers registered",
                          engine_id, answer->incarnation, answer->workers.size(),
                          std::size_t{answer->tp_size} * answer->pp_size));
  } else {
    auto info = std::make_shared<const EngineInfo>(std::move(*answer));
    EngineLookup lookup{info, false, ""};
    if (!e.last_incarnation.empty() && e.last_incarnation != info->incarnation) {
      lookup.incarnation_changed = true;
      lookup.previous_incarnation = e.last_incarnation;
    }
    e.last_incarnation = info->incarnation;
    // An Invalidate() during the query means the caller saw this engine fail after the query
    // began; the answer may predate the failure, so it serves this call but is not cached.
    if (e.epoch == epoch) {
      e.info = info;
      e.info_addr = bootstrap_addr;
    }
    out = std::move(lookup);
  }
  if (shared && e.flight == flight) e.flight.reset();
  flight->result = out;
  flight->done = true;
  flight->cv.notify_all();
  // Do not keep an entry for every unknown id a request ever named.
  if (!e.info && !e.flight && e.last_incarnation.empty()) entries_.erase(engine_id);
  return out;
}

void EngineDirectory::Invalidate(const std::string& engine_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(engine_id);
  if (it == entries_.end()) return;
  it->second.info.reset();
  it->second.info_addr.clear();
  ++it->second.epoch;
}

std::shared_ptr<const EngineInfo> EngineDirectory::Cached(const std::string& engine_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(engine_id);
  return it == entries_.end() ? nullptr : it->second.info;
}

std::uint64_t EngineDirectory::queries_sent() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queries_sent_;
}

}  // namespace kvferry::control
