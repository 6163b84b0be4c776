// The end-of-run leak audit can fail: a block still allocated, or an engine adapter still
// knowing a transfer, is reported on either side; a clean engine reports nothing.
#include "leak_audit.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kvferry::sim {
namespace {

struct Heard {
  std::vector<std::string> what;
  Violations sink() {
    return [this](std::string w) { what.push_back(std::move(w)); };
  }
};

TEST(LeakAudit, ACleanEngineReportsNothing) {
  core::BlockPool p_pool(8);
  core::BlockPool d_pool(8);
  protocol::PrefillAdapter p_adapter({.ranks = 1});
  protocol::DecodeAdapter d_adapter({.ranks = 1});
  const std::vector<std::set<protocol::EndpointId>> sockets;
  Heard heard;
  AuditPrefillSide({{}, p_pool, p_adapter}, heard.sink());
  AuditDecodeSide({{}, sockets, 256, d_pool, d_adapter}, heard.sink());
  EXPECT_TRUE(heard.what.empty());
}

TEST(LeakAudit, ABlockStillAllocatedOnEitherSideIsALeak) {
  core::BlockPool p_pool(8);
  core::BlockPool d_pool(8);
  ASSERT_TRUE(p_pool.Allocate(2, 1).has_value());
  ASSERT_TRUE(d_pool.Allocate(3, 1).has_value());
  protocol::PrefillAdapter p_adapter({.ranks = 1});
  protocol::DecodeAdapter d_adapter({.ranks = 1});
  const std::vector<std::set<protocol::EndpointId>> sockets;
  Heard heard;
  AuditPrefillSide({{}, p_pool, p_adapter}, heard.sink());
  AuditDecodeSide({{}, sockets, 256, d_pool, d_adapter}, heard.sink());
  ASSERT_EQ(heard.what.size(), 2u);
  EXPECT_EQ(heard.what[0], "leak: 2 P blocks still allocated");
  EXPECT_EQ(heard.what[1], "leak: 3 D blocks still allocated");
}

TEST(LeakAudit, ATransferPsAdapterStillKnowsIsALeak) {
  core::BlockPool p_pool(8);
  protocol::PrefillAdapter p_adapter({.ranks = 1});
  ASSERT_TRUE(p_adapter.Admit("xfer-0", 7).ok());
  Heard heard;
  AuditPrefillSide({{}, p_pool, p_adapter}, heard.sink());
  ASSERT_EQ(heard.what.size(), 1u);
  EXPECT_EQ(heard.what[0], "leak: P's engine adapter still knows 1 transfers");
}

}  // namespace
}  // namespace kvferry::sim
