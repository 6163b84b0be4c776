#include "control/etcd_registry.h"

#include <fmt/format.h>
#include <httplib.h>
#include <sodium.h>

#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "control/bootstrap_json.h"
#include "control/bounded_answer.h"
#include "control/bootstrap_registry.h"
#include "control/json_limits.h"

namespace kvferry::control {
namespace {

using nlohmann::json;

std::string Base64(std::string_view bytes) {
  std::string out(sodium_base64_ENCODED_LEN(bytes.size(), sodium_base64_VARIANT_ORIGINAL), '\0');
  sodium_bin2base64(out.data(), out.size(), reinterpret_cast<const unsigned char*>(bytes.data()),
                    bytes.size(), sodium_base64_VARIANT_ORIGINAL);
  out.resize(std::strlen(out.c_str()));
  return out;
}

Result<std::string> Unbase64(const std::string& text) {
  std::string out(text.size(), '\0');
  std::size_t len = 0;
  if (sodium_base642bin(reinterpret_cast<unsigned char*>(out.data()), out.size(), text.c_str(),
                        text.size(), nullptr, &len, nullptr,
                        sodium_base64_VARIANT_ORIGINAL) != 0) {
    return Err(ErrorCode::kProtocol, "etcd answered a value that is not base64");
  }
  out.resize(len);
  return out;
}

// The smallest key after every key that starts with `prefix` (etcd's range_end for a prefix).
std::string PrefixEnd(std::string prefix) {
  while (!prefix.empty()) {
    auto& last = reinterpret_cast<unsigned char&>(prefix.back());
    if (last < 0xff) {
      ++last;
      return prefix;
    }
    prefix.pop_back();
  }
  return std::string(1, '\0');  // every key
}

// etcd's JSON gateway writes 64-bit integers as strings.
std::int64_t Int64(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end()) return 0;
  if (it->is_string()) return std::strtoll(it->get_ref<const std::string&>().c_str(), nullptr, 10);
  if (it->is_number_integer()) return it->get<std::int64_t>();
  return 0;
}

struct HostPort {
  std::string host;
  int port = 0;
};

Result<HostPort> ParseEndpoint(std::string_view endpoint) {
  std::string_view rest = endpoint;
  if (rest.rfind("http://", 0) == 0) rest.remove_prefix(7);
  const auto colon = rest.rfind(':');
  if (colon == std::string_view::npos || colon == 0) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("etcd endpoint '{}' is not [http://]host:port", endpoint));
  }
  const std::string port_text(rest.substr(colon + 1));
  char* end = nullptr;
  const long port = std::strtol(port_text.c_str(), &end, 10);
  if (port_text.empty() || *end != '\0' || port <= 0 || port > 65535) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("etcd endpoint '{}' has no valid port", endpoint));
  }
  return HostPort{std::string(rest.substr(0, colon)), static_cast<int>(port)};
}

std::string EngineKeyPrefix(const EtcdOptions& o) { return o.prefix + "/engines/"; }

bool IsPowerOfTen(std::uint64_t n) {
  while (n >= 10 && n % 10 == 0) n /= 10;
  return n == 1;
}

std::string WorkerKey(const EtcdOptions& o, const WorkerRegistration& r) {
  return fmt::format("{}{}/{}-{}", EngineKeyPrefix(o), r.engine_id, r.tp_rank, r.pp_rank);
}

// The most an etcd answer may hold (a range of every engine's records: ~0.5 KB each, so room for
// about 100,000 workers). One record is bounded like a registration's HTTP body
// (kMaxBodyBytes), envelope included, before anything parses it.
constexpr std::size_t kMaxAnswerBytes = std::size_t{64} << 20;

// What P stores under a worker's key: the registration's JSON, or, with a cluster secret,
// {"registration": "<that JSON>", "signature": "<SignRecord over key and that JSON>"}.
std::string EncodeRecord(const EtcdOptions& o, const std::string& key,
                         const WorkerRegistration& r) {
  std::string registration = EncodeRegistration(r);
  if (!o.cluster_secret) return registration;
  const std::string signature = SignRecord(*o.cluster_secret, key, registration, UnixNowSeconds());
  return nlohmann::json{{"registration", std::move(registration)}, {"signature", signature}}.dump();
}

// The registration in a record, checked against the cluster secret when there is one.
Result<WorkerRegistration> DecodeRecord(const EtcdOptions& o, const std::string& key,
                                        const std::string& value) {
  if (value.size() > kMaxBodyBytes) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("record of {} bytes (at most {})", value.size(), kMaxBodyBytes));
  }
  std::string registration = value;
  std::string signature;
  // Bounded before parsing, as every JSON from the network (json_limits.h): anyone who reaches
  // etcd can write this value.
  nlohmann::json j;
  if (JsonDepth(value) <= kMaxJsonDepth && JsonValues(value) <= kMaxJsonValues) {
    j = nlohmann::json::parse(value, nullptr, false);
  }
  if (j.is_object() && j.contains("registration") && j["registration"].is_string()) {
    registration = j["registration"].get<std::string>();
    if (j.contains("signature") && j["signature"].is_string()) {
      signature = j["signature"].get<std::string>();
    }
  }
  if (o.cluster_secret) {
    if (Status v = VerifyRecord(*o.cluster_secret, signature, key, registration); !v.ok()) {
      return tl::unexpected(v);
    }
  }
  return DecodeRegistration(registration);
}

}  // namespace

Status Validate(const EtcdOptions& options) {
  if (options.endpoints.empty()) {
    return Status(ErrorCode::kInvalidArgument, "etcd: no endpoint given");
  }
  for (const std::string& e : options.endpoints) {
    auto parsed = ParseEndpoint(e);
    if (!parsed) return parsed.error();
  }
  if (options.prefix.empty() || options.prefix.front() != '/') {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("etcd prefix '{}' must start with '/'", options.prefix));
  }
  if (options.request_timeout.count() <= 0) {
    return Status(ErrorCode::kInvalidArgument, "etcd request_timeout must be positive");
  }
  return Status::Ok();
}

// ---- EtcdClient

EtcdClient::EtcdClient(EtcdOptions options) : options_(std::move(options)) {}

Result<std::string> EtcdClient::Call(const std::string& path, const std::string& body) {
  if (options_.endpoints.empty()) return Err(ErrorCode::kInvalidArgument, "etcd: no endpoint");
  std::string failures;
  const std::size_t n = options_.endpoints.size();
  const std::size_t first = preferred_.load(std::memory_order_relaxed) % n;
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t index = (first + i) % n;
    const std::string& endpoint = options_.endpoints[index];
    auto hp = ParseEndpoint(endpoint);
    if (!hp) return tl::unexpected(hp.error());
    httplib::Client cli(hp->host, hp->port);
    const auto timeout = std::chrono::duration_cast<std::chrono::microseconds>(
        options_.request_timeout);
    cli.set_connection_timeout(timeout);
    cli.set_read_timeout(timeout);
    cli.set_write_timeout(timeout);
    // The answer is read into a bounded buffer: whoever can write under the prefix decides how
    // large a range answer is, and D reads it every poll.
    httplib::Request req;
    req.method = "POST";
    req.path = path;
    req.body = body;
    req.set_header("Content-Type", "application/json");
    std::string answer;
    bool too_large = false;
    req.content_receiver = BoundedAnswerReceiver(&answer, kMaxAnswerBytes, &too_large);
    httplib::Response res;
    httplib::Error error = httplib::Error::Success;
    const bool sent = cli.send(req, res, error);
    std::string why;
    if (too_large) {
      why = fmt::format("answer larger than {} MiB", kMaxAnswerBytes >> 20);
    } else if (!sent) {
      why = httplib::to_string(error);
    } else if (res.status == 200) {
      preferred_.store(index, std::memory_order_relaxed);
      return answer;
    } else {
      why = fmt::format("HTTP {}: {}", res.status, answer.substr(0, 200));
    }
    failures += fmt::format("{}{}: {}", failures.empty() ? "" : "; ", endpoint, why);
  }
  return Err(ErrorCode::kUnavailable, "etcd unreachable (" + failures + ")");
}

Result<std::int64_t> EtcdClient::Grant(std::chrono::seconds ttl) {
  auto text = Call("/v3/lease/grant", json{{"TTL", std::to_string(ttl.count())}}.dump());
  if (!text) return tl::unexpected(text.error());
  const json j = json::parse(*text, nullptr, false);
  const std::int64_t id = j.is_object() ? Int64(j, "ID") : 0;
  if (id == 0) return Err(ErrorCode::kProtocol, "etcd lease grant: no lease id in " + *text);
  return id;
}

Result<std::int64_t> EtcdClient::KeepAlive(std::int64_t lease) {
  auto text = Call("/v3/lease/keepalive", json{{"ID", std::to_string(lease)}}.dump());
  if (!text) return tl::unexpected(text.error());
  const json j = json::parse(*text, nullptr, false);
  if (!j.is_object() || !j.contains("result")) {
    return Err(ErrorCode::kProtocol, "etcd keepalive: unexpected answer " + *text);
  }
  const std::int64_t ttl = Int64(j["result"], "TTL");
  if (ttl <= 0) return Err(ErrorCode::kNotFound, fmt::format("etcd lease {} expired", lease));
  return ttl;
}

Status EtcdClient::Revoke(std::int64_t lease) {
  auto text = Call("/v3/lease/revoke", json{{"ID", std::to_string(lease)}}.dump());
  return text ? Status::Ok() : text.error();
}

Status EtcdClient::Put(std::string_view key, std::string_view value, std::int64_t lease) {
  auto text = Call("/v3/kv/put", json{{"key", Base64(key)},
                                      {"value", Base64(value)},
                                      {"lease", std::to_string(lease)}}
                                     .dump());
  return text ? Status::Ok() : text.error();
}

Result<std::vector<EtcdClient::KeyValue>> EtcdClient::Range(std::string_view prefix) {
  auto text = Call("/v3/kv/range", json{{"key", Base64(prefix)},
                                        {"range_end", Base64(PrefixEnd(std::string(prefix)))}}
                                       .dump());
  if (!text) return tl::unexpected(text.error());
  const json j = json::parse(*text, nullptr, false);
  // A real answer carries etcd's header; anything else (an error body behind a 200 from a
  // proxy) must not read as "no keys", which would report every engine down.
  if (!j.is_object() || !j.contains("header") || j.contains("error")) {
    return Err(ErrorCode::kProtocol, "etcd range: not an etcd answer: " + text->substr(0, 200));
  }
  std::vector<KeyValue> out;
  auto kvs = j.find("kvs");
  if (kvs == j.end()) return out;  // no key: etcd leaves the field out
  if (!kvs->is_array()) return Err(ErrorCode::kProtocol, "etcd range: kvs is not an array");
  for (const json& kv : *kvs) {
    if (!kv.is_object() || !kv.contains("key") || !kv["key"].is_string()) continue;
    auto key = Unbase64(kv["key"].get<std::string>());
    auto value = Unbase64(kv.value("value", std::string()));
    if (!key || !value) return Err(ErrorCode::kProtocol, "etcd range: a key or value is not base64");
    out.push_back({std::move(*key), std::move(*value)});
  }
  return out;
}

// ---- EtcdRegistrar

struct EtcdRegistrar::Impl {
  Impl(EtcdOptions o, std::vector<WorkerRegistration> r, std::chrono::seconds t,
       std::function<void(std::string_view)> l)
      : client(std::move(o)), registrations(std::move(r)), ttl(t), log(std::move(l)) {}

  void Log(std::string_view line) const {
    if (log) log(line);
  }

  Status Publish() {
    auto granted = client.Grant(ttl);
    if (!granted) return granted.error();
    for (const WorkerRegistration& r : registrations) {
      const std::string key = WorkerKey(client.options(), r);
      if (Status put = client.Put(key, EncodeRecord(client.options(), key, r), *granted);
          !put.ok()) {
        (void)client.Revoke(*granted);
        return put;
      }
    }
    std::lock_guard<std::mutex> lock(mu);
    lease = *granted;
    return Status::Ok();
  }

  void Loop() {
    std::unique_lock<std::mutex> lock(mu);
    // Three renewals per TTL: one lost or slow renewal never lets the lease lapse.
    const auto interval = std::max(std::chrono::milliseconds(100),
                                   std::chrono::duration_cast<std::chrono::milliseconds>(ttl) / 3);
    while (!cv.wait_for(lock, interval, [&] { return stopping; })) {
      const std::int64_t id = lease;
      lock.unlock();
      auto alive = client.KeepAlive(id);
      lock.lock();
      if (alive) {
        ++stats.keepalives;
        if (failing_since_ok != 0) {
          Log(fmt::format("etcd: lease of engine {} renewed again after {} failed attempts",
                          registrations.front().engine_id, failing_since_ok));
          failing_since_ok = 0;
        }
        continue;
      }
      if (alive.error().code() != ErrorCode::kNotFound) {
        // etcd away: keep trying; the lease may still be alive there. Said at the 1st, 10th,
        // 100th... failure in a row: decoders declare this engine down once the lease lapses.
        ++stats.failures;
        ++failing_since_ok;
        if (IsPowerOfTen(failing_since_ok)) {
          Log(fmt::format("etcd: cannot renew the lease of engine {} ({} attempts in a row): {}; "
                          "decoders declare it down if this lasts {} s",
                          registrations.front().engine_id, failing_since_ok,
                          alive.error().message(), ttl.count()));
        }
        continue;
      }
      lock.unlock();
      Log(fmt::format("etcd: lease of engine {} expired (D may have failed its waiting loads); "
                      "publishing again",
                      registrations.front().engine_id));
      Status again = Publish();
      lock.lock();
      if (again.ok()) {
        ++stats.republished;
      } else {
        ++stats.failures;
      }
    }
  }

  EtcdClient client;
  const std::vector<WorkerRegistration> registrations;
  const std::chrono::seconds ttl;
  std::function<void(std::string_view)> log;
  mutable std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;
  std::int64_t lease = 0;
  std::uint64_t failing_since_ok = 0;  // keepalive failures since the last success
  Stats stats;
  std::thread thread;
};

Result<std::unique_ptr<EtcdRegistrar>> EtcdRegistrar::Start(
    EtcdOptions options, std::vector<WorkerRegistration> registrations, std::chrono::seconds ttl,
    std::function<void(std::string_view)> log) {
  if (Status valid = Validate(options); !valid.ok()) return tl::unexpected(valid);
  if (registrations.empty()) return Err(ErrorCode::kInvalidArgument, "etcd: nothing to register");
  if (ttl.count() < 1) return Err(ErrorCode::kInvalidArgument, "etcd lease TTL must be >= 1 s");
  for (const WorkerRegistration& r : registrations) {
    if (Status valid = Validate(r); !valid.ok()) return tl::unexpected(valid);
    if (r.engine_id != registrations.front().engine_id ||
        r.incarnation != registrations.front().incarnation) {
      return Err(ErrorCode::kInvalidArgument, "etcd: registrations of more than one engine");
    }
  }
  auto impl = std::make_unique<Impl>(std::move(options), std::move(registrations), ttl,
                                     std::move(log));
  if (Status published = impl->Publish(); !published.ok()) {
    return Err(published.code(), "etcd registration: " + published.message());
  }
  impl->Log(fmt::format("etcd: engine {} incarnation {} registered ({} workers, lease TTL {} s)",
                        impl->registrations.front().engine_id,
                        impl->registrations.front().incarnation, impl->registrations.size(),
                        ttl.count()));
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->Loop(); });
  return std::unique_ptr<EtcdRegistrar>(new EtcdRegistrar(std::move(impl)));
}

EtcdRegistrar::EtcdRegistrar(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
EtcdRegistrar::~EtcdRegistrar() { Stop(); }

void EtcdRegistrar::Stop() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (impl_->stopping) return;
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  if (impl_->thread.joinable()) impl_->thread.join();
  if (Status revoked = impl_->client.Revoke(impl_->lease); !revoked.ok()) {
    impl_->Log("etcd: could not revoke the lease (its keys go when it expires): " +
               revoked.message());
  }
}

EtcdRegistrar::Stats EtcdRegistrar::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->stats;
}

// ---- EtcdWatcher

struct EtcdWatcher::Impl {
  Impl(EtcdOptions o, std::chrono::milliseconds p, DownCallback d,
       std::function<void(std::string_view)> l)
      : client(std::move(o)), poll(p), on_down(std::move(d)), log(std::move(l)) {}

  void Log(std::string_view line) const {
    if (log) log(line);
  }

  // `report` false (a lookup's refresh): engines found are added or updated, none is removed or
  // reported down — only the watcher's own thread does that, so no down callback ever runs on
  // a caller's thread.
  void PollOnce(bool report = true) {
    // One poll at a time (the thread's and lookups'), so an older answer never replaces a newer
    // one — that would report an engine that just registered as gone.
    std::lock_guard<std::mutex> serial(poll_mu);
    auto kvs = client.Range(EngineKeyPrefix(client.options()));
    if (!kvs) {
      std::lock_guard<std::mutex> lock(mu);
      ++stats.polls;
      ++stats.poll_failures;
      if (stats.healthy) Log("etcd: " + kvs.error().message() + "; keeping the engines last seen");
      stats.healthy = false;
      last_error = kvs.error().message();
      return;
    }
    // The registry's rules assemble each engine's ranks, one registry per engine: engines that
    // each run their own bootstrap may share a dp_rank, which one registry would refuse. An
    // entry that does not validate is skipped (it could only come from a bad writer, and must
    // not hide the others).
    std::map<std::string, BootstrapRegistry> per_engine;
    std::uint64_t refused = 0;
    Status first_refusal;
    for (const EtcdClient::KeyValue& kv : *kvs) {
      auto reg = DecodeRecord(client.options(), kv.key, kv.value);
      if (!reg) {
        if (reg.error().code() == ErrorCode::kUnauthenticated) {
          if (refused++ == 0) first_refusal = Status(reg.error().code(), kv.key + ": " + reg.error().message());
        }
        continue;
      }
      (void)per_engine[reg->engine_id].Register(*reg);
    }
    if (refused > 0) {
      std::lock_guard<std::mutex> lock(mu);
      stats.records_refused += refused;
      if (!warned_refusal) {
        warned_refusal = true;
        Log(fmt::format("etcd: ignoring {} record(s) not signed with the cluster secret, e.g. {}",
                        refused, first_refusal.message()));
      }
    }
    std::map<std::string, EngineInfo> now;
    for (auto& [id, registry] : per_engine) {
      auto info = registry.Query(id);
      if (info) now.emplace(id, std::move(*info));
    }
    std::vector<EngineInfo> gone;
    std::vector<std::pair<EngineInfo, std::string>> replaced;  // (old process, new incarnation)
    {
      std::lock_guard<std::mutex> lock(mu);
      ++stats.polls;
      if (!stats.healthy) Log("etcd: reachable; " + std::to_string(now.size()) + " engines");
      stats.healthy = true;
      if (!report) {
        // New engines, and known ones completing (more ranks of the same process). A known
        // engine under another incarnation is left to the reporting poll, which must see the
        // change to report the old process gone (found by review: a lookup's refresh that
        // took the new incarnation hid a restart from D).
        for (auto& [id, info] : now) {
          auto [known, added] = engines.try_emplace(id, info);
          if (!added && known->second.incarnation == info.incarnation) known->second = info;
        }
        return;
      }
      for (const auto& [id, info] : engines) {
        auto next = now.find(id);
        if (next == now.end()) {
          gone.push_back(info);
        } else if (next->second.incarnation != info.incarnation) {
          replaced.emplace_back(info, next->second.incarnation);
        }
      }
      stats.engines_down += gone.size();
      stats.engines_replaced += replaced.size();
      engines = std::move(now);
    }
    for (const EngineInfo& info : gone) {
      const Status why(ErrorCode::kUnavailable,
                       fmt::format("engine {} (incarnation {}) left etcd: its lease expired or was "
                                   "revoked",
                                   info.engine_id, info.incarnation));
      Log("etcd: " + why.message());
      if (on_down) on_down(info.engine_id, info.incarnation, "", why);
    }
    for (const auto& [info, successor] : replaced) {
      const Status why(ErrorCode::kUnavailable,
                       fmt::format("engine {} restarted: incarnation {} replaced {} in etcd",
                                   info.engine_id, successor, info.incarnation));
      Log("etcd: " + why.message());
      if (on_down) on_down(info.engine_id, info.incarnation, successor, why);
    }
  }

  void Loop() {
    std::unique_lock<std::mutex> lock(run_mu);
    while (!run_cv.wait_for(lock, poll, [&] { return stopping; })) {
      lock.unlock();
      PollOnce();
      lock.lock();
    }
  }

  EtcdClient client;
  const std::chrono::milliseconds poll;
  DownCallback on_down;
  std::function<void(std::string_view)> log;

  std::mutex poll_mu;     // held for a whole PollOnce; taken before mu, never after
  mutable std::mutex mu;  // engines, stats, last_error, last_refresh
  std::map<std::string, EngineInfo> engines;
  std::chrono::steady_clock::time_point last_refresh{};
  Stats stats;
  std::string last_error;
  bool warned_refusal = false;  // the first refused record is logged, the rest counted

  std::mutex run_mu;
  std::condition_variable run_cv;
  bool stopping = false;
  std::thread thread;
};

Result<std::unique_ptr<EtcdWatcher>> EtcdWatcher::Start(EtcdOptions options,
                                                        std::chrono::milliseconds poll_interval,
                                                        DownCallback on_down,
                                                        std::function<void(std::string_view)> log) {
  if (Status valid = Validate(options); !valid.ok()) return tl::unexpected(valid);
  if (poll_interval.count() <= 0) {
    return Err(ErrorCode::kInvalidArgument, "etcd poll interval must be positive");
  }
  auto impl = std::make_unique<Impl>(std::move(options), poll_interval, std::move(on_down),
                                     std::move(log));
  impl->stats.healthy = true;  // so a first failed poll is logged
  impl->PollOnce();
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->Loop(); });
  return std::unique_ptr<EtcdWatcher>(new EtcdWatcher(std::move(impl)));
}

EtcdWatcher::EtcdWatcher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
EtcdWatcher::~EtcdWatcher() { Stop(); }

void EtcdWatcher::Stop() {
  {
    std::lock_guard<std::mutex> lock(impl_->run_mu);
    if (impl_->stopping) return;
    impl_->stopping = true;
  }
  impl_->run_cv.notify_all();
  if (impl_->thread.joinable()) impl_->thread.join();
}

Result<EngineInfo> EtcdWatcher::Lookup(const std::string& engine_id) const {
  {
    // An engine that registered since the last poll would otherwise be "not registered" for up
    // to a poll interval, and D believes a failed lookup for a while: poll now, at most every
    // 100 ms (a client naming unknown engines cannot make D flood etcd).
    std::unique_lock<std::mutex> lock(impl_->mu);
    const auto now = std::chrono::steady_clock::now();
    if (impl_->engines.count(engine_id) == 0 &&
        now - impl_->last_refresh >= std::chrono::milliseconds(100)) {
      impl_->last_refresh = now;
      lock.unlock();
      impl_->PollOnce(/*report=*/false);
    }
  }
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->engines.find(engine_id);
  if (it == impl_->engines.end()) {
    if (!impl_->stats.healthy) {
      return Err(ErrorCode::kUnavailable,
                 fmt::format("engine {} is unknown and etcd is unreachable: {}", engine_id,
                             impl_->last_error));
    }
    return Err(ErrorCode::kNotFound, fmt::format("engine {} is not registered in etcd", engine_id));
  }
  if (!it->second.complete) {
    return Err(ErrorCode::kUnavailable,
               fmt::format("engine {}: {} of {} workers registered in etcd", engine_id,
                           it->second.workers.size(), it->second.tp_size * it->second.pp_size));
  }
  return it->second;
}

EtcdWatcher::Stats EtcdWatcher::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->stats;
}

}  // namespace kvferry::control
