// What a UcxEngine asks of UCX (src/transport/ucx_settings.h), without a UCX context: the
// settings planned from options and an environment, and the lanes read from an endpoint's
// description as UCX 1.13 prints it.
#include "ucx_settings.h"

#include <gtest/gtest.h>

#include <map>
#include <string>

namespace kvferry::transport::internal {
namespace {

struct FakeEnv {
  std::map<std::string, std::string> vars;
  EnvLookup lookup() const {
    return [this](const char* name) -> const char* {
      auto it = vars.find(name);
      return it == vars.end() ? nullptr : it->second.c_str();
    };
  }
};

std::map<std::string, std::string> AsMap(const std::vector<UcxSetting>& settings) {
  return {settings.begin(), settings.end()};
}

UcxSettingsPlan Plan(const UcxOptions& options, const FakeEnv& env) {
  auto plan = PlanUcxSettings(options, env.lookup());
  EXPECT_TRUE(plan.has_value()) << plan.error().ToString();
  return plan.value_or(UcxSettingsPlan{});
}

UcxOptions WithTls(const std::string& tls) {
  UcxOptions o;
  o.config = {{"TLS", tls}};
  return o;
}

TEST(UcxSettings, SharedMemoryTransportsGetErrorHandlingOnlyWhenTheyAreInUse) {
  FakeEnv env;
  auto all = AsMap(Plan(UcxOptions{}, env).environment);  // UCX_TLS unset: all transports
  EXPECT_EQ(all["UCX_POSIX_ERROR_HANDLING"], "y");
  EXPECT_EQ(all["UCX_SYSV_ERROR_HANDLING"], "y");
  auto posix = AsMap(Plan(WithTls("posix,self"), env).environment);
  EXPECT_EQ(posix.count("UCX_POSIX_ERROR_HANDLING"), 1u);
  EXPECT_EQ(posix.count("UCX_SYSV_ERROR_HANDLING"), 0u);
  auto tcp = AsMap(Plan(WithTls("tcp"), env).environment);
  EXPECT_EQ(tcp.count("UCX_POSIX_ERROR_HANDLING"), 0u);
  EXPECT_EQ(tcp.count("UCX_SYSV_ERROR_HANDLING"), 0u);
}

TEST(UcxSettings, TheCallersTransportsWinOverTheEnvironments) {
  FakeEnv env{{{"UCX_TLS", "tcp"}}};
  auto plan = AsMap(Plan(WithTls("sysv"), env).environment);
  EXPECT_EQ(plan.count("UCX_SYSV_ERROR_HANDLING"), 1u);
  EXPECT_EQ(plan.count("UCX_TCP_TX_SEG_SIZE"), 0u);  // no tcp in the caller's list
  auto from_env = AsMap(Plan(UcxOptions{}, env).environment);
  EXPECT_EQ(from_env.count("UCX_SYSV_ERROR_HANDLING"), 0u);
  EXPECT_EQ(from_env["UCX_TCP_TX_SEG_SIZE"], "1m");
}

TEST(UcxSettings, TcpSegmentsBecomeOneMebibyteAndPackSmallOpsUnlessTheUserChoseEitherSize) {
  FakeEnv none;
  auto plan = Plan(WithTls("tcp"), none);
  auto env = AsMap(plan.environment);
  EXPECT_EQ(env["UCX_TCP_TX_SEG_SIZE"], "1m");
  EXPECT_EQ(env["UCX_TCP_RX_SEG_SIZE"], "1m");
  EXPECT_TRUE(plan.pack_small_ops);

  // The user set the receive size only: both stay UCX's, and 8 KiB sends do not pack.
  FakeEnv rx{{{"UCX_TCP_RX_SEG_SIZE", "2m"}}};
  plan = Plan(WithTls("tcp"), rx);
  EXPECT_EQ(AsMap(plan.environment).count("UCX_TCP_TX_SEG_SIZE"), 0u);
  EXPECT_EQ(AsMap(plan.environment).count("UCX_TCP_RX_SEG_SIZE"), 0u);
  EXPECT_FALSE(plan.pack_small_ops);

  // Chosen in the config instead: its send size decides packing (256 KiB is kPackMaxOp).
  UcxOptions o = WithTls("tcp");
  o.config.emplace_back("TCP_TX_SEG_SIZE", "256k");
  plan = Plan(o, none);
  EXPECT_EQ(AsMap(plan.environment).count("UCX_TCP_TX_SEG_SIZE"), 0u);
  EXPECT_TRUE(plan.pack_small_ops);
  o.config.back().second = "128k";
  EXPECT_FALSE(Plan(o, none).pack_small_ops);
}

TEST(UcxSettings, TheKeepaliveIsADefaultTheEnvironmentOverrides) {
  UcxOptions o;
  o.keepalive_interval = std::chrono::milliseconds(750);
  EXPECT_EQ(AsMap(Plan(o, FakeEnv{}).defaults)["KEEPALIVE_INTERVAL"], "750ms");
  FakeEnv set{{{"UCX_KEEPALIVE_INTERVAL", "30s"}}};
  EXPECT_EQ(AsMap(Plan(o, set).defaults).count("KEEPALIVE_INTERVAL"), 0u);
}

TEST(UcxSettings, FencingMakesTheReceiverDriveEveryRendezvousExceptOverTcpAlone) {
  UcxOptions o = WithTls("posix,sysv,self");
  EXPECT_FALSE(Plan(o, FakeEnv{}).receiver_drives_rendezvous);  // not fencing
  o.fence_writes = true;
  EXPECT_TRUE(Plan(o, FakeEnv{}).receiver_drives_rendezvous);
  for (const char* tcp_alone : {"tcp", "tcp,self", "self,tcp"}) {
    UcxOptions t = WithTls(tcp_alone);
    t.fence_writes = true;
    EXPECT_FALSE(Plan(t, FakeEnv{}).receiver_drives_rendezvous) << tcp_alone;
  }
  UcxOptions everything;  // UCX_TLS unset: "all", which may hold shared memory or RDMA
  everything.fence_writes = true;
  EXPECT_TRUE(Plan(everything, FakeEnv{}).receiver_drives_rendezvous);
}

TEST(UcxSettings, FencingRefusesARendezvousTheSenderWouldDrive) {
  UcxOptions o = WithTls("posix,sysv,self");
  o.fence_writes = true;
  for (const char* fine : {"get_zcopy", "auto"}) {
    o.config = {{"TLS", "posix,sysv,self"}, {"RNDV_SCHEME", fine}};
    EXPECT_TRUE(PlanUcxSettings(o, FakeEnv{}.lookup()).has_value()) << fine;
  }
  o.config = {{"TLS", "posix,sysv,self"}, {"RNDV_SCHEME", "put_zcopy"}};
  auto refused = PlanUcxSettings(o, FakeEnv{}.lookup());
  ASSERT_FALSE(refused.has_value());
  EXPECT_EQ(refused.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(refused.error().message().find("RNDV_SCHEME=put_zcopy"), std::string::npos);
  o.fence_writes = false;  // the same config without a fence is the caller's business
  EXPECT_TRUE(PlanUcxSettings(o, FakeEnv{}.lookup()).has_value());
}

TEST(UcxSettings, TheCallersConfigIsPassedOnVerbatimAfterTheDefaults) {
  UcxOptions o;
  o.config = {{"TLS", "tcp"}, {"KEEPALIVE_INTERVAL", "5s"}};
  auto plan = Plan(o, FakeEnv{});
  EXPECT_EQ(plan.config, o.config);
  // The default is still planned; the caller's value comes later and wins in UCX.
  EXPECT_EQ(AsMap(plan.defaults).count("KEEPALIVE_INTERVAL"), 1u);
}

TEST(UcxSettings, SizesReadUcxsUnitsAndGarbageReadsZero) {
  EXPECT_EQ(ParseUcxSize("65536"), 65536u);
  EXPECT_EQ(ParseUcxSize("8k"), 8u << 10);
  EXPECT_EQ(ParseUcxSize("8KB"), 8u << 10);
  EXPECT_EQ(ParseUcxSize("1m"), 1u << 20);
  EXPECT_EQ(ParseUcxSize("2G"), std::size_t{2} << 30);
  EXPECT_EQ(ParseUcxSize("inf"), 0u);
  EXPECT_EQ(ParseUcxSize(""), 0u);
}

// ucp_ep_print_info of UCX 1.13.1 (Debian), captured from kvferry's endpoints on this machine
// (KVFERRY_UCX_DEBUG=1): shared memory between two processes, and tcp on loopback.
constexpr const char* kShm113 =
    "#\n# UCP endpoint \n#\n#               peer: <no debug data>\n"
    "#                 lane[0]:  1:sysv/memory.0 md[1]           -> md[1]/sysv/sysdev[255] am "
    "am_bw#0 keepalive\n"
    "#                 lane[1]:  2:posix/memory.0 md[2]          -> md[2]/posix/sysdev[255]\n#\n"
    "#                 am_send: 0..<egr/short>..93..<egr/bcopy>..8256..<rndv>..(inf)\n"
    "#                  put[0]: 0..<short>..4294967296..<bcopy>..(inf)\n"
    "#                  get[0]: 0..<bcopy>..(inf)\n"
    "#                  put[1]: 0..<short>..4294967296..<bcopy>..(inf)\n"
    "#                  get[1]: 0..<bcopy>..(inf)\n#\n"
    "#                  rma_bw: mds rndv_rkey_size 9\n#\n";
constexpr const char* kTcp113 =
    "#\n# UCP endpoint \n#\n#               peer: <no debug data>\n"
    "#                 lane[0]:  0:tcp/lo.0 md[0]                -> md[0]/tcp/sysdev[255] am "
    "am_bw#0 keepalive wireup\n#\n"
    "#                 am_send: 0..<egr/short>..1048569..<egr/zcopy>..1048576..<rndv>..(inf)\n#\n"
    "#                  rma_bw: mds rndv_rkey_size 9\n#\n";

// One lane line as UCX prints it: `tl`/`device` carrying `what` ("am keepalive", "rma_bw#0").
std::string Lane(int n, const std::string& tl, const std::string& device, const std::string& what) {
  return "#  lane[" + std::to_string(n) + "]:  " + std::to_string(n) + ":" + tl + "/" + device +
         " md[" + std::to_string(n) + "] -> md[" + std::to_string(n) + "]/" + tl +
         "/sysdev[255] " + what + "\n";
}

::testing::AssertionResult ReadsAs(const std::string& info, const std::string& transports,
                                   bool rma_ok) {
  const Lanes lanes = ReadLanes(info);
  if (lanes.transports == transports && lanes.rma_ok == rma_ok) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "read as \"" << lanes.transports << "\", rma_ok "
                                       << lanes.rma_ok << "; want \"" << transports
                                       << "\", rma_ok " << rma_ok;
}

TEST(UcxLanes, SharedMemoryWithPerKeyPutsIsAPutPath) {
  EXPECT_TRUE(ReadsAs(kShm113, "sysv+posix", true));
}

TEST(UcxLanes, TcpIsNeverAPutPath) {
  EXPECT_TRUE(ReadsAs(kTcp113, "tcp", false));
  // Even with put lines (a forced put mode prints them): put over tcp is emulated.
  EXPECT_TRUE(ReadsAs(std::string(kTcp113) + "#  put[0]: 0..<bcopy>..(inf)\n", "tcp", false));
}

TEST(UcxLanes, DedicatedRmaLanesArePutPathsUnlessOneIsTcp) {
  // The bytes take the RDMA lane; tcp only carries messages.
  EXPECT_TRUE(ReadsAs(Lane(0, "tcp", "eth0.0", "am keepalive") +
                          Lane(1, "rc_mlx5", "mlx5_0:1.0", "rma_bw#0"),
                      "tcp+rc_mlx5", true));
  EXPECT_TRUE(ReadsAs(Lane(0, "tcp", "lo.0", "am rma_bw#0 keepalive"), "tcp", false));
}

TEST(UcxLanes, SharedMemoryWithoutPutLinesIsNoPutPathByItsLanesAlone) {
  // UCX 1.22 picks shared-memory put protocols per remote key later and prints no put lines;
  // the engine then proves the put path by mapping every remote key (ucx_engine.cc).
  EXPECT_TRUE(ReadsAs(Lane(0, "sysv", "memory.0", "am am_bw#0 keepalive") +
                          Lane(1, "posix", "memory.0", ""),
                      "sysv+posix", false));
}

TEST(UcxLanes, ADescriptionWithoutLanesIsNoPathAndATruncatedLineIsRead) {
  EXPECT_TRUE(ReadsAs("", "", false));
  EXPECT_FALSE(ReadLanes("lane[0]: garbage without a slash").rma_ok);
  EXPECT_TRUE(ReadsAs("#  lane[0]:  1:sysv/memory.0", "sysv", false));  // no newline
}

}  // namespace
}  // namespace kvferry::transport::internal
