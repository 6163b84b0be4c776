#include "registry.h"

#include <fmt/format.h>

#include "wire/messages.h"

namespace kvferry::sim {

std::string Incarnation(std::uint32_t gen) { return std::to_string(gen + 1); }

core::EngineId GhostEngine(std::uint32_t g) { return fmt::format("G{}", g); }

void Registry::Lookup(std::uint32_t r, const protocol::LookupRequest& lookup) {
  if (lookup.engine_id.starts_with("G")) {
    const auto g = static_cast<std::uint32_t>(std::stoul(lookup.engine_id.substr(1)));
    if (g % 2 == 0) return;  // the session's lookup deadline fails it
    loop_.After(2 * c_.net.latency, lookup_kind_, r,
                [this, r, engine = lookup.engine_id, id = lookup.id] {
                  if (!hooks_.d_alive()) return;
                  hooks_.found(r, {engine, "1", 1, {"g" + engine}}, id);
                });
    return;
  }
  loop_.After(c_.net.latency, lookup_kind_, r, [this, r, engine = lookup.engine_id, id = lookup.id] {
    const bool p_was_dead = hooks_.p_dead();
    const std::uint32_t gen = c_.variants.stale_registry ? 0 : hooks_.p_gen();
    loop_.After(c_.net.latency, lookup_kind_, r, [this, r, engine, id, p_was_dead, gen] {
      if (!hooks_.d_alive()) return;
      if (p_was_dead) {
        hooks_.failed(r, engine, Status(ErrorCode::kUnavailable, "P is down"), id);
      } else {
        protocol::PeerEngine view{engine, Incarnation(gen), c_.p.tp, {}, wire::kProtocolFeatures};
        for (std::uint32_t p = 0; p < c_.p.tp; ++p) view.side_channels.push_back(PName(gen, p));
        hooks_.found(r, view, id);
      }
    });
  });
}

std::string Registry::PName(std::uint32_t gen, std::uint32_t p) const {
  return gen == 0 || c_.faults.p_same_address ? fmt::format("p{}", p)
                                              : fmt::format("p{}@{}", p, gen);
}

std::uint32_t Registry::GenOf(const std::string& address) const {
  const std::size_t at = address.find('@');
  if (at != std::string::npos) {
    return static_cast<std::uint32_t>(std::stoul(address.substr(at + 1)));
  }
  return c_.faults.p_same_address ? hooks_.p_gen() : 0;
}

}  // namespace kvferry::sim
