// How D settles its receive entries from one PullResponse of one peer (SPEC §3 rule 1):
// `ok` → kOk, `err` → kErr (kTimeout for an entry marked `unsettled`: its writer may still
// land bytes, so the blocks are quarantined), a whole-message ERROR → kMessageError for every request of the
// pull, and on FINISH every request of the pull still pending → kFinished (failed: P will write
// nothing more for it). Only the requests the pull asked for are settled: an id the pull did not
// name is ignored, whatever the peer lists (a confused or hostile P cannot settle another pull's
// entries and make D reuse blocks that pull's writer may still fill).
//
// A template over the ledger so the runtime (core::ReceiveLedger) and the simulator (its Ledger
// seam, which mutation checks replace) run this same code. `Ledger` needs
//   SettleOutcome Settle(const RequestId&, PeerId, core::Settle, Status) and
//   bool IsPending(const RequestId&, PeerId) const.
#pragma once

#include <algorithm>
#include <span>
#include <string>

#include "kvferry/core/receive_ledger.h"
#include "wire/messages.h"

namespace kvferry::protocol {

template <typename Ledger>
void ApplyPullResponse(Ledger& ledger, core::PeerId peer,
                       std::span<const core::RequestId> pull_requests,
                       const wire::PullResponse& response) {
  auto asked = [&](const core::RequestId& id) {
    return std::find(pull_requests.begin(), pull_requests.end(), id) != pull_requests.end();
  };
  if (response.status == wire::PullStatus::kError) {
    const Status reason(response.code == ErrorCode::kOk ? ErrorCode::kInternal : response.code,
                        response.message);
    for (const core::RequestId& id : pull_requests) {
      (void)ledger.Settle(id, peer, core::Settle::kMessageError, reason);
    }
    return;
  }
  for (const core::RequestId& id : response.ok) {
    if (asked(id)) (void)ledger.Settle(id, peer, core::Settle::kOk, Status());
  }
  for (const wire::RequestError& e : response.err) {
    if (asked(e.d_req_id)) {
      // An unsettled write may still land: the request fails now, its blocks stay quarantined.
      (void)ledger.Settle(e.d_req_id, peer, e.unsettled ? core::Settle::kTimeout : core::Settle::kErr,
                          Status(e.code, e.reason));
    }
  }
  if (response.status == wire::PullStatus::kFinish) {
    for (const core::RequestId& id : pull_requests) {
      if (!ledger.IsPending(id, peer)) continue;
      (void)ledger.Settle(
          id, peer, core::Settle::kFinished,
          Status(ErrorCode::kNotFound, "prefill peer finished the pull without listing " + id));
    }
  }
}

}  // namespace kvferry::protocol
