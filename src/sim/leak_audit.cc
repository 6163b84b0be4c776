#include "leak_audit.h"

#include <fmt/format.h>

namespace kvferry::sim {

void AuditPrefillSide(const PrefillSide& p, const Violations& violation) {
  for (std::size_t r = 0; r < p.ranks.size(); ++r) {
    const protocol::PrefillSession& session = *p.ranks[r];
    if (session.hold().size() != 0) {
      violation(
          fmt::format("leak: P rank {} still holds {} entries", r, session.hold().size()));
    }
    const protocol::PrefillStats stats = session.stats();
    if (stats.source_transfers != 0) {
      violation(fmt::format("leak: P rank {} still keeps the source blocks of {} transfers", r,
                            stats.source_transfers));
    }
    if (stats.pulls_in_progress != 0 || stats.requests_parked != 0) {
      violation(fmt::format("leak: P rank {} still has {} pulls in progress ({} parked)", r,
                            stats.pulls_in_progress, stats.requests_parked));
    }
  }
  if (p.pool.used() != 0) {
    violation(fmt::format("leak: {} P blocks still allocated", p.pool.used()));
  }
  const protocol::PrefillAdapterStats adapter = p.adapter.stats();
  if (adapter.transfers != 0) {
    violation(fmt::format("leak: P's engine adapter still knows {} transfers",
                          adapter.transfers));
  }
  if (adapter.stray_results != 0) {
    violation(fmt::format("P's ranks reported {} answers or frees for nothing of theirs",
                          adapter.stray_results));
  }
}

void AuditDecodeSide(const DecodeSide& d, const Violations& violation) {
  if (d.pool.used() != 0) {
    violation(fmt::format("leak: {} D blocks still allocated", d.pool.used()));
  }
  const protocol::DecodeAdapterStats adapter = d.adapter.stats();
  if (adapter.tracked != 0) {
    violation(fmt::format("leak: D's engine adapter still tracks {} requests", adapter.tracked));
  }
  if (adapter.stray_results != 0) {
    // A rank reported a receive it never started, twice, or a release of nothing held.
    violation(fmt::format("D's ranks reported {} results for no load of theirs",
                          adapter.stray_results));
  }
  for (std::size_t r = 0; r < d.ranks.size(); ++r) {
    // Once nothing is in flight, every socket is idle: no more than max_idle_endpoints of
    // them stay open, however many P addresses came and went.
    if (d.sockets[r].size() > d.max_idle_endpoints) {
      violation(fmt::format("leak: D rank {} holds {} idle sockets, over max_idle_endpoints {}",
                            r, d.sockets[r].size(), d.max_idle_endpoints));
    }
    const protocol::DecodeStats stats = d.ranks[r]->stats();
    if (stats.receiving != 0 || stats.quarantined_blocks != 0 || stats.pulls_in_flight != 0) {
      violation(
          fmt::format("leak: D rank {} still has {} receives, {} quarantined blocks, {} "
                      "pulls in flight",
                      r, stats.receiving, stats.quarantined_blocks, stats.pulls_in_flight));
    }
    if (stats.tracked != 0) {
      violation(fmt::format("leak: D rank {} still renews {} transfers", r, stats.tracked));
    }
  }
}

}  // namespace kvferry::sim
