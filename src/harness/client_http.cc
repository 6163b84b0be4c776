#include "client_http.h"

#include <httplib.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <sstream>

#include "control/json_limits.h"

namespace kvferry::harness {

std::optional<HostPort> ParseUrl(const std::string& url) {
  std::string rest = url;
  if (rest.rfind("http://", 0) == 0) rest = rest.substr(7);
  while (!rest.empty() && rest.back() == '/') rest.pop_back();
  const auto colon = rest.rfind(':');
  if (colon == std::string::npos || colon == 0 || rest.find('/') != std::string::npos) {
    return std::nullopt;
  }
  HostPort hp;
  hp.host = rest.substr(0, colon);
  const std::string port = rest.substr(colon + 1);
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](unsigned char c) { return std::isdigit(c); })) {
    return std::nullopt;
  }
  hp.port = std::stoi(port);
  if (hp.port <= 0 || hp.port > 65535) return std::nullopt;
  return hp;
}

std::string RandomUuid() {
  static thread_local std::mt19937_64 rng{
      std::random_device{}() ^
      static_cast<std::uint64_t>(SteadyClock::now().time_since_epoch().count())};
  std::uint64_t hi = rng(), lo = rng();
  hi = (hi & ~0xF000ULL) | 0x4000ULL;                  // version 4
  lo = (lo & ~(0xC000ULL << 48)) | (0x8000ULL << 48);  // variant 10xx
  char buf[40];
  std::snprintf(buf, sizeof buf, "%08x-%04x-%04x-%04x-%012llx", static_cast<unsigned>(hi >> 32),
                static_cast<unsigned>((hi >> 16) & 0xFFFF), static_cast<unsigned>(hi & 0xFFFF),
                static_cast<unsigned>(lo >> 48),
                static_cast<unsigned long long>(lo & 0xFFFFFFFFFFFFULL));
  return buf;
}

void SseParser::Feed(const char* data, std::size_t len) {
  for (std::size_t i = 0; i < len; ++i) {
    const char c = data[i];
    if (c != '\n') {
      if (line_.size() < (8u << 20)) line_.push_back(c);
      continue;
    }
    if (!line_.empty() && line_.back() == '\r') line_.pop_back();
    if (line_.rfind("data:", 0) == 0) {
      std::size_t start = 5;
      if (line_.size() > 5 && line_[5] == ' ') start = 6;
      on_data_(line_.substr(start));
    }
    line_.clear();
  }
}

std::vector<int> RandomPrompt(std::mt19937_64& rng, int tokens, int low, int high) {
  std::uniform_int_distribution<int> dist(low, high - 1);
  std::vector<int> out(static_cast<std::size_t>(std::max(tokens, 0)));
  for (auto& t : out) t = dist(rng);
  return out;
}

namespace {

std::string ErrorFromJson(const std::string& text) {
  // A backend's body: bounded like a client's before anything recurses over it.
  if (control::JsonDepth(text) > control::kMaxJsonDepth) return "error body nested too deeply";
  auto j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded()) return {};
  if (j.is_object() && j.contains("error")) {
    const auto& e = j["error"];
    if (e.is_string()) return e.get<std::string>();
    if (e.is_object() && e.contains("message") && e["message"].is_string()) {
      return e["message"].get<std::string>();
    }
    return e.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  }
  // {"object": "error", "message": ...} (vLLM's and `kvferry serve`'s plain error body).
  if (j.is_object() && j.value("object", "") == "error" && j.contains("message") &&
      j["message"].is_string()) {
    return j["message"].get<std::string>();
  }
  return {};
}

}  // namespace

CompletionOutcome PostCompletion(const CompletionCall& call) {
  CompletionOutcome out;
  const auto t0 = SteadyClock::now();
  const auto deadline = t0 + std::chrono::duration_cast<SteadyClock::duration>(
                                 std::chrono::duration<double>(call.timeout_s));
  const auto hp = ParseUrl(call.url);
  if (!hp) {
    out.error = "bad url " + call.url;
    return out;
  }
  httplib::Client cli(hp->host, hp->port);
  const auto timeout = std::chrono::duration<double>(std::max(call.timeout_s, 0.001));
  cli.set_connection_timeout(std::chrono::duration_cast<std::chrono::microseconds>(
      std::min(timeout, std::chrono::duration<double>(10.0))));
  cli.set_read_timeout(std::chrono::duration_cast<std::chrono::microseconds>(timeout));
  cli.set_write_timeout(std::chrono::seconds(10));

  if (call.gate != nullptr) {
    // Open the connection (keep-alive) one at a time per server; the POST below reuses it.
    cli.set_keep_alive(true);
    cli.set_read_timeout(std::chrono::seconds(5));
    {
      std::lock_guard<std::mutex> lock(call.gate->For(hp->host + ":" + std::to_string(hp->port)));
      cli.Get("/health");
    }
    cli.set_read_timeout(std::chrono::duration_cast<std::chrono::microseconds>(timeout));
  }
  std::string stream_error;
  bool past_deadline = false;
  bool cancelled = false;
  SseParser sse([&](const std::string& data) {
    if (data == "[DONE]") {
      out.saw_done = true;
      return;
    }
    const std::string err = ErrorFromJson(data);
    if (!err.empty()) {
      if (stream_error.empty()) stream_error = err;
      return;
    }
    if (control::JsonDepth(data) > control::kMaxJsonDepth) return;  // not a token event
    auto j = nlohmann::json::parse(data, nullptr, false);
    if (j.is_object() && j.contains("choices") && j["choices"].is_array() &&
        !j["choices"].empty()) {
      if (out.ttft_s < 0) out.ttft_s = SecondsSince(t0);
      ++out.tokens;
    }
  });

  httplib::Request req;
  req.method = "POST";
  req.path = call.path;
  req.body = call.body;
  req.set_header("Content-Type", "application/json");
  if (call.stream) req.set_header("Accept", "text/event-stream");
  for (const auto& [name, value] : call.headers) req.set_header(name, value);
  // A cancel that lands before the request is on the wire only closes an idle socket (httplib
  // then reconnects): checking the group here makes it stick.
  auto cancelled_now = [&] { return call.cancel != nullptr && call.cancel->cancelled(); };
  req.response_handler = [&](const httplib::Response& r) {
    out.http_status = r.status;
    return !cancelled_now();
  };
  req.content_receiver = [&](const char* data, std::size_t len, std::uint64_t, std::uint64_t) {
    if (cancelled_now()) return false;
    if (SteadyClock::now() > deadline) {
      past_deadline = true;
      return false;
    }
    if (call.stream && out.http_status == 200) {
      sse.Feed(data, len);
    } else if (out.body.size() < 65536) {
      out.body.append(data, std::min(len, 65536 - out.body.size()));
    }
    return true;
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  std::uint64_t reg = 0;
  if (call.cancel != nullptr) {
    reg = call.cancel->Add([&cli] { cli.stop(); });
    if (reg == 0) {
      out.error = "cancelled";
      return out;
    }
  }
  const bool sent = cli.send(req, res, err);
  if (reg != 0) call.cancel->Remove(reg);
  if (call.cancel != nullptr && call.cancel->cancelled()) cancelled = true;
  out.latency_s = SecondsSince(t0);
  if (res.status > 0) out.http_status = res.status;
  if (cancelled) {
    out.error = "cancelled";
    return out;
  }
  if (past_deadline || (!sent && err == httplib::Error::Read && out.latency_s >= call.timeout_s)) {
    out.error = "timeout after " + std::to_string(static_cast<int>(call.timeout_s)) + " s";
    return out;
  }
  if (!sent) {
    out.error = "http error: " + httplib::to_string(err);
    return out;
  }
  if (out.http_status != 200) {
    std::string msg = ErrorFromJson(out.body);
    if (msg.empty()) msg = out.body.substr(0, 200);
    out.error = "HTTP " + std::to_string(out.http_status) + ": " + msg;
    return out;
  }
  if (call.stream) {
    if (!stream_error.empty()) {
      out.error = "stream error: " + stream_error;
    } else if (!out.saw_done) {
      out.error = "stream ended without [DONE]";
    } else {
      out.ok = true;
    }
    return out;
  }
  const std::string msg = ErrorFromJson(out.body);
  if (!msg.empty()) {
    out.error = "error body: " + msg;
    return out;
  }
  out.ok = true;
  out.tokens = 1;
  out.ttft_s = out.latency_s;
  return out;
}

std::mutex& ConnectGate::For(const std::string& host_port) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& g = gates_[host_port];
  if (!g) g = std::make_unique<std::mutex>();
  return *g;
}

std::uint64_t CancelGroup::Add(std::function<void()> stop) {
  std::lock_guard<std::mutex> lock(mu_);
  if (cancelled_.load()) return 0;
  const std::uint64_t id = next_++;
  stops_.emplace(id, std::move(stop));
  return id;
}

void CancelGroup::Remove(std::uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  stops_.erase(id);
}

void CancelGroup::CancelAll() {
  std::lock_guard<std::mutex> lock(mu_);
  cancelled_.store(true);
  for (auto& [id, stop] : stops_) stop();
}

std::string NormalizeReason(const std::string& reason) {
  std::string out;
  out.reserve(reason.size());
  std::size_t i = 0;
  while (i < reason.size()) {
    // A run of [0-9a-fA-F-] that contains a digit and is a "word" → N.
    std::size_t j = i;
    bool digit = false;
    while (j < reason.size() && (std::isxdigit(static_cast<unsigned char>(reason[j])) ||
                                 reason[j] == '-' || reason[j] == '.')) {
      digit = digit || std::isdigit(static_cast<unsigned char>(reason[j]));
      ++j;
    }
    const bool word_start = i == 0 || !std::isalnum(static_cast<unsigned char>(reason[i - 1]));
    const bool word_end =
        j == reason.size() || !std::isalnum(static_cast<unsigned char>(reason[j]));
    if (j > i && digit && word_start && word_end) {
      out += 'N';
      i = j;
    } else {
      out += reason[i];
      ++i;
    }
  }
  if (out.size() > 160) out = out.substr(0, 157) + "...";
  return out;
}

std::map<std::string, double> ParsePrometheus(const std::string& text) {
  std::map<std::string, double> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::size_t name_end = line.find_first_of("{ \t");
    if (name_end == std::string::npos) continue;
    const std::string name = line.substr(0, name_end);
    std::size_t value_start = name_end;
    if (line[name_end] == '{') {
      const auto close = line.find('}', name_end);
      if (close == std::string::npos) continue;
      value_start = close + 1;
    }
    std::istringstream vs(line.substr(value_start));
    std::string value;
    vs >> value;
    try {
      out[name] += std::stod(value);
    } catch (...) {
      // NaN / garbage: skip the series.
    }
  }
  return out;
}

std::optional<std::string> HttpGet(const std::string& url, const std::string& path,
                                   double timeout_s) {
  const auto hp = ParseUrl(url);
  if (!hp) return std::nullopt;
  httplib::Client cli(hp->host, hp->port);
  const auto us = std::chrono::microseconds(static_cast<std::int64_t>(timeout_s * 1e6));
  cli.set_connection_timeout(us);
  cli.set_read_timeout(us);
  cli.set_write_timeout(us);
  auto res = cli.Get(path.c_str());
  if (!res || res->status != 200) return std::nullopt;
  return res->body;
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return -1;
  std::sort(v.begin(), v.end());
  const double rank = std::ceil(p / 100.0 * static_cast<double>(v.size()));
  std::size_t idx = rank < 1 ? 0 : static_cast<std::size_t>(rank) - 1;
  if (idx >= v.size()) idx = v.size() - 1;
  return v[idx];
}

}  // namespace kvferry::harness
