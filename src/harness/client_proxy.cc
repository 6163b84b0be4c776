#include "client_proxy.h"

#include <fmt/format.h>
#include <httplib.h>

#include <condition_variable>
#include <cstdio>
#include <deque>
#include <list>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "client_http.h"
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
                            const PrefillTarget& p) {
  json j = json::parse(client_body);
  j["kv_transfer_params"] = {{"do_remote_decode", false},
                             {"do_remote_prefill", true},
                             {"remote_engine_id", p.engine_id},
                             {"remote_bootstrap_addr", BootstrapUrl(p.bootstrap)},
                             {"transfer_id", transfer_id}};
  return j.dump();
}

struct Proxy::Impl {
  ProxyOptions o;
  std::unique_ptr<control::HttpServer> svr;
  int bound_port = 0;
  CancelGroup cancel;
  ConnectGate gate;
  std::atomic<std::uint64_t> next{0};
  std::atomic<std::uint64_t> requests{0}, prefill_failed{0}, decode_failed{0}, in_flight{0},
      twins_aborted{0}, prefill_cancelled{0};

  std::mutex threads_mu;
  struct Task {
    std::thread t;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::list<Task> tasks;
  bool stopped = false;

  explicit Impl(ProxyOptions options) : o(std::move(options)) {}

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

  void Handle(const control::HttpRequest& req, control::HttpExchange& ex) {
    requests.fetch_add(1);
    if (o.prefills.empty() || o.decodes.empty()) {
      ex.Reply(JsonAnswer(503, ErrorBody("proxy has no prefill or decode instance", "proxy_error")));
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
    const auto max_tokens = client.find("max_tokens");
    if (max_tokens != client.end() && !max_tokens->is_null() &&
        !(max_tokens->is_number_unsigned() && max_tokens->get<std::uint64_t>() > 0)) {
      refuse("field 'max_tokens' must be a positive integer");
      return;
    }
    const auto prompt = client.find("prompt");
    if (prompt == client.end() || !(prompt->is_string() || prompt->is_array())) {
      refuse("field 'prompt' must be a string or an array of token ids");
      return;
    }
    const bool stream =
        stream_field != client.end() && stream_field->is_boolean() && stream_field->get<bool>();
    const std::uint64_t n = next.fetch_add(1);
    const PrefillTarget& p = o.prefills[n % o.prefills.size()];
    const std::string d_url = o.decodes[n % o.decodes.size()];
    const std::string transfer_id = "xfer-" + RandomUuid();
    std::string p_body, d_body;
    try {
      p_body = BuildPrefillBody(req.body, transfer_id);
      d_body = BuildDecodeBody(req.body, transfer_id, p);
    } catch (const std::exception& e) {
      refuse(e.what());
      return;
    }

    // P's copy, in the background: its answer (one token) is not used; its failure ends the
    // request at once (D's copy would only wait for a prefill that will not come).
    auto pipe = std::make_shared<Pipe>();
    const std::uint64_t p_reg = cancel.Add([pipe] { pipe->p_cancel.CancelAll(); });
    if (p_reg == 0) pipe->p_cancel.CancelAll();  // shutting down
    const bool spawned = Spawn([this, pipe, p_reg, p_url = p.url, p_body, transfer_id] {
      CompletionCall call{p_url, p_body, true, o.prefill_timeout_s, &pipe->p_cancel, &gate};
      const CompletionOutcome r = PostCompletion(call);
      cancel.Remove(p_reg);
      if (r.ok) return;
      if (pipe->p_cancel.cancelled()) {  // we cancelled it: D failed (or the proxy stops)
        if (!cancel.cancelled()) prefill_cancelled.fetch_add(1);
        return;
      }
      prefill_failed.fetch_add(1);
      std::fprintf(stderr, "[proxy] prefill %s failed: %s\n", transfer_id.c_str(), r.error.c_str());
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
    if (!Spawn([this, pipe, d_url, d_body, stream] {
          ReadDecode(*pipe, d_url, d_body, stream);
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
    Stream(*pipe, p.url, ex);
    pipe->Abandon();  // D's copy is done or no longer wanted
  }

  // Relays D's stream to the client chunk by chunk, until D ends it, P's half fails, the client
  // leaves or the proxy stops.
  void Stream(Pipe& pipe, const std::string& p_url, control::HttpExchange& ex) {
    control::HttpResponse head;
    head.content_type = "text/event-stream";
    head.headers.emplace_back("Cache-Control", "no-cache");
    ex.BeginStream(std::move(head));
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
        if (!ex.Write(c)) return;  // the client left
        lock.lock();
      }
      if (pipe.finished) {
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

  void ReadDecode(Pipe& pipe, const std::string& d_url, const std::string& d_body, bool stream) {
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
    req.path = "/v1/completions";
    req.body = d_body;
    req.set_header("Content-Type", "application/json");
    if (stream) req.set_header("Accept", "text/event-stream");
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
  control::HttpServerOptions http;
  http.name = "proxy";
  http.handler_threads = m.o.threads > 0 ? static_cast<std::size_t>(m.o.threads) : 512;
  http.max_body_bytes = m.o.max_body_bytes;
  http.error_format = [](int status, const std::string& reason) {
    return JsonAnswer(status, ErrorBody(reason, status < 500 ? "invalid_request" : "proxy_error"));
  };
  http.log = [](std::string_view line) {
    std::fprintf(stderr, "[proxy] %.*s\n", static_cast<int>(line.size()), line.data());
  };
  m.svr = std::make_unique<control::HttpServer>(std::move(http));
  m.svr->Route("POST", "/v1/completions",
               control::BlockingHandler(
                   [&m](const control::HttpRequest& req, control::HttpExchange& ex) {
                     m.Handle(req, ex);
                   }));
  m.svr->Route("GET", "/health", control::InlineHandler([](const control::HttpRequest&) {
                 return JsonAnswer(200, "{\"status\":\"ok\"}");
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
    t += control::RenderHttpMetrics({{"proxy", m.svr->stats()}});
    control::HttpResponse r;
    r.content_type = "text/plain; version=0.0.4";
    r.body = std::move(t);
    return r;
  }));
  auto bound = m.svr->Start(m.o.host, m.o.port);
  if (!bound) {
    if (error) *error = bound.error().message();
    m.svr.reset();
    return false;
  }
  m.bound_port = *bound;
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
  m.cancel.CancelAll();  // every upstream call returns, so every handler does
  if (m.svr) m.svr->Stop();
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
                    impl_->twins_aborted.load(), impl_->prefill_cancelled.load()};
}

}  // namespace kvferry::harness
