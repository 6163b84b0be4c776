// libFuzzer target: PeekType and PeekId on arbitrary bytes, cross-checked against every full
// decoder: at most one decoder accepts an input, and then PeekType names that decoder's type
// and PeekId its id.
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvferry::wire;
  auto peeked = PeekType(data, size);
  if (!peeked) {
    KVF_FUZZ_CHECK(!peeked.error().message().empty());
    KVF_FUZZ_CHECK(fuzz::IsDecodeErrorCode(peeked.error().code()));
  }
  int accepted = 0;
  accepted +=
      fuzz::CheckDecoder(data, size, MessageType::kPull,
                         [](const std::uint8_t* d, std::size_t n) { return DecodePull(d, n); });
  accepted +=
      fuzz::CheckDecoder(data, size, MessageType::kRenewal,
                         [](const std::uint8_t* d, std::size_t n) { return DecodeRenewal(d, n); });
  accepted += fuzz::CheckDecoder(
      data, size, MessageType::kRenewalReply,
      [](const std::uint8_t* d, std::size_t n) { return DecodeRenewalReply(d, n); });
  accepted += fuzz::CheckDecoder(
      data, size, MessageType::kPullResponse,
      [](const std::uint8_t* d, std::size_t n) { return DecodePullResponse(d, n); });
  accepted +=
      fuzz::CheckDecoder(data, size, MessageType::kRelease,
                         [](const std::uint8_t* d, std::size_t n) { return DecodeRelease(d, n); });
  accepted += fuzz::CheckDecoder(
      data, size, MessageType::kReleaseReply,
      [](const std::uint8_t* d, std::size_t n) { return DecodeReleaseReply(d, n); });
  accepted += fuzz::CheckDecoder(
      data, size, MessageType::kAbortNotice,
      [](const std::uint8_t* d, std::size_t n) { return DecodeAbortNotice(d, n); });
  KVF_FUZZ_CHECK(accepted <= 1);
  // PeekId never fails; on any input it is total and bounded (a crash or hang is the finding).
  (void)PeekId(data, size);
  return 0;
}
