// Bootstrap JSON bodies: round trips, malformed input, hostile answers; and the lease check.
#include "control/bootstrap_json.h"

#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "bootstrap_test_util.h"
#include "control/json_limits.h"

namespace kvferry::control {
namespace {

using testing::MakeWorker;

// A valid registration body with one field replaced by `value` (raw JSON text), or removed
// when `value` is empty.
std::string BodyWith(const std::string& field, const std::string& value) {
  const std::vector<std::pair<std::string, std::string>> fields = {
      {"engine_id", "\"p0\""},
      {"dp_rank", "0"},
      {"tp_rank", "0"},
      {"pp_rank", "0"},
      {"tp_size", "2"},
      {"pp_size", "1"},
      {"side_channel", "\"tcp://127.0.0.1:5555\""},
      {"data_plane", "\"ucx://127.0.0.1:6000\""},
      {"kv_lease_duration", "30"},
      {"protocol_version", "1"},
      {"incarnation", "\"abc\""}};
  std::string out = "{";
  for (const auto& [name, json] : fields) {
    const std::string& v = name == field ? value : json;
    if (v.empty()) continue;
    if (out.size() > 1) out += ",";
    out += "\"" + name + "\":" + v;
  }
  return out + "}";
}

TEST(BootstrapJson, RegistrationRoundTrips) {
  auto r = MakeWorker("engine-7", 1, 4, "inc-42", 3);
  r.pp_size = 2;
  r.pp_rank = 1;
  r.kv_lease_duration = 0.1;  // not exactly representable: must survive the trip bit for bit
  auto back = DecodeRegistration(EncodeRegistration(r));
  ASSERT_TRUE(back) << back.error().ToString();
  EXPECT_EQ(*back, r);
}

TEST(BootstrapJson, ValidBodyDecodes) {
  auto r = DecodeRegistration(BodyWith("", ""));
  ASSERT_TRUE(r) << r.error().ToString();
  EXPECT_EQ(r->kv_lease_duration, 30);
  EXPECT_EQ(r->data_plane, "ucx://127.0.0.1:6000");
  // Unknown fields are ignored (a newer P may send more).
  EXPECT_TRUE(DecodeRegistration(BodyWith("", "").insert(1, "\"future\":[1,2],")));
  // The lease may be fractional.
  EXPECT_TRUE(DecodeRegistration(BodyWith("kv_lease_duration", "2.5")));
  // data_plane may be empty.
  EXPECT_TRUE(DecodeRegistration(BodyWith("data_plane", "\"\"")));
}

struct BadBody {
  const char* name;
  std::string body;
  const char* reason;  // a substring of the error message
};

TEST(BootstrapJson, MalformedRegistrationsAreRejectedWithAReason) {
  const std::string long_string = "\"" + std::string(kMaxStringBytes + 1, 'x') + "\"";
  const std::vector<BadBody> cases = {
      {"empty", "", "not valid JSON"},
      {"not json", "engine_id=p0", "not valid JSON"},
      {"truncated", BodyWith("", "").substr(0, 40), "not valid JSON"},
      {"array", "[1,2,3]", "must be a JSON object"},
      {"missing engine_id", BodyWith("engine_id", ""), "missing field engine_id"},
      {"missing tp_size", BodyWith("tp_size", ""), "missing field tp_size"},
      {"missing incarnation", BodyWith("incarnation", ""), "missing field incarnation"},
      {"missing lease", BodyWith("kv_lease_duration", ""), "missing field kv_lease_duration"},
      {"rank as float", BodyWith("tp_rank", "0.0"), "tp_rank must be a non-negative integer"},
      {"rank as string", BodyWith("dp_rank", "\"0\""), "dp_rank must be a non-negative integer"},
      {"negative rank", BodyWith("pp_rank", "-1"), "pp_rank must be a non-negative integer"},
      {"rank as bool", BodyWith("tp_rank", "true"), "tp_rank must be a non-negative integer"},
      {"rank null", BodyWith("tp_rank", "null"), "tp_rank must be a non-negative integer"},
      {"huge rank", BodyWith("dp_rank", "18446744073709551615"), "out of range"},
      {"rank 1024", BodyWith("dp_rank", "1024"), "dp_rank 1024 is not below 1024"},
      {"tp_rank >= tp_size", BodyWith("tp_rank", "2"), "outside tp_size 2"},
      {"tp_size 0", BodyWith("tp_size", "0"), "at least 1"},
      {"too many workers", BodyWith("pp_size", "1024"), "exceeds 1024 workers"},
      {"engine_id number", BodyWith("engine_id", "7"), "engine_id must be a string"},
      {"empty engine_id", BodyWith("engine_id", "\"\""), "engine_id must not be empty"},
      {"long side_channel", BodyWith("side_channel", long_string), "side_channel is 257 bytes"},
      {"control char", BodyWith("incarnation", "\"a\\u0001b\""), "printable ASCII"},
      {"lease as string", BodyWith("kv_lease_duration", "\"30\""), "must be a number"},
      {"negative lease", BodyWith("kv_lease_duration", "-1"), "kv_lease_duration -1"},
      {"huge lease", BodyWith("kv_lease_duration", "1e300"), "kv_lease_duration"},
      {"overflowing lease", BodyWith("kv_lease_duration", "1e999"), "not valid JSON"},
      {"oversized",
       BodyWith("", "").insert(1, "\"pad\":\"" + std::string(kMaxBodyBytes, ' ') + "\","),
       "limit 65536"},
  };
  for (const BadBody& c : cases) {
    auto r = DecodeRegistration(c.body);
    ASSERT_FALSE(r) << c.name;
    EXPECT_EQ(r.error().code(), ErrorCode::kInvalidArgument) << c.name;
    EXPECT_NE(r.error().message().find(c.reason), std::string::npos)
        << c.name << ": " << r.error().message();
  }
}

EngineInfo SampleEngine() {
  EngineInfo info;
  info.engine_id = "p0";
  info.incarnation = "inc";
  info.tp_size = 2;
  info.kv_lease_duration = 30;
  info.protocol_version = 1;
  info.complete = true;
  info.workers = {{0, 0, 0, "tcp://a:1", "d0"}, {0, 1, 0, "tcp://a:2", ""}};
  return info;
}

// A body nested beyond kMaxJsonDepth is refused before any parser or serializer sees it.
TEST(BootstrapJson, DeeplyNestedBodyIsRefusedBeforeParsing) {
  const std::string deep =
      "{\"engine_id\":" + std::string(10000, '[') + std::string(10000, ']') + "}";
  auto r = DecodeRegistration(deep);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(r.error().message().find("deeper than 32 levels"), std::string::npos)
      << r.error().message();
  auto q = DecodeEngine("{\"workers\":" + std::string(40, '[') + std::string(40, ']') + "}");
  ASSERT_FALSE(q);
  EXPECT_NE(q.error().message().find("deeper than 32 levels"), std::string::npos)
      << q.error().message();
}

// The value count is an upper bound taken on the raw text: commas and brackets inside strings
// do not count, so a long string is one value.
TEST(JsonLimits, ValuesCountCommasAndBracketsOutsideStrings) {
  EXPECT_EQ(JsonValues("1"), 1u);
  EXPECT_EQ(JsonValues("[1,2,3]"), 4u);  // the array and its three elements
  EXPECT_EQ(JsonValues(R"({"a":"x,y,[z]","b":[1,2]})"), 5u);
  EXPECT_EQ(JsonValues(R"(["a\",b"])"), 2u);  // an escaped quote does not end the string
  std::string flat = "[";
  for (int i = 0; i < 1000; ++i) flat += "1,";
  flat += "1]";
  EXPECT_EQ(JsonValues(flat), 1002u);
}

// The features a P reads travel with its registration and its query answer; a P that predates
// the key advertises none.
TEST(BootstrapJson, ProtocolFeaturesRoundTripAndDefaultToNone) {
  auto r = MakeWorker("engine-7", 0, 1, "inc-1", 3);
  r.protocol_features = 0x5;
  auto back = DecodeRegistration(EncodeRegistration(r));
  ASSERT_TRUE(back) << back.error().ToString();
  EXPECT_EQ(back->protocol_features, 0x5u);
  auto old = DecodeRegistration(BodyWith("", ""));
  ASSERT_TRUE(old) << old.error().ToString();
  EXPECT_EQ(old->protocol_features, 0u);
  EXPECT_FALSE(DecodeRegistration(BodyWith("", "").insert(1, "\"protocol_features\":-1,")));
  EXPECT_FALSE(DecodeRegistration(BodyWith("", "").insert(1, "\"protocol_features\":\"1\",")));
  EngineInfo info = SampleEngine();
  info.protocol_features = 1;
  auto engine = DecodeEngine(EncodeEngine(info));
  ASSERT_TRUE(engine) << engine.error().ToString();
  EXPECT_EQ(engine->protocol_features, 1u);
}

TEST(BootstrapJson, EngineRoundTrips) {
  const EngineInfo info = SampleEngine();
  auto back = DecodeEngine(EncodeEngine(info));
  ASSERT_TRUE(back) << back.error().ToString();
  EXPECT_EQ(*back, info);
  EngineInfo other = info;
  other.engine_id = "p1";
  other.dp_rank = 1;
  for (WorkerAddress& w : other.workers) w.dp_rank = 1;
  auto list = DecodeEngines(EncodeEngines({other, info}));
  ASSERT_TRUE(list) << list.error().ToString();
  ASSERT_EQ(list->size(), 2u);
  EXPECT_EQ((*list)[0], info) << "sorted by dp rank";
  EXPECT_EQ((*list)[1], other);
}

// GET /query lists engines keyed by dp rank, each with Mooncake's worker_addr map beside
// kvferry's fields, so a router written for vLLM's Mooncake bootstrap reads it as is.
TEST(BootstrapJson, ListingIsKeyedByDpRankInMooncakesShape) {
  EngineInfo p0 = SampleEngine();
  EngineInfo p1 = SampleEngine();
  p1.engine_id = "p1";
  p1.dp_rank = 1;
  for (WorkerAddress& w : p1.workers) w.dp_rank = 1;
  p1.complete = false;
  p1.workers.pop_back();
  const std::string text = EncodeEngines({p0, p1});
  const nlohmann::json j = nlohmann::json::parse(text);
  ASSERT_TRUE(j.is_object()) << text;
  EXPECT_EQ(j.size(), 2u);
  EXPECT_EQ(j["0"]["engine_id"], "p0");
  EXPECT_EQ(j["1"]["engine_id"], "p1");
  EXPECT_EQ(j["0"]["worker_addr"]["0"]["0"], "tcp://a:1");
  EXPECT_EQ(j["0"]["worker_addr"]["1"]["0"], "tcp://a:2");
  EXPECT_EQ(j["1"]["worker_addr"].size(), 1u);
  auto routes = DecodeDpEngines(text);
  ASSERT_TRUE(routes) << routes.error().ToString();
  EXPECT_EQ(*routes, (std::vector<DpEngine>{{0, "p0", true}, {1, "p1", false}}));
  EXPECT_TRUE(DecodeDpEngines("{}").value().empty()) << "a service with no engine yet";
}

// A vLLM Mooncake bootstrap's listing has engine_id and worker_addr only: a router reads it (its
// engines count as complete); kvferry's D, which needs the rest, does not.
TEST(BootstrapJson, AMooncakeListingIsReadAsARouterReadsIt) {
  const std::string mooncake =
      R"({"1":{"engine_id":"e1","worker_addr":{"0":{"0":"tcp://h:2"}}},)"
      R"("0":{"engine_id":"e0","worker_addr":{"0":{"0":"tcp://h:1"},"1":{"0":"tcp://h:3"}}}})";
  auto routes = DecodeDpEngines(mooncake);
  ASSERT_TRUE(routes) << routes.error().ToString();
  EXPECT_EQ(*routes, (std::vector<DpEngine>{{0, "e0", true}, {1, "e1", true}}));
  auto full = DecodeEngines(mooncake);
  ASSERT_FALSE(full);
  EXPECT_EQ(full.error().code(), ErrorCode::kProtocol);
  EXPECT_NE(full.error().message().find("missing field incarnation"), std::string::npos)
      << full.error().message();
}

// What a router reads from a bootstrap is bounded before it is parsed and checked field by
// field: every hostile answer is a kProtocol error naming the problem, never a crash or an
// allocation the answer chose.
TEST(BootstrapJson, HostileListingsAreProtocolErrorsNamingTheProblem) {
  auto entries = [](std::size_t n) {
    std::string out = "{";
    for (std::size_t i = 0; i < n; ++i) {
      out += (i ? ",\"" : "\"") + std::to_string(i) + "\":{\"engine_id\":\"e" + std::to_string(i) +
             "\"}";
    }
    return out + "}";
  };
  std::string many_values = "{\"0\":{\"engine_id\":\"e\",\"x\":[";
  for (std::size_t i = 0; i <= kMaxJsonValues; ++i) many_values += "0,";
  many_values += "0]}}";
  const struct Case {
    std::string name;
    std::string body;
    std::string reason;
  } cases[] = {
      {"not json", "<html>", "not valid JSON"},
      {"an array", "[]", "keyed by dp rank"},
      {"kvferry's old shape", R"({"engines":[]})", "key 'engines' is not a dp rank"},
      {"deep", "{\"0\":" + std::string(100000, '[') + std::string(100000, ']') + "}",
       "deeper than 32 levels"},
      {"too many values", many_values, "more than 1048576 JSON values"},
      {"huge", "{\"0\":{\"engine_id\":\"e\",\"pad\":\"" + std::string(17 << 20, 'x') + "\"}}",
       "limit 16777216"},
      {"too many entries", entries(kMaxRank + 1), "1025 entries, limit 1024"},
      {"leading zero", R"({"01":{"engine_id":"e"}})", "key '01'"},
      {"negative", R"({"-1":{"engine_id":"e"}})", "key '-1'"},
      {"rank too high", R"({"1024":{"engine_id":"e"}})", "key '1024'"},
      {"huge rank", R"({"99999999999999999999":{"engine_id":"e"}})", "key '9999"},
      {"control bytes in a key", "{\"\\u0001x\":{\"engine_id\":\"e\"}}", "key '?x'"},
      {"entry not an object", R"({"0":"e0"})", "must be a JSON object"},
      {"no engine_id", R"({"0":{"worker_addr":{}}})", "missing field engine_id"},
      {"engine_id a number", R"({"0":{"engine_id":7}})", "engine_id must be a string"},
      {"engine_id empty", R"({"0":{"engine_id":""}})", "printable ASCII"},
      {"engine_id too long", "{\"0\":{\"engine_id\":\"" + std::string(300, 'e') + "\"}}",
       "300 bytes, limit 256"},
      {"engine_id with a newline", R"({"0":{"engine_id":"a\nb"}})", "printable ASCII"},
      {"complete not a boolean", R"({"0":{"engine_id":"e","complete":"yes"}})",
       "complete must be a boolean"},
      {"dp_rank disagreeing", R"({"0":{"engine_id":"e","dp_rank":1}})", "says dp_rank 1"},
      {"dp_rank a string", R"({"0":{"engine_id":"e","dp_rank":"0"}})",
       "dp_rank must be a non-negative integer"},
      {"one engine on two ranks", R"({"0":{"engine_id":"e"},"1":{"engine_id":"e"}})",
       "listed on two dp ranks"},
  };
  for (const Case& c : cases) {
    auto r = DecodeDpEngines(c.body);
    ASSERT_FALSE(r) << c.name;
    EXPECT_EQ(r.error().code(), ErrorCode::kProtocol) << c.name;
    EXPECT_NE(r.error().message().find(c.reason), std::string::npos)
        << c.name << ": " << r.error().message();
    EXPECT_FALSE(DecodeEngines(c.body)) << c.name;
  }
  auto most = DecodeDpEngines(entries(kMaxRank));
  ASSERT_TRUE(most) << most.error().ToString();
  EXPECT_EQ(most->size(), kMaxRank);
}

TEST(BootstrapJson, InconsistentAnswersAreProtocolErrors) {
  auto expect_bad = [](EngineInfo info, const char* reason) {
    auto r = DecodeEngine(EncodeEngine(info));
    ASSERT_FALSE(r) << reason;
    EXPECT_EQ(r.error().code(), ErrorCode::kProtocol);
    EXPECT_NE(r.error().message().find(reason), std::string::npos) << r.error().message();
  };
  EngineInfo info = SampleEngine();
  info.complete = false;
  expect_bad(info, "complete=false with 2 of 2");
  info = SampleEngine();
  info.workers[1].tp_rank = 0;
  expect_bad(info, "unsorted or twice");
  info = SampleEngine();
  info.workers[1].tp_rank = 5;
  expect_bad(info, "outside");
  info = SampleEngine();
  info.workers.push_back({0, 1, 0, "tcp://a:3", ""});
  expect_bad(info, "3 workers");
  EXPECT_EQ(DecodeEngine("{\"engine_id\":\"p0\"}").error().code(), ErrorCode::kProtocol);
  EXPECT_EQ(DecodeEngine("nope").error().code(), ErrorCode::kProtocol);
  EXPECT_EQ(DecodeEngines("{\"0\":{}}").error().code(), ErrorCode::kProtocol);
}

TEST(BootstrapJson, ErrorBodies) {
  EXPECT_EQ(DecodeError(EncodeError("dp_rank 0 belongs to engine p0")),
            "dp_rank 0 belongs to engine p0");
  EXPECT_EQ(DecodeError("<html>"), "");
  EXPECT_EQ(DecodeError("{\"error\":3}"), "");
}

TEST(BootstrapLease, MismatchNamesBothValuesInEitherDirection) {
  EngineInfo p = SampleEngine();

  p.kv_lease_duration = 0;
  Status s = CheckLease(30, p);  // D lease on, P off
  EXPECT_EQ(s.code(), ErrorCode::kLeaseMismatch);
  EXPECT_EQ(s.message(),
            "kv_lease_duration mismatch: decoder has 30s, prefiller has off "
            "(engine p0)");

  p.kv_lease_duration = 20;
  s = CheckLease(0, p);  // D off, P on
  EXPECT_EQ(s.code(), ErrorCode::kLeaseMismatch);
  EXPECT_NE(s.message().find("decoder has off, prefiller has 20s"), std::string::npos);

  s = CheckLease(30, p);  // both on, different
  EXPECT_EQ(s.code(), ErrorCode::kLeaseMismatch);
  EXPECT_NE(s.message().find("decoder has 30s, prefiller has 20s"), std::string::npos);

  p.kv_lease_duration = 0.5;
  s = CheckLease(1.5, p);
  EXPECT_NE(s.message().find("decoder has 1.5s, prefiller has 0.5s"), std::string::npos);
}

TEST(BootstrapLease, MatchingLeasesPass) {
  EngineInfo p = SampleEngine();
  p.kv_lease_duration = 30;
  EXPECT_TRUE(CheckLease(30, p).ok());
  p.kv_lease_duration = 0;
  EXPECT_TRUE(CheckLease(0, p).ok());
  // The value D checks against is the one that crossed the wire.
  p.kv_lease_duration = 0.1;
  auto back = DecodeEngine(EncodeEngine(p));
  ASSERT_TRUE(back);
  EXPECT_TRUE(CheckLease(0.1, *back).ok());
}

TEST(BootstrapLease, BadDecoderLeaseIsInvalid) {
  EngineInfo p = SampleEngine();
  EXPECT_EQ(CheckLease(-1, p).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(CheckLease(std::nan(""), p).code(), ErrorCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvferry::control
