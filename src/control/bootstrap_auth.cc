#include "control/bootstrap_auth.h"

namespace kvferry::control {

Status BootstrapAuth::CheckRequest(std::string_view authorization, std::string_view method,
                                   std::string_view path, std::string_view body) {
  if (!secret_) return Status::Ok();
  Status verdict = VerifyRequest(*secret_, authorization, method, path, body, UnixNowSeconds());
  if (!verdict.ok()) refusals_.fetch_add(1, std::memory_order_relaxed);
  return verdict;
}

std::string BootstrapAuth::SignAnswer(int status, std::string_view path,
                                      std::string_view body) const {
  if (!secret_) return {};
  return SignResponse(*secret_, status, path, body, UnixNowSeconds());
}

}  // namespace kvferry::control
