// Bootstrap data model (SPEC §1, §4): what a P worker registers with the bootstrap service and
// what D learns about a P engine from it. Plain structs, no I/O; shared by the server, the
// client and D's EngineDirectory.
//
// Unlike vLLM's Mooncake bootstrap, an engine states its own tp_size/pp_size (D never infers the
// TP size from how many ranks happened to register), its lease and protocol version (so D can
// refuse a misconfigured pairing up front), and an `incarnation` that changes on every P restart
// (so D can tell a restarted P, whose old transfers are gone, from the one it knew).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvferry/status.h"

namespace kvferry::control {

// Input limits. A registration beyond them is rejected with a reason (HTTP 400) and changes
// nothing; D applies the same limits to query answers.
inline constexpr std::size_t kMaxBodyBytes = 64 * 1024;      // one HTTP request body
inline constexpr std::size_t kMaxStringBytes = 256;          // ids and addresses
inline constexpr std::uint32_t kMaxRank = 1024;              // dp/tp/pp ranks are < this
inline constexpr std::uint32_t kMaxWorkersPerEngine = 1024;  // tp_size * pp_size
// A lease longer than a day is a configuration mistake; bounding it also keeps D's and P's
// `now + lease` arithmetic far from overflow.
inline constexpr double kMaxLeaseSeconds = 86400.0;

// One P worker's entry, sent by that worker (POST /register).
struct WorkerRegistration {
  std::string engine_id;         // the P engine (vLLM's engine_id / D's remote_engine_id)
  std::uint32_t dp_rank = 0;     // one engine per dp_rank
  std::uint32_t tp_rank = 0;     // < tp_size
  std::uint32_t pp_rank = 0;     // < pp_size
  std::uint32_t tp_size = 1;     // the engine's TP size, stated by every rank
  std::uint32_t pp_size = 1;     // the engine's PP size, stated by every rank
  std::string side_channel;      // the worker's ZeroMQ ROUTER, e.g. "tcp://10.0.0.1:5555"
  std::string data_plane;        // opaque data-plane address of the worker
  double kv_lease_duration = 0;  // seconds; 0 = lease off
  std::uint32_t protocol_version = 0;
  // wire::kFeature* bits: the optional messages this worker's side channel reads (JSON key
  // "protocol_features", absent = 0 from a build before them). D sends a Release only to an
  // engine that advertises it, so an older P never has to answer one with an ERROR.
  std::uint32_t protocol_features = 0;
  std::string incarnation;  // random id, new on every P process start (all ranks share it)

  friend bool operator==(const WorkerRegistration&, const WorkerRegistration&) = default;
};

// OK, or kInvalidArgument naming the first field that is missing or out of range: empty or
// over-long strings, strings outside printable ASCII (ids and addresses end up in logs and URLs),
// ranks >= kMaxRank, tp_rank >= tp_size, pp_rank >= pp_size, sizes of 0 or with
// tp_size * pp_size > kMaxWorkersPerEngine, a lease that is negative, not finite or above
// kMaxLeaseSeconds. `data_plane` may be empty (a P without a data plane of its own yet).
[[nodiscard]] Status Validate(const WorkerRegistration& r);

// One P process's identity: the engine it serves and the incarnation it registers with.
struct EngineIncarnation {
  std::string engine_id;
  std::string incarnation;

  friend bool operator==(const EngineIncarnation&, const EngineIncarnation&) = default;
};

// One worker as D sees it in a query answer.
struct WorkerAddress {
  std::uint32_t dp_rank = 0;
  std::uint32_t tp_rank = 0;
  std::uint32_t pp_rank = 0;
  std::string side_channel;
  std::string data_plane;

  friend bool operator==(const WorkerAddress&, const WorkerAddress&) = default;
};

// A P engine's current incarnation as the bootstrap service knows it (GET /query).
struct EngineInfo {
  std::string engine_id;
  std::string incarnation;
  std::uint32_t dp_rank = 0;
  std::uint32_t tp_size = 1;
  std::uint32_t pp_size = 1;
  double kv_lease_duration = 0;  // seconds; 0 = off
  std::uint32_t protocol_version = 0;
  std::uint32_t protocol_features = 0;  // as registered (WorkerRegistration)
  // Every (tp_rank, pp_rank) in tp_size x pp_size has registered. D must not pair with an
  // incomplete engine: the ranks it needs may be missing.
  bool complete = false;
  std::vector<WorkerAddress> workers;  // sorted by (pp_rank, tp_rank), no duplicates

  // The worker at (tp_rank, pp_rank), or nullptr if it has not registered.
  [[nodiscard]] const WorkerAddress* Find(std::uint32_t tp_rank, std::uint32_t pp_rank) const;

  friend bool operator==(const EngineInfo&, const EngineInfo&) = default;
};

// One engine of a bootstrap service as its listing (GET /query without a parameter) names it:
// what a router needs to send requests to that engine. The listing of a vLLM Mooncake
// bootstrap has the same shape, without kvferry's fields (docs/bootstrap.md).
struct DpEngine {
  std::uint32_t dp_rank = 0;  // < kMaxRank; one engine per dp_rank
  std::string engine_id;      // 1..kMaxStringBytes of printable ASCII
  // False while some of the engine's ranks have not registered (kvferry's `complete`): D would
  // refuse to pair with it. A listing without the field (Mooncake's) counts as complete.
  bool complete = true;

  friend bool operator==(const DpEngine&, const DpEngine&) = default;
};

// OK, or kProtocol describing why `info` cannot have come from a correct bootstrap service
// (limits as in Validate, a worker outside tp_size x pp_size or of another dp_rank, duplicates,
// unsorted workers, or `complete` disagreeing with the workers). D checks every query answer.
[[nodiscard]] Status ValidateEngineInfo(const EngineInfo& info);

// D's check before pairing with a P engine (SPEC §4: lease misconfiguration is an explicit
// error). OK when both sides have the same kv_lease_duration; kLeaseMismatch otherwise, with a
// message naming both values and the engine, e.g.
//   "kv_lease_duration mismatch: decoder has 30s, prefiller has off (engine prefill-0)".
// kInvalidArgument if `decoder_lease_s` is negative or not finite.
[[nodiscard]] Status CheckLease(double decoder_lease_s, const EngineInfo& prefiller);

// "off" for 0, otherwise seconds with a unit ("30s", "0.5s"): how leases appear in messages.
[[nodiscard]] std::string LeaseText(double lease_s);

}  // namespace kvferry::control
