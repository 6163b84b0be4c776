// The `--kv-transfer-config` JSON of `kvferry serve`, read with vLLM's key names so that the same
// string works for both (SPEC §2):
//
//   {"kv_connector": "...", "kv_role": "kv_producer" | "kv_consumer", "engine_id": "...",
//    "kv_load_failure_policy": "fail",
//    "kv_connector_extra_config": {"kv_lease_duration": 30, "abort_request_timeout": 480,
//                                  "bootstrap_port": 8998, "kv_release": true,
//                                  "cluster_secret_file": "/etc/kvferry/secret"}}
//
// Unknown keys are accepted and reported as warnings (vLLM's configs carry many keys the harness
// has no use for); malformed JSON, wrong types and out-of-range values are errors.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/core/time.h"
#include "kvferry/status.h"

namespace kvferry::harness {

enum class Role { kPrefill, kDecode };
const char* ToString(Role role);
// "prefill" / "decode"; kInvalidArgument otherwise.
Result<Role> ParseRole(std::string_view text);

struct KvTransferConfig {
  std::optional<Role> role;  // from kv_role, when present
  std::string engine_id;     // empty: the caller picks a default
  core::Duration lease{0};   // kv_lease_duration; 0 = off
  core::Duration abort_request_timeout = std::chrono::seconds(480);
  int bootstrap_port = 8998;  // P: where its embedded bootstrap service listens (0: any)
  // D: release a transfer to P as soon as its request no longer needs it (wire::Release).
  // false only to measure what that saves; the lease (or timeout) still frees P's KV.
  bool release = true;
  // Cluster authentication (docs/security.md): the secret file every P, D and bootstrap of
  // the cluster shares. Empty: the cluster is open (the default, as in vLLM). Only the path is
  // parsed here; RunServe loads and checks the file.
  std::string cluster_secret_file;
  // The etcd registry (opt-in; control/etcd_registry.h): endpoints ("http://host:port"); empty:
  // off (the per-P bootstrap only). P publishes its workers under a lease of etcd_lease_ttl;
  // D finds engines there instead of in each P's bootstrap, and fails the loads waiting for an
  // engine that left etcd at once.
  std::vector<std::string> etcd_endpoints;
  std::string etcd_prefix = "/kvferry";
  std::chrono::seconds etcd_lease_ttl{5};
  // D: receiver-side fencing (transport::UcxOptions::fence_writes): P's writes come through
  // D's own handlers, stamped with each pull's write key, so D can revoke a silent or dead P's
  // keys and release the blocks it quarantined for it. Costs the one-sided put path (shared
  // memory, RDMA) into D. nullopt: on exactly when etcd is configured (where D learns of a P's
  // death and must act on it without waiting for P).
  std::optional<bool> fence_writes;
  std::string kv_load_failure_policy = "fail";
  std::vector<std::string> warnings;  // one line per ignored key
};

// The vLLM connector parses the same kv_connector_extra_config keys in Python
// (python/kvferry/vllm/config.py); tests/data/kv_connector_extra_config_cases.json holds both
// to one set of cases.
// Parses `json`. `env_abort_timeout` is the value of KVFERRY_ABORT_REQUEST_TIMEOUT (null when
// unset); it applies only when the JSON has no abort_request_timeout. Errors: kInvalidArgument
// with the offending key in the message.
Result<KvTransferConfig> ParseKvTransferConfig(std::string_view json,
                                               const char* env_abort_timeout);

}  // namespace kvferry::harness
