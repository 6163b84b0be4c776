#include "harness/http_front.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <ctime>
#include <limits>
#include <nlohmann/json.hpp>

#include "client_http.h"
#include "control/http_server.h"
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

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

control::HttpResponse ErrorResponse(int status, const std::string& message) {
  control::HttpResponse r;
  r.status = status;
  r.body = Dump(ErrorObject(status, message));
  return r;
}

std::string TokenText(std::uint32_t token) { return fmt::format(" t{}", token); }

}  // namespace

namespace {

// kv_transfer_params into `spec` (kind, transfer id, remote engine and bootstrap).
Status ParseTransferParams(const json& doc, Role role, CompletionSpec* spec) {
  auto params = doc.find("kv_transfer_params");
  if (params == doc.end() || params->is_null()) return Status::Ok();
  if (!params->is_object()) return Bad("kv_transfer_params must be an object");
  auto remote_decode = BoolField(*params, "do_remote_decode", "kv_transfer_params.");
  if (!remote_decode) return remote_decode.error();
  auto remote_prefill = BoolField(*params, "do_remote_prefill", "kv_transfer_params.");
  if (!remote_prefill) return remote_prefill.error();
  if (*remote_decode && *remote_prefill) {
    return Bad("do_remote_decode and do_remote_prefill are exclusive");
  }
  if (*remote_decode) {
    if (role != Role::kPrefill) return Bad("do_remote_decode sent to a decode instance");
    auto id = IdField(*params, "transfer_id", true);
    if (!id) return id.error();
    spec->kind = RequestKind::kRemoteDecode;
    spec->transfer_id = *id;
  } else if (*remote_prefill) {
    if (role != Role::kDecode) return Bad("do_remote_prefill sent to a prefill instance");
    auto id = IdField(*params, "transfer_id", true);
    if (!id) return id.error();
    auto engine = IdField(*params, "remote_engine_id", true);
    if (!engine) return engine.error();
    auto bootstrap = IdField(*params, "remote_bootstrap_addr", true);
    if (!bootstrap) return bootstrap.error();
    spec->kind = RequestKind::kRemotePrefill;
    spec->transfer_id = *id;
    spec->remote_engine_id = *engine;
    spec->remote_bootstrap_addr = *bootstrap;
  }
  return Status::Ok();
}

}  // namespace

Result<CompletionRequest> ParseCompletionRequest(std::string_view body, Role role,
                                                 std::uint32_t max_model_len,
                                                 CompletionSpec* refused) {
  if (control::JsonDepth(body) > control::kMaxJsonDepth) {
    return tl::unexpected(
        Bad(fmt::format("JSON nested deeper than {} levels", control::kMaxJsonDepth)));
  }
  if (control::JsonValues(body) > control::kMaxJsonValues) {
    return tl::unexpected(
        Bad(fmt::format("JSON with more than {} values", control::kMaxJsonValues)));
  }
  json doc = json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return tl::unexpected(Bad("body is not valid JSON"));
  if (!doc.is_object()) return tl::unexpected(Bad("body must be a JSON object"));
  CompletionRequest out;
  // The transfer first: once it is known, every refusal below names it to the caller, which
  // must settle it with the other half (found by attacking real processes: a D that refused a
  // too-long request here released nothing, and P held its KV for a lease or 480 s).
  Status params = ParseTransferParams(doc, role, &out.spec);
  if (!params.ok()) return tl::unexpected(params);
  auto refuse = [&](Status why) -> Result<CompletionRequest> {
    if (refused != nullptr && out.spec.kind != RequestKind::kLocal) *refused = out.spec;
    return tl::unexpected(std::move(why));
  };
  if (auto it = doc.find("model"); it != doc.end() && !it->is_null()) {
    if (!it->is_string() || it->get_ref<const std::string&>().size() > kMaxIdBytes) {
      return refuse(Bad("model must be a short string"));
    }
    out.model = it->get<std::string>();
  }
  // prompt: token ids, or a string whose bytes are the tokens.
  auto prompt = doc.find("prompt");
  if (prompt == doc.end()) return refuse(Bad("prompt is required"));
  std::uint64_t prompt_tokens = 0;
  if (prompt->is_string()) {
    prompt_tokens = prompt->get_ref<const std::string&>().size();
  } else if (prompt->is_array()) {
    for (const json& token : *prompt) {
      if (!token.is_number_integer() || token.get<std::int64_t>() < 0 ||
          token.get<std::int64_t>() > std::numeric_limits<std::int32_t>::max()) {
        return refuse(
            Bad("prompt must be a string or a list of non-negative token ids (one prompt only)"));
      }
    }
    prompt_tokens = prompt->size();
  } else {
    return refuse(Bad("prompt must be a string or a list of token ids"));
  }
  if (prompt_tokens == 0) return refuse(Bad("prompt is empty"));
  std::int64_t max_tokens = 16;
  if (auto it = doc.find("max_tokens"); it != doc.end() && !it->is_null()) {
    if (!it->is_number_integer() || it->get<std::int64_t>() < 1) {
      return refuse(Bad("max_tokens must be a positive integer"));
    }
    max_tokens = it->get<std::int64_t>();
  }
  if (prompt_tokens + static_cast<std::uint64_t>(std::min<std::int64_t>(max_tokens, 1ll << 40)) >
      max_model_len) {
    return refuse(Bad(fmt::format("prompt ({} tokens) + max_tokens ({}) exceeds max_model_len {}",
                                  prompt_tokens, max_tokens, max_model_len)));
  }
  auto stream = BoolField(doc, "stream", "");
  if (!stream) return refuse(stream.error());
  out.stream = *stream;
  auto ignore_eos = BoolField(doc, "ignore_eos", "");  // the synthetic model has no EOS anyway
  if (!ignore_eos) return refuse(ignore_eos.error());
  out.spec.prompt_tokens = static_cast<std::uint32_t>(prompt_tokens);
  out.spec.max_tokens = static_cast<std::uint32_t>(max_tokens);
  return out;
}

struct HttpFront::Impl {
  HttpFrontOptions options;
  ServingEngine* engine = nullptr;
  std::unique_ptr<control::HttpServer> server;
  std::atomic<bool> stopping{false};
  std::atomic<std::uint64_t> next_id{1};

  void Completions(const control::HttpRequest& req, control::HttpExchange& ex);
  void Stream(const std::shared_ptr<RequestStream>& stream, const CompletionRequest& request,
              const std::string& id, control::HttpExchange& ex);
};

HttpFront::HttpFront() : impl_(std::make_unique<Impl>()) {}
HttpFront::~HttpFront() { Stop(); }
int HttpFront::port() const { return impl_->server ? impl_->server->port() : 0; }

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
  control::HttpServerOptions http;
  http.name = "serve";
  http.max_body_bytes = impl.options.max_body_bytes;
  http.handler_threads = std::max<std::size_t>(4, impl.options.threads);
  http.max_connections = impl.options.max_connections;
  http.idle_timeout = impl.options.idle_timeout;
  http.error_format = ErrorResponse;
  http.log = [](std::string_view line) { spdlog::warn("{}", line); };
  impl.server = std::make_unique<control::HttpServer>(std::move(http));
  impl.server->Route("POST", "/v1/completions",
                     control::BlockingHandler(
                         [&impl](const control::HttpRequest& req, control::HttpExchange& ex) {
                           impl.Completions(req, ex);
                         }));
  // On a handler thread: P's metrics wait for its listeners' counters (up to 200 ms a rank),
  // which must never stall the event thread every connection shares.
  impl.server->Route("GET", "/metrics",
                     control::BlockingHandler([&impl](const control::HttpRequest&,
                                                      control::HttpExchange& ex) {
                       control::HttpResponse r;
                       r.content_type = "text/plain; version=0.0.4";
                       std::vector<std::pair<std::string, control::HttpServerStats>> servers = {
                           {"serve", impl.server->stats()}};
                       if (impl.options.more_http_stats) {
                         for (auto& more : impl.options.more_http_stats()) servers.push_back(more);
                       }
                       r.body = impl.engine->RenderMetrics() + control::RenderHttpMetrics(servers);
                       if (impl.options.more_metrics) r.body += impl.options.more_metrics();
                       ex.Reply(std::move(r));
                     }));
  impl.server->Route("GET", "/health",
                     control::InlineHandler([&impl, health_extra](const control::HttpRequest&) {
                       json body = health_extra;
                       body["status"] = impl.stopping ? "stopping" : "ok";
                       control::HttpResponse r;
                       r.status = impl.stopping ? 503 : 200;
                       r.body = Dump(body);
                       return r;
                     }));
  auto bound = impl.server->Start(impl.options.host, impl.options.port);
  if (!bound) return tl::unexpected(bound.error());
  return front;
}

void HttpFront::Stop() {
  if (!impl_ || !impl_->server) return;
  impl_->stopping = true;
  impl_->server->Stop();
}

void HttpFront::Impl::Completions(const control::HttpRequest& req, control::HttpExchange& ex) {
  if (stopping) {
    ex.Reply(ErrorResponse(503, "the server is shutting down"));
    return;
  }
  CompletionSpec refused;
  auto parsed =
      ParseCompletionRequest(req.body, engine->options().role, options.max_model_len, &refused);
  if (!parsed) {
    // A request this instance will never serve as sent: its transfer is settled with the other
    // half (ServingEngine::Refused), then the client hears why.
    if (refused.kind != RequestKind::kLocal) engine->Refused(refused, parsed.error());
    ex.Reply(ErrorResponse(400, parsed.error().message()));
    return;
  }
  auto submitted = engine->Submit(parsed->spec);
  if (!submitted) {
    ex.Reply(ErrorResponse(HttpStatusOf(submitted.error()), submitted.error().ToString()));
    return;
  }
  std::shared_ptr<RequestStream> stream = *submitted;
  std::string id = fmt::format("cmpl-{}-{}", engine->options().engine_id, next_id.fetch_add(1));
  if (parsed->stream) {
    Stream(stream, *parsed, id, ex);
    return;
  }
  // Non-streaming: collect until the terminal event.
  const auto deadline = Clock::now() + options.request_timeout;
  std::string text;
  std::vector<std::uint32_t> tokens;
  std::string finish_reason;
  while (true) {
    if (ex.client_gone()) {  // nobody will read the answer: free what the request holds
      engine->Abort(stream->handle());
      return;
    }
    if (stopping || Clock::now() >= deadline) {
      engine->Abort(stream->handle());
      ex.Reply(ErrorResponse(stopping ? 503 : 504,
                             stopping ? "the server is shutting down" : "request timed out"));
      return;
    }
    bool terminal = false;
    for (StreamEvent& e : stream->Wait(std::min(deadline, Clock::now() + kKeepalive))) {
      if (e.kind == StreamEvent::Kind::kToken) {
        tokens.push_back(e.token);
        text += TokenText(e.token);
        if (!e.finish_reason.empty()) finish_reason = e.finish_reason;
      } else if (e.kind == StreamEvent::Kind::kError) {
        ex.Reply(ErrorResponse(e.http_status >= 400 ? e.http_status : 500, e.message));
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
  control::HttpResponse r;
  r.body = Dump(body);
  ex.Reply(std::move(r));
}

void HttpFront::Impl::Stream(const std::shared_ptr<RequestStream>& stream,
                             const CompletionRequest& request, const std::string& id,
                             control::HttpExchange& ex) {
  const std::string model = request.model.empty() ? options.served_model : request.model;
  const auto created = static_cast<std::int64_t>(std::time(nullptr));
  const std::uint32_t prompt_tokens = request.spec.prompt_tokens;
  std::uint32_t completion_tokens = 0;
  const auto deadline = Clock::now() + options.request_timeout;
  control::HttpResponse head;
  head.content_type = "text/event-stream";
  ex.BeginStream(std::move(head));
  auto finish_with_error = [&](int status, const std::string& message) {
    engine->Abort(stream->handle());
    (void)ex.Write("data: " + Dump({{"error", ErrorObject(status, message)}}) +
                   "\n\ndata: [DONE]\n\n");
  };
  for (;;) {
    if (stopping) return finish_with_error(503, "the server is shutting down");
    const auto now = Clock::now();
    if (now >= deadline) return finish_with_error(504, "request timed out");
    std::vector<StreamEvent> events = stream->Wait(std::min(deadline, now + kKeepalive));
    std::string out;
    bool done = false;
    if (events.empty()) {
      // An SSE comment: clients ignore it; a client that went away fails the write.
      out = ": keepalive\n\n";
    }
    for (StreamEvent& e : events) {
      if (e.kind == StreamEvent::Kind::kToken) {
        ++completion_tokens;
        json chunk = {
            {"id", id},
            {"object", "text_completion"},
            {"created", created},
            {"model", model},
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
        done = true;
      } else {
        json usage = {
            {"id", id},
            {"object", "text_completion"},
            {"created", created},
            {"model", model},
            {"choices", json::array()},
            {"usage",
             {{"prompt_tokens", prompt_tokens},
              {"completion_tokens", completion_tokens},
              {"total_tokens", prompt_tokens + completion_tokens}}},
        };
        out += "data: " + Dump(usage) + "\n\ndata: [DONE]\n\n";
        done = true;
      }
      if (done) break;
    }
    if (!ex.Write(out)) {
      // The client went away (or is too slow to read): free what the request holds.
      if (!done) engine->Abort(stream->handle());
      return;
    }
    if (done) {
      ex.EndStream();
      return;
    }
  }
}

}  // namespace kvferry::harness
