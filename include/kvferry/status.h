// kvferry's one error model: a Status (code + human-readable reason) and Result<T>, which is
// either a T or the Status that explains why there is none. Both are [[nodiscard]].
//
// Every fallible call in kvferry returns one of these; none throws across a module boundary.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <tl/expected.hpp>
#include <utility>

namespace kvferry {

enum class ErrorCode : std::uint8_t {
  kOk = 0,
  kInvalidArgument,    // malformed input; nothing was changed
  kNotFound,           // unknown id
  kAlreadyExists,      // a conflicting registration or a second terminal event
  kOutOfRange,         // a size, id or address outside what is registered or allowed
  kTimeout,            // a deadline passed
  kUnavailable,        // a peer cannot be reached (or died)
  kRejected,           // a peer understood the request and refused it (e.g. renewals without lease)
  kLeaseMismatch,      // P and D disagree on kv_lease_duration
  kTombstoned,         // the transfer was freed earlier: a late pull
  kProtocol,           // the wire message violates the protocol (version, type, limits)
  kResourceExhausted,  // a bounded structure is full
  kCancelled,          // shut down or aborted before completion
  kInternal,           // a bug: an invariant failed
  // The caller could not prove it belongs to the cluster (docs/security.md): a missing, forged,
  // stale or malformed signature. Never on the side channel (authentication happens in its
  // ZeroMQ handshake), so wire::kMaxErrorCode stays kInternal and the wire values are unchanged.
  kUnauthenticated,
};

constexpr std::string_view ToString(ErrorCode code) {
  switch (code) {
    case ErrorCode::kOk:
      return "OK";
    case ErrorCode::kInvalidArgument:
      return "INVALID_ARGUMENT";
    case ErrorCode::kNotFound:
      return "NOT_FOUND";
    case ErrorCode::kAlreadyExists:
      return "ALREADY_EXISTS";
    case ErrorCode::kOutOfRange:
      return "OUT_OF_RANGE";
    case ErrorCode::kTimeout:
      return "TIMEOUT";
    case ErrorCode::kUnavailable:
      return "UNAVAILABLE";
    case ErrorCode::kRejected:
      return "REJECTED";
    case ErrorCode::kLeaseMismatch:
      return "LEASE_MISMATCH";
    case ErrorCode::kTombstoned:
      return "TOMBSTONED";
    case ErrorCode::kProtocol:
      return "PROTOCOL";
    case ErrorCode::kResourceExhausted:
      return "RESOURCE_EXHAUSTED";
    case ErrorCode::kCancelled:
      return "CANCELLED";
    case ErrorCode::kInternal:
      return "INTERNAL";
    case ErrorCode::kUnauthenticated:
      return "UNAUTHENTICATED";
  }
  return "UNKNOWN";
}

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(ErrorCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == ErrorCode::kOk; }
  ErrorCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // "TIMEOUT: prefill of xfer-1 not done within 480 s"
  std::string ToString() const {
    if (ok()) return "OK";
    std::string out(kvferry::ToString(code_));
    if (!message_.empty()) out.append(": ").append(message_);
    return out;
  }

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message_ == b.message_;
  }

 private:
  ErrorCode code_ = ErrorCode::kOk;
  std::string message_;
};

// A T, or the Status that explains why there is none. [[nodiscard]] like Status: a result that
// nobody looks at is an error nobody hears about. Everything tl::expected offers works on it.
template <typename T>
class [[nodiscard]] Result : public tl::expected<T, Status> {
 public:
  using tl::expected<T, Status>::expected;
  Result(tl::expected<T, Status> other)  // NOLINT: implicit, like expected's own conversions
      : tl::expected<T, Status>(std::move(other)) {}

  // Exact matches, so comparisons do not fall to tl::expected's templates, which C++20's
  // rewritten operators make ambiguous for a derived class.
  friend bool operator==(const Result& a, const Result& b) {
    return static_cast<const tl::expected<T, Status>&>(a) ==
           static_cast<const tl::expected<T, Status>&>(b);
  }
  friend bool operator==(const Result& a, const T& value) { return a.has_value() && *a == value; }
};

inline tl::unexpected<Status> Err(ErrorCode code, std::string message) {
  return tl::unexpected<Status>(Status(code, std::move(message)));
}

}  // namespace kvferry
