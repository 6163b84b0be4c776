#include "client_proxy.h"

#include <fmt/format.h>
#include <httplib.h>

#include <algorithm>
#include <cctype>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <list>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "client_http.h"
#include "control/bootstrap_client.h"
#include "control/bootstrap_types.h"
#include "control/call_deadline.h"
#include "control/cluster_auth.h"
#include "control/http_server.h"
#include "control/json_limits.h"

namespace kvferry::harness {

namespace {

using nlohmann::json;

std::string BootstrapUrl(const std::string& addr) {
  if (addr.rfind("http://", 0) == 0) return addr;
  return "http://" + addr;
}

json ErrorJson(const std::string& message, const std::string& type) {
  return json{{"error", {{"message", message}, {"type", type}}}};
}

// Error bodies carry backend text that may not be valid UTF-8: never throw while answering.
std::string ErrorBody(const std::string& message, const std::string& type) {
  return ErrorJson(message, type).dump(-1, ' ', false, json::error_handler_t::replace);
}

control::HttpResponse JsonAnswer(int status, std::string body) {
  control::HttpResponse r;
  r.status = status;
  r.body = std::move(body);
  return r;
}

constexpr const char* kCompletionsPath = "/v1/completions";
constexpr const char* kChatCompletionsPath = "/v1/chat/completions";

// At most 80 printable bytes of a command-line value, for an error message.
std::string Shown(std::string_view text) {
  std::string out;
  for (char c : text.substr(0, 80)) out.push_back(c >= 0x20 && c <= 0x7e ? c : '?');
  if (text.size() > 80) out += "...";
  return out;
}

bool ParsePort(std::string_view text, int& port) {
  if (text.empty() || text.size() > 5) return false;
  int value = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
    value = value * 10 + (c - '0');
  }
  if (value < 1 || value > 65535) return false;
  port = value;
  return true;
}

// The rule D applies to remote_engine_id and a bootstrap to engine_id.
bool IsEngineId(std::string_view id) {
  return !id.empty() && id.size() <= control::kMaxStringBytes &&
         std::all_of(id.begin(), id.end(), [](char c) { return c >= 0x20 && c <= 0x7e; });
}

// vLLM's proxy reads the word in any case.
bool IsNone(std::string_view text) {
  constexpr std::string_view kNone = "none";
  return std::equal(text.begin(), text.end(), kNone.begin(), kNone.end(), [](char a, char b) {
    return std::tolower(static_cast<unsigned char>(a)) == b;
  });
}

// One way to reach P: an instance and, when learned from its bootstrap, one of its dp ranks.
struct Route {
  std::size_t prefill = 0;  // index into ProxyOptions::prefills
  std::string engine_id;
  std::optional<std::uint32_t> dp_rank;  // sent to P as X-data-parallel-rank
};

// What the proxy knows of one P while it learns the engine ids it was not given.
struct PrefillState {
  bool ready = false;
  std::string reason;  // why it is not ready yet (empty before the first attempt ended)
  std::vector<Route> routes;
};

// D's response travelling from the thread that reads it to the client's connection.
struct Pipe {
  std::mutex mu;
  std::condition_variable cv;
  int status = 0;  // 0 until D's status line arrived
  std::string content_type;
  std::deque<std::string> chunks;
  bool finished = false;
  std::string error;                   // transport failure (no or broken response)
  std::atomic<bool> abandoned{false};  // the client (or P's failure) ended it: stop reading D
  // The request's other half: P's copy. It fails -> the client hears P's reason at once and D's
  // copy is dropped; D's copy fails -> P's copy is cancelled (P aborts the prefill).
  bool p_failed = false;
  int p_status = 0;
  std::string p_error;
  CancelGroup p_cancel;
  CancelGroup d_cancel;  // closes D's connection: D's copy is dropped, not left to run

  // Stop reading D and close its connection (the client left, or the request already failed).
  void Abandon() {
    abandoned.store(true);
    d_cancel.CancelAll();
  }
};

}  // namespace

std::string BuildPrefillBody(const std::string& client_body, const std::string& transfer_id) {
  json j = json::parse(client_body);
  j["max_tokens"] = 1;
  if (j.contains("max_completion_tokens")) j["max_completion_tokens"] = 1;  // chat's name
  // Streamed, so that closing the connection (the proxy cancelling it because D's half failed)
  // is noticed by P at its next keepalive write and the prefill is aborted.
  j["stream"] = true;
  j.erase("stream_options");
  if (j.contains("min_tokens")) j.erase("min_tokens");
  j["kv_transfer_params"] = {
      {"do_remote_decode", true}, {"do_remote_prefill", false}, {"transfer_id", transfer_id}};
  return j.dump();
}

std::string BuildDecodeBody(const std::string& client_body, const std::string& transfer_id,
                            const std::string& engine_id, const std::string& bootstrap) {
  json j = json::parse(client_body);
  json params = {{"do_remote_decode", false},
                 {"do_remote_prefill", true},
                 {"remote_engine_id", engine_id},
                 {"transfer_id", transfer_id}};
  if (!bootstrap.empty()) params["remote_bootstrap_addr"] = BootstrapUrl(bootstrap);
  j["kv_transfer_params"] = std::move(params);
  return j.dump();
}

Result<std::vector<PrefillTarget>> PrefillTargetsFromFlags(const ProxyPrefillFlags& flags) {
  auto refuse = [](std::string why) { return Err(ErrorCode::kInvalidArgument, std::move(why)); };
  const std::size_t n = flags.prefill.size();
  if (n == 0) return refuse("give at least one --prefill URL");
  if (!flags.bootstrap.empty() && flags.bootstrap.size() != n) {
    return refuse(fmt::format(
        "{} --prefill-bootstrap for {} --prefill: give one per --prefill (the i-th is the i-th "
        "P's) or none (each P's bootstrap is then its URL's host, at the port after the URL or "
        "{})",
        flags.bootstrap.size(), n, kDefaultBootstrapPort));
  }
  if (!flags.engine_id.empty() && flags.engine_id.size() != n) {
    return refuse(fmt::format(
        "{} --prefill-engine-id for {} --prefill: give one per --prefill (the i-th is the i-th "
        "P's) or none (every engine id is then learned from P's bootstrap)",
        flags.engine_id.size(), n));
  }
  std::vector<PrefillTarget> out;
  for (std::size_t i = 0; i < n; ++i) {
    const std::vector<std::string>& args = flags.prefill[i];
    if (args.empty()) return refuse("--prefill needs P's URL");
    PrefillTarget t;
    t.url = args[0];
    const auto url = ParseUrl(t.url);
    if (!url) {
      return refuse(
          fmt::format("--prefill {}: not a URL of the form http://host:port", Shown(t.url)));
    }
    if (args.size() > 2) {
      return refuse(fmt::format(
          "--prefill {} has {} values after the URL; it takes at most one, a bootstrap port or "
          "'none'",
          Shown(t.url), args.size() - 1));
    }
    bool none = false;
    int port = kDefaultBootstrapPort;
    if (args.size() == 2) {
      if (!flags.bootstrap.empty()) {
        return refuse(fmt::format(
            "--prefill {} {} and --prefill-bootstrap {} both name this P's bootstrap: give one",
            Shown(t.url), Shown(args[1]), Shown(flags.bootstrap[i])));
      }
      none = IsNone(args[1]);
      if (!none && !ParsePort(args[1], port)) {
        return refuse(
            fmt::format("--prefill {} {}: the value after the URL is not a bootstrap "
                        "port (1..65535) or 'none'",
                        Shown(t.url), Shown(args[1])));
      }
    }
    std::string bootstrap;
    if (!flags.bootstrap.empty()) {
      bootstrap = flags.bootstrap[i];
    } else if (!none) {
      // ParseUrl keeps an IPv6 host's brackets; a bare one gets them.
      const bool bare_v6 = url->host.find(':') != std::string::npos && url->host[0] != '[';
      bootstrap = (bare_v6 ? "[" + url->host + "]" : url->host) + ":" + std::to_string(port);
    }
    if (!bootstrap.empty()) {
      auto address = control::ParseBootstrapAddress(bootstrap);
      if (!address) {
        return refuse(fmt::format("P {}: {}", Shown(t.url), address.error().message()));
      }
      t.bootstrap = address->ToString();
    }
    if (!flags.engine_id.empty()) {
      t.engine_id = flags.engine_id[i];
      if (!IsEngineId(t.engine_id)) {
        return refuse(
            fmt::format("--prefill-engine-id '{}': an engine id is 1 to {} bytes of "
                        "printable ASCII",
                        Shown(t.engine_id), control::kMaxStringBytes));
      }
    } else if (none) {
      return refuse(fmt::format(
          "--prefill {} none: this P has no bootstrap to learn its engine id from; give one "
          "--prefill-engine-id per --prefill",
          Shown(t.url)));
    }
    out.push_back(std::move(t));
  }
  return out;
}

struct Proxy::Impl {
  ProxyOptions o;
  std::unique_ptr<control::HttpServer> svr;
  int bound_port = 0;
  CancelGroup cancel;
  ConnectGate gate;
  std::atomic<std::uint64_t> next{0};
  std::atomic<std::uint64_t> requests{0}, prefill_failed{0}, decode_failed{0}, in_flight{0},
      twins_aborted{0}, prefill_cancelled{0}, not_ready{0};
  std::shared_ptr<const control::ClusterSecret> secret;  // null: an open cluster
  std::string api_key;  // $OPENAI_API_KEY at start: sent when the client sends no Authorization

  std::mutex threads_mu;
  struct Task {
    std::thread t;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::list<Task> tasks;
  bool stopped = false;

  // Readiness. ready_mu is held only for in-memory work, never during I/O (the /health
  // handler takes it on the server's event thread).
  mutable std::mutex ready_mu;
  std::condition_variable ready_cv;  // wakes learners at Stop
  bool learners_stop = false;
  std::vector<PrefillState> prefill_state;           // one per o.prefills
  std::shared_ptr<const std::vector<Route>> routes;  // set once every P is ready
  std::vector<std::thread> learners;

  explicit Impl(ProxyOptions options) : o(std::move(options)) {}

  void Log(const std::string& line) const {
    if (o.log) {
      o.log(line);
    } else {
      std::fprintf(stderr, "[proxy] %s\n", line.c_str());
    }
  }

  // Runs `fn` on a tracked thread (joined by Stop; finished ones are reaped here).
  bool Spawn(std::function<void()> fn) {
    std::lock_guard<std::mutex> lock(threads_mu);
    if (stopped) return false;
    for (auto it = tasks.begin(); it != tasks.end();) {
      if (it->done->load()) {
        it->t.join();
        it = tasks.erase(it);
      } else {
        ++it;
      }
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    tasks.push_back(Task{std::thread([fn = std::move(fn), done] {
                           fn();
                           done->store(true);
                         }),
                         done});
    return true;
  }

  std::shared_ptr<const std::vector<Route>> CurrentRoutes() const {
    std::lock_guard<std::mutex> lock(ready_mu);
    return routes;
  }

  ProxyReadiness Readiness() const {
    std::lock_guard<std::mutex> lock(ready_mu);
    if (routes) return {true, ""};
    std::size_t waiting = 0;
    std::size_t first = prefill_state.size();
    for (std::size_t i = 0; i < prefill_state.size(); ++i) {
      if (prefill_state[i].ready) continue;
      ++waiting;
      if (first == prefill_state.size()) first = i;
    }
    if (first == prefill_state.size()) return {false, "no prefill instance"};
    const std::string& why = prefill_state[first].reason;
    return {false, fmt::format("prefill {} is not ready{}: {}", o.prefills[first].url,
                               waiting > 1 ? fmt::format(" ({} of {} prefill instances are not)",
                                                         waiting, prefill_state.size())
                                           : std::string(),
                               why.empty() ? "its first check has not ended yet" : why)};
  }

  json HealthJson() const {
    std::lock_guard<std::mutex> lock(ready_mu);
    json prefills = json::array();
    for (std::size_t i = 0; i < prefill_state.size(); ++i) {
      json p = {{"url", o.prefills[i].url}, {"ready", prefill_state[i].ready}};
      if (!prefill_state[i].ready) p["reason"] = prefill_state[i].reason;
      json engines = json::array();
      for (const Route& r : prefill_state[i].routes) {
        json e = {{"engine_id", r.engine_id}};
        if (r.dp_rank) e["dp_rank"] = *r.dp_rank;
        engines.push_back(std::move(e));
      }
      p["engines"] = std::move(engines);
      prefills.push_back(std::move(p));
    }
    return prefills;
  }

  // Records P `i` as ready; once every P is, the routes are fixed (P order, then dp rank).
  void MarkReady(std::size_t i, std::vector<Route> learned) {
    std::string line;
    {
      std::lock_guard<std::mutex> lock(ready_mu);
      PrefillState& st = prefill_state[i];
      st.ready = true;
      st.reason.clear();
      st.routes = std::move(learned);
      std::string engines;
      for (const Route& r : st.routes) {
        if (!engines.empty()) engines += ", ";
        engines +=
            r.dp_rank ? fmt::format("{} (dp rank {})", r.engine_id, *r.dp_rank) : r.engine_id;
      }
      line = fmt::format("prefill {} is ready: {}{}", o.prefills[i].url, engines,
                         o.prefills[i].bootstrap.empty()
                             ? std::string()
                             : fmt::format(", bootstrap {}", o.prefills[i].bootstrap));
      if (std::all_of(prefill_state.begin(), prefill_state.end(),
                      [](const PrefillState& p) { return p.ready; })) {
        auto all = std::make_shared<std::vector<Route>>();
        for (const PrefillState& p : prefill_state) {
          all->insert(all->end(), p.routes.begin(), p.routes.end());
        }
        line += fmt::format("; every prefill instance is ready ({} routes)", all->size());
        routes = std::move(all);
      }
    }
    Log(line);
  }

  // GET url/health within the attempt's deadline: "" when it answered 200, else why not. The
  // body is never read (a P may answer anything there).
  std::string ProbeHealth(const std::string& url) {
    const auto hp = ParseUrl(url);
    if (!hp) return "bad url";
    const auto attempt = std::chrono::duration<double>(std::max(o.ready_attempt_timeout_s, 0.001));
    httplib::Client cli(hp->host, hp->port);
    const auto us = std::chrono::duration_cast<std::chrono::microseconds>(attempt);
    cli.set_connection_timeout(us);
    cli.set_read_timeout(us);
    cli.set_write_timeout(us);
    cli.set_keep_alive(false);
    int status = 0;
    httplib::Request req;
    req.method = "GET";
    req.path = "/health";
    req.response_handler = [&status](const httplib::Response& r) {
      status = r.status;
      return false;  // the status is all the proxy needs
    };
    const std::uint64_t reg = cancel.Add([&cli] { cli.stop(); });
    if (reg == 0) return "the proxy is stopping";
    httplib::Response res;
    httplib::Error err = httplib::Error::Success;
    {
      control::CallDeadline deadline(
          SteadyClock::now() + std::chrono::duration_cast<SteadyClock::duration>(attempt),
          [&cli] { cli.stop(); });
      (void)cli.send(req, res, err);
    }
    cancel.Remove(reg);
    if (status == 200) return "";
    if (status != 0) return fmt::format("GET {}/health answered HTTP {}", url, status);
    return fmt::format("GET {}/health: {}", url,
                       err == httplib::Error::Success || err == httplib::Error::Canceled
                           ? std::string("no answer in time")
                           : httplib::to_string(err));
  }

  // Learns P `i`'s engines: its /health until 200, then its bootstrap's listing, each attempt
  // bounded, repeated at the retry interval until P is ready or the proxy stops.
  void Learn(std::size_t i) {
    const PrefillTarget& p = o.prefills[i];
    auto address = control::ParseBootstrapAddress(p.bootstrap);  // checked by Start
    if (!address) return;
    const control::BootstrapClient bootstrap(*address, secret);
    const auto attempt = std::chrono::duration_cast<control::Timeout>(
        std::chrono::duration<double>(std::max(o.ready_attempt_timeout_s, 0.001)));
    const auto retry = std::chrono::duration_cast<SteadyClock::duration>(
        std::chrono::duration<double>(std::max(o.ready_retry_interval_s, 0.001)));
    const auto log_every = std::chrono::duration_cast<SteadyClock::duration>(
        std::chrono::duration<double>(std::max(o.ready_log_interval_s, 0.001)));
    const auto start = SteadyClock::now();
    std::string logged;
    SteadyClock::time_point logged_at = start;
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(ready_mu);
        if (learners_stop) return;
      }
      std::string reason = ProbeHealth(p.url);
      std::vector<Route> learned;
      if (reason.empty()) {
        auto engines = bootstrap.QueryDpEngines(attempt);
        if (!engines) {
          reason = engines.error().message();
        } else if (engines->empty()) {
          reason = fmt::format("bootstrap {} lists no engine yet", address->ToString());
        } else {
          for (const control::DpEngine& e : *engines) {
            if (!e.complete) {
              reason = fmt::format(
                  "engine {} (dp rank {}) at bootstrap {} waits for some of its ranks to register",
                  e.engine_id, e.dp_rank, address->ToString());
              break;
            }
            learned.push_back(Route{i, e.engine_id, e.dp_rank});
          }
        }
      }
      if (reason.empty()) {
        MarkReady(i, std::move(learned));
        return;
      }
      {
        std::lock_guard<std::mutex> lock(ready_mu);
        prefill_state[i].reason = reason;
      }
      const auto now = SteadyClock::now();
      if (reason != logged || now - logged_at >= log_every) {
        Log(fmt::format("prefill {} is not ready after {:.1f} s: {}", p.url,
                        std::chrono::duration<double>(now - start).count(), reason));
        logged = reason;
        logged_at = now;
      }
      std::unique_lock<std::mutex> lock(ready_mu);
      if (ready_cv.wait_for(lock, retry, [this] { return learners_stop; })) return;
    }
  }

  void Handle(const control::HttpRequest& req, control::HttpExchange& ex, const char* path) {
    requests.fetch_add(1);
    if (o.prefills.empty() || o.decodes.empty()) {
      ex.Reply(JsonAnswer(503, ErrorBody("proxy has no prefill or decode instance", "proxy_error")));
      return;
    }
    const std::shared_ptr<const std::vector<Route>> ready_routes = CurrentRoutes();
    if (!ready_routes) {
      not_ready.fetch_add(1);
      control::HttpResponse answer =
          JsonAnswer(503, ErrorBody("proxy is not ready: " + Readiness().reason, "proxy_error"));
      answer.headers.emplace_back("Retry-After", "1");
      ex.Reply(std::move(answer));
      return;
    }
    auto refuse = [&ex](const std::string& why) {
      ex.Reply(JsonAnswer(400, ErrorBody(why, "invalid_request")));
    };
    // Bounded before parsing: the bodies are re-serialized for P and D, and serializing
    // recurses once per level (a 70,000-deep body used to crash the proxy).
    if (control::JsonDepth(req.body) > control::kMaxJsonDepth) {
      refuse(fmt::format("request body nests JSON deeper than {} levels", control::kMaxJsonDepth));
      return;
    }
    if (control::JsonValues(req.body) > control::kMaxJsonValues) {
      refuse(fmt::format("request body has more than {} JSON values", control::kMaxJsonValues));
      return;
    }
    json client = json::parse(req.body, nullptr, false);
    if (client.is_discarded() || !client.is_object()) {
      refuse("request body is not a JSON object");
      return;
    }
    const auto stream_field = client.find("stream");
    if (stream_field != client.end() && !stream_field->is_boolean() && !stream_field->is_null()) {
      refuse("field 'stream' must be a boolean");
      return;
    }
    // Fields P's copy does not carry as sent (max_tokens becomes 1) are checked here: only D
    // would refuse them, after P prefilled and began holding KV for nobody.
    for (const char* field : {"max_tokens", "max_completion_tokens"}) {
      const auto limit = client.find(field);
      if (limit != client.end() && !limit->is_null() &&
          !(limit->is_number_unsigned() && limit->get<std::uint64_t>() > 0)) {
        refuse(fmt::format("field '{}' must be a positive integer", field));
        return;
      }
    }
    if (std::string_view(path) == kChatCompletionsPath) {
      const auto messages = client.find("messages");
      if (messages == client.end() || !messages->is_array() || messages->empty()) {
        refuse("field 'messages' must be a non-empty array of messages");
        return;
      }
    } else {
      const auto prompt = client.find("prompt");
      if (prompt == client.end() || !(prompt->is_string() || prompt->is_array())) {
        refuse("field 'prompt' must be a string or an array of token ids");
        return;
      }
    }
    const bool stream =
        stream_field != client.end() && stream_field->is_boolean() && stream_field->get<bool>();
    const std::uint64_t n = next.fetch_add(1);
    const Route& route = (*ready_routes)[n % ready_routes->size()];
    const PrefillTarget& p = o.prefills[route.prefill];
    const std::string d_url = o.decodes[n % o.decodes.size()];
    const std::string request_id = RandomUuid();
    const std::string transfer_id = "xfer-" + request_id;
    std::string p_body, d_body;
    try {
      p_body = BuildPrefillBody(req.body, transfer_id);
      d_body = BuildDecodeBody(req.body, transfer_id, route.engine_id, p.bootstrap);
    } catch (const std::exception& e) {
      refuse(e.what());
      return;
    }
    // Headers as vLLM's Mooncake proxy sends them: the request id to both, the client's
    // credentials (else $OPENAI_API_KEY) to both, P's dp rank to P.
    std::vector<std::pair<std::string, std::string>> d_headers = {{"X-Request-Id", request_id}};
    if (const std::string* authorization = req.Header("authorization")) {
      d_headers.emplace_back("Authorization", *authorization);
    } else if (!api_key.empty()) {
      d_headers.emplace_back("Authorization", "Bearer " + api_key);
    }
    std::vector<std::pair<std::string, std::string>> p_headers = d_headers;
    if (route.dp_rank)
      p_headers.emplace_back("X-data-parallel-rank", std::to_string(*route.dp_rank));

    // P's copy, in the background: its answer (one token) is not used; its failure ends the
    // request at once (D's copy would only wait for a prefill that will not come).
    auto pipe = std::make_shared<Pipe>();
    const std::uint64_t p_reg = cancel.Add([pipe] { pipe->p_cancel.CancelAll(); });
    if (p_reg == 0) pipe->p_cancel.CancelAll();  // shutting down
    const bool spawned = Spawn([this, pipe, p_reg, p_url = p.url, p_body, transfer_id, path,
                                p_headers = std::move(p_headers)] {
      CompletionCall call{p_url,           p_body, true, o.prefill_timeout_s,
                          &pipe->p_cancel, &gate,  path, p_headers};
      const CompletionOutcome r = PostCompletion(call);
      cancel.Remove(p_reg);
      if (r.ok) return;
      if (pipe->p_cancel.cancelled()) {  // we cancelled it: D failed (or the proxy stops)
        if (!cancel.cancelled()) prefill_cancelled.fetch_add(1);
        return;
      }
      prefill_failed.fetch_add(1);
      Log(fmt::format("prefill {} failed: {}", transfer_id, r.error));
      std::lock_guard<std::mutex> lock(pipe->mu);
      pipe->p_failed = true;
      pipe->p_status = r.http_status;
      pipe->p_error = r.error;
      pipe->cv.notify_all();
    });
    if (!spawned) {
      ex.Reply(JsonAnswer(503, ErrorBody("proxy is shutting down", "proxy_error")));
      return;
    }

    // D's copy at the same time, read on its own thread into the pipe.
    in_flight.fetch_add(1);
    if (!Spawn([this, pipe, d_url, d_body, stream, path, d_headers = std::move(d_headers)] {
          ReadDecode(*pipe, d_url, path, d_body, stream, d_headers);
          in_flight.fetch_sub(1);
        })) {
      in_flight.fetch_sub(1);
      ex.Reply(JsonAnswer(503, ErrorBody("proxy is shutting down", "proxy_error")));
      return;
    }

    {
      std::unique_lock<std::mutex> lock(pipe->mu);
      const auto deadline =
          SteadyClock::now() + std::chrono::duration_cast<SteadyClock::duration>(
                                   std::chrono::duration<double>(o.decode_timeout_s + 5));
      // In short waits, so a client that left is noticed (and both copies dropped) early.
      while (!(pipe->status != 0 || pipe->finished || pipe->p_failed) &&
             SteadyClock::now() < deadline) {
        pipe->cv.wait_for(lock, std::chrono::milliseconds(500));
        if (ex.client_gone()) {
          lock.unlock();
          pipe->p_cancel.CancelAll();
          pipe->Abandon();
          return;
        }
      }
      if (pipe->status == 0 && pipe->p_failed) {
        // P refused or failed its half: D's copy can only fail later; answer now, drop it.
        twins_aborted.fetch_add(1);
        pipe->Abandon();
        ex.Reply(JsonAnswer(pipe->p_status >= 400 && pipe->p_status < 600 ? pipe->p_status : 502,
                            ErrorBody("prefill " + p.url + " failed: " + pipe->p_error,
                                      "prefill_error")));
        return;
      }
      if (pipe->status == 0) {
        pipe->p_cancel.CancelAll();
        decode_failed.fetch_add(1);
        const std::string why = pipe->error.empty() ? "no answer from decode" : pipe->error;
        ex.Reply(JsonAnswer(502, ErrorBody("decode " + d_url + ": " + why, "proxy_error")));
        pipe->Abandon();
        return;
      }
      if (pipe->status != 200) {
        // D refused or failed its half: P must not go on prefilling (or hold KV) for nobody.
        decode_failed.fetch_add(1);
        twins_aborted.fetch_add(1);
        pipe->p_cancel.CancelAll();
      }
      if (pipe->status != 200 || !stream) {
        // Not a stream: wait for the whole body.
        while (!pipe->finished && SteadyClock::now() < deadline) {
          pipe->cv.wait_for(lock, std::chrono::milliseconds(500));
          if (ex.client_gone()) {
            lock.unlock();
            pipe->Abandon();
            return;
          }
        }
        control::HttpResponse answer;
        answer.status = pipe->status;
        for (auto& c : pipe->chunks) answer.body += c;
        if (pipe->finished && pipe->error.empty() && pipe->status >= 500) {
          lock.unlock();
          if (auto why = LoadFailure(d_url, transfer_id)) {
            answer.body = ErrorBody("decode " + d_url + ": the KV transfer failed: " + *why,
                                    "kv_transfer_error");
            answer.content_type = "application/json";
            pipe->content_type.clear();
          }
          lock.lock();
        }
        if (!pipe->finished || !pipe->error.empty()) {
          if (pipe->status == 200) decode_failed.fetch_add(1);
          answer.status = 502;
          answer.body = ErrorBody(
              "decode " + d_url + ": " + (pipe->error.empty() ? "no complete answer" : pipe->error),
              "proxy_error");
          pipe->Abandon();
        } else if (!pipe->content_type.empty()) {
          answer.content_type = pipe->content_type;
        }
        ex.Reply(std::move(answer));
        return;
      }
    }
    Stream(*pipe, p.url, d_url, transfer_id, ex);
    pipe->Abandon();  // D's copy is done or no longer wanted
  }

  // Why D's KV load of `transfer_id` failed, from D's load-failure service when it runs one;
  // nullopt when it has none, does not know the transfer, or does not answer within 1 s.
  std::optional<std::string> LoadFailure(const std::string& d_url, const std::string& transfer_id) {
    auto port = o.load_failure_ports.find(d_url);
    const auto hp = ParseUrl(d_url);
    if (port == o.load_failure_ports.end() || !hp) return std::nullopt;
    httplib::Client cli(hp->host, port->second);
    cli.set_connection_timeout(std::chrono::seconds(1));
    cli.set_read_timeout(std::chrono::seconds(1));
    auto res = cli.Get("/load_failure?transfer_id=" + httplib::detail::encode_query_param(transfer_id));
    if (!res || res->status != 200 || res->body.size() > 64 * 1024) return std::nullopt;
    json answer = json::parse(res->body, nullptr, /*allow_exceptions=*/false);
    if (!answer.is_object() || !answer.contains("reason") || !answer["reason"].is_string()) {
      return std::nullopt;
    }
    return answer["reason"].get<std::string>();
  }

  // Relays D's stream to the client chunk by chunk, until D ends it, P's half fails, the client
  // leaves or the proxy stops.
  void Stream(Pipe& pipe, const std::string& p_url, const std::string& d_url,
              const std::string& transfer_id, control::HttpExchange& ex) {
    control::HttpResponse head;
    head.content_type = "text/event-stream";
    head.headers.emplace_back("Cache-Control", "no-cache");
    ex.BeginStream(std::move(head));
    // With D's load-failure service known, D's stream is relayed event by event (an event may
    // arrive in pieces), so an error event can be told and given the failed load's reason.
    const bool by_event = o.load_failure_ports.count(d_url) != 0;
    std::string partial;
    auto relay = [&](std::string c) {
      if (!by_event) return ex.Write(c);
      partial += c;
      for (std::size_t end; (end = partial.find("\n\n")) != std::string::npos;) {
        std::string event = partial.substr(0, end + 2);
        partial.erase(0, end + 2);
        // vLLM ends a stream whose KV load failed with "Internal server error".
        if (event.rfind("data: {\"error\"", 0) == 0) {
          if (auto why = LoadFailure(d_url, transfer_id)) {
            event = "data: " +
                    ErrorBody("decode " + d_url + ": the KV transfer failed: " + *why,
                              "kv_transfer_error") +
                    "\n\n";
          }
        }
        if (!ex.Write(event)) return false;
      }
      return true;
    };
    std::unique_lock<std::mutex> lock(pipe.mu);
    for (;;) {
      pipe.cv.wait_for(lock, std::chrono::milliseconds(500), [&] {
        return !pipe.chunks.empty() || pipe.finished || pipe.p_failed;
      });
      if (pipe.p_failed && !pipe.finished) {
        // D answered 200 at once (it streams) but P refused or failed its half: D's stream
        // can only end in an error later. End it now with P's reason and drop D's copy.
        twins_aborted.fetch_add(1);
        pipe.finished = true;
        const std::string reason = pipe.p_error;
        lock.unlock();
        (void)ex.Write("data: " +
                       ErrorBody("prefill " + p_url + " failed: " + reason, "prefill_error") +
                       "\n\ndata: [DONE]\n\n");
        return;
      }
      while (!pipe.chunks.empty()) {
        std::string c = std::move(pipe.chunks.front());
        pipe.chunks.pop_front();
        lock.unlock();
        if (!relay(std::move(c))) return;  // the client left
        lock.lock();
      }
      if (pipe.finished) {
        if (!partial.empty()) {  // an unterminated last event: passed on as it came
          lock.unlock();
          if (!ex.Write(std::exchange(partial, {}))) return;
          lock.lock();
        }
        if (!pipe.error.empty()) {
          decode_failed.fetch_add(1);
          const std::string error = pipe.error;
          lock.unlock();
          (void)ex.Write("data: " + ErrorBody("decode stream broke: " + error, "proxy_error") +
                         "\n\n");
        }
        return;
      }
      if (cancel.cancelled() || ex.client_gone()) return;
    }
  }

  void ReadDecode(Pipe& pipe, const std::string& d_url, const char* path, const std::string& d_body,
                  bool stream, const std::vector<std::pair<std::string, std::string>>& headers) {
    auto finish = [&](const std::string& error) {
      std::lock_guard<std::mutex> lock(pipe.mu);
      pipe.finished = true;
      if (pipe.error.empty()) pipe.error = error;
      pipe.cv.notify_all();
    };
    const auto hp = ParseUrl(d_url);
    if (!hp) return finish("bad decode url");
    httplib::Client cli(hp->host, hp->port);
    cli.set_connection_timeout(std::chrono::seconds(10));
    cli.set_write_timeout(std::chrono::seconds(10));
    {
      // One connect at a time per D (see ConnectGate); the POST reuses this connection.
      cli.set_keep_alive(true);
      cli.set_read_timeout(std::chrono::seconds(5));
      std::lock_guard<std::mutex> lock(gate.For(hp->host + ":" + std::to_string(hp->port)));
      if (!pipe.abandoned.load() && !cancel.cancelled()) cli.Get("/health");
    }
    cli.set_read_timeout(std::chrono::duration_cast<std::chrono::microseconds>(
        std::chrono::duration<double>(o.decode_timeout_s)));
    httplib::Request req;
    req.method = "POST";
    req.path = path;
    req.body = d_body;
    req.set_header("Content-Type", "application/json");
    if (stream) req.set_header("Accept", "text/event-stream");
    for (const auto& [name, value] : headers) req.set_header(name, value);
    req.response_handler = [&](const httplib::Response& r) {
      std::lock_guard<std::mutex> lock(pipe.mu);
      pipe.status = r.status;
      pipe.content_type = r.get_header_value("Content-Type");
      pipe.cv.notify_all();
      return !pipe.abandoned.load();
    };
    req.content_receiver = [&](const char* data, std::size_t len, std::uint64_t, std::uint64_t) {
      if (pipe.abandoned.load()) return false;
      std::lock_guard<std::mutex> lock(pipe.mu);
      pipe.chunks.emplace_back(data, len);
      pipe.cv.notify_all();
      return true;
    };
    const std::uint64_t reg = cancel.Add([&cli] { cli.stop(); });
    if (reg == 0) return finish("proxy is shutting down");
    const std::uint64_t dropped = pipe.d_cancel.Add([&cli] { cli.stop(); });
    if (dropped == 0) {
      cancel.Remove(reg);
      return finish("client went away");
    }
    httplib::Response res;
    httplib::Error err = httplib::Error::Success;
    const bool ok = cli.send(req, res, err);
    pipe.d_cancel.Remove(dropped);
    cancel.Remove(reg);
    if (!ok) {
      if (pipe.abandoned.load()) return finish("client went away");
      return finish(cancel.cancelled() ? "proxy is shutting down"
                                       : "http error: " + httplib::to_string(err));
    }
    finish("");
  }
};

Proxy::Proxy(ProxyOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}

Proxy::~Proxy() { Stop(); }

bool Proxy::Start(std::string* error) {
  Impl& m = *impl_;
  auto fail = [error](std::string why) {
    if (error) *error = std::move(why);
    return false;
  };
  for (const PrefillTarget& p : m.o.prefills) {
    if (!ParseUrl(p.url)) return fail("prefill url '" + p.url + "' is not http://host:port");
    if (p.engine_id.empty()) {
      if (p.bootstrap.empty()) {
        return fail("prefill " + p.url +
                    " has neither an engine id nor a bootstrap to learn it from");
      }
      if (auto address = control::ParseBootstrapAddress(p.bootstrap); !address) {
        return fail("prefill " + p.url + ": " + address.error().message());
      }
    }
  }
  for (const std::string& d : m.o.decodes) {
    if (!ParseUrl(d)) return fail("decode url '" + d + "' is not http://host:port");
  }
  if (!m.o.cluster_secret_file.empty()) {
    auto loaded = control::LoadClusterSecret(m.o.cluster_secret_file);
    if (!loaded) return fail(loaded.error().message());
    m.secret = std::make_shared<const control::ClusterSecret>(std::move(*loaded));
  }
  if (const char* key = std::getenv("OPENAI_API_KEY")) m.api_key = key;
  // A P whose engine id is given is ready at once; the others are learned once serving.
  std::vector<std::size_t> to_learn;
  {
    std::lock_guard<std::mutex> lock(m.ready_mu);
    m.prefill_state.assign(m.o.prefills.size(), PrefillState{});
    auto all = std::make_shared<std::vector<Route>>();
    for (std::size_t i = 0; i < m.o.prefills.size(); ++i) {
      if (m.o.prefills[i].engine_id.empty()) {
        to_learn.push_back(i);
        continue;
      }
      m.prefill_state[i].ready = true;
      m.prefill_state[i].routes = {Route{i, m.o.prefills[i].engine_id, std::nullopt}};
      all->push_back(m.prefill_state[i].routes.front());
    }
    if (to_learn.empty() && !all->empty()) m.routes = std::move(all);
  }

  control::HttpServerOptions http;
  http.name = "proxy";
  http.handler_threads = m.o.threads > 0 ? static_cast<std::size_t>(m.o.threads) : 512;
  http.max_body_bytes = m.o.max_body_bytes;
  http.error_format = [](int status, const std::string& reason) {
    return JsonAnswer(status, ErrorBody(reason, status < 500 ? "invalid_request" : "proxy_error"));
  };
  http.log = [&m](std::string_view line) { m.Log(std::string(line)); };
  m.svr = std::make_unique<control::HttpServer>(std::move(http));
  for (const char* path : {kCompletionsPath, kChatCompletionsPath}) {
    m.svr->Route("POST", path,
                 control::BlockingHandler(
                     [&m, path](const control::HttpRequest& req, control::HttpExchange& ex) {
                       m.Handle(req, ex, path);
                     }));
  }
  m.svr->Route("GET", "/health", control::InlineHandler([&m](const control::HttpRequest&) {
                 const ProxyReadiness r = m.Readiness();
                 if (r.ready) return JsonAnswer(200, "{\"status\":\"ok\"}");
                 const json body = {
                     {"status", "not ready"}, {"reason", r.reason}, {"prefills", m.HealthJson()}};
                 return JsonAnswer(503, body.dump(-1, ' ', false, json::error_handler_t::replace));
               }));
  m.svr->Route("GET", "/metrics", control::InlineHandler([&m](const control::HttpRequest&) {
    std::string t;
    t += "# TYPE kvferry_proxy_requests_total counter\nkvferry_proxy_requests_total " +
         std::to_string(m.requests.load()) + "\n";
    t += "# TYPE kvferry_proxy_prefill_failed_total counter\nkvferry_proxy_prefill_failed_total " +
         std::to_string(m.prefill_failed.load()) + "\n";
    t += "# TYPE kvferry_proxy_decode_failed_total counter\nkvferry_proxy_decode_failed_total " +
         std::to_string(m.decode_failed.load()) + "\n";
    t += "# TYPE kvferry_proxy_twins_aborted_total counter\nkvferry_proxy_twins_aborted_total " +
         std::to_string(m.twins_aborted.load()) + "\n";
    t += "# TYPE kvferry_proxy_in_flight gauge\nkvferry_proxy_in_flight " +
         std::to_string(m.in_flight.load()) + "\n";
    t += "# TYPE kvferry_proxy_not_ready_total counter\nkvferry_proxy_not_ready_total " +
         std::to_string(m.not_ready.load()) + "\n";
    t += std::string("# TYPE kvferry_proxy_ready gauge\nkvferry_proxy_ready ") +
         (m.CurrentRoutes() ? "1" : "0") + "\n";
    t += control::RenderHttpMetrics({{"proxy", m.svr->stats()}});
    control::HttpResponse r;
    r.content_type = "text/plain; version=0.0.4";
    r.body = std::move(t);
    return r;
  }));
  auto bound = m.svr->Start(m.o.host, m.o.port);
  if (!bound) {
    m.svr.reset();
    return fail(bound.error().message());
  }
  m.bound_port = *bound;
  for (std::size_t i : to_learn) m.learners.emplace_back([&m, i] { m.Learn(i); });
  return true;
}

int Proxy::port() const { return impl_->bound_port; }

void Proxy::Stop() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.threads_mu);
    if (m.stopped) return;
    m.stopped = true;
  }
  {
    std::lock_guard<std::mutex> lock(m.ready_mu);
    m.learners_stop = true;
  }
  m.ready_cv.notify_all();
  m.cancel.CancelAll();  // every upstream call returns, so every handler does
  if (m.svr) m.svr->Stop();
  for (std::thread& t : m.learners) t.join();
  m.learners.clear();
  std::list<Impl::Task> tasks;
  {
    std::lock_guard<std::mutex> lock(m.threads_mu);
    tasks.swap(m.tasks);
  }
  for (auto& t : tasks) t.t.join();
}

ProxyStats Proxy::stats() const {
  return ProxyStats{impl_->requests.load(),      impl_->prefill_failed.load(),
                    impl_->decode_failed.load(), impl_->in_flight.load(),
                    impl_->twins_aborted.load(), impl_->prefill_cancelled.load(),
                    impl_->not_ready.load()};
}

ProxyReadiness Proxy::readiness() const { return impl_->Readiness(); }

}  // namespace kvferry::harness
