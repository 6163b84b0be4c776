// Reading an HTTP answer whose size the peer decides: the content receiver below appends to a
// string and stops the read once the answer would pass a bound, so a hostile or broken server
// (a bootstrap service, an etcd member, or whoever can write into etcd) cannot make this
// process allocate without limit. Shared by the bootstrap client and the etcd client.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace kvferry::control {

// For httplib::Request::content_receiver: appends to `*out`; once `*out` would exceed
// `max_bytes` it sets `*too_large` and returns false, which aborts the read. `out` and
// `too_large` must outlive the request.
inline auto BoundedAnswerReceiver(std::string* out, std::size_t max_bytes, bool* too_large) {
  return [out, max_bytes, too_large](const char* data, std::size_t n, std::uint64_t,
                                     std::uint64_t) {
    if (out->size() + n > max_bytes) {
      *too_large = true;
      return false;
    }
    out->append(data, n);
    return true;
  };
}

}  // namespace kvferry::control
