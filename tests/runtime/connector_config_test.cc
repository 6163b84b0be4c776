// runtime::ParseConnectorConfig: kv_connector_extra_config as kvferry serve and the vLLM connector
// both read it (the connector through the binding: python/tests/test_config.py runs the same
// case file).
#include "runtime/connector_config.h"

#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kvferry::runtime {
namespace {

using nlohmann::json;

EnvLookup MapEnv(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](std::string_view name) -> std::optional<std::string> {
    auto it = vars.find(std::string(name));
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

double Secs(core::Duration d) { return std::chrono::duration<double>(d).count(); }

// `want`'s value for `key` against the parsed config; the keys are the connector's names.
void ExpectField(const ConnectorConfig& got, const std::string& key, const json& want) {
  const auto opt_string = [](const std::string& s) { return s.empty() ? json() : json(s); };
  const auto opt = [](const auto& o) { return o ? json(*o) : json(); };
  if (key == "kv_lease_duration") {
    EXPECT_DOUBLE_EQ(Secs(got.lease), want.get<double>());
  } else if (key == "abort_request_timeout") {
    EXPECT_DOUBLE_EQ(Secs(got.abort_request_timeout), want.get<double>());
  } else if (key == "bootstrap_port") {
    EXPECT_EQ(got.bootstrap_port, want.get<int>());
  } else if (key == "bootstrap_server_address") {
    EXPECT_EQ(opt_string(got.bootstrap_server_address), want);
  } else if (key == "kv_release") {
    EXPECT_EQ(got.release, want.get<bool>());
  } else if (key == "fence_writes") {
    EXPECT_EQ(opt(got.fence_writes), want);
  } else if (key == "layer_writes") {
    EXPECT_EQ(got.layer_writes, want.get<bool>());
  } else if (key == "load_failure_port") {
    EXPECT_EQ(opt(got.load_failure_port), want);
  } else if (key == "kv_staging") {
    EXPECT_EQ(ToString(got.staging), want.get<std::string>());
  } else if (key == "kv_staging_blocks") {
    EXPECT_EQ(opt(got.staging_blocks), want);
  } else if (key == "cluster_secret_file") {
    EXPECT_EQ(opt_string(got.cluster_secret_file), want);
  } else if (key == "etcd_endpoints") {
    EXPECT_EQ(json(got.etcd_endpoints), want);
  } else if (key == "etcd_prefix") {
    EXPECT_EQ(got.etcd_prefix, want.get<std::string>());
  } else if (key == "etcd_lease_ttl") {
    EXPECT_EQ(got.etcd_lease_ttl.count(), want.get<int>());
  } else if (key == "ignored_keys") {
    EXPECT_EQ(json(got.ignored_keys), want);
  } else {
    ADD_FAILURE() << "a case expects " << key << ", which this test does not know";
  }
}

TEST(ConnectorConfig, GivesEveryCaseOfTheSharedCaseFile) {
  std::ifstream in(KVFERRY_EXTRA_CONFIG_CASES);
  ASSERT_TRUE(in.good()) << KVFERRY_EXTRA_CONFIG_CASES;
  const json cases = json::parse(in)["cases"];
  ASSERT_GT(cases.size(), 40u);
  for (const json& c : cases) {
    SCOPED_TRACE(c.dump());
    const auto got = ParseConnectorConfig(c["extra"].dump(), MapEnv({}));
    if (c.value("error", false)) {
      ASSERT_FALSE(got.has_value());
      EXPECT_EQ(got.error().code(), ErrorCode::kInvalidArgument);
      // The message names the key that was wrong (each error case has one key).
      EXPECT_NE(got.error().message().find(c["extra"].begin().key()), std::string::npos)
          << got.error().message();
      continue;
    }
    ASSERT_TRUE(got.has_value()) << got.error().ToString();
    for (const auto& [key, want] : c["want"].items()) ExpectField(*got, key, want);
  }
}

TEST(ConnectorConfig, FallsBackOnTheEnvironmentOnlyWhenTheKeyIsAbsent) {
  const auto env = MapEnv({{"KVFERRY_ABORT_REQUEST_TIMEOUT", "30"},
                           {"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", "40"},
                           {"VLLM_MOONCAKE_BOOTSTRAP_PORT", "9100"}});
  auto c = ParseConnectorConfig("{}", env);
  ASSERT_TRUE(c.has_value()) << c.error().ToString();
  EXPECT_EQ(c->abort_request_timeout, std::chrono::seconds(30));  // kvferry's name first
  EXPECT_EQ(c->bootstrap_port, 9100);

  auto mooncake =
      ParseConnectorConfig("{}", MapEnv({{"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", "40"}}));
  ASSERT_TRUE(mooncake.has_value());
  EXPECT_EQ(mooncake->abort_request_timeout, std::chrono::seconds(40));

  auto keys_win = ParseConnectorConfig(R"({"abort_request_timeout": 7, "bootstrap_port": 0})", env);
  ASSERT_TRUE(keys_win.has_value());
  EXPECT_EQ(keys_win->abort_request_timeout, std::chrono::seconds(7));
  EXPECT_EQ(keys_win->bootstrap_port, 0);

  // An empty variable is unset; no environment at all is allowed.
  auto empty = ParseConnectorConfig("{}", MapEnv({{"KVFERRY_ABORT_REQUEST_TIMEOUT", ""}}));
  ASSERT_TRUE(empty.has_value());
  EXPECT_EQ(empty->abort_request_timeout, std::chrono::seconds(480));
  ASSERT_TRUE(ParseConnectorConfig("{}", EnvLookup()).has_value());
}

TEST(ConnectorConfig, RefusesABadEnvironmentValueNamingTheVariable) {
  for (const auto& [name, value] : std::vector<std::pair<std::string, std::string>>{
           {"KVFERRY_ABORT_REQUEST_TIMEOUT", "soon"},
           {"KVFERRY_ABORT_REQUEST_TIMEOUT", "0"},
           {"KVFERRY_ABORT_REQUEST_TIMEOUT", "30s"},
           {"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", "-3"},
           {"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", "nan"},
           {"VLLM_MOONCAKE_BOOTSTRAP_PORT", "x"},
           {"VLLM_MOONCAKE_BOOTSTRAP_PORT", "70000"},
           {"VLLM_MOONCAKE_BOOTSTRAP_PORT", "-1"}}) {
    SCOPED_TRACE(name + "=" + value);
    auto c = ParseConnectorConfig("{}", MapEnv({{name, value}}));
    ASSERT_FALSE(c.has_value());
    EXPECT_NE(c.error().message().find(name), std::string::npos) << c.error().message();
  }
}

TEST(ConnectorConfig, ListsTheCallersUnusedKeysAsIgnoredAfterCheckingThem) {
  constexpr std::string_view kUnused[] = {"kv_staging"};
  auto c = ParseConnectorConfig(R"({"kv_staging": "host", "zz": 1, "kv_lease_duration": 3})",
                                MapEnv({}), kUnused);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->ignored_keys, (std::vector<std::string>{"kv_staging", "zz"}));
  EXPECT_EQ(c->staging, StagingMode::kHost);
  // Unused here or not, a bad value is an error.
  EXPECT_FALSE(ParseConnectorConfig(R"({"kv_staging": "gpu"})", MapEnv({}), kUnused).has_value());
}

// What a hostile or broken config file can hold: nothing of it crashes, hangs or is taken.
TEST(ConnectorConfig, RefusesHostileInputWithAClearErrorAndAShortMessage) {
  const std::string huge(1 << 20, 'x');
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const std::vector<std::string> hostile = {
      "{",
      "[]",
      "null",
      "\"x\"",
      "",
      R"({"kv_lease_duration": 1e400})",
      R"({"bootstrap_port": 1e30})",
      R"({"kv_staging_blocks": -9223372036854775808})",
      R"({"kv_staging_blocks": 18446744073709551615})",
      R"({"cluster_secret_file": ")" + huge + R"("})",
      R"({"etcd_endpoints": [)" + std::string(20, '"') + "]}",
      R"({"etcd_endpoints": ["a","a","a","a","a","a","a","a","a","a","a","a","a","a","a","a","a"]})",
      R"({"kv_lease_duration": )" + deep + "}"};
  for (const std::string& bad : hostile) {
    SCOPED_TRACE(bad.substr(0, 80));
    auto c = ParseConnectorConfig(bad, MapEnv({}));
    ASSERT_FALSE(c.has_value());
    EXPECT_EQ(c.error().code(), ErrorCode::kInvalidArgument);
    EXPECT_LT(c.error().message().size(), 256u);  // the value is cut short, not echoed whole
  }
}

}  // namespace
}  // namespace kvferry::runtime
