// The etcd registry (opt-in; issue 12): P engines publish their workers' registrations in etcd
// under a lease they keep alive, and D learns engines — and their death — from it instead of
// querying each P's bootstrap. The per-P HTTP bootstrap stays the default, vLLM-compatible path.
//
// Layout: `<prefix>/engines/<engine_id>/<tp_rank>-<pp_rank>` = the WorkerRegistration JSON that
// POST /register carries (docs/bootstrap.md), every key of one engine process attached to one
// lease. A P that dies stops renewing; etcd deletes its keys when the lease's TTL runs out, and
// D, polling the prefix, sees the engine gone.
//
// Liveness from etcd is advisory (SPEC §3.6): "gone from etcd" makes D fail the loads waiting for
// that engine and fence its endpoints (protocol::DecodeSession::OnEngineDown); blocks whose pulls
// are in flight are released only by a fence or P's late answer, never by etcd alone — a P cut off
// by a partition may still be writing. While etcd is unreachable, D keeps the last engines it saw
// and reports nobody dead; lookups of engines it never saw fail with the reason.
//
// etcd is reached through its v3 JSON gateway (POST /v3/kv/range, /v3/kv/put, /v3/lease/grant,
// /v3/lease/keepalive, /v3/lease/revoke; etcd 3.4, Debian's etcd-server), one request per call,
// each with a deadline, trying the endpoints in turn.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "control/bootstrap_types.h"
#include "control/cluster_auth.h"
#include "kvferry/status.h"

namespace kvferry::control {

struct EtcdOptions {
  std::vector<std::string> endpoints;  // "http://host:port" (or "host:port"); at least one
  std::string prefix = "/kvferry";
  // The connect, read and write timeouts of one HTTP request to one member. A call tries each
  // endpoint once, so it returns within about endpoints.size() * 2 * request_timeout (connect,
  // then read); names are resolved by the system resolver, outside this bound — use addresses.
  std::chrono::milliseconds request_timeout{1000};
  // The cluster secret (docs/security.md); null: an open cluster. With it, P signs every
  // record it publishes (SignRecord, bound to its key) and D believes only records signed with
  // it: a record written by anyone else who can reach etcd — unsigned, signed with another
  // secret, or a member's record copied under another engine's key — is ignored and counted
  // (EtcdWatcher::Stats::records_refused). Without it D also reads signed records.
  std::shared_ptr<const ClusterSecret> cluster_secret;
};

// OK, or kInvalidArgument naming what is wrong (no endpoint, an endpoint that is not
// [http://]host:port, a prefix that is empty or does not start with '/').
[[nodiscard]] Status Validate(const EtcdOptions& options);

// A minimal etcd v3 client over the JSON gateway. Thread-safe (no shared connection state).
class EtcdClient {
 public:
  explicit EtcdClient(EtcdOptions options);

  struct KeyValue {
    std::string key;
    std::string value;
  };

  // A new lease of `ttl` seconds; its id.
  [[nodiscard]] Result<std::int64_t> Grant(std::chrono::seconds ttl);
  // Renews the lease; its remaining TTL in seconds, or kNotFound once it has expired.
  [[nodiscard]] Result<std::int64_t> KeepAlive(std::int64_t lease);
  [[nodiscard]] Status Revoke(std::int64_t lease);
  [[nodiscard]] Status Put(std::string_view key, std::string_view value, std::int64_t lease);
  // Every key beginning with `prefix`, in key order.
  [[nodiscard]] Result<std::vector<KeyValue>> Range(std::string_view prefix);

  const EtcdOptions& options() const { return options_; }

 private:
  // POSTs `body` to `path` on the endpoints in turn (starting with the last that answered) and
  // returns the first answer's JSON text. kUnavailable naming every endpoint's failure.
  Result<std::string> Call(const std::string& path, const std::string& body);

  EtcdOptions options_;
  std::atomic<std::size_t> preferred_{0};  // the endpoint that answered last: tried first
};

// P's side: publishes an engine's registrations under a lease and keeps it alive on a thread of
// its own (every ttl/3). If the lease is lost (etcd answered that it expired, e.g. after a
// partition longer than the TTL), it grants a new one and publishes again under the same
// incarnation, logging a warning: D may have failed this engine's waiting loads meanwhile, and
// the loads that come after will find it again. Stop() revokes the lease, so D sees a clean
// shutdown at once rather than a TTL later.
class EtcdRegistrar {
 public:
  struct Stats {
    std::uint64_t keepalives = 0;
    std::uint64_t failures = 0;        // keepalive calls that got no answer
    std::uint64_t republished = 0;     // leases lost and published again
  };

  // Publishes synchronously (so a misconfigured etcd fails P's start with the reason) and starts
  // the keepalive thread. `registrations` are one engine's workers (same engine_id and
  // incarnation). `log` gets one line per state change; may be empty.
  [[nodiscard]] static Result<std::unique_ptr<EtcdRegistrar>> Start(
      EtcdOptions options, std::vector<WorkerRegistration> registrations, std::chrono::seconds ttl,
      std::function<void(std::string_view)> log);
  ~EtcdRegistrar();  // Stop()s
  EtcdRegistrar(const EtcdRegistrar&) = delete;
  EtcdRegistrar& operator=(const EtcdRegistrar&) = delete;

  // Joins the thread and revokes the lease (bounded by the client's deadlines). Idempotent.
  void Stop();
  Stats stats() const;

 private:
  struct Impl;
  explicit EtcdRegistrar(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// D's side: polls `<prefix>/engines/` every `poll_interval` on a thread of its own and keeps the
// engines it finds (assembled by BootstrapRegistry's rules, so an engine is `complete` only when
// every rank is there). When an engine that was present disappears, `on_down(engine_id,
// incarnation, "", why)` is called on that thread; when its keys name another incarnation
// (the engine restarted within its lease's TTL, so its keys were replaced, not deleted),
// `on_down(engine_id, old incarnation, new incarnation, why)`. A poll that fails changes
// nothing (advisory).
class EtcdWatcher {
 public:
  using DownCallback =
      std::function<void(const std::string& engine_id, const std::string& incarnation,
                         const std::string& successor, const Status& why)>;

  struct Stats {
    std::uint64_t polls = 0;
    std::uint64_t poll_failures = 0;
    std::uint64_t engines_down = 0;
    std::uint64_t engines_replaced = 0;  // re-registered under another incarnation
    std::uint64_t records_refused = 0;   // records not believed (signature), summed over polls
    bool healthy = false;  // the last poll succeeded
  };

  // Polls once before returning (its failure is logged, not returned: D starts while etcd is
  // away and finds engines once it is back).
  [[nodiscard]] static Result<std::unique_ptr<EtcdWatcher>> Start(
      EtcdOptions options, std::chrono::milliseconds poll_interval, DownCallback on_down,
      std::function<void(std::string_view)> log);
  ~EtcdWatcher();  // Stop()s
  EtcdWatcher(const EtcdWatcher&) = delete;
  EtcdWatcher& operator=(const EtcdWatcher&) = delete;

  void Stop();  // joins the thread; idempotent

  // The engine as last seen; one it has not seen makes it poll etcd now (at most every
  // 100 ms), so an engine that just registered is found at once. kNotFound (not registered),
  // kUnavailable (registered but not all ranks yet, or etcd unreachable and the engine never
  // seen: the message says which). Thread-safe; may block for one etcd call.
  [[nodiscard]] Result<EngineInfo> Lookup(const std::string& engine_id) const;
  Stats stats() const;

 private:
  struct Impl;
  explicit EtcdWatcher(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvferry::control
