// Seams: the two core classes the simulator drives, behind interfaces so that tests can swap in
// broken variants (mutation checks: an exploration that cannot fail proves nothing).
//
// P's hold table is reached through protocol::Hold, the seam of protocol::PrefillSession, and
// D's ledger through protocol::Ledger, the seam of protocol::DecodeSession (the sessions the
// simulator drives). The production wiring is protocol::CoreHold / CoreLedger, thin forwarders to
// core::HoldTable and core::ReceiveLedger: the simulator runs the SAME lifetime rules as real
// processes. The interfaces mirror those classes' public APIs one to one; their contracts are the
// core's.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "kvferry/core/hold_table.h"
#include "kvferry/core/receive_ledger.h"
#include "protocol/hold.h"
#include "protocol/ledger.h"

namespace kvferry::sim {

// How the simulator builds its holds and ledgers. Default: the real core classes.
struct Variants {
  protocol::HoldFactory make_hold;
  protocol::LedgerFactory make_ledger;
  // A data plane that acknowledges D's fences without stopping the writes they cover: what a
  // session that believed a fence (or a new registration) without proof would face.
  bool lying_fence = false;
  // A registry that keeps naming P's first process after P restarted on new addresses: what a
  // decoder that never finds the new process would face (the restart invariant must catch it).
  bool stale_registry = false;

  std::unique_ptr<protocol::Hold> NewHold(const core::HoldConfig& config) const {
    return make_hold ? make_hold(config) : std::make_unique<protocol::CoreHold>(config);
  }
  std::unique_ptr<protocol::Ledger> NewLedger() const {
    return make_ledger ? make_ledger() : std::make_unique<protocol::CoreLedger>();
  }
};

}  // namespace kvferry::sim
