// A fencing receiver's rule for which writes may land (src/transport/write_fence.h), without
// UCX: unstamped and revoked keys are refused, for good, and a revocation can tell when nothing
// admitted with its keys still lands.
#include "write_fence.h"

#include <gtest/gtest.h>

#include <vector>

namespace kvferry::transport::internal {
namespace {

TEST(WriteFence, AReceiverThatDoesNotFenceAdmitsEveryKeyEvenRevokedOnes) {
  WriteFence f(false);
  const std::vector<WriteKey> keys{7};
  f.Revoke(keys);
  EXPECT_TRUE(f.Admitted(kNoWriteKey));
  EXPECT_TRUE(f.Admitted(7));
}

TEST(WriteFence, AFencingReceiverRefusesUnstampedWritesAndRevokedKeysForGood) {
  WriteFence f(true);
  EXPECT_FALSE(f.Admitted(kNoWriteKey));
  EXPECT_TRUE(f.Admitted(7));
  EXPECT_TRUE(f.Admitted(8));
  const std::vector<WriteKey> keys{7};
  f.Revoke(keys);
  EXPECT_FALSE(f.Admitted(7));
  EXPECT_TRUE(f.Admitted(8));
  f.Revoke(std::vector<WriteKey>{8, 9});
  EXPECT_FALSE(f.Admitted(7));  // still
  EXPECT_FALSE(f.Admitted(8));
  EXPECT_FALSE(f.Admitted(9));
}

TEST(WriteFence, AWriteLandsFromItsAdmissionUntilItLandedAndEachCountsOnce) {
  WriteFence f(true);
  const std::vector<WriteKey> seven{7};
  f.Admit(7);
  f.Admit(7);
  f.Admit(8);
  EXPECT_TRUE(f.AnyLanding(seven));
  f.Revoke(seven);  // a revocation waits for what was admitted before it
  f.Landed(7);
  EXPECT_TRUE(f.AnyLanding(seven));
  f.Landed(7);
  EXPECT_FALSE(f.AnyLanding(seven));
  EXPECT_TRUE(f.AnyLanding(std::vector<WriteKey>{7, 8}));
  f.Landed(8);
  f.Landed(8);  // one too many changes nothing
  EXPECT_FALSE(f.AnyLanding(std::vector<WriteKey>{7, 8}));
  f.Admit(8);
  EXPECT_TRUE(f.AnyLanding(std::vector<WriteKey>{8}));
}

}  // namespace
}  // namespace kvferry::transport::internal
