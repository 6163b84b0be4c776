// libFuzzer target: DecodeRelease on arbitrary bytes (oracle in fuzz_common.h).
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  kvferry::wire::fuzz::CheckDecoder(
      data, size, kvferry::wire::MessageType::kRelease,
      [](const std::uint8_t* d, std::size_t n) { return kvferry::wire::DecodeRelease(d, n); });
  return 0;
}
