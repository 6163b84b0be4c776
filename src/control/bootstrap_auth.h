// BootstrapAuth: the bootstrap server's authentication, kept apart from the HTTP library so
// that the server (bootstrap_server.cc) carries only two calls: CheckRequest before a
// registration is read, SignAnswer on every /query answer. docs/security.md.
//
// Without a secret every request passes and no answer is signed (an open cluster).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "control/cluster_auth.h"
#include "kvferry/status.h"

namespace kvferry::control {

class BootstrapAuth {
 public:
  explicit BootstrapAuth(std::shared_ptr<const ClusterSecret> secret)
      : secret_(std::move(secret)) {}

  bool enabled() const { return secret_ != nullptr; }

  // OK without a secret. With one: VerifyRequest of the request's Authorization header (empty
  // when absent) at the current time; a refusal (kUnauthenticated, with the reason to answer
  // with 401) is counted. Thread-safe.
  [[nodiscard]] Status CheckRequest(std::string_view authorization, std::string_view method,
                                    std::string_view path, std::string_view body);

  // The X-Kvferry-Signature value for an answer (SignResponse at the current time), or "" when
  // there is no secret (send no header then). Thread-safe.
  std::string SignAnswer(int status, std::string_view path, std::string_view body) const;

  // Requests CheckRequest refused so far.
  std::uint64_t refusals() const { return refusals_.load(std::memory_order_relaxed); }

 private:
  const std::shared_ptr<const ClusterSecret> secret_;
  std::atomic<std::uint64_t> refusals_{0};
};

}  // namespace kvferry::control
