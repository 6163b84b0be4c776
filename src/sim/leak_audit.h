// The end-of-run leak audit of an exploration run (which must also have gone quiet: no event
// left before the horizon; scenario runs stop at a horizon and skip it). Nothing may still be
// held anywhere — no hold-table entry, source block, parked pull, allocated block,
// tracked transfer or receive, quarantined block, renewal, or socket beyond the idle cap — and
// no rank may have reported a result for nothing of its own (docs/simulation.md, Invariants).
// The audit reads the engines' production classes only and changes nothing; a dead engine is
// not audited (its state died with it), nor D's pool under the shared-write-key limit.
#pragma once

#include <functional>
#include <set>
#include <string>
#include <vector>

#include "kvferry/core/block_pool.h"
#include "protocol/decode_adapter.h"
#include "protocol/decode_session.h"
#include "protocol/endpoint_pool.h"
#include "protocol/prefill_adapter.h"
#include "protocol/prefill_session.h"

namespace kvferry::sim {

using Violations = std::function<void(std::string)>;

struct PrefillSide {
  std::vector<const protocol::PrefillSession*> ranks;
  const core::BlockPool& pool;
  const protocol::PrefillAdapter& adapter;
};

struct DecodeSide {
  std::vector<const protocol::DecodeSession*> ranks;
  const std::vector<std::set<protocol::EndpointId>>& sockets;  // [d_rank]: the pump's open sockets
  std::size_t max_idle_endpoints;
  const core::BlockPool& pool;
  const protocol::DecodeAdapter& adapter;
};

// Reports each leak of a live P engine's ranks, pool and adapter.
void AuditPrefillSide(const PrefillSide& p, const Violations& violation);
// Reports each leak of a live D engine's ranks, sockets, pool and adapter.
void AuditDecodeSide(const DecodeSide& d, const Violations& violation);

}  // namespace kvferry::sim
