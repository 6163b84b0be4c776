// kvferry's keys of vLLM's `kv_connector_extra_config`, parsed in one place for both of kvferry's
// front ends: `kvferry serve` (harness/serve_config.h reads the rest of --kv-transfer-config and
// hands this parser the extra config) and the vLLM connector (python/kvferry/vllm/config.py,
// through the binding's `parse_connector_config`). One parser, so a key cannot mean one thing
// to `serve` and another to vLLM; docs/vllm.md lists the keys for users.
//
//   {"kv_lease_duration": 30, "abort_request_timeout": 480, "bootstrap_port": 8998,
//    "bootstrap_server_address": "10.0.0.1:8998", "kv_release": true, "fence_writes": false,
//    "load_failure_port": 8999, "kv_staging": "auto", "kv_staging_blocks": 4096,
//    "cluster_secret_file": "/etc/kvferry/secret",
//    "etcd_endpoints": ["http://10.0.0.9:2379"], "etcd_prefix": "/kvferry", "etcd_lease_ttl": 5}
//
// Contract:
//  - Every key is bounded before use; a wrong type or an out-of-range value is kInvalidArgument
//    naming the key (and the environment variable, for a fallback), and nothing is returned.
//  - Keys kvferry does not know are not errors (vLLM's configs carry other connectors' keys, e.g.
//    MooncakeConnector's num_workers): they are listed in `ignored_keys` for the caller to log.
//    So are known keys that the caller's front end does not use (`unused_here`), after they are
//    checked: a bad value is an error wherever it is given.
//  - Durations are seconds in the JSON, core::Duration here; anything above a day is a typo.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/core/time.h"
#include "kvferry/status.h"

namespace kvferry::runtime {

// How the vLLM connector's worker moves a KV cache (python/kvferry/vllm/staging.py): through host
// staging slots when the cache is not in host memory (kAuto), always (kHost: the staging path on
// a host cache, how tests run it without a GPU), or never (kOff: register the cache as it is).
enum class StagingMode : std::uint8_t { kAuto, kHost, kOff };
const char* ToString(StagingMode mode);  // "auto", "host", "off"

inline constexpr std::uint32_t kMaxStagingBlocks = std::uint32_t{1} << 24;
inline constexpr double kMaxConfigSeconds = 86400;

struct ConnectorConfig {
  // Renewal lease; 0 = off (P keeps KV until abort_request_timeout). The same on P and D.
  core::Duration lease{0};
  // From the key, else env KVFERRY_ABORT_REQUEST_TIMEOUT, else VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT
  // (MooncakeConnector's name), else 480 s.
  core::Duration abort_request_timeout = std::chrono::seconds(480);
  // P: where its bootstrap service listens (0: any free port). From the key, else env
  // VLLM_MOONCAKE_BOOTSTRAP_PORT (MooncakeConnector's only way to set it), else 8998.
  int bootstrap_port = 8998;
  // "host:port" of a bootstrap service elsewhere that P registers with; empty: P starts its own.
  std::string bootstrap_server_address;
  // D releases a transfer to P as soon as its request no longer needs it (wire::Release).
  bool release = true;
  // D fences its writers (transport::UcxOptions::fence_writes). nullopt: the front end decides
  // (serve: on exactly when etcd is configured; the connector: off).
  std::optional<bool> fence_writes;
  // P: the layers of a prompt's last step leave for a decoder already waiting as each is
  // computed (PrefillSession::LayersReady), not after the prefill. The connector does so only
  // for KV it registers as it is in host memory (not staged, not a GPU's: a GPU computes a
  // layer after save_kv_layer returns); `serve`, whose engine has no layers, ignores it. Off by
  // default: host KV means a CPU engine, whose forward pass then competes with the writes for
  // the cores, and through real vLLM on 2 cores time-to-first-token got worse (median 1,255 ms
  // against 525 ms, two of eight requests stalled 15-18 s; docs/performance.md).
  bool layer_writes = false;
  // D: the port of its load-failure service (0: any free one); nullopt: none.
  std::optional<int> load_failure_port;
  StagingMode staging = StagingMode::kAuto;
  // Staging slots per KV-cache group, 1..kMaxStagingBlocks; nullopt: the KV cache's block count.
  std::optional<std::uint32_t> staging_blocks;
  // The cluster secret's file (docs/security.md); empty: an open cluster. Only the path is
  // checked here; the front end loads and checks the file.
  std::string cluster_secret_file;
  // The etcd registry (control/etcd_registry.h); empty endpoints: off.
  std::vector<std::string> etcd_endpoints;
  std::string etcd_prefix = "/kvferry";
  std::chrono::seconds etcd_lease_ttl{5};
  // Unknown keys and the caller's `unused_here` keys that were given, sorted.
  std::vector<std::string> ignored_keys;
};

// An environment variable's value by name; nullopt when unset. Empty values count as unset.
using EnvLookup = std::function<std::optional<std::string>(std::string_view name)>;
// The process's environment (getenv).
EnvLookup ProcessEnvironment();

// Parses `extra_json`, a JSON object (the text of kv_connector_extra_config). `unused_here`: the
// known keys the caller's front end does not act on (reported in ignored_keys when given).
[[nodiscard]] Result<ConnectorConfig> ParseConnectorConfig(
    std::string_view extra_json, const EnvLookup& env,
    std::span<const std::string_view> unused_here = {});

}  // namespace kvferry::runtime
