#include "control/load_failure_service.h"

#include <list>
#include <mutex>
#include <nlohmann/json.hpp>
#include <unordered_map>
#include <utility>

namespace kvferry::control {

struct LoadFailureService::Impl {
  explicit Impl(std::size_t max) : max_entries(max == 0 ? 1 : max) {}

  const std::size_t max_entries;
  mutable std::mutex mu;
  std::list<std::string> order;  // oldest first
  std::unordered_map<std::string, std::pair<std::string, std::list<std::string>::iterator>>
      reasons;
  std::unique_ptr<HttpServer> server;

  HttpResponse Answer(const HttpRequest& req) const {
    const std::string* id = req.Param("transfer_id");
    HttpResponse res;
    if (id == nullptr || id->empty() || id->size() > kMaxIdBytes) {
      res.status = 400;
      res.body = nlohmann::json{{"error", "transfer_id must be 1.." + std::to_string(kMaxIdBytes) +
                                              " bytes"}}
                     .dump();
      return res;
    }
    std::lock_guard<std::mutex> lock(mu);
    auto it = reasons.find(*id);
    if (it == reasons.end()) {
      res.status = 404;
      res.body = nlohmann::json{{"error", "no failed load recorded for this transfer"}}.dump(
          -1, ' ', false, nlohmann::json::error_handler_t::replace);
      return res;
    }
    res.body = nlohmann::json{{"transfer_id", *id}, {"reason", it->second.first}}.dump(
        -1, ' ', false, nlohmann::json::error_handler_t::replace);
    return res;
  }
};

LoadFailureService::LoadFailureService(std::size_t max_entries)
    : impl_(std::make_unique<Impl>(max_entries)) {}

LoadFailureService::~LoadFailureService() { Stop(); }

Result<int> LoadFailureService::Start(const std::string& host, int port) {
  if (impl_->server) return Err(ErrorCode::kAlreadyExists, "the load failure service runs");
  HttpServerOptions o;
  o.name = "load_failures";
  o.max_connections = 1024;  // a router's lookups, now and then
  o.max_body_bytes = 0;      // GETs only
  auto server = std::make_unique<HttpServer>(o);
  Impl* impl = impl_.get();
  server->Route("GET", "/load_failure",
                InlineHandler([impl](const HttpRequest& req) { return impl->Answer(req); }));
  server->Route("GET", "/health", InlineHandler([](const HttpRequest&) {
                  HttpResponse res;
                  res.body = R"({"status":"ok"})";
                  return res;
                }));
  Result<int> bound = server->Start(host, port);
  if (!bound) return bound;
  impl_->server = std::move(server);
  return bound;
}

void LoadFailureService::Stop() {
  if (impl_->server) {
    impl_->server->Stop();
    impl_->server.reset();
  }
}

int LoadFailureService::port() const { return impl_->server ? impl_->server->port() : 0; }

void LoadFailureService::Record(const std::string& transfer_id, const std::string& reason) {
  if (transfer_id.empty() || transfer_id.size() > kMaxIdBytes) return;
  std::string cut = reason.substr(0, kMaxReasonBytes);
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->reasons.find(transfer_id);
  if (it != impl_->reasons.end()) {
    it->second.first = std::move(cut);
    impl_->order.splice(impl_->order.end(), impl_->order, it->second.second);
    return;
  }
  impl_->order.push_back(transfer_id);
  impl_->reasons.emplace(transfer_id, std::make_pair(std::move(cut), std::prev(impl_->order.end())));
  while (impl_->reasons.size() > impl_->max_entries) {
    impl_->reasons.erase(impl_->order.front());
    impl_->order.pop_front();
  }
}

std::optional<std::string> LoadFailureService::Find(const std::string& transfer_id) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->reasons.find(transfer_id);
  if (it == impl_->reasons.end()) return std::nullopt;
  return it->second.first;
}

std::size_t LoadFailureService::size() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->reasons.size();
}

}  // namespace kvferry::control
