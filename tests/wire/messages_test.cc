// Unit tests of the wire codec: round trips, byte layout, limits and every malformed input we
// know of. Property tests are in property_test.cc.
#include "wire/messages.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "kvferry/core/tp_plan.h"
#include "raw_msgpack.h"

namespace kvferry::wire {
namespace {

using testing::Raw;
using Bytes = std::vector<std::uint8_t>;

Pull SamplePull() {
  Pull p;
  p.d_engine_id = "decode-engine-0";
  p.d_tp_size = 4;
  p.d_tp_rank = 3;
  p.d_lease_ms = 30000;
  p.region_descriptor = Bytes{1, 2, 3, 4, 5};
  p.block_len = 2 * 1024 * 1024;
  p.num_blocks = 70000;
  p.requests.push_back({"cmpl-a", "xfer-a", {0, 1, 2, 65535, 65536, 69999}});
  p.requests.push_back({"cmpl-b", "xfer-b", {}});
  p.write_key = 0x0123456789abcdefULL;
  return p;
}

PullResponse SampleResponse() {
  return {PullStatus::kContinue,
          {"cmpl-a", "cmpl-b"},
          {{"cmpl-c", ErrorCode::kTombstoned, "xfer-c was freed"},
           {"cmpl-d", ErrorCode::kLeaseMismatch, "P lease 30000 ms, D lease 20000 ms"}},
          ErrorCode::kOk,
          ""};
}

// A pull frame built field by field, so tests can drop or replace one field. Keys in
// encoder order; `skip` omits a key, `replace` substitutes its value's bytes.
Bytes PullWith(std::string_view skip = "", std::string_view replace = "", const Bytes& value = {}) {
  struct KV {
    std::string_view key;
    Bytes value;
  };
  const std::vector<KV> fields = {
      {"e", Raw().Str("d")},
      {"ts", Raw().Uint(2)},
      {"tr", Raw().Uint(1)},
      {"l", Raw().Uint(30000)},
      {"bl", Raw().Uint(4096)},
      {"nb", Raw().Uint(64)},
      {"rd", Raw().Bin({9, 9})},
      {"rq", Raw().Array(1).Array(3).Str("r").Str("x").Bin({3, 0, 0, 0})},
  };
  Raw r;
  r.Head(static_cast<std::uint32_t>(2 + fields.size() - (skip.empty() ? 0 : 1)), 1);
  for (const auto& f : fields) {
    if (f.key == skip) continue;
    r.Str(f.key).Append(f.key == replace ? value : f.value);
  }
  return r.bytes();
}

// A frame of message type `type` built from `fields` (keys in encoder order), like PullWith:
// `skip` omits a key; `replace` substitutes a key's value, or adds the key when it is not there.
struct KV {
  std::string_view key;
  Bytes value;
};
Bytes FrameWith(std::uint64_t type, const std::vector<KV>& fields, std::string_view skip,
                std::string_view replace, const Bytes& value) {
  bool found = false;
  for (const auto& f : fields) found = found || f.key == replace;
  const bool add = !replace.empty() && !found;
  Raw r;
  r.Head(static_cast<std::uint32_t>(2 + fields.size() - (skip.empty() ? 0 : 1) + (add ? 1 : 0)),
         type);
  for (const auto& f : fields) {
    if (f.key == skip) continue;
    r.Str(f.key).Append(f.key == replace ? value : f.value);
  }
  if (add) r.Str(replace).Append(value);
  return r.bytes();
}

Bytes ReleaseWith(std::string_view skip = "", std::string_view replace = "",
                  const Bytes& value = {}) {
  return FrameWith(5,
                   {{"id", Raw().Uint(11)},
                    {"e", Raw().Str("d")},
                    {"ts", Raw().Uint(2)},
                    {"tr", Raw().Uint(1)},
                    {"fp", Raw().Bin({1, 2, 3, 4, 5, 6, 7})}},
                   skip, replace, value);
}

Bytes ReleaseReplyWith(std::string_view skip = "", std::string_view replace = "",
                       const Bytes& value = {}) {
  return FrameWith(6,
                   {{"id", Raw().Uint(11)},
                    {"s", Raw().Uint(0)},
                    {"r", Raw().Uint(1)},
                    {"k", Raw().Uint(2)},
                    {"u", Raw().Uint(3)}},
                   skip, replace, value);
}

Bytes AbortNoticeWith(std::string_view skip = "", std::string_view replace = "",
                      const Bytes& value = {}) {
  return FrameWith(7,
                   {{"e", Raw().Str("p")},
                    {"pr", Raw().Uint(1)},
                    {"a", Raw().Array(1).Array(3).Str("x").Uint(12).Str("why")}},
                   skip, replace, value);
}

// The "a" value of an AbortNotice holding `entries` copies of one [transfer_id, code, reason].
Bytes Aborts(std::size_t entries, std::string_view transfer_id = "x", std::uint64_t code = 12,
             std::string_view reason = "") {
  Raw r;
  r.Array(static_cast<std::uint32_t>(entries));
  for (std::size_t i = 0; i < entries; ++i) r.Array(3).Str(transfer_id).Uint(code).Str(reason);
  return r.bytes();
}

Release SampleRelease() {
  return {
      "decode-engine-0", 4, 3, {0, 1, core::kFingerprintMask, core::FingerprintOf("xfer-1")}, 12};
}

AbortNotice SampleNotice() {
  return {"prefill-engine-0",
          5,
          {{"xfer-a", ErrorCode::kCancelled, "aborted by the engine"},
           {"xfer-b", ErrorCode::kTimeout, ""},
           {"xfer-c", ErrorCode::kLeaseMismatch, "P lease 30000 ms, D lease 20000 ms"}}};
}

// The error of a Result, or OK when it holds a value.
template <typename T>
Status ErrorOf(const Result<T>& r) {
  return r ? Status() : r.error();
}

template <typename T>
void ExpectError(const Result<T>& r, ErrorCode code, std::string_view needle) {
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), code) << r.error().ToString();
  EXPECT_NE(r.error().message().find(needle), std::string::npos)
      << "reason '" << r.error().message() << "' does not mention '" << needle << "'";
}

// ---------------------------------------------------------------------------------------------
// Round trips and layout

TEST(WireRoundTrip, Pull) {
  const Pull p = SamplePull();
  ASSERT_TRUE(Validate(p).ok());
  auto d = DecodePull(Encode(p));
  ASSERT_TRUE(d.has_value()) << d.error().ToString();
  EXPECT_EQ(*d, p);
}

TEST(WireRoundTrip, PullVariants) {
  Pull old_d = SamplePull();
  old_d.d_lease_ms.reset();  // an old D that does not say
  Pull lease_off = SamplePull();
  lease_off.d_lease_ms = 0;
  Pull steady = SamplePull();
  steady.region_descriptor.reset();
  Pull empty_desc = SamplePull();
  empty_desc.region_descriptor = Bytes{};
  Pull notify = SamplePull();
  notify.requests.clear();
  for (const Pull& p : {old_d, lease_off, steady, empty_desc, notify}) {
    auto d = DecodePull(Encode(p));
    ASSERT_TRUE(d.has_value()) << d.error().ToString();
    EXPECT_EQ(*d, p);
  }
  // Absent and 0 are different on the wire and after decoding.
  EXPECT_FALSE(DecodePull(Encode(old_d))->d_lease_ms.has_value());
  EXPECT_EQ(DecodePull(Encode(lease_off))->d_lease_ms, std::optional<std::uint64_t>(0));
}

TEST(WireRoundTrip, Renewal) {
  Renewal r{
      "decode-engine-0", 30000, {0, 1, core::kFingerprintMask, core::FingerprintOf("xfer-1")}};
  ASSERT_TRUE(Validate(r).ok());
  auto d = DecodeRenewal(Encode(r));
  ASSERT_TRUE(d.has_value()) << d.error().ToString();
  EXPECT_EQ(*d, r);
}

TEST(WireRoundTrip, RenewalReply) {
  for (auto status : {RenewalStatus::kAccepted, RenewalStatus::kRejected, RenewalStatus::kError}) {
    for (std::string message : {"", "this P has no lease"}) {
      RenewalReply r{status, 1u << 20, 3, 30000, message};
      auto d = DecodeRenewalReply(Encode(r));
      ASSERT_TRUE(d.has_value()) << d.error().ToString();
      EXPECT_EQ(*d, r);
    }
  }
}

TEST(WireRoundTrip, PullResponse) {
  PullResponse finish{PullStatus::kFinish, {}, {}, ErrorCode::kOk, ""};
  PullResponse error{PullStatus::kError, {}, {}, ErrorCode::kProtocol, "unsupported version 2"};
  PullResponse unsettled = SampleResponse();
  unsettled.err.push_back({"r-unsettled", ErrorCode::kTimeout, "write did not complete", true});
  for (const PullResponse& r : {SampleResponse(), finish, error, unsettled}) {
    ASSERT_TRUE(Validate(r).ok()) << Validate(r).ToString();
    auto d = DecodePullResponse(Encode(r));
    ASSERT_TRUE(d.has_value()) << d.error().ToString();
    EXPECT_EQ(*d, r);
  }
}

TEST(WireRoundTrip, IdIsCarriedAndOmittedWhenZero) {
  Pull p = SamplePull();
  const std::size_t without = Encode(p).size();
  p.id = 1ull << 40;
  EXPECT_EQ(Encode(p).size(), without + 3 + 9);  // "id" key + uint64
  EXPECT_EQ(DecodePull(Encode(p))->id, 1ull << 40);
  Renewal r{"d", 1, {}, 7};
  EXPECT_EQ(DecodeRenewal(Encode(r))->id, 7u);
  RenewalReply y;
  y.id = 8;
  EXPECT_EQ(DecodeRenewalReply(Encode(y))->id, 8u);
  PullResponse q = SampleResponse();
  q.id = 9;
  EXPECT_EQ(DecodePullResponse(Encode(q))->id, 9u);
  ExpectError(DecodeRenewalReply(Raw()
                                     .Head(7, 3)
                                     .Str("id")
                                     .Str("9")
                                     .Str("s")
                                     .Uint(0)
                                     .Str("x")
                                     .Uint(0)
                                     .Str("u")
                                     .Uint(0)
                                     .Str("l")
                                     .Uint(0)),
              ErrorCode::kProtocol, "'id' (id): expected uint, got str");
}

TEST(WireLayout, TypeAndVersionComeFirst) {
  // fixmap, "t", type, "v", 1: what PeekType's fast path reads.
  const Bytes b = Encode(SamplePull());
  ASSERT_GE(b.size(), 7u);
  EXPECT_EQ(b[0] & 0xf0, 0x80);
  EXPECT_EQ((Bytes{b.begin() + 1, b.begin() + 7}), (Bytes{0xa1, 't', 1, 0xa1, 'v', 1}));
}

TEST(WireLayout, BlockIdsAreLittleEndianU32Bin) {
  Pull p = SamplePull();
  p.requests = {{"r", "x", {0x04030201}}};
  p.region_descriptor.reset();
  const Bytes b = Encode(p);
  const Bytes tail = {0xc4, 4, 1, 2, 3, 4};
  ASSERT_GE(b.size(), tail.size());
  EXPECT_EQ(Bytes(b.end() - 6, b.end()), tail);
}

TEST(WireLayout, FingerprintsAreSevenByteLittleEndian) {
  const Bytes b = Encode(Renewal{"d", 1, {0x07060504030201}});
  const Bytes tail = {0xc4, 7, 1, 2, 3, 4, 5, 6, 7};
  EXPECT_EQ(Bytes(b.end() - 9, b.end()), tail);
}

// The renewal budget of SPEC §2: <= 1 KB of message per 128 transfer ids.
TEST(WireSize, RenewalOf128IdsFitsInOneKilobyte) {
  std::vector<core::TransferId> ids;
  for (int i = 0; i < 128; ++i) {
    ids.push_back("xfer-" + std::string("0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f") +
                  std::to_string(i % 10));
  }
  // A realistic engine id (vLLM uses a uuid4 string): 36 bytes.
  // With a realistic message id (D's counter) too.
  Renewal r{"5f0c6f1e-8a44-4d5e-9b7a-2f1d3c4b5a69", 30000, FingerprintsOf(ids), 1234567};
  const std::size_t size = Encode(r).size();
  std::printf("renewal of 128 ids: %zu bytes (full ids would need %zu)\n", size,
              ids.size() * (ids[0].size() + 2));
  EXPECT_LE(size, 1000u);
  // Even a maximal 256-byte engine id stays within 1.2 KB.
  r.d_engine_id.assign(kMaxIdBytes, 'e');
  EXPECT_LE(Encode(r).size(), 1200u);
}

// ---------------------------------------------------------------------------------------------
// Forward compatibility

TEST(WireCompat, UnknownKeysOfAnyTypeAreSkipped) {
  Raw r;
  r.Map(13)
      .Str("future_map")
      .Map(1)
      .Str("a")
      .Array(2)
      .Nil()
      .Bin({1})
      .Uint(7)
      .Str("int key")  // non-str keys are unknown keys too
      .Str("e")
      .Str("d")
      .Str("ts")
      .Uint(1)
      .Str("tr")
      .Uint(0)
      .Str("bl")
      .Uint(16)
      .Str("nb")
      .Uint(8)
      .Str("rq")
      .Array(1)
      .Array(4)
      .Str("r")
      .Str("x")
      .Bin({5, 0, 0, 0})
      .Str("extra element")
      .Str("f64")
      .Bytes({0xcb, 0, 0, 0, 0, 0, 0, 0, 0})
      .Str("neg")
      .Byte(0xff)
      .Str("ext")
      .Bytes({0xd4, 1, 2})
      .Str("v")
      .Uint(1)
      .Str("t")
      .Uint(1);  // "t" last: the decoder does not care about order
  auto d = DecodePull(r.bytes());
  ASSERT_TRUE(d.has_value()) << d.error().ToString();
  EXPECT_EQ(d->d_engine_id, "d");
  ASSERT_EQ(d->requests.size(), 1u);
  EXPECT_EQ(d->requests[0].block_ids, std::vector<core::BlockId>{5});
  EXPECT_FALSE(d->d_lease_ms.has_value());
  EXPECT_FALSE(d->region_descriptor.has_value());
}

TEST(WireCompat, AnyIntegerEncodingIsAccepted) {
  // Other encoders (e.g. Python's) may use wider or signed encodings of small non-negative ints.
  auto d = DecodeRenewalReply(Raw()
                                  .Map(6)
                                  .Str("t")
                                  .Bytes({0xcf, 0, 0, 0, 0, 0, 0, 0, 3})
                                  .Str("v")
                                  .Bytes({0xd0, 1})
                                  .Str("s")
                                  .Bytes({0xd1, 0, 1})
                                  .Str("x")
                                  .Bytes({0xcd, 0, 5})
                                  .Str("u")
                                  .Bytes({0xd3, 0, 0, 0, 0, 0, 0, 0, 6})
                                  .Str("l")
                                  .Uint(0));
  ASSERT_TRUE(d.has_value()) << d.error().ToString();
  EXPECT_EQ(d->status, RenewalStatus::kRejected);
  EXPECT_EQ(d->extended, 5u);
  EXPECT_EQ(d->unknown, 6u);
}

TEST(WireCompat, NewerVersionIsADistinctError) {
  for (std::uint64_t v : {2ull, 7ull, 1ull << 40}) {
    const Bytes b = Raw().Head(3, 1, v).Str("whatever").Str("changed");
    ExpectError(DecodePull(b), ErrorCode::kProtocol, "unsupported version " + std::to_string(v));
    ExpectError(DecodeRenewal(b), ErrorCode::kProtocol, "unsupported version");
    ExpectError(PeekType(b.data(), b.size()), ErrorCode::kProtocol, "unsupported version");
  }
  ExpectError(DecodePull(Raw().Head(2, 1, 0)), ErrorCode::kProtocol, "unsupported version 0");
  // The version is checked before anything else, even before the message type.
  ExpectError(DecodeRenewal(Raw().Head(2, 99, 2)), ErrorCode::kProtocol, "unsupported version 2");
}

// ---------------------------------------------------------------------------------------------
// Malformed input: structure

TEST(WireMalformed, EmptyAndNonMap) {
  ExpectError(DecodePull(nullptr, 0), ErrorCode::kProtocol, "empty");
  ExpectError(DecodeRelease(nullptr, 0), ErrorCode::kProtocol, "empty");
  ExpectError(DecodeReleaseReply(nullptr, 0), ErrorCode::kProtocol, "empty");
  ExpectError(DecodeAbortNotice(nullptr, 0), ErrorCode::kProtocol, "empty");
  for (const Bytes& b : {Bytes{0x01}, Bytes{0xc0}, Bytes(Raw().Array(1).Uint(1)),
                         Bytes(Raw().Str("t")), Bytes(Raw().Bin({1}))}) {
    ExpectError(DecodePull(b), ErrorCode::kProtocol, "not a msgpack map");
    ExpectError(DecodeRenewal(b), ErrorCode::kProtocol, "not a msgpack map");
    ExpectError(DecodeRenewalReply(b), ErrorCode::kProtocol, "not a msgpack map");
    ExpectError(DecodePullResponse(b), ErrorCode::kProtocol, "not a msgpack map");
    ExpectError(DecodeRelease(b), ErrorCode::kProtocol, "not a msgpack map");
    ExpectError(DecodeReleaseReply(b), ErrorCode::kProtocol, "not a msgpack map");
    ExpectError(DecodeAbortNotice(b), ErrorCode::kProtocol, "not a msgpack map");
    ExpectError(PeekType(b.data(), b.size()), ErrorCode::kProtocol, "not a msgpack map");
  }
}

TEST(WireMalformed, EveryTruncationFails) {
  Renewal notices{"d", 5, {1, 2, 3}, 4};
  notices.accepts_notices = true;
  const std::vector<Bytes> frames = {Encode(SamplePull()),
                                     Encode(Renewal{"d", 5, {1, 2, 3}}),
                                     Encode(notices),
                                     Encode(RenewalReply{RenewalStatus::kError, 1, 2, 3, "m"}),
                                     Encode(SampleResponse()),
                                     Encode(SampleRelease()),
                                     Encode(ReleaseReply{ReleaseStatus::kError, 1, 2, 3, "m", 4}),
                                     Encode(SampleNotice())};
  for (const Bytes& full : frames) {
    for (std::size_t n = 0; n < full.size(); ++n) {
      const Bytes cut(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(n));
      for (const Status& r :
           {ErrorOf(DecodePull(cut)), ErrorOf(DecodeRenewal(cut)), ErrorOf(DecodeRenewalReply(cut)),
            ErrorOf(DecodePullResponse(cut)), ErrorOf(DecodeRelease(cut)),
            ErrorOf(DecodeReleaseReply(cut)), ErrorOf(DecodeAbortNotice(cut))}) {
        EXPECT_FALSE(r.ok()) << "prefix of " << n << " bytes decoded";
        EXPECT_FALSE(r.message().empty());
      }
    }
  }
}

TEST(WireMalformed, TrailingBytes) {
  Bytes b = Encode(SamplePull());
  b.push_back(0xc0);
  ExpectError(DecodePull(b), ErrorCode::kProtocol, "trailing");
}

TEST(WireMalformed, ReservedByte) {
  ExpectError(DecodePull(Raw().Head(3, 1).Str("x").Byte(0xc1)), ErrorCode::kProtocol, "0xc1");
}

TEST(WireMalformed, HugeDeclaredSizesAreRefusedBeforeAllocating) {
  // The libFuzzer OOM of reference/deps.md: array32 declaring 0xe46ddc5b items.
  const Bytes oom = {0xdd, 0xe4, 0x6d, 0xdc, 0x5b, 0x6d};
  ExpectError(DecodePull(oom), ErrorCode::kOutOfRange, "array size");
  ExpectError(DecodeRenewal(oom), ErrorCode::kOutOfRange, "array size");
  ExpectError(DecodeRenewalReply(oom), ErrorCode::kOutOfRange, "array size");
  ExpectError(DecodePullResponse(oom), ErrorCode::kOutOfRange, "array size");
  ExpectError(DecodeRelease(oom), ErrorCode::kOutOfRange, "array size");
  ExpectError(DecodeReleaseReply(oom), ErrorCode::kOutOfRange, "array size");
  ExpectError(DecodeAbortNotice(oom), ErrorCode::kOutOfRange, "array size");
  ExpectError(
      DecodeAbortNotice(AbortNoticeWith("", "a", Raw().Bytes({0xdd, 0x7f, 0xff, 0xff, 0xff}))),
      ErrorCode::kOutOfRange, "field 'a': array size of 2147483647");
  // Declared sizes inside a map, within the type's limit but beyond the bytes present.
  const Bytes lies[] = {
      Raw().Head(3, 1).Str("rq").Bytes({0xdc, 0x0f, 0xff}),              // array16 of 4095
      Raw().Head(3, 1).Str("x").Bytes({0xdb, 0x00, 0x00, 0x0f, 0xff}),   // str32 of 4095
      Raw().Head(3, 1).Str("rd").Bytes({0xc6, 0x00, 0x00, 0xff, 0xff}),  // bin32 of 65535
      Raw().Head(3, 1).Str("x").Bytes({0xdf, 0x00, 0x00, 0x00, 0x20}),   // map32 of 32
  };
  for (const Bytes& b : lies) ExpectError(DecodePull(b), ErrorCode::kProtocol, "truncated");
  // And beyond every limit: refused as over the limit, whatever the bytes present.
  ExpectError(DecodePull(Raw().Head(3, 1).Str("x").Bytes({0xdf, 0xff, 0xff, 0xff, 0xff})),
              ErrorCode::kOutOfRange, "map size");
  ExpectError(DecodePull(Raw().Head(3, 1).Str("x").Bytes({0xdb, 0xff, 0xff, 0xff, 0xff})),
              ErrorCode::kOutOfRange, "str length");
  ExpectError(DecodePull(Raw().Head(3, 1).Str("x").Bytes({0xc6, 0xff, 0xff, 0xff, 0xff})),
              ErrorCode::kOutOfRange, "bin length");
  ExpectError(DecodePull(Raw().Head(3, 1).Str("x").Bytes({0xc9, 0xff, 0xff, 0xff, 0xff, 1})),
              ErrorCode::kOutOfRange, "ext length");
  ExpectError(DecodePull(Raw().Map(65)), ErrorCode::kOutOfRange, "map size");
}

TEST(WireMalformed, DepthBomb) {
  // Top map + 7 nested arrays in an unknown key = depth 8: accepted (and skipped).
  Raw ok_frame = Raw()
                     .Map(7)
                     .Str("t")
                     .Uint(3)
                     .Str("v")
                     .Uint(1)
                     .Str("s")
                     .Uint(0)
                     .Str("x")
                     .Uint(0)
                     .Str("u")
                     .Uint(0)
                     .Str("l")
                     .Uint(0)
                     .Str("deep");
  for (int i = 0; i < 7; ++i) ok_frame.Array(1);
  ok_frame.Nil();
  auto d = DecodeRenewalReply(ok_frame.bytes());
  EXPECT_TRUE(d.has_value()) << d.error().ToString();
  // One more level is refused, and so is a classic bomb of a thousand levels.
  Raw deep = Raw().Head(3, 1).Str("deep");
  for (int i = 0; i < 8; ++i) deep.Array(1);
  ExpectError(DecodePull(deep.Nil().bytes()), ErrorCode::kOutOfRange, "nesting depth");
  Bytes bomb(1000, 0x91);
  bomb.push_back(0xc0);
  ExpectError(DecodePull(bomb), ErrorCode::kOutOfRange, "nesting depth");
}

TEST(WireMalformed, FrameOverEightMebibytes) {
  const Bytes big(kMaxFrameBytes + 1, 0);
  ExpectError(DecodePull(big), ErrorCode::kOutOfRange, "frame");
  ExpectError(PeekType(big.data(), big.size()), ErrorCode::kOutOfRange, "frame");
}

TEST(WireMalformed, WrongMessageType) {
  ExpectError(DecodeRenewal(Encode(SamplePull())), ErrorCode::kProtocol,
              "message type 1 (pull) is not a renewal");
  ExpectError(DecodePull(Raw().Head(2, 77)), ErrorCode::kProtocol, "message type 77");
  ExpectError(DecodeRelease(Encode(Renewal{"d", 1, {1}})), ErrorCode::kProtocol,
              "message type 2 (renewal) is not a release");
  ExpectError(DecodeRenewal(Encode(SampleRelease())), ErrorCode::kProtocol,
              "message type 5 (release) is not a renewal");
  ExpectError(DecodeAbortNotice(Encode(ReleaseReply{})), ErrorCode::kProtocol,
              "message type 6 (release_reply) is not an abort_notice");
  ExpectError(DecodeReleaseReply(Encode(SampleNotice())), ErrorCode::kProtocol,
              "message type 7 (abort_notice) is not a release_reply");
  ExpectError(DecodeReleaseReply(Encode(RenewalReply{})), ErrorCode::kProtocol,
              "message type 3 (renewal_reply) is not a release_reply");
  ExpectError(DecodeRelease(Raw().Head(2, 8)), ErrorCode::kProtocol, "message type 8 (unknown)");
}

TEST(WireMalformed, DuplicateKey) {
  Bytes b = Raw()
                .Map(11)
                .Str("t")
                .Uint(1)
                .Str("v")
                .Uint(1)
                .Str("e")
                .Str("a")
                .Str("ts")
                .Uint(1)
                .Str("tr")
                .Uint(0)
                .Str("bl")
                .Uint(1)
                .Str("nb")
                .Uint(1)
                .Str("rq")
                .Array(0)
                .Str("e")
                .Str("b")
                .Str("x")
                .Nil()
                .Str("y")
                .Nil();
  ExpectError(DecodePull(b), ErrorCode::kProtocol, "'e' (d_engine_id): duplicate");
}

// ---------------------------------------------------------------------------------------------
// Malformed input: fields of a pull

TEST(WirePullFields, BaselineDecodes) {
  auto d = DecodePull(PullWith());
  ASSERT_TRUE(d.has_value()) << d.error().ToString();
  EXPECT_EQ(d->requests[0].block_ids, std::vector<core::BlockId>{3});
}

TEST(WirePullFields, MissingRequiredFieldIsNamed) {
  const std::pair<const char*, const char*> required[] = {{"e", "d_engine_id"}, {"ts", "d_tp_size"},
                                                          {"tr", "d_tp_rank"},  {"bl", "block_len"},
                                                          {"nb", "num_blocks"}, {"rq", "requests"}};
  for (auto [key, name] : required) {
    ExpectError(DecodePull(PullWith(key)), ErrorCode::kProtocol,
                std::string("'") + key + "' (" + name + "): missing");
  }
  EXPECT_TRUE(DecodePull(PullWith("l")).has_value());   // optional
  EXPECT_TRUE(DecodePull(PullWith("rd")).has_value());  // optional
  ExpectError(DecodePull(Raw().Map(1).Str("t").Uint(1)), ErrorCode::kProtocol, "'v' (version)");
  ExpectError(DecodePull(Raw().Map(1).Str("v").Uint(1)), ErrorCode::kProtocol, "'t' (type)");
}

TEST(WirePullFields, WrongTypeIsNamed) {
  const Bytes str = Raw().Str("1");
  const Bytes neg = Raw().Byte(0xff);
  ExpectError(DecodePull(PullWith("", "e", Raw().Uint(1))), ErrorCode::kProtocol,
              "'e' (d_engine_id): expected str, got uint");
  ExpectError(DecodePull(PullWith("", "ts", str)), ErrorCode::kProtocol, "'ts' (d_tp_size)");
  ExpectError(DecodePull(PullWith("", "tr", neg)), ErrorCode::kProtocol,
              "'tr' (d_tp_rank): expected uint, got negative int");
  ExpectError(DecodePull(PullWith("", "l", Raw().Nil())), ErrorCode::kProtocol,
              "'l' (d_lease_ms): expected uint, got nil");
  ExpectError(DecodePull(PullWith("", "bl", Raw().Bytes({0xcb, 0, 0, 0, 0, 0, 0, 0, 0}))),
              ErrorCode::kProtocol, "'bl' (block_len): expected uint, got float");
  ExpectError(DecodePull(PullWith("", "rd", str)), ErrorCode::kProtocol,
              "'rd' (region_descriptor)");
  ExpectError(DecodePull(PullWith("", "rq", Raw().Map(0))), ErrorCode::kProtocol,
              "'rq' (requests): expected array, got map");
  // Inside a request entry.
  ExpectError(DecodePull(PullWith("", "rq", Raw().Array(1).Str("r"))), ErrorCode::kProtocol,
              "'rq'[0].: expected array");
  ExpectError(DecodePull(PullWith("", "rq", Raw().Array(1).Array(2).Str("r").Str("x"))),
              ErrorCode::kProtocol, "need at least 3");
  ExpectError(
      DecodePull(PullWith(
          "", "rq",
          Raw().Array(2).Array(3).Str("r").Str("x").Bin({}).Array(3).Uint(1).Str("x").Bin({}))),
      ErrorCode::kProtocol, "'rq'[1].d_req_id: expected str");
  ExpectError(DecodePull(PullWith("", "rq", Raw().Array(1).Array(3).Str("r").Str("").Bin({}))),
              ErrorCode::kProtocol, "'rq'[0].transfer_id: empty");
  // Block ids as a msgpack array (not our encoding) are a type error, not silently accepted.
  ExpectError(
      DecodePull(PullWith("", "rq", Raw().Array(1).Array(3).Str("r").Str("x").Array(1).Uint(1))),
      ErrorCode::kProtocol, "'rq'[0].block_ids: expected bin, got array");
}

TEST(WirePullFields, ValueRules) {
  ExpectError(DecodePull(PullWith("", "ts", Raw().Uint(0))), ErrorCode::kOutOfRange,
              "'ts' (d_tp_size): must be >= 1");
  ExpectError(DecodePull(PullWith("", "tr", Raw().Uint(2))), ErrorCode::kOutOfRange,
              "2 is not below d_tp_size 2");
  // Bounded by the 64-rank limit before P does any per-rank work (a 46-byte pull naming 2^31
  // ranks once made P allocate per rank and exit with bad_alloc).
  ExpectError(DecodePull(PullWith("", "ts", Raw().Uint(65))), ErrorCode::kOutOfRange,
              "'ts' (d_tp_size): 65 exceeds 64");
  ExpectError(DecodePull(PullWith("", "ts", Raw().Uint(1ull << 31))), ErrorCode::kOutOfRange,
              "'ts' (d_tp_size): 2147483648 exceeds 64");
  ExpectError(DecodePull(PullWith("", "bl", Raw().Uint(0))), ErrorCode::kOutOfRange,
              "'bl' (block_len): must be >= 1");
  // A lease is converted to nanoseconds on P: bounded so that can never overflow.
  ExpectError(DecodePull(PullWith("", "l", Raw().Uint(kMaxLeaseMs + 1))), ErrorCode::kOutOfRange,
              "'l' (d_lease_ms)");
  ExpectError(DecodePull(PullWith("", "nb", Raw().Uint(1ull << 32))), ErrorCode::kOutOfRange,
              "'nb' (num_blocks)");
}

TEST(WirePullFields, BlockBinLengthMustBeAMultipleOfFour) {
  ExpectError(DecodePull(PullWith("", "rq",
                                  Raw().Array(1).Array(3).Str("r").Str("x").Bin({1, 2, 3, 4, 5}))),
              ErrorCode::kProtocol, "'rq'[0].block_ids: bin length 5 is not a multiple of 4");
}

TEST(WirePullFields, IdAndTextLimits) {
  ExpectError(DecodePull(PullWith("", "e", Raw().Str(std::string(kMaxIdBytes + 1, 'e')))),
              ErrorCode::kOutOfRange, "'e' (d_engine_id): length 257 exceeds 256");
  EXPECT_TRUE(DecodePull(PullWith("", "e", Raw().Str(std::string(kMaxIdBytes, 'e')))));
  ExpectError(DecodePull(PullWith("", "rd", Raw().Bin(Bytes(kMaxDescriptorBytes + 1, 0)))),
              ErrorCode::kOutOfRange, "'rd' (region_descriptor): length 65537 exceeds 65536");
  EXPECT_TRUE(DecodePull(PullWith("", "rd", Raw().Bin(Bytes(kMaxDescriptorBytes, 0)))));
}

TEST(WirePullFields, CountLimits) {
  Pull p = SamplePull();
  p.region_descriptor.reset();
  // Requests: 4096 pass, 4097 fail.
  p.requests.assign(kMaxRequestsPerPull, PullRequest{"r", "x", {1}});
  EXPECT_TRUE(Validate(p).ok());
  EXPECT_TRUE(DecodePull(Encode(p)).has_value());
  p.requests.emplace_back(PullRequest{"r", "x", {1}});
  EXPECT_EQ(Validate(p).code(), ErrorCode::kOutOfRange);
  ExpectError(DecodePull(Encode(p)), ErrorCode::kOutOfRange, "array size of 4097");
  // Blocks per request: 65536 pass, 65537 fail.
  p.requests.assign(1, PullRequest{"r", "x", std::vector<core::BlockId>(kMaxBlocksPerRequest, 1)});
  EXPECT_TRUE(DecodePull(Encode(p)).has_value());
  p.requests[0].block_ids.push_back(1);
  EXPECT_EQ(Validate(p).code(), ErrorCode::kOutOfRange);
  ExpectError(DecodePull(Encode(p)), ErrorCode::kOutOfRange, "bin length of 262148");
  // Blocks per pull: 16 full requests pass, a 17th fails.
  p.requests.assign(16, PullRequest{"r", "x", std::vector<core::BlockId>(kMaxBlocksPerRequest, 1)});
  EXPECT_TRUE(DecodePull(Encode(p)).has_value());
  p.requests.push_back(PullRequest{"r", "x", {1}});
  EXPECT_EQ(Validate(p).code(), ErrorCode::kOutOfRange);
  ExpectError(DecodePull(Encode(p)), ErrorCode::kOutOfRange, "1048577 blocks in one pull");
}

TEST(WirePullFields, CheckBlockIds) {
  const PullRequest r{"cmpl-9", "xfer-9", {0, 5, 9, 10}};
  EXPECT_TRUE(CheckBlockIds(r, 11).ok());
  const Status s = CheckBlockIds(r, 10);
  EXPECT_EQ(s.code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(s.message(), "request cmpl-9: block_ids[3] = 10 is not below num_blocks 10");
}

// ---------------------------------------------------------------------------------------------
// Malformed input: renewal, renewal reply, pull response

TEST(WireRenewalFields, Rules) {
  auto renewal = [](const Bytes& fp) {
    return Raw().Head(5, 2).Str("e").Str("d").Str("l").Uint(1).Str("fp").Append(fp).bytes();
  };
  ExpectError(DecodeRenewal(renewal(Raw().Bin(Bytes(8, 0)))), ErrorCode::kProtocol,
              "'fp' (fingerprints): bin length 8 is not a multiple of 7");
  ExpectError(DecodeRenewal(renewal(Raw().Array(1).Uint(1))), ErrorCode::kProtocol,
              "'fp' (fingerprints): expected bin, got array");
  EXPECT_TRUE(DecodeRenewal(renewal(Raw().Bin(Bytes(7 * kMaxFingerprintsPerRenewal, 1)))));
  ExpectError(DecodeRenewal(renewal(Raw().Bin(Bytes(7 * (kMaxFingerprintsPerRenewal + 1), 1)))),
              ErrorCode::kOutOfRange, "bin length");
  ExpectError(DecodeRenewal(Raw().Head(4, 2).Str("e").Str("d").Str("fp").Bin({})),
              ErrorCode::kProtocol, "'l' (d_lease_ms): missing");
  ExpectError(DecodeRenewal(Raw().Head(5, 2).Str("e").Str("").Str("l").Uint(1).Str("fp").Bin({})),
              ErrorCode::kProtocol, "'e' (d_engine_id): empty");
  Renewal too_many{"d", 1, std::vector<core::Fingerprint>(kMaxFingerprintsPerRenewal + 1, 1)};
  EXPECT_EQ(Validate(too_many).code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(Validate(Renewal{"d", 1, {core::kFingerprintMask + 1}}).code(), ErrorCode::kOutOfRange);
}

TEST(WireRenewalReplyFields, Rules) {
  ExpectError(
      DecodeRenewalReply(
          Raw().Head(6, 3).Str("s").Uint(3).Str("x").Uint(0).Str("u").Uint(0).Str("l").Uint(0)),
      ErrorCode::kProtocol, "'s' (status): unknown value 3");
  ExpectError(
      DecodeRenewalReply(Raw().Head(5, 3).Str("s").Uint(0).Str("u").Uint(0).Str("l").Uint(0)),
      ErrorCode::kProtocol, "'x' (extended): missing");
  ExpectError(DecodeRenewalReply(Raw()
                                     .Head(7, 3)
                                     .Str("s")
                                     .Uint(0)
                                     .Str("x")
                                     .Uint(0)
                                     .Str("u")
                                     .Uint(0)
                                     .Str("l")
                                     .Uint(0)
                                     .Str("m")
                                     .Uint(0)),
              ErrorCode::kProtocol, "'m' (message): expected str");
  ExpectError(DecodeRenewalReply(Raw()
                                     .Head(7, 3)
                                     .Str("s")
                                     .Uint(0)
                                     .Str("x")
                                     .Uint(0)
                                     .Str("u")
                                     .Uint(0)
                                     .Str("l")
                                     .Uint(0)
                                     .Str("m")
                                     .Str(std::string(kMaxTextBytes + 1, 'm'))),
              ErrorCode::kOutOfRange, "str length");
}

TEST(WirePullResponseFields, Rules) {
  auto resp = [](std::uint64_t status) { return Raw().Head(6, 4).Str("s").Uint(status); };
  ExpectError(DecodePullResponse(Raw().Head(3, 4).Str("s").Uint(3)), ErrorCode::kProtocol,
              "'s' (status): unknown value 3");
  ExpectError(DecodePullResponse(Raw().Head(3, 4).Str("s").Uint(2)), ErrorCode::kProtocol,
              "'c' (code): missing");
  ExpectError(DecodePullResponse(Raw().Head(4, 4).Str("s").Uint(2).Str("c").Uint(10)),
              ErrorCode::kProtocol, "'m' (message): missing for ERROR");
  ExpectError(DecodePullResponse(resp(2).Str("c").Uint(10).Str("m").Str("bad").Str("ok").Array(0)),
              ErrorCode::kProtocol, "must not carry");
  ExpectError(
      DecodePullResponse(Raw().Head(5, 4).Str("s").Uint(2).Str("c").Uint(0).Str("m").Str("x")),
      ErrorCode::kProtocol, "'c' (code): unknown error code 0");
  for (std::uint64_t code : {0ull, 14ull, 255ull}) {
    ExpectError(DecodePullResponse(Raw()
                                       .Head(4, 4)
                                       .Str("err")
                                       .Array(1)
                                       .Array(3)
                                       .Str("r")
                                       .Uint(code)
                                       .Str("why")
                                       .Str("s")
                                       .Uint(0)),
                ErrorCode::kProtocol, "'err'[0].code: unknown error code " + std::to_string(code));
  }
  ExpectError(
      DecodePullResponse(Raw().Head(4, 4).Str("s").Uint(0).Str("ok").Array(2).Str("a").Uint(5)),
      ErrorCode::kProtocol, "'ok'[1].d_req_id: expected str, got uint");
  ExpectError(DecodePullResponse(
                  Raw().Head(4, 4).Str("s").Uint(0).Str("err").Array(1).Array(2).Str("r").Uint(4)),
              ErrorCode::kProtocol, "'err'[0].: 2 items, need at least 3");
  // The fourth element of an err entry is `unsettled`, a bool; more trailing elements are a
  // forward-compatible extension: ignored.
  auto entry = [](std::uint32_t n) {
    return Raw().Head(4, 4).Str("s").Uint(0).Str("err").Array(1).Array(n).Str("r").Uint(4).Str(
        "why");
  };
  auto d = DecodePullResponse(entry(5).Bool(true).Str("future"));
  ASSERT_TRUE(d.has_value()) << d.error().ToString();
  EXPECT_EQ(d->err, (std::vector<RequestError>{{"r", ErrorCode::kOutOfRange, "why", true}}));
  d = DecodePullResponse(entry(4).Bool(false));
  ASSERT_TRUE(d.has_value()) << d.error().ToString();
  EXPECT_FALSE(d->err.at(0).unsettled);
  ExpectError(DecodePullResponse(entry(4).Str("future")), ErrorCode::kProtocol,
              "'err'[0].unsettled: expected bool");
  // "c" on a non-ERROR response means nothing and is skipped like an unknown key.
  EXPECT_TRUE(DecodePullResponse(Raw().Head(4, 4).Str("s").Uint(0).Str("c").Str("x")));
  // ok + err together are bounded.
  PullResponse big{PullStatus::kContinue, std::vector<std::string>(3000, "r"),
                   std::vector<RequestError>(1097, {"r", ErrorCode::kTimeout, ""}), ErrorCode::kOk,
                   ""};
  EXPECT_EQ(Validate(big).code(), ErrorCode::kOutOfRange);
  ExpectError(DecodePullResponse(Encode(big)), ErrorCode::kOutOfRange, "4097 entries");
}

TEST(WireValidate, PullResponseErrorShape) {
  EXPECT_FALSE(Validate(PullResponse{PullStatus::kError, {}, {}, ErrorCode::kOk, "x"}).ok());
  EXPECT_FALSE(Validate(PullResponse{PullStatus::kError, {}, {}, ErrorCode::kInternal, ""}).ok());
  EXPECT_FALSE(
      Validate(PullResponse{PullStatus::kError, {"r"}, {}, ErrorCode::kInternal, "x"}).ok());
  EXPECT_FALSE(Validate(PullResponse{PullStatus::kFinish, {}, {}, ErrorCode::kInternal, ""}).ok());
  EXPECT_FALSE(
      Validate(
          PullResponse{PullStatus::kFinish, {}, {{"r", ErrorCode::kOk, ""}}, ErrorCode::kOk, ""})
          .ok());
}

// ---------------------------------------------------------------------------------------------
// Renewal "n" (accepts_notices): an optional key added to v1

// docs/protocol.md §7's example renewal, byte for byte: what every build before "n" encodes.
const Bytes kRenewalExample = {0x86, 0xa1, 0x74, 0x02, 0xa1, 0x76, 0x01, 0xa2, 0x69, 0x64,
                               0x07, 0xa1, 0x65, 0xa8, 0x64, 0x65, 0x63, 0x6f, 0x64, 0x65,
                               0x2d, 0x30, 0xa1, 0x6c, 0xcd, 0x75, 0x30, 0xa2, 0x66, 0x70,
                               0xc4, 0x07, 0xb1, 0xc1, 0x87, 0x28, 0x1c, 0x7f, 0x8f};

TEST(WireRenewalNotices, ARenewalWithoutNoticesEncodesExactlyAsBefore) {
  Renewal r{"decode-0", 30000, {core::FingerprintOf("xfer-1")}, 7};
  EXPECT_EQ(Encode(r), kRenewalExample);
  auto d = DecodeRenewal(kRenewalExample);
  ASSERT_TRUE(d.has_value()) << d.error().ToString();
  EXPECT_FALSE(d->accepts_notices);
  EXPECT_EQ(*d, r);
}

TEST(WireRenewalNotices, NoticesFlagIsOneMoreKeyAtTheEnd) {
  Renewal r{"decode-0", 30000, {core::FingerprintOf("xfer-1")}, 7};
  r.accepts_notices = true;
  Bytes want = kRenewalExample;
  want[0] = 0x87;  // one more key
  want.insert(want.end(), {0xa1, 'n', 0xc3});
  EXPECT_EQ(Encode(r), want);
  auto d = DecodeRenewal(want);
  ASSERT_TRUE(d.has_value()) << d.error().ToString();
  EXPECT_TRUE(d->accepts_notices);
  EXPECT_EQ(*d, r);
  EXPECT_EQ(PeekType(want), MessageType::kRenewal);
}

TEST(WireRenewalNotices, NoticesFlagMustBeABool) {
  auto renewal = [](const Bytes& n) {
    return Raw()
        .Head(6, 2)
        .Str("e")
        .Str("d")
        .Str("l")
        .Uint(1)
        .Str("fp")
        .Bin({})
        .Str("n")
        .Append(n)
        .bytes();
  };
  ExpectError(DecodeRenewal(renewal(Raw().Uint(1))), ErrorCode::kProtocol,
              "'n' (accepts_notices): expected bool, got uint");
  ExpectError(DecodeRenewal(renewal(Raw().Nil())), ErrorCode::kProtocol,
              "'n' (accepts_notices): expected bool, got nil");
  ExpectError(DecodeRenewal(renewal(Raw().Str("true"))), ErrorCode::kProtocol,
              "'n' (accepts_notices): expected bool, got str");
  auto yes = DecodeRenewal(renewal(Raw().Byte(0xc3)));
  ASSERT_TRUE(yes.has_value()) << yes.error().ToString();
  EXPECT_TRUE(yes->accepts_notices);
  // An explicit false means the same as no key, and re-encodes without it.
  auto no = DecodeRenewal(renewal(Raw().Byte(0xc2)));
  ASSERT_TRUE(no.has_value()) << no.error().ToString();
  EXPECT_FALSE(no->accepts_notices);
  EXPECT_EQ(Encode(*no), Encode(Renewal{"d", 1, {}}));
  ExpectError(DecodeRenewal(Raw()
                                .Head(7, 2)
                                .Str("n")
                                .Byte(0xc3)
                                .Str("e")
                                .Str("d")
                                .Str("l")
                                .Uint(1)
                                .Str("fp")
                                .Bin({})
                                .Str("n")
                                .Byte(0xc3)),
              ErrorCode::kProtocol, "'n' (accepts_notices): duplicate key");
}

// ---------------------------------------------------------------------------------------------
// Release (t = 5)

TEST(WireRoundTrip, Release) {
  Release max_release{std::string(kMaxIdBytes, 'e'), core::kMaxTpSize, core::kMaxTpSize - 1,
                      std::vector<core::Fingerprint>(kMaxFingerprintsPerRelease, 3), ~0ull};
  for (const Release& r : {SampleRelease(), Release{"d", 1, 0, {7}}, max_release}) {
    ASSERT_TRUE(Validate(r).ok()) << Validate(r).ToString();
    auto d = DecodeRelease(Encode(r));
    ASSERT_TRUE(d.has_value()) << d.error().ToString();
    EXPECT_EQ(*d, r);
  }
}

TEST(WireLayout, ReleaseIsTheRenewalLayoutWithTpKeys) {
  // {"t": 5, "v": 1, "e": "d", "ts": 2, "tr": 1, "fp": bin of 7-byte little-endian values}.
  const Bytes b = Encode(Release{"d", 2, 1, {0x07060504030201}});
  const Bytes want = {0x86, 0xa1, 't', 5, 0xa1, 'v', 1,   0xa1, 'e',  0xa1, 'd',
                      0xa2, 't',  's', 2, 0xa2, 't', 'r', 1,    0xa2, 'f',  'p',
                      0xc4, 7,    1,   2, 3,    4,   5,   6,    7};
  EXPECT_EQ(b, want);
}

TEST(WireReleaseFields, BaselineDecodes) {
  auto d = DecodeRelease(ReleaseWith());
  ASSERT_TRUE(d.has_value()) << d.error().ToString();
  EXPECT_EQ(*d, (Release{"d", 2, 1, {0x07060504030201}, 11}));
  EXPECT_EQ(d->id, 11u);
}

TEST(WireReleaseFields, MissingRequiredFieldIsNamed) {
  const std::pair<const char*, const char*> required[] = {
      {"e", "d_engine_id"}, {"ts", "d_tp_size"}, {"tr", "d_tp_rank"}, {"fp", "fingerprints"}};
  for (auto [key, name] : required) {
    ExpectError(DecodeRelease(ReleaseWith(key)), ErrorCode::kProtocol,
                std::string("'") + key + "' (" + name + "): missing");
  }
  auto no_id = DecodeRelease(ReleaseWith("id"));  // optional: absent = 0
  ASSERT_TRUE(no_id.has_value()) << no_id.error().ToString();
  EXPECT_EQ(no_id->id, 0u);
}

TEST(WireReleaseFields, WrongTypeIsNamed) {
  ExpectError(DecodeRelease(ReleaseWith("", "e", Raw().Uint(1))), ErrorCode::kProtocol,
              "'e' (d_engine_id): expected str, got uint");
  ExpectError(DecodeRelease(ReleaseWith("", "ts", Raw().Str("2"))), ErrorCode::kProtocol,
              "'ts' (d_tp_size): expected uint, got str");
  ExpectError(DecodeRelease(ReleaseWith("", "tr", Raw().Byte(0xff))), ErrorCode::kProtocol,
              "'tr' (d_tp_rank): expected uint, got negative int");
  ExpectError(DecodeRelease(ReleaseWith("", "fp", Raw().Array(1).Uint(7))), ErrorCode::kProtocol,
              "'fp' (fingerprints): expected bin, got array");
  ExpectError(DecodeRelease(ReleaseWith("", "fp", Raw().Str("1234567"))), ErrorCode::kProtocol,
              "'fp' (fingerprints): expected bin, got str");
  ExpectError(DecodeRelease(ReleaseWith("", "id", Raw().Str("11"))), ErrorCode::kProtocol,
              "'id' (id): expected uint, got str");
}

TEST(WireReleaseFields, EmptyIdAndEmptyFingerprintsAreRefused) {
  ExpectError(DecodeRelease(ReleaseWith("", "e", Raw().Str(""))), ErrorCode::kProtocol,
              "'e' (d_engine_id): empty");
  ExpectError(DecodeRelease(ReleaseWith("", "fp", Raw().Bin({}))), ErrorCode::kProtocol,
              "'fp' (fingerprints): empty");
}

TEST(WireReleaseFields, TpRules) {
  ExpectError(DecodeRelease(ReleaseWith("", "ts", Raw().Uint(0))), ErrorCode::kOutOfRange,
              "'ts' (d_tp_size): must be >= 1");
  ExpectError(DecodeRelease(ReleaseWith("", "tr", Raw().Uint(2))), ErrorCode::kOutOfRange,
              "'tr' (d_tp_rank): 2 is not below d_tp_size 2");
  ExpectError(DecodeRelease(ReleaseWith("", "ts", Raw().Uint(core::kMaxTpSize + 1))),
              ErrorCode::kOutOfRange, "'ts' (d_tp_size): 65 exceeds 64");
  ExpectError(DecodeRelease(ReleaseWith("", "ts", Raw().Uint(1ull << 31))), ErrorCode::kOutOfRange,
              "'ts' (d_tp_size): 2147483648 exceeds 64");
  ExpectError(DecodeRelease(ReleaseWith("", "tr", Raw().Uint(1ull << 32))), ErrorCode::kOutOfRange,
              "'tr' (d_tp_rank): 4294967296 exceeds 4294967295");
  // At the limit: 64 ranks, the last one.
  const Bytes at_limit = FrameWith(5,
                                   {{"e", Raw().Str("d")},
                                    {"ts", Raw().Uint(core::kMaxTpSize)},
                                    {"tr", Raw().Uint(core::kMaxTpSize - 1)},
                                    {"fp", Raw().Bin(Bytes(7, 1))}},
                                   "", "", {});
  auto d = DecodeRelease(at_limit);
  ASSERT_TRUE(d.has_value()) << d.error().ToString();
  EXPECT_EQ(d->d_tp_rank, core::kMaxTpSize - 1);
}

TEST(WireReleaseFields, SizeLimits) {
  ExpectError(DecodeRelease(ReleaseWith("", "e", Raw().Str(std::string(kMaxIdBytes + 1, 'e')))),
              ErrorCode::kOutOfRange, "'e' (d_engine_id): length 257 exceeds 256");
  EXPECT_TRUE(DecodeRelease(ReleaseWith("", "e", Raw().Str(std::string(kMaxIdBytes, 'e')))));
  ExpectError(DecodeRelease(ReleaseWith("", "fp", Raw().Bin(Bytes(8, 0)))), ErrorCode::kProtocol,
              "'fp' (fingerprints): bin length 8 is not a multiple of 7");
  EXPECT_TRUE(
      DecodeRelease(ReleaseWith("", "fp", Raw().Bin(Bytes(7 * kMaxFingerprintsPerRelease, 1)))));
  ExpectError(DecodeRelease(
                  ReleaseWith("", "fp", Raw().Bin(Bytes(7 * (kMaxFingerprintsPerRelease + 1), 1)))),
              ErrorCode::kOutOfRange, "field 'fp': bin length of 57351");
}

TEST(WireValidate, Release) {
  EXPECT_TRUE(Validate(SampleRelease()).ok());
  auto code = [](auto edit) {
    Release r = SampleRelease();
    edit(r);
    return Validate(r).code();
  };
  EXPECT_EQ(code([](Release& r) { r.d_engine_id.clear(); }), ErrorCode::kProtocol);
  EXPECT_EQ(code([](Release& r) { r.d_engine_id.assign(kMaxIdBytes + 1, 'e'); }),
            ErrorCode::kOutOfRange);
  EXPECT_EQ(code([](Release& r) { r.d_tp_size = 0; }), ErrorCode::kOutOfRange);
  EXPECT_EQ(code([](Release& r) { r.d_tp_size = core::kMaxTpSize + 1; }), ErrorCode::kOutOfRange);
  EXPECT_EQ(code([](Release& r) { r.d_tp_rank = r.d_tp_size; }), ErrorCode::kOutOfRange);
  EXPECT_EQ(code([](Release& r) { r.fingerprints.clear(); }), ErrorCode::kProtocol);
  EXPECT_EQ(code([](Release& r) { r.fingerprints.assign(kMaxFingerprintsPerRelease + 1, 1); }),
            ErrorCode::kOutOfRange);
  EXPECT_EQ(code([](Release& r) { r.fingerprints.push_back(core::kFingerprintMask + 1); }),
            ErrorCode::kOutOfRange);
}

// ---------------------------------------------------------------------------------------------
// ReleaseReply (t = 6)

TEST(WireRoundTrip, ReleaseReply) {
  for (auto status : {ReleaseStatus::kAccepted, ReleaseStatus::kError}) {
    for (std::string message :
         {std::string(), std::string("bad d_tp_size"), std::string(kMaxTextBytes, 'm')}) {
      ReleaseReply r{status, 1u << 20, 3, ~0ull, message, 77};
      ASSERT_TRUE(Validate(r).ok());
      auto d = DecodeReleaseReply(Encode(r));
      ASSERT_TRUE(d.has_value()) << d.error().ToString();
      EXPECT_EQ(*d, r);
    }
  }
}

TEST(WireReleaseReplyFields, BaselineDecodes) {
  auto d = DecodeReleaseReply(ReleaseReplyWith());
  ASSERT_TRUE(d.has_value()) << d.error().ToString();
  EXPECT_EQ(*d, (ReleaseReply{ReleaseStatus::kAccepted, 1, 2, 3, "", 11}));
}

TEST(WireReleaseReplyFields, Rules) {
  const std::pair<const char*, const char*> required[] = {
      {"s", "status"}, {"r", "released"}, {"k", "kept"}, {"u", "unknown"}};
  for (auto [key, name] : required) {
    ExpectError(DecodeReleaseReply(ReleaseReplyWith(key)), ErrorCode::kProtocol,
                std::string("'") + key + "' (" + name + "): missing");
  }
  ExpectError(DecodeReleaseReply(ReleaseReplyWith("", "s", Raw().Uint(2))), ErrorCode::kProtocol,
              "'s' (status): unknown value 2");
  ExpectError(DecodeReleaseReply(ReleaseReplyWith("", "r", Raw().Byte(0xff))), ErrorCode::kProtocol,
              "'r' (released): expected uint, got negative int");
  ExpectError(DecodeReleaseReply(ReleaseReplyWith("", "k", Raw().Nil())), ErrorCode::kProtocol,
              "'k' (kept): expected uint, got nil");
  ExpectError(DecodeReleaseReply(ReleaseReplyWith("", "m", Raw().Bin({1}))), ErrorCode::kProtocol,
              "'m' (message): expected str, got bin");
  auto m =
      DecodeReleaseReply(ReleaseReplyWith("", "m", Raw().Str(std::string(kMaxTextBytes, 'm'))));
  ASSERT_TRUE(m.has_value()) << m.error().ToString();
  EXPECT_EQ(m->message.size(), kMaxTextBytes);
  ExpectError(
      DecodeReleaseReply(ReleaseReplyWith("", "m", Raw().Str(std::string(kMaxTextBytes + 1, 'm')))),
      ErrorCode::kOutOfRange, "field 'm': str length of 4097");
  ReleaseReply bad_status;
  bad_status.status = static_cast<ReleaseStatus>(2);
  EXPECT_EQ(Validate(bad_status).code(), ErrorCode::kProtocol);
  EXPECT_EQ(
      Validate(ReleaseReply{ReleaseStatus::kError, 0, 0, 0, std::string(kMaxTextBytes + 1, 'm')})
          .code(),
      ErrorCode::kOutOfRange);
}

// ---------------------------------------------------------------------------------------------
// AbortNotice (t = 7)

TEST(WireRoundTrip, AbortNotice) {
  AbortNotice max_notice{std::string(kMaxIdBytes, 'p'), core::kMaxTpSize - 1, {}};
  max_notice.aborted.assign(kMaxAbortsPerNotice,
                            AbortedTransfer{std::string(kMaxIdBytes, 'x'), ErrorCode::kInternal,
                                            std::string(kMaxTextBytes, 'r')});
  for (const AbortNotice& n :
       {SampleNotice(), AbortNotice{"p", 0, {{"x", ErrorCode::kInvalidArgument, ""}}},
        max_notice}) {
    ASSERT_TRUE(Validate(n).ok()) << Validate(n).ToString();
    const Bytes b = Encode(n);
    EXPECT_LE(b.size(), kMaxFrameBytes);
    auto d = DecodeAbortNotice(b);
    ASSERT_TRUE(d.has_value()) << d.error().ToString();
    EXPECT_EQ(*d, n);
  }
}

TEST(WireLayout, AbortNoticeCarriesNoId) {
  const Bytes b = Encode(SampleNotice());
  // {"t": 7, "v": 1, "e": ...}: three keys after the header, none of them "id".
  ASSERT_GE(b.size(), 10u);
  EXPECT_EQ((Bytes{b.begin(), b.begin() + 10}),
            (Bytes{0x85, 0xa1, 't', 7, 0xa1, 'v', 1, 0xa1, 'e', 0xb0}));
  EXPECT_EQ(PeekId(b), 0u);
  // An "id" from another encoder is read (it must be a uint, as in every message) and ignored.
  auto d = DecodeAbortNotice(AbortNoticeWith("", "id", Raw().Uint(9)));
  ASSERT_TRUE(d.has_value()) << d.error().ToString();
  EXPECT_EQ(Encode(*d), Encode(AbortNotice{"p", 1, {{"x", ErrorCode::kCancelled, "why"}}}));
  ExpectError(DecodeAbortNotice(AbortNoticeWith("", "id", Raw().Str("9"))), ErrorCode::kProtocol,
              "'id' (id): expected uint, got str");
}

TEST(WireAbortNoticeFields, BaselineDecodes) {
  auto d = DecodeAbortNotice(AbortNoticeWith());
  ASSERT_TRUE(d.has_value()) << d.error().ToString();
  EXPECT_EQ(*d, (AbortNotice{"p", 1, {{"x", ErrorCode::kCancelled, "why"}}}));
}

TEST(WireAbortNoticeFields, MissingAndMistypedFieldsAreNamed) {
  const std::pair<const char*, const char*> required[] = {
      {"e", "p_engine_id"}, {"pr", "p_tp_rank"}, {"a", "aborted"}};
  for (auto [key, name] : required) {
    ExpectError(DecodeAbortNotice(AbortNoticeWith(key)), ErrorCode::kProtocol,
                std::string("'") + key + "' (" + name + "): missing");
  }
  ExpectError(DecodeAbortNotice(AbortNoticeWith("", "e", Raw().Bin({1}))), ErrorCode::kProtocol,
              "'e' (p_engine_id): expected str, got bin");
  ExpectError(DecodeAbortNotice(AbortNoticeWith("", "e", Raw().Str(""))), ErrorCode::kProtocol,
              "'e' (p_engine_id): empty");
  ExpectError(DecodeAbortNotice(AbortNoticeWith("", "pr", Raw().Str("1"))), ErrorCode::kProtocol,
              "'pr' (p_tp_rank): expected uint, got str");
  ExpectError(DecodeAbortNotice(AbortNoticeWith("", "a", Raw().Map(0))), ErrorCode::kProtocol,
              "'a' (aborted): expected array, got map");
  ExpectError(DecodeAbortNotice(AbortNoticeWith("", "a", Raw().Array(0))), ErrorCode::kProtocol,
              "'a' (aborted): 0 items, need at least 1");
}

TEST(WireAbortNoticeFields, EntryRules) {
  auto notice = [](const Bytes& aborted) {
    return DecodeAbortNotice(AbortNoticeWith("", "a", aborted));
  };
  ExpectError(notice(Raw().Array(1).Str("x")), ErrorCode::kProtocol, "'a'[0].: expected array");
  ExpectError(notice(Raw().Array(1).Array(2).Str("x").Uint(12)), ErrorCode::kProtocol,
              "'a'[0].: 2 items, need at least 3");
  ExpectError(notice(Raw().Array(1).Array(3).Str("").Uint(12).Str("")), ErrorCode::kProtocol,
              "'a'[0].transfer_id: empty");
  ExpectError(
      notice(Raw().Array(2).Array(3).Str("x").Uint(12).Str("").Array(3).Uint(1).Uint(12).Str("")),
      ErrorCode::kProtocol, "'a'[1].transfer_id: expected str, got uint");
  for (std::uint64_t code : {0ull, 14ull, 255ull, 1ull << 40}) {
    ExpectError(notice(Aborts(1, "x", code)), ErrorCode::kProtocol,
                "'a'[0].code: unknown error code " + std::to_string(code));
  }
  ExpectError(notice(Raw().Array(1).Array(3).Str("x").Str("12").Str("")), ErrorCode::kProtocol,
              "'a'[0].code: expected uint, got str");
  ExpectError(notice(Raw().Array(1).Array(3).Str("x").Uint(12).Uint(0)), ErrorCode::kProtocol,
              "'a'[0].reason: expected str, got uint");
  // Every valid non-OK code is accepted.
  for (int code = 1; code <= static_cast<int>(ErrorCode::kInternal); ++code) {
    auto d = notice(Aborts(1, "x", static_cast<std::uint64_t>(code)));
    ASSERT_TRUE(d.has_value()) << d.error().ToString();
    EXPECT_EQ(d->aborted[0].code, static_cast<ErrorCode>(code));
  }
  // Extra trailing elements of an entry are a forward-compatible extension: ignored.
  auto d = notice(Raw().Array(1).Array(5).Str("x").Uint(9).Str("freed").Nil().Array(1).Uint(1));
  ASSERT_TRUE(d.has_value()) << d.error().ToString();
  EXPECT_EQ(d->aborted, (std::vector<AbortedTransfer>{{"x", ErrorCode::kTombstoned, "freed"}}));
}

TEST(WireAbortNoticeFields, Limits) {
  auto notice = [](std::string_view key, const Bytes& value) {
    return DecodeAbortNotice(AbortNoticeWith("", key, value));
  };
  ExpectError(notice("e", Raw().Str(std::string(kMaxIdBytes + 1, 'p'))), ErrorCode::kOutOfRange,
              "'e' (p_engine_id): length 257 exceeds 256");
  EXPECT_TRUE(notice("e", Raw().Str(std::string(kMaxIdBytes, 'p'))));
  ExpectError(notice("pr", Raw().Uint(core::kMaxTpSize)), ErrorCode::kOutOfRange,
              "'pr' (p_tp_rank): 64 exceeds 63");
  EXPECT_TRUE(notice("pr", Raw().Uint(core::kMaxTpSize - 1)));
  ExpectError(notice("a", Aborts(1, std::string(kMaxIdBytes + 1, 'x'))), ErrorCode::kOutOfRange,
              "'a'[0].transfer_id: length 257 exceeds 256");
  EXPECT_TRUE(notice("a", Aborts(1, std::string(kMaxIdBytes, 'x'))));
  ExpectError(notice("a", Aborts(1, "x", 12, std::string(kMaxTextBytes + 1, 'r'))),
              ErrorCode::kOutOfRange, "field 'a': str length of 4097");
  EXPECT_TRUE(notice("a", Aborts(1, "x", 12, std::string(kMaxTextBytes, 'r'))));
  ExpectError(notice("a", Aborts(kMaxAbortsPerNotice + 1)), ErrorCode::kOutOfRange,
              "field 'a': array size of 1025");
  auto full = notice("a", Aborts(kMaxAbortsPerNotice));
  ASSERT_TRUE(full.has_value()) << full.error().ToString();
  EXPECT_EQ(full->aborted.size(), kMaxAbortsPerNotice);
}

TEST(WireValidate, AbortNotice) {
  EXPECT_TRUE(Validate(SampleNotice()).ok());
  auto code = [](auto edit) {
    AbortNotice n = SampleNotice();
    edit(n);
    return Validate(n).code();
  };
  EXPECT_EQ(code([](AbortNotice& n) { n.p_engine_id.clear(); }), ErrorCode::kProtocol);
  EXPECT_EQ(code([](AbortNotice& n) { n.p_engine_id.assign(kMaxIdBytes + 1, 'p'); }),
            ErrorCode::kOutOfRange);
  EXPECT_EQ(code([](AbortNotice& n) { n.p_tp_rank = core::kMaxTpSize; }), ErrorCode::kOutOfRange);
  EXPECT_EQ(code([](AbortNotice& n) { n.aborted.clear(); }), ErrorCode::kProtocol);
  EXPECT_EQ(code([](AbortNotice& n) {
              n.aborted.assign(kMaxAbortsPerNotice + 1, {"x", ErrorCode::kCancelled, ""});
            }),
            ErrorCode::kOutOfRange);
  EXPECT_EQ(code([](AbortNotice& n) { n.aborted[1].transfer_id.clear(); }), ErrorCode::kProtocol);
  EXPECT_EQ(code([](AbortNotice& n) { n.aborted[1].transfer_id.assign(kMaxIdBytes + 1, 'x'); }),
            ErrorCode::kOutOfRange);
  EXPECT_EQ(code([](AbortNotice& n) { n.aborted[2].code = ErrorCode::kOk; }), ErrorCode::kProtocol);
  EXPECT_EQ(code([](AbortNotice& n) { n.aborted[2].code = static_cast<ErrorCode>(14); }),
            ErrorCode::kProtocol);
  EXPECT_EQ(code([](AbortNotice& n) { n.aborted[0].reason.assign(kMaxTextBytes + 1, 'r'); }),
            ErrorCode::kOutOfRange);
}

// ---------------------------------------------------------------------------------------------
// Forward compatibility of the new messages

TEST(WireCompat, NewMessagesSkipUnknownKeys) {
  // Unknown keys of every kind around the known ones, and "t" last.
  auto with_noise = [](const std::vector<KV>& known, std::uint64_t type) {
    Raw r;
    r.Map(static_cast<std::uint32_t>(known.size() + 6))
        .Str("future_map")
        .Map(1)
        .Str("a")
        .Array(2)
        .Nil()
        .Bin({1})
        .Uint(7)
        .Str("int key");
    for (const auto& kv : known) r.Str(kv.key).Append(kv.value);
    r.Str("f64")
        .Bytes({0xcb, 0, 0, 0, 0, 0, 0, 0, 0})
        .Str("x")
        .Byte(0xc3)
        .Str("v")
        .Uint(1)
        .Str("t")
        .Uint(type);
    return r.bytes();
  };
  auto release = DecodeRelease(with_noise({{"e", Raw().Str("d")},
                                           {"ts", Raw().Uint(1)},
                                           {"tr", Raw().Uint(0)},
                                           {"fp", Raw().Bin(Bytes(7, 2))}},
                                          5));
  ASSERT_TRUE(release.has_value()) << release.error().ToString();
  EXPECT_EQ(*release, (Release{"d", 1, 0, {0x02020202020202}}));
  auto reply = DecodeReleaseReply(with_noise(
      {{"s", Raw().Uint(1)}, {"r", Raw().Uint(0)}, {"k", Raw().Uint(0)}, {"u", Raw().Uint(4)}}, 6));
  ASSERT_TRUE(reply.has_value()) << reply.error().ToString();
  EXPECT_EQ(*reply, (ReleaseReply{ReleaseStatus::kError, 0, 0, 4, ""}));
  auto notice = DecodeAbortNotice(with_noise(
      {{"e", Raw().Str("p")}, {"pr", Raw().Uint(2)}, {"a", Aborts(2, "x", 5, "late")}}, 7));
  ASSERT_TRUE(notice.has_value()) << notice.error().ToString();
  EXPECT_EQ(*notice,
            (AbortNotice{
                "p", 2, {{"x", ErrorCode::kTimeout, "late"}, {"x", ErrorCode::kTimeout, "late"}}}));
  auto renewal = DecodeRenewal(with_noise(
      {{"e", Raw().Str("d")}, {"l", Raw().Uint(5)}, {"fp", Raw().Bin({})}, {"n", Raw().Byte(0xc3)}},
      2));
  ASSERT_TRUE(renewal.has_value()) << renewal.error().ToString();
  EXPECT_TRUE(renewal->accepts_notices);
}

TEST(WireCompat, NewMessagesRefuseNewerVersions) {
  const Bytes b = Raw().Head(3, 5, 2).Str("whatever").Str("changed");
  ExpectError(DecodeRelease(b), ErrorCode::kProtocol, "unsupported version 2");
  ExpectError(DecodeReleaseReply(Raw().Head(2, 6, 2)), ErrorCode::kProtocol,
              "unsupported version 2");
  ExpectError(DecodeAbortNotice(Raw().Head(2, 7, 0)), ErrorCode::kProtocol,
              "unsupported version 0");
}

TEST(WireRoundTrip, IdOfTheNewMessagesIsCarriedAndOmittedWhenZero) {
  Release r = SampleRelease();
  r.id = 0;
  const std::size_t without = Encode(r).size();
  r.id = 1ull << 40;
  EXPECT_EQ(Encode(r).size(), without + 3 + 9);
  EXPECT_EQ(DecodeRelease(Encode(r))->id, 1ull << 40);
  ReleaseReply y;
  const std::size_t reply_without = Encode(y).size();
  y.id = 8;
  EXPECT_EQ(Encode(y).size(), reply_without + 3 + 1);
  EXPECT_EQ(DecodeReleaseReply(Encode(y))->id, 8u);
}

// ---------------------------------------------------------------------------------------------
// PeekType

TEST(WirePeek, EveryTypeFastPath) {
  const std::pair<Bytes, MessageType> cases[] = {
      {Encode(SamplePull()), MessageType::kPull},
      {Encode(Renewal{"d", 1, {1}}), MessageType::kRenewal},
      {Encode(RenewalReply{}), MessageType::kRenewalReply},
      {Encode(SampleResponse()), MessageType::kPullResponse},
      {Encode(SampleRelease()), MessageType::kRelease},
      {Encode(ReleaseReply{}), MessageType::kReleaseReply},
      {Encode(SampleNotice()), MessageType::kAbortNotice},
  };
  for (const auto& [bytes, type] : cases) {
    auto t = PeekType(bytes.data(), bytes.size());
    ASSERT_TRUE(t.has_value()) << t.error().ToString();
    EXPECT_EQ(*t, type);
    auto s = PeekType(std::as_bytes(std::span(bytes)));
    EXPECT_EQ(s, t);
  }
}

TEST(WirePeek, DoesNotDecodeTheBody) {
  // Only the first 7 bytes matter on the fast path: garbage after them is the decoder's problem.
  Bytes b = Raw().Map(3).Str("t").Uint(1).Str("v").Uint(1).Bytes({0xc1, 0xc1});
  EXPECT_EQ(PeekType(b.data(), b.size()), MessageType::kPull);
  EXPECT_FALSE(DecodePull(b).has_value());
}

TEST(WirePeek, SlowPathFindsKeysAnywhere) {
  Bytes later = Raw()
                    .Map(4)
                    .Str("rq")
                    .Array(2)
                    .Array(0)
                    .Map(1)
                    .Str("t")
                    .Uint(4)
                    .Str("x")
                    .Nil()
                    .Str("v")
                    .Uint(1)
                    .Str("t")
                    .Uint(2);
  EXPECT_EQ(PeekType(later.data(), later.size()), MessageType::kRenewal);
  Bytes wide = Raw().Map(2).Str("v").Bytes({0xcd, 0, 1}).Str("t").Bytes({0xcc, 3});
  EXPECT_EQ(PeekType(wide.data(), wide.size()), MessageType::kRenewalReply);
  Bytes map16 = Raw().Bytes({0xde, 0, 2}).Str("t").Uint(4).Str("v").Uint(1);
  EXPECT_EQ(PeekType(map16.data(), map16.size()), MessageType::kPullResponse);
}

TEST(WirePeek, Errors) {
  auto peek = [](const Bytes& b) { return PeekType(b.data(), b.size()); };
  ExpectError(PeekType(nullptr, 0), ErrorCode::kProtocol, "empty frame");
  ExpectError(peek(Raw().Head(2, 9)), ErrorCode::kProtocol, "unknown message type 9");
  // The first type after this build's last (kMaxMessageType = 7): a newer peer's message.
  ExpectError(peek(Raw().Head(2, 8)), ErrorCode::kProtocol, "unknown message type 8");
  ExpectError(peek(Raw().Map(2).Str("v").Uint(1).Str("t").Uint(8)), ErrorCode::kProtocol,
              "unknown message type 8");
  ExpectError(peek(Raw().Head(2, 0)), ErrorCode::kProtocol, "unknown message type 0");
  ExpectError(peek(Raw().Head(2, 1, 2)), ErrorCode::kProtocol, "unsupported version 2");
  ExpectError(peek(Raw().Map(1).Str("t").Uint(1)), ErrorCode::kProtocol, "'v' (version): missing");
  ExpectError(peek(Raw().Map(1).Str("v").Uint(1)), ErrorCode::kProtocol, "'t' (type): missing");
  ExpectError(peek(Raw().Map(2).Str("t").Str("1").Str("v").Uint(1)), ErrorCode::kProtocol,
              "'t' (type): expected uint");
  ExpectError(peek(Raw().Map(2).Str("t").Uint(1)), ErrorCode::kProtocol, "truncated");
  ExpectError(peek({0xdd, 0xe4, 0x6d, 0xdc, 0x5b, 0x6d}), ErrorCode::kProtocol,
              "not a msgpack map");
  ExpectError(peek({0xdf, 0xe4, 0x6d, 0xdc, 0x5b, 0x6d}), ErrorCode::kOutOfRange, "keys exceeds");
  Raw deep = Raw().Map(2).Str("x");
  for (int i = 0; i < 9; ++i) deep.Array(1);
  ExpectError(peek(deep.Nil().Str("t").Uint(1).bytes()), ErrorCode::kOutOfRange, "nesting depth");
}

// ---------------------------------------------------------------------------------------------
// PeekId

TEST(WirePeekId, FindsTheIdEveryEncoderWrites) {
  Pull p = SamplePull();
  p.id = 1;
  Renewal r{"d", 1, {1}, 300};
  RenewalReply y;
  y.id = 70000;
  PullResponse q = SampleResponse();
  q.id = 1ull << 40;
  Release l = SampleRelease();
  l.id = ~0ull;
  ReleaseReply z;
  z.id = 5;
  const std::pair<Bytes, std::uint64_t> cases[] = {
      {Encode(p), 1},          {Encode(r), 300},   {Encode(y), 70000},
      {Encode(q), 1ull << 40}, {Encode(l), ~0ull}, {Encode(z), 5},
  };
  for (const auto& [bytes, id] : cases) {
    EXPECT_EQ(PeekId(bytes.data(), bytes.size()), id);
    EXPECT_EQ(PeekId(bytes), id);
    EXPECT_EQ(PeekId(std::as_bytes(std::span(bytes))), id);
  }
}

TEST(WirePeekId, IsZeroWhenAbsent) {
  EXPECT_EQ(PeekId(Encode(SamplePull())), 0u);
  EXPECT_EQ(PeekId(Encode(Renewal{"d", 1, {}})), 0u);
  EXPECT_EQ(PeekId(Encode(ReleaseReply{})), 0u);
  EXPECT_EQ(PeekId(Encode(SampleNotice())), 0u);
  EXPECT_EQ(PeekId(Raw().Map(0)), 0u);
  EXPECT_EQ(PeekId(Raw().Head(2, 1)), 0u);
  // Keys that are not exactly the str "id".
  EXPECT_EQ(PeekId(Raw().Map(3).Str("i").Uint(1).Str("ids").Uint(2).Str("ID").Uint(3)), 0u);
  EXPECT_EQ(PeekId(Raw().Map(1).Bin({'i', 'd'}).Uint(4)), 0u);
}

TEST(WirePeekId, IsZeroWhenMistyped) {
  for (const Bytes& value : {Bytes(Raw().Str("7")), Bytes{0xff}, Bytes{0xd0, 0x80}, Bytes{0xc0},
                             Bytes{0xc3}, Bytes{0xcb, 0x40, 0x1c, 0, 0, 0, 0, 0, 0},
                             Bytes(Raw().Array(1).Uint(7)), Bytes(Raw().Bin({7}))}) {
    EXPECT_EQ(PeekId(Raw().Head(3, 5).Str("id").Append(value)), 0u);
  }
}

TEST(WirePeekId, IsZeroForNonMapsAndGarbage) {
  EXPECT_EQ(PeekId(nullptr, 0), 0u);
  EXPECT_EQ(PeekId(Bytes{}), 0u);
  for (const Bytes& b :
       {Bytes{0x01}, Bytes{0xc0}, Bytes{0xc1}, Bytes(Raw().Array(2).Str("id").Uint(7)),
        Bytes(Raw().Str("id")), Bytes{0xdd, 0xe4, 0x6d, 0xdc, 0x5b, 0x6d},
        Bytes{0xdf, 0xe4, 0x6d, 0xdc, 0x5b, 0x6d}, Bytes(Raw().Map(65)),
        // Truncated before the id's value, or inside a value skipped before it.
        Bytes(Raw().Map(3).Str("t").Uint(1).Str("id")),
        Bytes(Raw().Map(3).Str("t").Uint(1).Str("id").Byte(0xcd).Byte(1)),
        Bytes(Raw().Map(2).Str("x").Bytes({0xdb, 0, 0, 0x0f, 0xff}).Str("id").Uint(7)),
        // Over a limit while skipping: a str above the text limit, a depth bomb.
        Bytes(Raw().Map(2).Str("x").Str(std::string(kMaxTextBytes + 1, 'x')).Str("id").Uint(7))}) {
    EXPECT_EQ(PeekId(b), 0u);
  }
  Raw deep = Raw().Map(2).Str("x");
  for (int i = 0; i < 9; ++i) deep.Array(1);
  EXPECT_EQ(PeekId(deep.Nil().Str("id").Uint(7).bytes()), 0u);
  Bytes big = Raw().Map(1).Str("id").Uint(7);
  big.resize(kMaxFrameBytes + 1, 0);
  EXPECT_EQ(PeekId(big), 0u);
}

TEST(WirePeekId, FindsTheIdAnywhereAndReadsNothingAfterIt) {
  // After other keys, values of any kind skipped; any uint encoding; a str8 key.
  EXPECT_EQ(PeekId(Raw()
                       .Map(4)
                       .Str("rq")
                       .Array(2)
                       .Array(0)
                       .Map(1)
                       .Str("id")
                       .Uint(4)
                       .Str("x")
                       .Nil()
                       .Str("id")
                       .Bytes({0xcf, 0, 0, 0, 0, 0, 0, 1, 0})
                       .Str("t")
                       .Uint(2)),
            256u);
  EXPECT_EQ(PeekId(Raw().Map(1).Bytes({0xd9, 2, 'i', 'd'}).Bytes({0xd0, 5})), 5u);
  // Garbage after the id's value is not looked at; the first "id" wins.
  EXPECT_EQ(PeekId(Raw().Map(3).Str("id").Uint(9).Bytes({0xc1, 0xc1})), 9u);
  EXPECT_EQ(PeekId(Raw().Map(2).Str("id").Uint(9).Str("id").Uint(10)), 9u);
}

TEST(WirePeekId, AnswersAMessageOfAnUnknownType) {
  // What P does with a newer D's message: PeekType refuses it, PeekId still has its id.
  const Bytes newer = Raw().Head(4, 8).Str("id").Uint(21).Str("future").Array(1).Nil();
  ExpectError(PeekType(newer), ErrorCode::kProtocol, "unknown message type 8");
  EXPECT_EQ(PeekId(newer), 21u);
  // And a Release as an older P would see it (undecodable for it, but the id is readable).
  Release r = SampleRelease();
  r.id = 42;
  EXPECT_EQ(PeekId(Encode(r)), 42u);
}

// ---------------------------------------------------------------------------------------------
// The committed seed corpus (fuzz/corpus, written by wire_gen_corpus) means what its names say:
// "valid_*" seeds decode, the others are rejected, so the fuzzers start from both sides.

namespace corpus {

Bytes ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

template <typename Decode>
void CheckDir(const std::string& target, Decode decode, int expect_valid) {
  int valid = 0;
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(
           std::filesystem::path(KVFERRY_WIRE_CORPUS_DIR) / target)) {
    const Bytes b = ReadFile(entry.path());
    const bool want = entry.path().filename().string().rfind("valid_", 0) == 0;
    auto r = decode(b);
    EXPECT_EQ(r.has_value(), want) << target << "/" << entry.path().filename().string() << ": "
                                   << (r ? "decoded" : r.error().ToString());
    valid += want;
    ++files;
  }
  EXPECT_EQ(valid, expect_valid) << target;
  EXPECT_GE(files, 5) << target;
}

TEST(WireCorpus, SeedsMeanWhatTheirNamesSay) {
  CheckDir(
      "pull", [](const Bytes& b) { return DecodePull(b); }, 5);
  CheckDir(
      "renewal", [](const Bytes& b) { return DecodeRenewal(b); }, 3);
  CheckDir(
      "renewal_reply", [](const Bytes& b) { return DecodeRenewalReply(b); }, 4);
  CheckDir(
      "pull_response", [](const Bytes& b) { return DecodePullResponse(b); }, 4);
  CheckDir(
      "release", [](const Bytes& b) { return DecodeRelease(b); }, 3);
  CheckDir(
      "release_reply", [](const Bytes& b) { return DecodeReleaseReply(b); }, 3);
  CheckDir(
      "abort_notice", [](const Bytes& b) { return DecodeAbortNotice(b); }, 3);
  for (const auto& [name, type] : std::vector<std::pair<std::string, MessageType>>{
           {"pull", MessageType::kPull},
           {"renewal", MessageType::kRenewal},
           {"renewal_reply", MessageType::kRenewalReply},
           {"pull_response", MessageType::kPullResponse},
           {"release", MessageType::kRelease},
           {"release_reply", MessageType::kReleaseReply},
           {"abort_notice", MessageType::kAbortNotice},
           {"t_not_first", MessageType::kRenewal},
           {"t_uint8", MessageType::kPullResponse}}) {
    const Bytes b = ReadFile(std::filesystem::path(KVFERRY_WIRE_CORPUS_DIR) / "peek" / name);
    EXPECT_EQ(PeekType(b), type) << name;
  }
  // A newer peer's message: PeekType refuses it, and PeekId still finds the id to answer with.
  const Bytes newer =
      ReadFile(std::filesystem::path(KVFERRY_WIRE_CORPUS_DIR) / "peek" / "unknown_type_8");
  ExpectError(PeekType(newer), ErrorCode::kProtocol, "unknown message type 8");
  EXPECT_EQ(PeekId(newer), 21u);
}

}  // namespace corpus
}  // namespace
}  // namespace kvferry::wire
