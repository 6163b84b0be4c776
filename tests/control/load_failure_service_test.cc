// LoadFailureService over real HTTP on 127.0.0.1: what D's connector records, a router reads;
// and what a client controls (ids, paths, methods, bodies, volume) stays bounded.
#include "control/load_failure_service.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <nlohmann/json.hpp>
#include <string>

namespace kvferry::control {
namespace {

class LoadFailureServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto port = service_.Start("127.0.0.1", 0);
    ASSERT_TRUE(port.has_value()) << port.error().ToString();
    port_ = *port;
  }
  httplib::Result Get(const std::string& path) {
    httplib::Client cli("127.0.0.1", port_);
    cli.set_read_timeout(std::chrono::seconds(5));
    return cli.Get(path);
  }

  LoadFailureService service_{4};
  int port_ = 0;
};

TEST_F(LoadFailureServiceTest, ARecordedReasonIsAnsweredByTransferIdAndAnUnknownOneIs404) {
  service_.Record("xfer-1", "TOMBSTONED: transfer xfer-1 was already released on P");
  auto r = Get("/load_failure?transfer_id=xfer-1");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  auto body = nlohmann::json::parse(r->body);
  EXPECT_EQ(body["transfer_id"], "xfer-1");
  EXPECT_EQ(body["reason"], "TOMBSTONED: transfer xfer-1 was already released on P");
  r = Get("/load_failure?transfer_id=xfer-2");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 404);
  r = Get("/health");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
}

TEST_F(LoadFailureServiceTest, OnlyTheLastEntriesAreKeptAndEachReasonIsCut) {
  for (int i = 0; i < 10; ++i) service_.Record("x" + std::to_string(i), "r" + std::to_string(i));
  EXPECT_EQ(service_.size(), 4u);
  EXPECT_FALSE(service_.Find("x5").has_value());
  EXPECT_EQ(service_.Find("x9"), "r9");
  service_.Record("x6", "again");  // replacing one makes it the newest
  service_.Record("x10", "r10");
  EXPECT_EQ(service_.Find("x6"), "again");
  EXPECT_FALSE(service_.Find("x7").has_value());
  service_.Record("long", std::string(100000, 'y'));
  EXPECT_EQ(service_.Find("long")->size(), LoadFailureService::kMaxReasonBytes);
  service_.Record(std::string(LoadFailureService::kMaxIdBytes + 1, 'i'), "never kept");
  service_.Record("", "never kept");
  EXPECT_EQ(service_.size(), 4u);
}

// The attacker's test: what a client sends changes nothing and gets a clear refusal.
TEST_F(LoadFailureServiceTest, HostileRequestsAreRefusedAndChangeNothing) {
  service_.Record("xfer-1", "reason");
  for (const std::string& path :
       {std::string("/load_failure"), std::string("/load_failure?transfer_id="),
        "/load_failure?transfer_id=" + std::string(LoadFailureService::kMaxIdBytes + 1, 'a')}) {
    auto r = Get(path);
    ASSERT_TRUE(r) << path;
    EXPECT_EQ(r->status, 400) << path;
  }
  auto r = Get("/load_failure/xfer-1");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 404);
  httplib::Client cli("127.0.0.1", port_);
  auto post = cli.Post("/load_failure?transfer_id=xfer-1", std::string(64, 'b'), "text/plain");
  ASSERT_TRUE(post);
  EXPECT_GE(post->status, 400);
  EXPECT_EQ(service_.Find("xfer-1"), "reason");
  EXPECT_EQ(service_.size(), 1u);
}

}  // namespace
}  // namespace kvferry::control
