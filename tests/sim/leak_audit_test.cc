// The end-of-run leak audit can fail: a block still allocated, or an engine adapter still
// knowing a transfer, is reported on either side; a clean engine reports nothing.
#include "leak_audit.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kvferry::sim {
namespace {

// One P and one D engine's parts, as the audit reads them at the end of a run: empty until a
// test allocates or admits something.
class LeakAudit : public ::testing::Test {
 protected:
  // Audits both sides; returns what was reported, in order (P's side first).
  std::vector<std::string> Audit() {
    std::vector<std::string> heard;
    auto sink = [&heard](std::string w) { heard.push_back(std::move(w)); };
    AuditPrefillSide({{}, p_pool, p_adapter}, sink);
    AuditDecodeSide({{}, sockets, 256, d_pool, d_adapter}, sink);
    return heard;
  }

  core::BlockPool p_pool{8};
  core::BlockPool d_pool{8};
  protocol::PrefillAdapter p_adapter{{.ranks = 1}};
  protocol::DecodeAdapter d_adapter{{.ranks = 1}};
  const std::vector<std::set<protocol::EndpointId>> sockets;
};

TEST_F(LeakAudit, ACleanEngineReportsNothing) { EXPECT_TRUE(Audit().empty()); }

TEST_F(LeakAudit, ABlockStillAllocatedOnEitherSideIsALeak) {
  ASSERT_TRUE(p_pool.Allocate(2, 1).has_value());
  ASSERT_TRUE(d_pool.Allocate(3, 1).has_value());
  const std::vector<std::string> heard = Audit();
  ASSERT_EQ(heard.size(), 2u);
  EXPECT_EQ(heard[0], "leak: 2 P blocks still allocated");
  EXPECT_EQ(heard[1], "leak: 3 D blocks still allocated");
}

TEST_F(LeakAudit, ATransferPsAdapterStillKnowsIsALeak) {
  ASSERT_TRUE(p_adapter.Admit("xfer-0", 7).ok());
  const std::vector<std::string> heard = Audit();
  ASSERT_EQ(heard.size(), 1u);
  EXPECT_EQ(heard[0], "leak: P's engine adapter still knows 1 transfers");
}

}  // namespace
}  // namespace kvferry::sim
