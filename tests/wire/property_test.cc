// Property tests of the wire codec (rapidcheck):
//  - every valid message of every type round-trips, PeekType names its type and PeekId its id;
//  - arbitrary bytes, and valid frames with random damage, never crash a decoder, and every
//    failure carries a reason (kProtocol or kOutOfRange).
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <string>
#include <vector>

#include "kvferry/core/tp_plan.h"
#include "wire/messages.h"

namespace kvferry::wire {
namespace {

using Bytes = std::vector<std::uint8_t>;

// Ids: mostly short, sometimes at the 256-byte limit; never empty.
std::string GenId() {
  return *rc::gen::oneOf(
      rc::gen::nonEmpty(rc::gen::container<std::string>(rc::gen::character<char>())),
      rc::gen::map(rc::gen::inRange<int>(1, static_cast<int>(kMaxIdBytes) + 1),
                   [](int n) { return std::string(static_cast<std::size_t>(n), 'i'); }));
}
std::string GenText() {
  return *rc::gen::resize(100, rc::gen::container<std::string>(rc::gen::arbitrary<char>()));
}
std::uint64_t GenU64() {
  return *rc::gen::oneOf(rc::gen::inRange<std::uint64_t>(0, 300),
                         rc::gen::arbitrary<std::uint64_t>());
}
// A lease in ms, up to the protocol's bound (kMaxLeaseMs) and at it.
std::uint64_t GenLeaseMs() {
  return *rc::gen::oneOf(rc::gen::inRange<std::uint64_t>(0, 300),
                         rc::gen::inRange<std::uint64_t>(0, kMaxLeaseMs + 1));
}

Pull GenPull() {
  Pull p;
  p.d_engine_id = GenId();
  p.d_tp_size = *rc::gen::inRange<std::uint32_t>(1, 65);
  p.d_tp_rank = *rc::gen::inRange<std::uint32_t>(0, p.d_tp_size);
  if (*rc::gen::arbitrary<bool>()) p.d_lease_ms = GenLeaseMs();
  if (*rc::gen::arbitrary<bool>())
    p.region_descriptor = *rc::gen::resize(300, rc::gen::arbitrary<Bytes>());
  p.block_len = *rc::gen::inRange<std::uint64_t>(1, std::uint64_t{1} << 40);
  p.num_blocks = *rc::gen::arbitrary<std::uint32_t>();
  const auto n = *rc::gen::inRange<std::size_t>(0, 9);
  for (std::size_t i = 0; i < n; ++i) {
    p.requests.push_back(
        {GenId(), GenId(), *rc::gen::resize(64, rc::gen::arbitrary<std::vector<core::BlockId>>())});
  }
  p.id = GenU64();
  if (*rc::gen::arbitrary<bool>()) p.write_key = GenU64();
  return p;
}

std::vector<core::Fingerprint> GenFingerprints() {
  return *rc::gen::resize(300, rc::gen::container<std::vector<core::Fingerprint>>(rc::gen::map(
                                   rc::gen::arbitrary<std::uint64_t>(),
                                   [](auto v) { return v & core::kFingerprintMask; })));
}

Renewal GenRenewal() {
  Renewal r{GenId(), GenLeaseMs(), GenFingerprints(), GenU64()};
  r.accepts_notices = *rc::gen::arbitrary<bool>();
  return r;
}

Release GenRelease() {
  Release r;
  r.d_engine_id = GenId();
  r.d_tp_size = *rc::gen::inRange<std::uint32_t>(1, core::kMaxTpSize + 1);
  r.d_tp_rank = *rc::gen::inRange<std::uint32_t>(0, r.d_tp_size);
  r.fingerprints = GenFingerprints();
  if (r.fingerprints.empty())
    r.fingerprints.push_back(*rc::gen::arbitrary<std::uint64_t>() & core::kFingerprintMask);
  r.id = GenU64();
  return r;
}

ReleaseReply GenReleaseReply() {
  return {static_cast<ReleaseStatus>(*rc::gen::inRange(0, 2)),
          GenU64(),
          GenU64(),
          GenU64(),
          GenText(),
          GenU64()};
}

RenewalReply GenRenewalReply() {
  return {static_cast<RenewalStatus>(*rc::gen::inRange(0, 3)),
          GenU64(),
          GenU64(),
          GenU64(),
          GenText(),
          GenU64()};
}

ErrorCode GenErrorCode() {
  return static_cast<ErrorCode>(
      *rc::gen::inRange<int>(1, static_cast<int>(ErrorCode::kInternal) + 1));
}

PullResponse GenPullResponse() {
  PullResponse r;
  r.id = GenU64();
  r.status = static_cast<PullStatus>(*rc::gen::inRange(0, 3));
  if (r.status == PullStatus::kError) {
    r.code = GenErrorCode();
    r.message = *rc::gen::nonEmpty(rc::gen::container<std::string>(rc::gen::arbitrary<char>()));
    return r;
  }
  const auto n_ok = *rc::gen::inRange<std::size_t>(0, 10);
  for (std::size_t i = 0; i < n_ok; ++i) r.ok.push_back(GenId());
  const auto n_err = *rc::gen::inRange<std::size_t>(0, 10);
  for (std::size_t i = 0; i < n_err; ++i) {
    r.err.push_back({GenId(), GenErrorCode(), GenText(), *rc::gen::arbitrary<bool>()});
  }
  r.message = GenText();
  return r;
}

AbortNotice GenAbortNotice() {
  AbortNotice n;
  n.p_engine_id = GenId();
  n.p_tp_rank = *rc::gen::inRange<std::uint32_t>(0, core::kMaxTpSize);
  const auto count = *rc::gen::inRange<std::size_t>(1, 10);
  for (std::size_t i = 0; i < count; ++i) n.aborted.push_back({GenId(), GenErrorCode(), GenText()});
  return n;
}

bool PeeksAs(const Bytes& bytes, MessageType type) {
  auto peeked = PeekType(bytes.data(), bytes.size());
  return peeked.has_value() && *peeked == type;
}

template <typename T, typename Decode>
void CheckRoundTrip(const T& msg, MessageType type, Decode decode) {
  RC_ASSERT(Validate(msg).ok());
  const Bytes bytes = Encode(msg);
  auto back = decode(bytes.data(), bytes.size());
  RC_ASSERT(back.has_value());
  RC_ASSERT(*back == msg);
  RC_ASSERT(PeeksAs(bytes, type));
  if constexpr (requires { msg.id; }) {
    RC_ASSERT(PeekId(bytes) == msg.id);
  } else {
    RC_ASSERT(PeekId(bytes) == 0u);  // AbortNotice: never an id on the wire
  }
}

RC_GTEST_PROP(WireProperty, PullRoundTrips, ()) {
  CheckRoundTrip(GenPull(), MessageType::kPull, [](auto d, auto n) { return DecodePull(d, n); });
}
RC_GTEST_PROP(WireProperty, RenewalRoundTrips, ()) {
  CheckRoundTrip(GenRenewal(), MessageType::kRenewal,
                 [](auto d, auto n) { return DecodeRenewal(d, n); });
}
RC_GTEST_PROP(WireProperty, RenewalReplyRoundTrips, ()) {
  CheckRoundTrip(GenRenewalReply(), MessageType::kRenewalReply,
                 [](auto d, auto n) { return DecodeRenewalReply(d, n); });
}
RC_GTEST_PROP(WireProperty, PullResponseRoundTrips, ()) {
  CheckRoundTrip(GenPullResponse(), MessageType::kPullResponse,
                 [](auto d, auto n) { return DecodePullResponse(d, n); });
}

RC_GTEST_PROP(WireProperty, ReleaseRoundTrips, ()) {
  CheckRoundTrip(GenRelease(), MessageType::kRelease,
                 [](auto d, auto n) { return DecodeRelease(d, n); });
}
RC_GTEST_PROP(WireProperty, ReleaseReplyRoundTrips, ()) {
  CheckRoundTrip(GenReleaseReply(), MessageType::kReleaseReply,
                 [](auto d, auto n) { return DecodeReleaseReply(d, n); });
}
RC_GTEST_PROP(WireProperty, AbortNoticeRoundTrips, ()) {
  CheckRoundTrip(GenAbortNotice(), MessageType::kAbortNotice,
                 [](auto d, auto n) { return DecodeAbortNotice(d, n); });
}

// A renewal that does not accept notices encodes exactly as a build that predates "n" did: the
// same bytes as the same renewal with "n" (true) removed and the map one key shorter.
RC_GTEST_PROP(WireProperty, RenewalWithoutNoticesIsTheOldEncoding, ()) {
  Renewal r = GenRenewal();
  r.accepts_notices = false;
  const Bytes old_bytes = Encode(r);
  r.accepts_notices = true;
  Bytes with_n = Encode(r);
  RC_ASSERT(with_n.size() == old_bytes.size() + 3);
  RC_ASSERT((Bytes(with_n.end() - 3, with_n.end()) == Bytes{0xa1, 'n', 0xc3}));
  with_n.resize(with_n.size() - 3);
  RC_ASSERT(with_n[0] == old_bytes[0] + 1);  // fixmap of 6 or 7 keys, now one more
  with_n[0] = old_bytes[0];
  RC_ASSERT(with_n == old_bytes);
}

// Runs every decoder and PeekType on `bytes`; asserts that failures are explained and that at
// most one decoder accepts, agreeing with PeekType.
void CheckAnyBytes(const Bytes& bytes) {
  int accepted = 0;
  auto check = [&](auto result, MessageType type) {
    if (result) {
      ++accepted;
      RC_ASSERT(PeeksAs(bytes, type));
      RC_ASSERT(Validate(*result).ok());
      if constexpr (requires { result->id; }) RC_ASSERT(PeekId(bytes) == result->id);
    } else {
      RC_ASSERT(!result.error().message().empty());
      RC_ASSERT(result.error().code() == ErrorCode::kProtocol ||
                result.error().code() == ErrorCode::kOutOfRange);
    }
  };
  check(DecodePull(bytes.data(), bytes.size()), MessageType::kPull);
  check(DecodeRenewal(bytes.data(), bytes.size()), MessageType::kRenewal);
  check(DecodeRenewalReply(bytes.data(), bytes.size()), MessageType::kRenewalReply);
  check(DecodePullResponse(bytes.data(), bytes.size()), MessageType::kPullResponse);
  check(DecodeRelease(bytes.data(), bytes.size()), MessageType::kRelease);
  check(DecodeReleaseReply(bytes.data(), bytes.size()), MessageType::kReleaseReply);
  check(DecodeAbortNotice(bytes.data(), bytes.size()), MessageType::kAbortNotice);
  RC_ASSERT(accepted <= 1);
  (void)PeekId(bytes.data(), bytes.size());  // total: any bytes, never fails
  auto peeked = PeekType(bytes.data(), bytes.size());
  RC_ASSERT(peeked.has_value() || !peeked.error().message().empty());
}

RC_GTEST_PROP(WireProperty, ArbitraryBytesNeverCrash, (const Bytes& bytes)) {
  CheckAnyBytes(bytes);
}

// Random bytes are almost never a map; damaging valid frames reaches the field checks.
RC_GTEST_PROP(WireProperty, DamagedFramesNeverCrash, ()) {
  Bytes bytes = *rc::gen::oneOf(rc::gen::exec([] { return Encode(GenPull()); }),
                                rc::gen::exec([] { return Encode(GenRenewal()); }),
                                rc::gen::exec([] { return Encode(GenRenewalReply()); }),
                                rc::gen::exec([] { return Encode(GenPullResponse()); }),
                                rc::gen::exec([] { return Encode(GenRelease()); }),
                                rc::gen::exec([] { return Encode(GenReleaseReply()); }),
                                rc::gen::exec([] { return Encode(GenAbortNotice()); }));
  const auto edits = *rc::gen::inRange(1, 6);
  for (int i = 0; i < edits && !bytes.empty(); ++i) {
    const auto at = *rc::gen::inRange<std::size_t>(0, bytes.size());
    switch (*rc::gen::inRange(0, 3)) {
      case 0:
        bytes[at] = *rc::gen::arbitrary<std::uint8_t>();
        break;  // overwrite
      case 1:
        bytes.resize(at);
        break;  // truncate
      default:
        bytes.insert(bytes.begin() + static_cast<std::ptrdiff_t>(at),
                     *rc::gen::arbitrary<std::uint8_t>());  // insert
    }
  }
  CheckAnyBytes(bytes);
}

}  // namespace
}  // namespace kvferry::wire
