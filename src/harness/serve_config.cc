#include "harness/serve_config.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "control/json_limits.h"

namespace kvferry::harness {

using nlohmann::json;

const char* ToString(Role role) { return role == Role::kPrefill ? "prefill" : "decode"; }

Result<Role> ParseRole(std::string_view text) {
  if (text == "prefill") return Role::kPrefill;
  if (text == "decode") return Role::kDecode;
  return Err(ErrorCode::kInvalidArgument,
             fmt::format("role must be prefill or decode, not '{}'", text));
}

Result<KvTransferConfig> ParseKvTransferConfig(std::string_view text,
                                               const runtime::EnvLookup& env) {
  KvTransferConfig config;
  // The extra config is dumped again for the connector's parser, and dump recurses per level.
  if (control::JsonDepth(text) > control::kMaxJsonDepth) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("--kv-transfer-config nests deeper than {} levels",
                           control::kMaxJsonDepth));
  }
  json doc = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
    return Err(ErrorCode::kInvalidArgument, "--kv-transfer-config is not valid JSON");
  }
  if (!doc.is_object()) {
    return Err(ErrorCode::kInvalidArgument, "--kv-transfer-config must be a JSON object");
  }
  json extra = json::object();
  for (const auto& [key, value] : doc.items()) {
    if (key == "kv_role") {
      if (!value.is_string()) return Err(ErrorCode::kInvalidArgument, "kv_role must be a string");
      const std::string role = value.get<std::string>();
      if (role == "kv_producer") {
        config.role = Role::kPrefill;
      } else if (role == "kv_consumer") {
        config.role = Role::kDecode;
      } else {
        return Err(ErrorCode::kInvalidArgument,
                   fmt::format("kv_role '{}' is not supported (kv_producer or kv_consumer)", role));
      }
    } else if (key == "engine_id") {
      if (!value.is_string() || value.get<std::string>().empty() ||
          value.get<std::string>().size() > 128) {
        return Err(ErrorCode::kInvalidArgument, "engine_id must be a string of 1..128 bytes");
      }
      config.engine_id = value.get<std::string>();
    } else if (key == "kv_load_failure_policy") {
      if (!value.is_string() || value.get<std::string>() != "fail") {
        return Err(ErrorCode::kInvalidArgument,
                   "kv_load_failure_policy: only \"fail\" is supported by the harness");
      }
    } else if (key == "kv_connector") {
      // Any connector name is accepted: the harness is the connector.
    } else if (key == "kv_connector_extra_config") {
      extra = value;  // an object or not: the connector's parser says
    } else {
      config.warnings.push_back(fmt::format("ignoring kv-transfer-config key {}", key));
    }
  }
  auto parsed = runtime::ParseConnectorConfig(extra.dump(), env, kServeIgnoresKeys);
  if (!parsed) return tl::unexpected(parsed.error());
  config.extra = std::move(*parsed);
  for (const std::string& key : config.extra.ignored_keys) {
    config.warnings.push_back(fmt::format("ignoring kv_connector_extra_config.{}", key));
  }
  return config;
}

}  // namespace kvferry::harness
