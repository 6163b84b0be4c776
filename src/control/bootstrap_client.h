// Client side of the bootstrap service: BootstrapClient (P workers register, D queries) and
// EngineDirectory (D's cache of P engines).
//
// Every call blocks for at most the timeout its caller passes: connect, each read and write are
// bounded by the time left, and a watchdog aborts a call that is still running when the time is
// up (a server that trickles bytes cannot stretch it). Answers are size-limited and validated
// (ValidateEngineInfo) before anyone sees them.
//
// Cluster authentication (docs/security.md): a client with a ClusterSecret signs its
// registrations and accepts only /query answers signed with the same secret.

#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "control/bootstrap_types.h"
#include "control/cluster_auth.h"
#include "kvferry/status.h"

namespace kvferry::control {

using Timeout = std::chrono::milliseconds;

// Where a bootstrap service listens. Accepted spellings: "host:port", "http://host:port" (an
// optional trailing '/'), and "[v6addr]:port" in either form. https is not supported.
struct BootstrapAddress {
  std::string host;  // without brackets
  int port = 0;

  std::string ToString() const;  // "host:port" ("[::1]:port" for IPv6)
};
[[nodiscard]] Result<BootstrapAddress> ParseBootstrapAddress(std::string_view address);

// Register()'s retries. Each attempt is bounded by min(attempt_timeout, time left); the pause
// between attempts starts at initial_backoff and doubles up to max_backoff.
struct RetryPolicy {
  Timeout attempt_timeout{2000};
  Timeout initial_backoff{50};
  Timeout max_backoff{1000};
};

// Stateless apart from its address and secret: safe to use from many threads at once. Each
// call opens its own connection (bootstrap traffic is a handful of calls per engine lifetime).
//
// With a `secret`, Register signs each attempt (Authorization: kvferry-hmac ...) and Query /
// QueryAll accept only answers whose X-Kvferry-Signature verifies (kUnauthenticated otherwise:
// unsigned, forged, or older than kMaxClockSkewSeconds). Without one, nothing is signed, and a
// Query answer that is signed is refused with kUnauthenticated too: the service belongs to an
// authenticated cluster whose side channels would refuse this process anyway, so the pairing
// fails now, with the reason, instead of as pull timeouts later.
class BootstrapClient {
 public:
  explicit BootstrapClient(BootstrapAddress address,
                           std::shared_ptr<const ClusterSecret> secret = nullptr)
      : address_(std::move(address)), secret_(std::move(secret)) {}
  // kInvalidArgument if `address` does not parse.
  [[nodiscard]] static Result<BootstrapClient> Create(
      std::string_view address, std::shared_ptr<const ClusterSecret> secret = nullptr);

  // Registers one worker, retrying transport failures and 5xx answers (other than "registry
  // full") with backoff until `timeout` has passed; safe because an identical re-registration
  // is idempotent. Returns OK, kInvalidArgument (the registration is invalid: checked here
  // before any I/O, or the server said 400), kAlreadyExists (409: a conflict, with the server's
  // reason), kResourceExhausted (the registry is full), kUnauthenticated (401: the service
  // requires a signature this client lacks or the server could not verify), or kTimeout /
  // kUnavailable (the service did not answer in time / could not be reached; the message counts
  // the attempts).
  [[nodiscard]] Status Register(const WorkerRegistration& registration, Timeout timeout,
                                const RetryPolicy& retry = {}) const;

  // The engine's current registration; one attempt. kNotFound for an unknown engine,
  // kInvalidArgument for an id the server refuses, kProtocol for a malformed answer (or an
  // answer about another engine), kUnauthenticated for an answer whose signature is missing or
  // wrong (see the class comment), kTimeout / kUnavailable for transport failures.
  [[nodiscard]] Result<EngineInfo> Query(const std::string& engine_id, Timeout timeout) const;
  // Every engine the service knows (GET /query), sorted by dp_rank; one attempt. Errors as
  // Query's, except that a signed answer is accepted without a secret.
  [[nodiscard]] Result<std::vector<EngineInfo>> QueryAll(Timeout timeout) const;
  // The same listing read as a router reads it (DecodeDpEngines): the engine id of each dp
  // rank, from kvferry's bootstrap or a vLLM Mooncake bootstrap; one attempt. Without a secret
  // a signed answer is accepted (a router takes no part in the cluster's side channels); with
  // one, only an answer signed with it (kUnauthenticated otherwise). kProtocol for an answer
  // that is malformed or breaks a limit (over kMaxListAnswerBytes included), kTimeout /
  // kUnavailable for transport failures, the server's reason for a non-200 answer.
  [[nodiscard]] Result<std::vector<DpEngine>> QueryDpEngines(Timeout timeout) const;
  // OK if GET /health answers 200 {"status":"ok"} in time.
  [[nodiscard]] Status Health(Timeout timeout) const;

  const BootstrapAddress& address() const { return address_; }

 private:
  // GET /query without an engine: the body of a 200 answer whose signature checks, or why not.
  Result<std::string> Listing(Timeout timeout) const;

  BootstrapAddress address_;
  std::shared_ptr<const ClusterSecret> secret_;  // null: an open cluster
};

// What EngineDirectory::Lookup returns.
struct EngineLookup {
  std::shared_ptr<const EngineInfo> info;  // never null; always complete
  // True when this lookup fetched an incarnation other than the one the directory saw for this
  // engine before: P restarted, so D must treat it as a new peer (its old transfers are gone;
  // forget that it rejected renewals, re-check the lease). Every caller that shared the fetch
  // gets true; later lookups served from the cache get false.
  bool incarnation_changed = false;
  std::string previous_incarnation;  // set when incarnation_changed
};

// D's view of P engines. Thread-safe: D's scheduler and workers may call it concurrently. The
// mutex is never held during HTTP I/O; concurrent lookups of the same engine at the same
// address share one query.
class EngineDirectory {
 public:
  // `secret`: the cluster secret every query answer must be signed with (BootstrapClient);
  // null for an open cluster.
  explicit EngineDirectory(std::shared_ptr<const ClusterSecret> secret = nullptr)
      : secret_(std::move(secret)) {}
  EngineDirectory(const EngineDirectory&) = delete;
  EngineDirectory& operator=(const EngineDirectory&) = delete;

  // The engine's info: from the cache, or queried from `bootstrap_addr` (before first contact,
  // after Invalidate, or when the request names another bootstrap address than the cached
  // info came from). Only complete engines are cached and returned: an incomplete one yields
  // kUnavailable ("2 of 4 workers registered") so the caller retries later. Other errors are
  // BootstrapClient::Query's, or kTimeout when a shared query did not finish in `timeout`.
  // Failures are not cached.
  [[nodiscard]] Result<EngineLookup> Lookup(const std::string& engine_id,
                                            const std::string& bootstrap_addr, Timeout timeout);

  // Drops the cached info (call it when a side channel to the engine fails); the next Lookup
  // queries again. The incarnation last seen is kept, so that lookup reports a restart. A query
  // already in flight still answers its callers but does not refill the cache.
  void Invalidate(const std::string& engine_id);

  // The cached info, or null. Never does I/O.
  [[nodiscard]] std::shared_ptr<const EngineInfo> Cached(const std::string& engine_id) const;

  // Queries sent so far (metrics; tests use it to see deduplication).
  std::uint64_t queries_sent() const;

 private:
  struct Flight;
  struct Entry {
    std::shared_ptr<const EngineInfo> info;
    std::string info_addr;         // the bootstrap address `info` came from
    std::string last_incarnation;  // survives Invalidate
    std::uint64_t epoch = 0;       // bumped by Invalidate
    std::shared_ptr<Flight> flight;
  };

  const std::shared_ptr<const ClusterSecret> secret_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, Entry> entries_;
  std::uint64_t queries_sent_ = 0;
};

}  // namespace kvferry::control
