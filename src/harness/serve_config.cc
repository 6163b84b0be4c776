#include "harness/serve_config.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <nlohmann/json.hpp>

namespace kvferry::harness {

namespace {

using nlohmann::json;

// Durations are seconds in the JSON; anything above a day is a typo, not a lease.
constexpr double kMaxSeconds = 86400;

Result<core::Duration> SecondsValue(const json& value, std::string_view key, bool allow_zero) {
  if (!value.is_number()) {
    return Err(ErrorCode::kInvalidArgument, fmt::format("{} must be a number of seconds", key));
  }
  const double s = value.get<double>();
  if (!std::isfinite(s) || s < 0 || (!allow_zero && s == 0) || s > kMaxSeconds) {
    return Err(ErrorCode::kInvalidArgument, fmt::format("{} = {} is out of range ({}0, {}] s", key,
                                                        s, allow_zero ? "[" : "(", kMaxSeconds));
  }
  return core::Seconds(s);
}

}  // namespace

const char* ToString(Role role) { return role == Role::kPrefill ? "prefill" : "decode"; }

Result<Role> ParseRole(std::string_view text) {
  if (text == "prefill") return Role::kPrefill;
  if (text == "decode") return Role::kDecode;
  return Err(ErrorCode::kInvalidArgument,
             fmt::format("role must be prefill or decode, not '{}'", text));
}

Result<KvTransferConfig> ParseKvTransferConfig(std::string_view text,
                                               const char* env_abort_timeout) {
  KvTransferConfig config;
  json doc = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
    return Err(ErrorCode::kInvalidArgument, "--kv-transfer-config is not valid JSON");
  }
  if (!doc.is_object()) {
    return Err(ErrorCode::kInvalidArgument, "--kv-transfer-config must be a JSON object");
  }
  bool abort_from_json = false;
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
      if (!value.is_object()) {
        return Err(ErrorCode::kInvalidArgument, "kv_connector_extra_config must be an object");
      }
      for (const auto& [extra_key, extra] : value.items()) {
        if (extra_key == "kv_lease_duration") {
          auto lease = SecondsValue(extra, extra_key, /*allow_zero=*/true);
          if (!lease) return tl::unexpected(lease.error());
          config.lease = *lease;
        } else if (extra_key == "abort_request_timeout") {
          auto timeout = SecondsValue(extra, extra_key, /*allow_zero=*/false);
          if (!timeout) return tl::unexpected(timeout.error());
          config.abort_request_timeout = *timeout;
          abort_from_json = true;
        } else if (extra_key == "kv_release") {
          if (!extra.is_boolean()) {
            return Err(ErrorCode::kInvalidArgument, "kv_release must be true or false");
          }
          config.release = extra.get<bool>();
        } else if (extra_key == "fence_writes") {
          if (!extra.is_boolean()) {
            return Err(ErrorCode::kInvalidArgument, "fence_writes must be true or false");
          }
          config.fence_writes = extra.get<bool>();
        } else if (extra_key == "etcd_endpoints") {
          if (!extra.is_array() || extra.empty() || extra.size() > 16) {
            return Err(ErrorCode::kInvalidArgument,
                       "etcd_endpoints must be a list of 1..16 \"http://host:port\" strings");
          }
          for (const auto& e : extra) {
            if (!e.is_string() || e.get<std::string>().empty() ||
                e.get<std::string>().size() > 256) {
              return Err(ErrorCode::kInvalidArgument,
                         "etcd_endpoints must be a list of 1..16 \"http://host:port\" strings");
            }
            config.etcd_endpoints.push_back(e.get<std::string>());
          }
        } else if (extra_key == "etcd_prefix") {
          if (!extra.is_string() || extra.get<std::string>().empty() ||
              extra.get<std::string>().front() != '/' || extra.get<std::string>().size() > 128) {
            return Err(ErrorCode::kInvalidArgument,
                       "etcd_prefix must be a string of 1..128 bytes starting with '/'");
          }
          config.etcd_prefix = extra.get<std::string>();
        } else if (extra_key == "etcd_lease_ttl") {
          if (!extra.is_number_integer() || extra.get<std::int64_t>() < 2 ||
              extra.get<std::int64_t>() > 3600) {
            // etcd rounds a TTL below 2 s up to its minimum (1.5 x its election timeout).
            return Err(ErrorCode::kInvalidArgument, "etcd_lease_ttl must be an integer 2..3600");
          }
          config.etcd_lease_ttl = std::chrono::seconds(extra.get<std::int64_t>());
        } else if (extra_key == "cluster_secret_file") {
          if (!extra.is_string() || extra.get<std::string>().empty() ||
              extra.get<std::string>().size() > 4096) {
            return Err(ErrorCode::kInvalidArgument,
                       "cluster_secret_file must be a path of 1..4096 bytes");
          }
          config.cluster_secret_file = extra.get<std::string>();
        } else if (extra_key == "bootstrap_port") {
          if (!extra.is_number_integer() || extra.get<std::int64_t>() < 0 ||
              extra.get<std::int64_t>() > 65535) {
            return Err(ErrorCode::kInvalidArgument, "bootstrap_port must be an integer 0..65535");
          }
          config.bootstrap_port = static_cast<int>(extra.get<std::int64_t>());
        } else {
          config.warnings.push_back(
              fmt::format("ignoring kv_connector_extra_config.{}", extra_key));
        }
      }
    } else {
      config.warnings.push_back(fmt::format("ignoring kv-transfer-config key {}", key));
    }
  }
  if (!abort_from_json && env_abort_timeout != nullptr && *env_abort_timeout != '\0') {
    char* end = nullptr;
    const double s = std::strtod(env_abort_timeout, &end);
    if (end == env_abort_timeout || *end != '\0') {
      return Err(
          ErrorCode::kInvalidArgument,
          fmt::format("KVFERRY_ABORT_REQUEST_TIMEOUT='{}' is not a number", env_abort_timeout));
    }
    auto timeout = SecondsValue(json(s), "KVFERRY_ABORT_REQUEST_TIMEOUT", /*allow_zero=*/false);
    if (!timeout) return tl::unexpected(timeout.error());
    config.abort_request_timeout = *timeout;
  }
  return config;
}

}  // namespace kvferry::harness
