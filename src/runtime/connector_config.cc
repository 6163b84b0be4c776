#include "runtime/connector_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "control/json_limits.h"

namespace kvferry::runtime {

namespace {

using nlohmann::json;

// A value as the error message shows it: its JSON text, cut short (a peer of this parser may be a
// config file of any size).
std::string Shown(const json& value) {
  std::string text = value.dump();
  if (text.size() > 64) text = text.substr(0, 61) + "...";
  return text;
}

Status Invalid(std::string message) {
  return Status(ErrorCode::kInvalidArgument, std::move(message));
}

Result<core::Duration> Seconds(double s, std::string_view what, bool allow_zero) {
  if (!std::isfinite(s) || s < 0 || (!allow_zero && s == 0) || s > kMaxConfigSeconds) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("{} = {} is out of range {}0, {:g}] s", what, s, allow_zero ? "[" : "(",
                           kMaxConfigSeconds));
  }
  return core::Seconds(s);
}

Result<core::Duration> SecondsValue(const json& value, std::string_view key, bool allow_zero) {
  // JSON true is not a number of seconds (nlohmann keeps booleans apart from numbers).
  if (!value.is_number()) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("{} must be a number of seconds, not {}", key, Shown(value)));
  }
  return Seconds(value.get<double>(), key, allow_zero);
}

Result<int> PortValue(const json& value, std::string_view key) {
  if (!value.is_number_integer() || value.get<std::int64_t>() < 0 ||
      value.get<std::int64_t>() > 65535) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("{} must be an integer 0..65535, not {}", key, Shown(value)));
  }
  return static_cast<int>(value.get<std::int64_t>());
}

Result<std::string> StringValue(const json& value, std::string_view key, std::size_t max,
                                std::string_view what) {
  if (!value.is_string() || value.get<std::string>().empty() ||
      value.get<std::string>().size() > max) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("{} must be {} of 1..{} bytes, not {}", key, what, max, Shown(value)));
  }
  return value.get<std::string>();
}

Result<bool> BoolValue(const json& value, std::string_view key) {
  if (!value.is_boolean()) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("{} must be true or false, not {}", key, Shown(value)));
  }
  return value.get<bool>();
}

// "host:port" with an optional "http://" (MooncakeConnector's bootstrap_server_address takes
// both), a port 1..65535.
bool IsHostPort(std::string_view text) {
  if (text.starts_with("http://")) text.remove_prefix(7);
  const std::size_t colon = text.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == text.size()) return false;
  const std::string_view port = text.substr(colon + 1);
  int value = 0;
  const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  return ec == std::errc() && end == port.data() + port.size() && value > 0 && value <= 65535;
}

// One key of the extra config: its name and how it is read into the config.
struct KeyRule {
  std::string_view key;
  Status (*read)(const json& value, ConnectorConfig& config);
};

// Assigns `r`'s value to `out`, or returns its error.
template <class T, class U>
Status Assign(Result<T> r, U& out) {
  if (!r) return r.error();
  out = std::move(*r);
  return Status::Ok();
}

constexpr KeyRule kKeyRules[] = {
    {"kv_lease_duration",
     [](const json& v, ConnectorConfig& c) {
       return Assign(SecondsValue(v, "kv_lease_duration", /*allow_zero=*/true), c.lease);
     }},
    {"abort_request_timeout",
     [](const json& v, ConnectorConfig& c) {
       return Assign(SecondsValue(v, "abort_request_timeout", /*allow_zero=*/false),
                     c.abort_request_timeout);
     }},
    {"bootstrap_port",
     [](const json& v, ConnectorConfig& c) {
       return Assign(PortValue(v, "bootstrap_port"), c.bootstrap_port);
     }},
    {"bootstrap_server_address",
     [](const json& v, ConnectorConfig& c) {
       if (!v.is_string() || v.get<std::string>().empty() || v.get<std::string>().size() > 256 ||
           !IsHostPort(v.get<std::string>())) {
         return Invalid(fmt::format("bootstrap_server_address must be a 'host:port' string, not {}",
                                    Shown(v)));
       }
       c.bootstrap_server_address = v.get<std::string>();
       return Status::Ok();
     }},
    {"kv_release",
     [](const json& v, ConnectorConfig& c) {
       return Assign(BoolValue(v, "kv_release"), c.release);
     }},
    {"fence_writes",
     [](const json& v, ConnectorConfig& c) {
       return Assign(BoolValue(v, "fence_writes"), c.fence_writes);
     }},
    {"layer_writes",
     [](const json& v, ConnectorConfig& c) {
       return Assign(BoolValue(v, "layer_writes"), c.layer_writes);
     }},
    {"load_failure_port",
     [](const json& v, ConnectorConfig& c) {
       return Assign(PortValue(v, "load_failure_port"), c.load_failure_port);
     }},
    {"kv_staging",
     [](const json& v, ConnectorConfig& c) {
       for (StagingMode mode : {StagingMode::kAuto, StagingMode::kHost, StagingMode::kOff}) {
         if (v.is_string() && v.get<std::string>() == ToString(mode)) {
           c.staging = mode;
           return Status::Ok();
         }
       }
       return Invalid(fmt::format("kv_staging must be one of auto, host, off, not {}", Shown(v)));
     }},
    {"kv_staging_blocks",
     [](const json& v, ConnectorConfig& c) {
       if (!v.is_number_integer() || v.get<std::int64_t>() < 1 ||
           v.get<std::int64_t>() > std::int64_t{kMaxStagingBlocks}) {
         return Invalid(fmt::format("kv_staging_blocks must be an integer 1..{}, not {}",
                                    kMaxStagingBlocks, Shown(v)));
       }
       c.staging_blocks = static_cast<std::uint32_t>(v.get<std::int64_t>());
       return Status::Ok();
     }},
    {"cluster_secret_file",
     [](const json& v, ConnectorConfig& c) {
       return Assign(StringValue(v, "cluster_secret_file", 4096, "a path"), c.cluster_secret_file);
     }},
    {"etcd_endpoints",
     [](const json& v, ConnectorConfig& c) {
       const auto bad = [&] {
         return Invalid(fmt::format(
             "etcd_endpoints must be a list of 1..16 \"http://host:port\" strings, not {}",
             Shown(v)));
       };
       if (!v.is_array() || v.empty() || v.size() > 16) return bad();
       std::vector<std::string> endpoints;
       for (const json& e : v) {
         if (!e.is_string() || e.get<std::string>().empty() || e.get<std::string>().size() > 256) {
           return bad();
         }
         endpoints.push_back(e.get<std::string>());
       }
       c.etcd_endpoints = std::move(endpoints);
       return Status::Ok();
     }},
    {"etcd_prefix",
     [](const json& v, ConnectorConfig& c) {
       if (!v.is_string() || v.get<std::string>().empty() || v.get<std::string>().front() != '/' ||
           v.get<std::string>().size() > 128) {
         return Invalid(fmt::format(
             "etcd_prefix must be a string of 1..128 bytes starting with '/', not {}", Shown(v)));
       }
       c.etcd_prefix = v.get<std::string>();
       return Status::Ok();
     }},
    {"etcd_lease_ttl",
     [](const json& v, ConnectorConfig& c) {
       // etcd rounds a TTL below 2 s up to its minimum (1.5 x its election timeout).
       if (!v.is_number_integer() || v.get<std::int64_t>() < 2 || v.get<std::int64_t>() > 3600) {
         return Invalid(fmt::format("etcd_lease_ttl must be an integer 2..3600, not {}", Shown(v)));
       }
       c.etcd_lease_ttl = std::chrono::seconds(v.get<std::int64_t>());
       return Status::Ok();
     }},
};

const KeyRule* FindRule(std::string_view key) {
  for (const KeyRule& rule : kKeyRules) {
    if (rule.key == key) return &rule;
  }
  return nullptr;
}

// The first of `names` set (non-empty) in the environment, as seconds > 0; nullopt if none is.
Result<std::optional<core::Duration>> EnvSeconds(const EnvLookup& env,
                                                 std::initializer_list<std::string_view> names) {
  for (std::string_view name : names) {
    const std::optional<std::string> text = env ? env(name) : std::nullopt;
    if (!text || text->empty()) continue;
    char* end = nullptr;
    const double s = std::strtod(text->c_str(), &end);
    if (end == text->c_str() || *end != '\0') {
      return Err(ErrorCode::kInvalidArgument,
                 fmt::format("{}='{}' is not a number", name, text->substr(0, 64)));
    }
    auto duration = Seconds(s, name, /*allow_zero=*/false);
    if (!duration) return tl::unexpected(duration.error());
    return std::optional<core::Duration>(*duration);
  }
  return std::optional<core::Duration>();
}

Result<std::optional<int>> EnvPort(const EnvLookup& env, std::string_view name) {
  const std::optional<std::string> text = env ? env(name) : std::nullopt;
  if (!text || text->empty()) return std::optional<int>();
  int port = -1;
  const auto [end, ec] = std::from_chars(text->data(), text->data() + text->size(), port);
  if (ec != std::errc() || end != text->data() + text->size() || port < 0 || port > 65535) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("{}='{}' is not an integer 0..65535", name, text->substr(0, 64)));
  }
  return std::optional<int>(port);
}

}  // namespace

const char* ToString(StagingMode mode) {
  switch (mode) {
    case StagingMode::kAuto:
      return "auto";
    case StagingMode::kHost:
      return "host";
    case StagingMode::kOff:
      return "off";
  }
  return "?";
}

EnvLookup ProcessEnvironment() {
  return [](std::string_view name) -> std::optional<std::string> {
    const char* value = std::getenv(std::string(name).c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  };
}

Result<ConnectorConfig> ParseConnectorConfig(std::string_view extra_json, const EnvLookup& env,
                                             std::span<const std::string_view> unused_here) {
  // Before parsing: a value nested deeper than this is refused, because error messages dump
  // values and nlohmann's dump recurses once per level (json_limits.h; found by this parser's
  // hostile-input test, which crashed at 100,000 levels).
  if (control::JsonDepth(extra_json) > control::kMaxJsonDepth) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("kv_connector_extra_config nests deeper than {} levels",
                           control::kMaxJsonDepth));
  }
  const json extra =
      json::parse(extra_json.begin(), extra_json.end(), nullptr, /*allow_exceptions=*/false);
  if (extra.is_discarded()) {
    return Err(ErrorCode::kInvalidArgument, "kv_connector_extra_config is not valid JSON");
  }
  if (!extra.is_object()) {
    return Err(ErrorCode::kInvalidArgument, "kv_connector_extra_config must be an object");
  }
  ConnectorConfig config;
  for (const auto& [key, value] : extra.items()) {  // in key order: the first bad key is stable
    const KeyRule* rule = FindRule(key);
    if (rule == nullptr) {
      config.ignored_keys.push_back(key);
      continue;
    }
    if (Status s = rule->read(value, config); !s.ok()) return tl::unexpected(s);
    if (std::find(unused_here.begin(), unused_here.end(), key) != unused_here.end()) {
      config.ignored_keys.push_back(key);
    }
  }
  std::sort(config.ignored_keys.begin(), config.ignored_keys.end());

  if (!extra.contains("abort_request_timeout")) {
    auto from_env =
        EnvSeconds(env, {"KVFERRY_ABORT_REQUEST_TIMEOUT", "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"});
    if (!from_env) return tl::unexpected(from_env.error());
    if (*from_env) config.abort_request_timeout = **from_env;
  }
  if (!extra.contains("bootstrap_port")) {
    auto from_env = EnvPort(env, "VLLM_MOONCAKE_BOOTSTRAP_PORT");
    if (!from_env) return tl::unexpected(from_env.error());
    if (*from_env) config.bootstrap_port = **from_env;
  }
  return config;
}

}  // namespace kvferry::runtime
