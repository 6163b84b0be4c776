// Unit tests of the serving engine's pieces: the --kv-transfer-config parser, the KV byte
// pattern (and that TP slices composed through core/tp_plan verify on D), the fault-injecting
// writer, the /v1/completions body parser, and the runtime under the engine (EngineRanks).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "control/side_channel_listener.h"
#include "harness/engine_ranks.h"
#include "harness/fault_writer.h"
#include "harness/http_front.h"
#include "harness/kv_pattern.h"
#include "harness/metrics.h"
#include "harness/serve_config.h"
#include "kvferry/core/stat_fields.h"
#include "kvferry/core/tp_plan.h"
#include "protocol/decode_session.h"
#include "protocol/prefill_session.h"

namespace kvferry::harness {
namespace {

runtime::EnvLookup NoEnv() { return {}; }

TEST(KvTransferConfig, ReadsVllmKeys) {
  auto c = ParseKvTransferConfig(
      R"({"kv_connector":"MooncakeConnector","kv_role":"kv_producer","engine_id":"p0",
          "kv_load_failure_policy":"fail",
          "kv_connector_extra_config":{"kv_lease_duration":30,"abort_request_timeout":20,
                                       "bootstrap_port":8998,"device_name":"mlx5"}})",
      NoEnv());
  ASSERT_TRUE(c.has_value()) << c.error().ToString();
  EXPECT_EQ(c->role, Role::kPrefill);
  EXPECT_EQ(c->engine_id, "p0");
  EXPECT_EQ(c->extra.lease, std::chrono::seconds(30));
  EXPECT_EQ(c->extra.abort_request_timeout, std::chrono::seconds(20));
  EXPECT_EQ(c->extra.bootstrap_port, 8998);
  ASSERT_EQ(c->warnings.size(), 1u);  // device_name
  EXPECT_NE(c->warnings[0].find("device_name"), std::string::npos);
}

// The extra config is the connector's parser's (tests/runtime/connector_config_test.cc covers
// its keys); serve reads its environment through it and warns of the keys it has no use for.
TEST(KvTransferConfig, HandsTheExtraConfigToTheConnectorsParser) {
  auto c = ParseKvTransferConfig(R"({"kv_role":"kv_consumer"})", NoEnv());
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->role, Role::kDecode);
  EXPECT_EQ(c->extra.lease.count(), 0);
  EXPECT_EQ(c->extra.abort_request_timeout, std::chrono::seconds(480));
  EXPECT_TRUE(c->extra.cluster_secret_file.empty());  // off by default: an open cluster
  EXPECT_TRUE(c->warnings.empty());

  auto env = ParseKvTransferConfig(R"({})", [](std::string_view name) {
    return name == "KVFERRY_ABORT_REQUEST_TIMEOUT" ? std::optional<std::string>("20")
                                                   : std::nullopt;
  });
  ASSERT_TRUE(env.has_value());
  EXPECT_EQ(env->extra.abort_request_timeout, std::chrono::seconds(20));

  auto unused = ParseKvTransferConfig(
      R"({"kv_connector_extra_config":{"kv_staging":"host","load_failure_port":0,
                                       "etcd_endpoints":["http://127.0.0.1:2379"]}})",
      NoEnv());
  ASSERT_TRUE(unused.has_value()) << unused.error().ToString();
  EXPECT_EQ(unused->extra.etcd_endpoints.size(), 1u);  // serve acts on etcd
  ASSERT_EQ(unused->warnings.size(), 2u);
  EXPECT_NE(unused->warnings[0].find("kv_staging"), std::string::npos);
  EXPECT_NE(unused->warnings[1].find("load_failure_port"), std::string::npos);

  auto bad = ParseKvTransferConfig(R"({"kv_connector_extra_config":{"cluster_secret_file":""}})",
                                   NoEnv());
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.error().message().find("cluster_secret_file"), std::string::npos);
}

TEST(KvTransferConfig, RejectsBadInput) {
  for (const char* bad : {"{", "[]", "nope", R"({"kv_role":"kv_both"})", R"({"kv_role":1})",
                          R"({"kv_load_failure_policy":"recompute"})",
                          R"({"engine_id":""})",
                          R"({"kv_connector_extra_config":{"kv_lease_duration":-1}})",
                          R"({"kv_connector_extra_config":{"bootstrap_port":70000}})",
                          R"({"kv_connector_extra_config":[]})"}) {
    EXPECT_FALSE(ParseKvTransferConfig(bad, NoEnv()).has_value()) << bad;
  }
  // Nesting that would overflow the stack when the extra config is dumped for its parser.
  const std::string deep = R"({"kv_connector_extra_config":{"x":)" + std::string(100000, '[') +
                           std::string(100000, ']') + "}}";
  EXPECT_FALSE(ParseKvTransferConfig(deep, NoEnv()).has_value());
  EXPECT_FALSE(ParseKvTransferConfig("{}", [](std::string_view) {
                 return std::optional<std::string>("abc");
               }).has_value());
}

EngineOptions RanksOptions(Role role, std::uint32_t tp) {
  EngineOptions o;
  o.role = role;
  o.engine_id = role == Role::kPrefill ? "ranks-p" : "ranks-d";
  o.geometry.tp = tp;
  o.num_blocks = 8;
  o.ucx_name = "ranks-test";
  return o;
}

TEST(EngineRanks, EveryRankOfTheRoleStartsWithItsDriverAndAStopMayBeRepeated) {
  for (const Role role : {Role::kPrefill, Role::kDecode}) {
    SCOPED_TRACE(role == Role::kPrefill ? "P" : "D");
    const EngineOptions o = RanksOptions(role, 2);
    Result<std::unique_ptr<EngineRanks>> started = EngineRanks::Start(o, {});
    ASSERT_TRUE(started) << started.error().ToString();
    EngineRanks& ranks = **started;
    ASSERT_EQ(ranks.size(), 2u);
    ASSERT_NE(ranks.kv(0), nullptr);
    ASSERT_NE(ranks.kv(1), nullptr);
    EXPECT_NE(ranks.kv(0), ranks.kv(1)) << "each rank has a region of its own";
    EXPECT_EQ(ranks.prefill_driver() != nullptr, role == Role::kPrefill);
    EXPECT_EQ(ranks.decode_driver() != nullptr, role == Role::kDecode);
    EXPECT_EQ(ranks.prefill_workers().size(), role == Role::kPrefill ? 2u : 0u);
    EXPECT_EQ(ranks.decode_workers().size(), role == Role::kDecode ? 2u : 0u);
    ranks.Stop();
    EXPECT_EQ(ranks.size(), 0u);
    EXPECT_EQ(ranks.prefill_driver(), nullptr);
    EXPECT_EQ(ranks.decode_driver(), nullptr);
    EXPECT_TRUE(ranks.prefill_workers().empty());
    EXPECT_TRUE(ranks.decode_workers().empty());
    ranks.Stop();  // nothing left to stop; the destructor stops once more
  }
}

TEST(EngineRanks, ARankThatCannotStartFailsTheWholeStartNamingIt) {
  EngineOptions o = RanksOptions(Role::kPrefill, 2);
  o.side_channel_host = "256.0.0.1";  // no such address: rank 0's side channel cannot bind
  Result<std::unique_ptr<EngineRanks>> started = EngineRanks::Start(o, {});
  ASSERT_FALSE(started);
  EXPECT_NE(started.error().message().find("prefill rank 0"), std::string::npos)
      << started.error().ToString();
}

TEST(KvPattern, VerifiesOnlyTheRightTransferAndHeads) {
  KvGeometry g{.tp = 1, .kv_heads = 4, .block_tokens = 16, .head_bytes_per_token = 16};
  ASSERT_TRUE(g.Validate().ok());
  std::vector<std::byte> block(g.block_len());
  EXPECT_FALSE(VerifyBlock(block.data(), g, 0, SeedOfTransfer("x"), 0));  // zero-filled
  FillBlock(block.data(), g, 0, SeedOfTransfer("x"), 3);
  EXPECT_TRUE(VerifyBlock(block.data(), g, 0, SeedOfTransfer("x"), 3));
  EXPECT_FALSE(VerifyBlock(block.data(), g, 0, SeedOfTransfer("y"), 3));  // other request
  EXPECT_FALSE(VerifyBlock(block.data(), g, 0, SeedOfTransfer("x"), 2));  // other position
  block[5] ^= std::byte{1};
  EXPECT_FALSE(VerifyBlock(block.data(), g, 0, SeedOfTransfer("x"), 3));
}

// P TP2 writes its two head slices into D TP1's block as core::PlanSlice says: the result is
// exactly what D expects; swapped slices are not.
TEST(KvPattern, TpSlicesComposeOnDecode) {
  const KvGeometry p{.tp = 2, .kv_heads = 4, .block_tokens = 16, .head_bytes_per_token = 16};
  const KvGeometry d{.tp = 1, .kv_heads = 4, .block_tokens = 16, .head_bytes_per_token = 16};
  const std::uint64_t seed = SeedOfTransfer("xfer-tp");
  std::vector<std::byte> dst(d.block_len()), swapped(d.block_len());
  for (std::uint32_t rank = 0; rank < 2; ++rank) {
    std::vector<std::byte> src(p.block_len());
    FillBlock(src.data(), p, rank, seed, 7);
    auto slice = core::PlanSlice(rank, {2, 4, p.block_len()}, 0, {1, 4, d.block_len()});
    ASSERT_TRUE(slice.has_value());
    std::memcpy(dst.data() + slice->dst_offset, src.data() + slice->src_offset, slice->length);
    std::memcpy(swapped.data() + (slice->length - slice->dst_offset),
                src.data() + slice->src_offset, slice->length);
  }
  EXPECT_TRUE(VerifyBlock(dst.data(), d, 0, seed, 7));
  EXPECT_FALSE(VerifyBlock(swapped.data(), d, 0, seed, 7));
}

TEST(KvPattern, ReplicatedHeads) {
  // tp 4 over 2 heads: ranks 0,1 hold head 0; ranks 2,3 hold head 1.
  const KvGeometry g{.tp = 4, .kv_heads = 2, .block_tokens = 4, .head_bytes_per_token = 8};
  ASSERT_TRUE(g.Validate().ok());
  EXPECT_EQ(g.first_head(1), 0u);
  EXPECT_EQ(g.first_head(2), 1u);
  std::vector<std::byte> a(g.block_len()), b(g.block_len());
  FillBlock(a.data(), g, 0, 1, 0);
  FillBlock(b.data(), g, 1, 1, 0);
  EXPECT_EQ(a, b);
  EXPECT_FALSE(VerifyBlock(a.data(), g, 2, 1, 0));
  EXPECT_FALSE((KvGeometry{.tp = 3, .kv_heads = 4}).Validate().ok());
}

// The harness's faults wrap the real writer: a landed write is reported failed at fraction 1, a
// failed one stays failed, and cancellation reaches the writer underneath.
TEST(FaultInjectingWriter, FailsLandedWritesAndForwardsCancellation) {
  struct Inner final : control::KvWriter {
    protocol::WriteOutcome next = protocol::WriteOutcome::Landed();
    int writes = 0;
    bool cancelled = false;
    protocol::WriteOutcome Write(const protocol::PullContext&, const protocol::WriteJob&) override {
      ++writes;
      return next;
    }
    void CancelWrites() override { cancelled = true; }
  };
  auto inner = std::make_shared<Inner>();
  const protocol::PullContext context;
  protocol::WriteJob job;
  job.transfer_id = "xfer-1";
  FaultInjectingWriter always(inner, {.err_after_write_fraction = 1.0});
  protocol::WriteOutcome out = always.Write(context, job);
  EXPECT_EQ(out.end, protocol::WriteEnd::kFailed);
  EXPECT_NE(out.status.message().find("injected"), std::string::npos);
  EXPECT_EQ(inner->writes, 1) << "the write itself still happens";
  inner->next = protocol::WriteOutcome::Unsettled(Status(ErrorCode::kInternal, "unfenced"));
  EXPECT_EQ(always.Write(context, job).end, protocol::WriteEnd::kUnsettled);
  FaultInjectingWriter never(inner, {});
  inner->next = protocol::WriteOutcome::Landed();
  EXPECT_EQ(never.Write(context, job).end, protocol::WriteEnd::kLanded);
  never.CancelWrites();
  EXPECT_TRUE(inner->cancelled);
}

TEST(CompletionRequest, ParsesKvTransferParams) {
  auto p = ParseCompletionRequest(
      R"({"model":"m","prompt":[1,2,3],"max_tokens":1,"stream":false,
          "kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,
                                "transfer_id":"xfer-1"}})",
      Role::kPrefill, 100);
  ASSERT_TRUE(p.has_value()) << p.error().ToString();
  EXPECT_EQ(p->spec.kind, RequestKind::kRemoteDecode);
  EXPECT_EQ(p->spec.prompt_tokens, 3u);
  EXPECT_EQ(p->spec.transfer_id, "xfer-1");
  auto d = ParseCompletionRequest(
      R"({"prompt":"hello","max_tokens":4,"stream":true,"ignore_eos":true,
          "kv_transfer_params":{"do_remote_prefill":true,"transfer_id":"xfer-1",
                                "remote_engine_id":"p0",
                                "remote_bootstrap_addr":"http://127.0.0.1:8998"}})",
      Role::kDecode, 100);
  ASSERT_TRUE(d.has_value()) << d.error().ToString();
  EXPECT_EQ(d->spec.kind, RequestKind::kRemotePrefill);
  EXPECT_EQ(d->spec.prompt_tokens, 5u);
  EXPECT_TRUE(d->stream);
  auto local =
      ParseCompletionRequest(R"({"prompt":[5],"kv_transfer_params":null})", Role::kPrefill, 100);
  ASSERT_TRUE(local.has_value());
  EXPECT_EQ(local->spec.kind, RequestKind::kLocal);
}

TEST(CompletionRequest, RejectsBadBodies) {
  const std::string deep = std::string(100, '[') + std::string(100, ']');
  for (
      const std::string& bad : std::vector<std::string>{
          "", "{", "[]", deep, R"({"max_tokens":1})", R"({"prompt":[]})", R"({"prompt":[[1,2]]})",
          R"({"prompt":[-1]})", R"({"prompt":[1.5]})", R"({"prompt":[1],"max_tokens":0})",
          R"({"prompt":[1],"max_tokens":"3"})",
          R"({"prompt":[1],"max_tokens":100})",  // exceeds max_model_len
          R"({"prompt":[1],"stream":"yes"})", R"({"prompt":[1],"kv_transfer_params":[]})",
          R"({"prompt":[1],"kv_transfer_params":{"do_remote_decode":true}})",
          R"({"prompt":[1],"kv_transfer_params":{"do_remote_prefill":true,"transfer_id":"x"}})",
          R"({"prompt":[1],"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":true,"transfer_id":"x"}})",
          R"({"prompt":[1],"kv_transfer_params":{"do_remote_decode":true,"transfer_id":""}})"}) {
    EXPECT_FALSE(ParseCompletionRequest(bad, Role::kPrefill, 64).has_value()) << bad;
  }
  // Role checks.
  EXPECT_FALSE(
      ParseCompletionRequest(
          R"({"prompt":[1],"kv_transfer_params":{"do_remote_decode":true,"transfer_id":"x"}})",
          Role::kDecode, 64)
          .has_value());
}

// A body refused after its transfer was read names that transfer, so the instance can settle
// it with the other half; one refused before (unreadable params, or none) names nothing.
TEST(CompletionRequest, ARefusalAfterTheTransferWasReadNamesIt) {
  CompletionSpec refused;
  EXPECT_FALSE(ParseCompletionRequest(
                   R"({"prompt":[1,2,3],"max_tokens":100,
                       "kv_transfer_params":{"do_remote_prefill":true,"transfer_id":"xfer-9",
                                             "remote_engine_id":"p0",
                                             "remote_bootstrap_addr":"http://p:8998"}})",
                   Role::kDecode, 64, &refused)
                   .has_value());
  EXPECT_EQ(refused.kind, RequestKind::kRemotePrefill);
  EXPECT_EQ(refused.transfer_id, "xfer-9");
  EXPECT_EQ(refused.remote_engine_id, "p0");
  EXPECT_EQ(refused.remote_bootstrap_addr, "http://p:8998");
  CompletionSpec untouched;
  for (const std::string& bad : std::vector<std::string>{
           R"({"prompt":[1],"max_tokens":100})",
           R"({"prompt":[1],"max_tokens":100,"kv_transfer_params":{"do_remote_prefill":true}})",
           R"({"prompt":[1],"kv_transfer_params":{"do_remote_decode":true,"transfer_id":"x"}})"}) {
    EXPECT_FALSE(ParseCompletionRequest(bad, Role::kDecode, 64, &untouched).has_value()) << bad;
    EXPECT_EQ(untouched.kind, RequestKind::kLocal) << bad;
    EXPECT_TRUE(untouched.transfer_id.empty()) << bad;
  }
}

TEST(Metrics, HistogramIsCumulative) {
  Histogram h;
  h.Observe(0.0001);
  h.Observe(0.003);
  h.Observe(1000);
  PromWriter w;
  w.Family("x_seconds", "histogram", "test");
  w.Histo("x_seconds", h, {{"a", "b\"c"}});
  const std::string text = w.Take();
  EXPECT_NE(text.find("x_seconds_bucket{a=\"b\\\"c\",le=\"0.0005\"} 1"), std::string::npos) << text;
  EXPECT_NE(text.find("x_seconds_bucket{a=\"b\\\"c\",le=\"+Inf\"} 3"), std::string::npos) << text;
  EXPECT_NE(text.find("x_seconds_count{a=\"b\\\"c\"} 3"), std::string::npos) << text;
}

// Every row of a stats table is exported under its own key and sample, and a labelled family's
// rows sit together: rendered with distinct values, each value shows once, each family's TYPE
// line once, and every name is a valid Prometheus name of its kind.
template <class Stats>
void ExpectTableRenders(std::span<const core::StatField<Stats>> fields) {
  Stats stats{};
  std::uint64_t value = 1000;
  std::set<std::string> keys;
  for (const core::StatField<Stats>& f : fields) {
    stats.*(f.member) = value++;
    EXPECT_TRUE(keys.insert(std::string(f.key)).second) << "two rows named " << f.key;
    const std::string name = core::MetricName(f);
    EXPECT_TRUE(std::all_of(name.begin(), name.end(),
                            [](char c) { return (c >= 'a' && c <= 'z') || c == '_'; }))
        << name;
    EXPECT_EQ(name.starts_with("kvferry_"), true) << name;
    EXPECT_EQ(name.ends_with("_total"), f.kind == core::StatKind::kCounter) << name;
  }
  PromWriter w;
  w.Fields<Stats>(stats, fields);
  const std::string text = w.Take();
  std::map<std::string, int> types;
  std::set<std::string> values;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.starts_with("# TYPE ")) {
      ++types[line.substr(7, line.find(' ', 7) - 7)];
    } else if (!line.starts_with("#")) {
      EXPECT_TRUE(values.insert(line.substr(line.rfind(' ') + 1)).second) << line;
    }
  }
  for (const auto& [family, n] : types) EXPECT_EQ(n, 1) << family << " declared twice";
  EXPECT_EQ(values.size(), std::size(fields)) << text;
  for (std::uint64_t v = 1000; v < value; ++v) {
    EXPECT_EQ(values.count(std::to_string(v)), 1u) << "row " << v - 1000 << " not exported";
  }
}

TEST(Metrics, EveryCounterOfTheSessionsIsExportedOnceUnderItsOwnName) {
  ExpectTableRenders<protocol::DecodeStats>(protocol::kDecodeStatFields);
  ExpectTableRenders<protocol::PrefillStats>(protocol::kPrefillStatFields);
  ExpectTableRenders<control::ListenerStats>(control::kListenerStatFields);
}

// The hold table's rows and per-enumerator families render from their declarations, and no
// Prometheus family of P's /metrics is declared by two tables.
TEST(Metrics, TheHoldTablesCountersRenderFromTheirDeclarationsUnderNamesNoOtherTableUses) {
  ExpectTableRenders<core::HoldStats>(core::kHoldStatFields);

  core::HoldStats hold{};
  std::uint64_t value = 5000;
  for (core::HoldPhase phase : core::kAllHoldPhases) hold.entries[phase] = value++;
  for (core::ReleaseReason reason : core::kAllReleaseReasons) hold.released[reason] = value++;
  PromWriter w;
  w.EnumFamily(hold, core::kHoldEntriesFamily);
  w.EnumFamily(hold, core::kHoldReleasedFamily);
  const std::string text = w.Take();
  for (core::HoldPhase phase : core::kAllHoldPhases) {
    EXPECT_NE(text.find(fmt::format("kvferry_hold_entries{{state=\"{}\"}} {}",
                                    core::ToString(phase), hold.entries[phase])),
              std::string::npos)
        << text;
  }
  for (core::ReleaseReason reason : core::kAllReleaseReasons) {
    EXPECT_NE(text.find(fmt::format("kvferry_hold_released_total{{reason=\"{}\"}} {}",
                                    core::ToString(reason), hold.released[reason])),
              std::string::npos)
        << text;
  }

  // Family names (and Python dict keys) per table of P's /metrics and stats(): no overlap.
  std::map<std::string, std::string> metric_owner;
  std::map<std::string, std::string> key_owner;
  const auto claim = [](std::map<std::string, std::string>& owners, const std::string& name,
                        const std::string& table) {
    auto [it, fresh] = owners.emplace(name, table);
    EXPECT_TRUE(fresh || it->second == table)
        << name << " is declared by " << it->second << " and " << table;
  };
  const auto claim_table = [&](const auto& fields, const std::string& table) {
    for (const auto& f : fields) {
      claim(metric_owner, core::MetricName(f), table);
      claim(key_owner, std::string(f.key), table + "." + std::string(f.key));
    }
  };
  claim_table(protocol::kPrefillStatFields, "PrefillStats");
  claim_table(control::kListenerStatFields, "ListenerStats");
  claim_table(core::kHoldStatFields, "HoldStats");
  for (const auto& [metric, key] :
       {std::pair{core::kHoldEntriesFamily.metric, core::kHoldEntriesFamily.key},
        std::pair{core::kHoldReleasedFamily.metric, core::kHoldReleasedFamily.key}}) {
    claim(metric_owner, std::string(metric), "HoldStats family");
    claim(key_owner, std::string(key), "HoldStats family");
  }
}

TEST(Metrics, StatsOfSeveralRanksAddUpRowByRow) {
  protocol::DecodeStats a{}, b{};
  a.pulls_sent = 2;
  a.tracked = 3;
  b.pulls_sent = 5;
  b.endpoints_exhausted = 7;
  core::AddStats<protocol::DecodeStats>(a, b, protocol::kDecodeStatFields);
  EXPECT_EQ(a.pulls_sent, 7u);
  EXPECT_EQ(a.tracked, 3u);
  EXPECT_EQ(a.endpoints_exhausted, 7u);
}

}  // namespace
}  // namespace kvferry::harness
