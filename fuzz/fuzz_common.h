// Shared oracle of the wire fuzz targets (libFuzzer and the ctest corpus replay).
//
// For one decoder it checks, beyond "no crash, no sanitizer report":
//  - a failure has a non-empty reason and code kProtocol or kOutOfRange;
//  - a success passes Validate(), re-encodes to bytes that decode to the same message, and
//    PeekType() of the input agrees with the decoder's type (the listener's dispatch is sound)
//    and PeekId() with the decoded id (what P echoes when it cannot decode a message).
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "wire/messages.h"

#define KVF_FUZZ_CHECK(cond)                                                              \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      std::fprintf(stderr, "%s:%d: fuzz oracle failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                       \
    }                                                                                     \
  } while (0)

namespace kvferry::wire::fuzz {

inline bool IsDecodeErrorCode(ErrorCode code) {
  return code == ErrorCode::kProtocol || code == ErrorCode::kOutOfRange;
}

// Returns true when `decode` accepted the input.
template <typename Decode>
bool CheckDecoder(const std::uint8_t* data, std::size_t size, MessageType type, Decode decode) {
  auto msg = decode(data, size);
  if (!msg) {
    KVF_FUZZ_CHECK(!msg.error().message().empty());
    KVF_FUZZ_CHECK(IsDecodeErrorCode(msg.error().code()));
    return false;
  }
  KVF_FUZZ_CHECK(Validate(*msg).ok());
  const auto bytes = Encode(*msg);
  KVF_FUZZ_CHECK(bytes.size() <= size);  // canonical: smallest headers, unknown keys dropped
  auto again = decode(bytes.data(), bytes.size());
  KVF_FUZZ_CHECK(again.has_value());
  KVF_FUZZ_CHECK(*again == *msg);
  auto peeked = PeekType(data, size);
  KVF_FUZZ_CHECK(peeked.has_value() && *peeked == type);
  if constexpr (requires { msg->id; }) {  // AbortNotice has no id
    KVF_FUZZ_CHECK(PeekId(data, size) == msg->id);
    KVF_FUZZ_CHECK(PeekId(bytes.data(), bytes.size()) == msg->id);
  }
  return true;
}

}  // namespace kvferry::wire::fuzz
