// The `--kv-transfer-config` JSON of `kvferry serve`, read with vLLM's key names so that the same
// string works for both (SPEC §2):
//
//   {"kv_connector": "...", "kv_role": "kv_producer" | "kv_consumer", "engine_id": "...",
//    "kv_load_failure_policy": "fail",
//    "kv_connector_extra_config": {"kv_lease_duration": 30, ...}}
//
// kv_connector_extra_config goes to runtime::ParseConnectorConfig, the vLLM connector's parser.
//
// Unknown keys are accepted and reported as warnings (vLLM's configs carry many keys the harness
// has no use for); malformed JSON, wrong types and out-of-range values are errors.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/status.h"
#include "runtime/connector_config.h"

namespace kvferry::harness {

enum class Role { kPrefill, kDecode };
const char* ToString(Role role);
// "prefill" / "decode"; kInvalidArgument otherwise.
Result<Role> ParseRole(std::string_view text);

struct KvTransferConfig {
  std::optional<Role> role;  // from kv_role, when present
  std::string engine_id;     // empty: the caller picks a default
  std::string kv_load_failure_policy = "fail";
  // kv_connector_extra_config, read by the parser the vLLM connector uses too. Of its keys,
  // `serve` acts on the lease, abort_request_timeout, bootstrap_port, kv_release, fence_writes
  // (nullopt: on exactly when etcd is configured, where D learns of a P's death and must act
  // on it without waiting for P), cluster_secret_file (RunServe loads and checks the file) and
  // the etcd_* keys; kServeIgnoresKeys lists the connector's keys it has no use for.
  runtime::ConnectorConfig extra;
  std::vector<std::string> warnings;  // one line per ignored key
};

// The connector's keys that `serve` checks but does not act on: it has no staging (its KV is
// host memory), no external bootstrap service and no load-failure service.
inline constexpr std::string_view kServeIgnoresKeys[] = {
    "bootstrap_server_address", "load_failure_port", "kv_staging", "kv_staging_blocks",
    "layer_writes"};

// Parses `json`. `env` supplies the environment fallbacks of runtime::ParseConnectorConfig
// (KVFERRY_ABORT_REQUEST_TIMEOUT, ...). Errors: kInvalidArgument with the offending key in the
// message.
Result<KvTransferConfig> ParseKvTransferConfig(std::string_view json,
                                               const runtime::EnvLookup& env);

}  // namespace kvferry::harness
