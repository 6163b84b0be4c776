#include "descriptor.h"

#include <gtest/gtest.h>

#include "kvferry/transport/transport.h"

namespace kvferry::transport {
namespace {

internal::Descriptor Sample() {
  internal::Descriptor d;
  d.backend = "ucx";
  d.engine_uid = 0x1122334455667788ull;
  d.address = {std::byte{1}, std::byte{2}, std::byte{3}};
  d.regions.push_back({RemoteRegion{7, 0x1000, 4096, MemoryKind::kHost}, {std::byte{9}}});
  d.regions.push_back({RemoteRegion{8, 0x9000, 1 << 20, MemoryKind::kCuda}, {}});
  return d;
}

TEST(DescriptorTest, RoundTrips) {
  auto bytes = internal::EncodeDescriptor(Sample());
  auto d = internal::DecodeDescriptor(bytes);
  ASSERT_TRUE(d) << d.error().ToString();
  EXPECT_EQ(d->backend, "ucx");
  EXPECT_EQ(d->engine_uid, 0x1122334455667788ull);
  EXPECT_EQ(d->address.size(), 3u);
  ASSERT_EQ(d->regions.size(), 2u);
  EXPECT_EQ(d->regions[1].info.length, 1u << 20);
  EXPECT_EQ(d->regions[1].info.kind, MemoryKind::kCuda);
  auto info = ParseDescriptor(bytes);
  ASSERT_TRUE(info);
  EXPECT_EQ(info->regions[0].id, 7u);
}

TEST(DescriptorTest, EveryTruncationIsRejected) {
  auto bytes = internal::EncodeDescriptor(Sample());
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    auto d = internal::DecodeDescriptor(std::span(bytes.data(), n));
    ASSERT_FALSE(d) << n;
    EXPECT_EQ(d.error().code(), ErrorCode::kProtocol);
  }
  bytes.push_back(std::byte{0});
  EXPECT_FALSE(internal::DecodeDescriptor(bytes));
}

TEST(DescriptorTest, HugeDeclaredSizesAreRejectedWithoutAllocating) {
  auto bytes = internal::EncodeDescriptor(Sample());
  // The address length field follows magic(4) + version/backend/pad(4) + uid(8).
  bytes[16] = bytes[17] = bytes[18] = bytes[19] = std::byte{0xff};
  auto d = internal::DecodeDescriptor(bytes);
  ASSERT_FALSE(d);
  EXPECT_EQ(d.error().code(), ErrorCode::kProtocol);
}

// Version 1 engines write headers without a write key: their descriptors (and ours, to them)
// are refused at once, naming both versions, instead of every write hanging to its timeout.
TEST(DescriptorTest, ADescriptorOfAnotherVersionIsRefusedNamingBoth) {
  auto bytes = internal::EncodeDescriptor(Sample());
  bytes[4] = std::byte{1};
  auto d = internal::DecodeDescriptor(bytes);
  ASSERT_FALSE(d);
  EXPECT_EQ(d.error().code(), ErrorCode::kProtocol);
  EXPECT_NE(d.error().message().find("version 1, this build reads version 2"), std::string::npos)
      << d.error().ToString();
}

TEST(DescriptorTest, RangeFitsIsOverflowSafe) {
  EXPECT_TRUE(internal::RangeFits(0, 10, 10));
  EXPECT_FALSE(internal::RangeFits(1, 10, 10));
  EXPECT_FALSE(internal::RangeFits(11, 0, 10));
  EXPECT_FALSE(internal::RangeFits(5, ~0ull, 10));
}

}  // namespace
}  // namespace kvferry::transport
