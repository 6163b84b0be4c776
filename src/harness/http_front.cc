#include "harness/http_front.h"

#include <fmt/format.h>
#include <httplib.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <ctime>
#include <limits>
#include <nlohmann/json.hpp>
#include <thread>

#include "client_http.h"
#include "control/http_limits.h"
#include "control/json_limits.h"

namespace kvferry::harness {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr std::size_t kMaxIdBytes = 256;
constexpr auto kKeepalive = std::chrono::seconds(1);

Status Bad(std::string message) { return Status(ErrorCode::kInvalidArgument, std::move(message)); }

Result<std::string> IdField(const json& params, const char* key, bool required) {
  auto it = params.find(key);
  if (it == params.end() || it->is_null()) {
    if (required) return tl::unexpected(Bad(fmt::format("kv_transfer_params.{} is required", key)));
    return std::string();
  }
  if (!it->is_string() || it->get_ref<const std::string&>().empty() ||
      it->get_ref<const std::string&>().size() > kMaxIdBytes) {
    return tl::unexpected(Bad(
        fmt::format("kv_transfer_params.{} must be a string of 1..{} bytes", key, kMaxIdBytes)));
  }
  return it->get<std::string>();
}

Result<bool> BoolField(const json& object, const char* key, std::string_view where) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return false;
  if (!it->is_boolean())
    return tl::unexpected(Bad(fmt::format("{}{} must be a boolean", where, key)));
  return it->get<bool>();
}

int HttpStatusOf(const Status& s) {
  switch (s.code()) {
    case ErrorCode::kInvalidArgument:
    case ErrorCode::kOutOfRange:
      return 400;
    case ErrorCode::kAlreadyExists:
    case ErrorCode::kTombstoned:
      return 409;
    case ErrorCode::kResourceExhausted:
    case ErrorCode::kUnavailable:
    case ErrorCode::kCancelled:
    case ErrorCode::kRejected:
    case ErrorCode::kLeaseMismatch:
      return 503;
    case ErrorCode::kTimeout:
      return 504;
    default:
      return 500;
  }
}

json ErrorObject(int status, const std::string& message) {
  const char* type = status < 500    ? "BadRequestError"
                     : status == 503 ? "ServiceUnavailableError"
                                     : "InternalServerError";
  return {{"object", "error"},
          {"message", message},
          {"type", type},
          {"param", nullptr},
          {"code", status}};
}

void ReplyError(httplib::Response& res, int status, const std::string& message) {
  res.status = status;
  res.set_content(ErrorObject(status, message).dump(-1, ' ', false, json::error_handler_t::replace),
                  "application/json");
}

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string TokenText(std::uint32_t token) { return fmt::format(" t{}", token); }

}  // namespace

Result<CompletionRequest> ParseCompletionRequest(std::string_view body, Role role,
                                                 std::uint32_t max_model_len) {
  if (control::JsonDepth(body) > control::kMaxJsonDepth) {
    return tl::unexpected(
        Bad(fmt::format("JSON nested deeper than {} levels", control::kMaxJsonDepth)));
  }
  json doc = json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return tl::unexpected(Bad("body is not valid JSON"));
  if (!doc.is_object()) return tl::unexpected(Bad("body must be a JSON object"));
  CompletionRequest out;
  if (auto it = doc.find("model"); it != doc.end() && !it->is_null()) {
    if (!it->is_string() || it->get_ref<const std::string&>().size() > kMaxIdBytes) {
      return tl::unexpected(Bad("model must be a short string"));
    }
    out.model = it->get<std::string>();
  }
  // prompt: token ids, or a string whose bytes are the tokens.
  auto prompt = doc.find("prompt");
  if (prompt == doc.end()) return tl::unexpected(Bad("prompt is required"));
  std::uint64_t prompt_tokens = 0;
  if (prompt->is_string()) {
    prompt_tokens = prompt->get_ref<const std::string&>().size();
  } else if (prompt->is_array()) {
    for (const json& token : *prompt) {
      if (!token.is_number_integer() || token.get<std::int64_t>() < 0 ||
          token.get<std::int64_t>() > std::numeric_limits<std::int32_t>::max()) {
        return tl::unexpected(
            Bad("prompt must be a string or a list of non-negative token ids (one prompt only)"));
      }
    }
    prompt_tokens = prompt->size();
  } else {
    return tl::unexpected(Bad("prompt must be a string or a list of token ids"));
  }
  if (prompt_tokens == 0) return tl::unexpected(Bad("prompt is empty"));
  std::int64_t max_tokens = 16;
  if (auto it = doc.find("max_tokens"); it != doc.end() && !it->is_null()) {
    if (!it->is_number_integer() || it->get<std::int64_t>() < 1) {
      return tl::unexpected(Bad("max_tokens must be a positive integer"));
    }
    max_tokens = it->get<std::int64_t>();
  }
  if (prompt_tokens + static_cast<std::uint64_t>(std::min<std::int64_t>(max_tokens, 1ll << 40)) >
      max_model_len) {
    return tl::unexpected(
        Bad(fmt::format("prompt ({} tokens) + max_tokens ({}) exceeds "
                        "max_model_len {}",
                        prompt_tokens, max_tokens, max_model_len)));
  }
  auto stream = BoolField(doc, "stream", "");
  if (!stream) return tl::unexpected(stream.error());
  out.stream = *stream;
  auto ignore_eos = BoolField(doc, "ignore_eos", "");  // the synthetic model has no EOS anyway
  if (!ignore_eos) return tl::unexpected(ignore_eos.error());
  out.spec.prompt_tokens = static_cast<std::uint32_t>(prompt_tokens);
  out.spec.max_tokens = static_cast<std::uint32_t>(max_tokens);

  auto params = doc.find("kv_transfer_params");
  if (params != doc.end() && !params->is_null()) {
    if (!params->is_object()) return tl::unexpected(Bad("kv_transfer_params must be an object"));
    auto remote_decode = BoolField(*params, "do_remote_decode", "kv_transfer_params.");
    if (!remote_decode) return tl::unexpected(remote_decode.error());
    auto remote_prefill = BoolField(*params, "do_remote_prefill", "kv_transfer_params.");
    if (!remote_prefill) return tl::unexpected(remote_prefill.error());
    if (*remote_decode && *remote_prefill) {
      return tl::unexpected(Bad("do_remote_decode and do_remote_prefill are exclusive"));
    }
    if (*remote_decode) {
      if (role != Role::kPrefill) {
        return tl::unexpected(Bad("do_remote_decode sent to a decode instance"));
      }
      out.spec.kind = RequestKind::kRemoteDecode;
      auto id = IdField(*params, "transfer_id", true);
      if (!id) return tl::unexpected(id.error());
      out.spec.transfer_id = *id;
    } else if (*remote_prefill) {
      if (role != Role::kDecode) {
        return tl::unexpected(Bad("do_remote_prefill sent to a prefill instance"));
      }
      out.spec.kind = RequestKind::kRemotePrefill;
      auto id = IdField(*params, "transfer_id", true);
      if (!id) return tl::unexpected(id.error());
      auto engine = IdField(*params, "remote_engine_id", true);
      if (!engine) return tl::unexpected(engine.error());
      auto bootstrap = IdField(*params, "remote_bootstrap_addr", true);
      if (!bootstrap) return tl::unexpected(bootstrap.error());
      out.spec.transfer_id = *id;
      out.spec.remote_engine_id = *engine;
      out.spec.remote_bootstrap_addr = *bootstrap;
    }
  }
  return out;
}

struct HttpFront::Impl {
  HttpFrontOptions options;
  ServingEngine* engine = nullptr;
  httplib::Server server;
  std::thread thread;
  int port = 0;
  std::atomic<bool> stopping{false};
  std::atomic<std::uint64_t> next_id{1};

  void Completions(const httplib::Request& req, httplib::Response& res);
  void Stream(std::shared_ptr<RequestStream> stream, const CompletionRequest& request,
              std::string id, httplib::Response& res);
};

HttpFront::HttpFront() : impl_(std::make_unique<Impl>()) {}
HttpFront::~HttpFront() { Stop(); }
int HttpFront::port() const { return impl_->port; }

Result<std::unique_ptr<HttpFront>> HttpFront::Start(HttpFrontOptions options,
                                                    ServingEngine* engine) {
  std::unique_ptr<HttpFront> front(new HttpFront());
  Impl& impl = *front->impl_;
  impl.options = std::move(options);
  impl.engine = engine;
  const json health_extra = json::parse(impl.options.health_json, nullptr, false);
  if (!health_extra.is_object()) {
    return Err(ErrorCode::kInvalidArgument, "health_json must be a JSON object");
  }
  const std::size_t threads = std::max<std::size_t>(4, impl.options.threads);
  impl.server.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  control::BoundRequestBodies(impl.server, impl.options.max_body_bytes);
  impl.server.set_read_timeout(std::chrono::seconds(30));
  impl.server.set_write_timeout(std::chrono::seconds(30));
  impl.server.Post("/v1/completions", [&impl](const httplib::Request& req, httplib::Response& res) {
    impl.Completions(req, res);
  });
  impl.server.Get("/metrics", [&impl](const httplib::Request&, httplib::Response& res) {
    res.set_content(impl.engine->RenderMetrics(), "text/plain; version=0.0.4");
  });
  impl.server.Get("/health",
                  [&impl, health_extra](const httplib::Request&, httplib::Response& res) {
                    json body = health_extra;
                    body["status"] = impl.stopping ? "stopping" : "ok";
                    res.status = impl.stopping ? 503 : 200;
                    res.set_content(Dump(body), "application/json");
                  });
  impl.server.set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
        ReplyError(res, 500, "internal error");
      });
  impl.port =
      impl.options.port == 0
          ? impl.server.bind_to_any_port(impl.options.host)
          : (impl.server.bind_to_port(impl.options.host, impl.options.port) ? impl.options.port
                                                                            : -1);
  if (impl.port <= 0) {
    return Err(ErrorCode::kUnavailable,
               fmt::format("cannot bind {}:{}", impl.options.host, impl.options.port));
  }
  impl.thread = std::thread([&impl] { impl.server.listen_after_bind(); });
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (!impl.server.is_running()) {
    if (Clock::now() > deadline) {
      front->Stop();
      return Err(ErrorCode::kTimeout, "HTTP server did not start");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  // Debian's httplib listens with a backlog of 5: a burst of clients connecting at once (the
  // seed's load sends 128 requests together) would overflow the accept queue and stall.
  if (!RaiseListenBacklog(impl.port)) {
    spdlog::warn("HTTP {}:{}: could not raise the listen backlog", impl.options.host, impl.port);
  }
  return front;
}

void HttpFront::Stop() {
  if (!impl_) return;
  impl_->stopping = true;
  impl_->server.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

void HttpFront::Impl::Completions(const httplib::Request& req, httplib::Response& res) {
  if (stopping) {
    ReplyError(res, 503, "the server is shutting down");
    return;
  }
  auto parsed = ParseCompletionRequest(req.body, engine->options().role, options.max_model_len);
  if (!parsed) {
    ReplyError(res, 400, parsed.error().message());
    return;
  }
  auto submitted = engine->Submit(parsed->spec);
  if (!submitted) {
    ReplyError(res, HttpStatusOf(submitted.error()), submitted.error().ToString());
    return;
  }
  std::shared_ptr<RequestStream> stream = *submitted;
  std::string id = fmt::format("cmpl-{}-{}", engine->options().engine_id, next_id.fetch_add(1));
  if (parsed->stream) {
    Stream(stream, *parsed, std::move(id), res);
    return;
  }
  // Non-streaming: collect until the terminal event.
  const auto deadline = Clock::now() + options.request_timeout;
  std::string text;
  std::vector<std::uint32_t> tokens;
  std::string finish_reason;
  while (true) {
    if (stopping || Clock::now() >= deadline) {
      engine->Abort(stream->handle());
      ReplyError(res, stopping ? 503 : 504,
                 stopping ? "the server is shutting down" : "request timed out");
      return;
    }
    bool terminal = false;
    for (StreamEvent& e : stream->Wait(std::min(deadline, Clock::now() + kKeepalive))) {
      if (e.kind == StreamEvent::Kind::kToken) {
        tokens.push_back(e.token);
        text += TokenText(e.token);
        if (!e.finish_reason.empty()) finish_reason = e.finish_reason;
      } else if (e.kind == StreamEvent::Kind::kError) {
        ReplyError(res, e.http_status >= 400 ? e.http_status : 500, e.message);
        return;
      } else {
        terminal = true;
      }
    }
    if (terminal) break;
  }
  json body = {
      {"id", id},
      {"object", "text_completion"},
      {"created", static_cast<std::int64_t>(std::time(nullptr))},
      {"model", parsed->model.empty() ? options.served_model : parsed->model},
      {"choices", json::array({{{"index", 0},
                                {"text", text},
                                {"logprobs", nullptr},
                                {"finish_reason", finish_reason.empty() ? "length" : finish_reason},
                                {"stop_reason", nullptr},
                                {"token_ids", tokens}}})},
      {"usage",
       {{"prompt_tokens", parsed->spec.prompt_tokens},
        {"completion_tokens", tokens.size()},
        {"total_tokens", parsed->spec.prompt_tokens + tokens.size()}}},
      {"kv_transfer_params", nullptr},
  };
  res.set_content(Dump(body), "application/json");
}

void HttpFront::Impl::Stream(std::shared_ptr<RequestStream> stream,
                             const CompletionRequest& request, std::string id,
                             httplib::Response& res) {
  struct State {
    std::shared_ptr<RequestStream> stream;
    std::string id;
    std::string model;
    std::int64_t created;
    std::uint32_t prompt_tokens;
    std::uint32_t completion_tokens = 0;
    Clock::time_point deadline;
    bool done = false;  // the terminal event was written
  };
  auto state = std::make_shared<State>();
  state->stream = std::move(stream);
  state->id = std::move(id);
  state->model = request.model.empty() ? options.served_model : request.model;
  state->created = static_cast<std::int64_t>(std::time(nullptr));
  state->prompt_tokens = request.spec.prompt_tokens;
  state->deadline = Clock::now() + options.request_timeout;
  ServingEngine* eng = engine;
  std::atomic<bool>* front_stopping = &stopping;
  res.set_chunked_content_provider(
      "text/event-stream",
      [state, eng, front_stopping](std::size_t, httplib::DataSink& sink) {
        if (state->done) return false;
        auto finish_with_error = [&](int status, const std::string& message) {
          const std::string out =
              "data: " + Dump({{"error", ErrorObject(status, message)}}) + "\n\ndata: [DONE]\n\n";
          state->done = true;
          eng->Abort(state->stream->handle());
          if (!sink.write(out.data(), out.size())) return false;
          sink.done();
          return true;
        };
        if (*front_stopping) return finish_with_error(503, "the server is shutting down");
        const auto now = Clock::now();
        if (now >= state->deadline) return finish_with_error(504, "request timed out");
        std::vector<StreamEvent> events =
            state->stream->Wait(std::min(state->deadline, now + kKeepalive));
        if (events.empty()) {
          // An SSE comment: clients ignore it; a closed connection fails the write.
          static constexpr char kPing[] = ": keepalive\n\n";
          return sink.write(kPing, sizeof(kPing) - 1);
        }
        std::string out;
        for (StreamEvent& e : events) {
          if (e.kind == StreamEvent::Kind::kToken) {
            ++state->completion_tokens;
            json chunk = {
                {"id", state->id},
                {"object", "text_completion"},
                {"created", state->created},
                {"model", state->model},
                {"choices",
                 json::array({{{"index", 0},
                               {"text", TokenText(e.token)},
                               {"logprobs", nullptr},
                               {"finish_reason",
                                e.finish_reason.empty() ? json(nullptr) : json(e.finish_reason)},
                               {"stop_reason", nullptr},
                               {"token_ids", json::array({e.token})}}})},
            };
            out += "data: " + Dump(chunk) + "\n\n";
          } else if (e.kind == StreamEvent::Kind::kError) {
            out += "data: " +
                   Dump({{"error",
                          ErrorObject(e.http_status >= 400 ? e.http_status : 500, e.message)}}) +
                   "\n\ndata: [DONE]\n\n";
            state->done = true;
          } else {
            json usage = {
                {"id", state->id},
                {"object", "text_completion"},
                {"created", state->created},
                {"model", state->model},
                {"choices", json::array()},
                {"usage",
                 {{"prompt_tokens", state->prompt_tokens},
                  {"completion_tokens", state->completion_tokens},
                  {"total_tokens", state->prompt_tokens + state->completion_tokens}}},
            };
            out += "data: " + Dump(usage) + "\n\ndata: [DONE]\n\n";
            state->done = true;
          }
          if (state->done) break;
        }
        if (!sink.write(out.data(), out.size())) return false;
        if (state->done) sink.done();
        return true;
      },
      [state, eng](bool /*success*/) {
        // The connection ended; if the request was still open the client went away.
        if (!state->done) eng->Abort(state->stream->handle());
      });
}

}  // namespace kvferry::harness
