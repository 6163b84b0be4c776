// Registry: the simulated bootstrap that D's sessions look P's engine up in.
//
// It answers with P's engine as registered — its incarnation, TP size and one side-channel
// address per rank — or fails the lookup once P is dead. The registry is read one latency after
// the lookup is asked and the answer arrives one latency later: P may die (or be declared down)
// in between, so D can get an answer that describes a process already gone, as a real one can.
// SimConfig::variants.stale_registry keeps naming P's first process after restarts (a mutation
// check). Silent engines ("G<g>", Faults' hostile traffic) never answer for an even g, and name
// workers that never reply for an odd one.
//
// Addresses: P process `gen` (0: the first; each restart makes the next) binds "p<rank>", or
// "p<rank>@<gen>" when it restarts on new addresses (Faults::p_same_address off).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "cluster.h"
#include "event_loop.h"
#include "protocol/decode_session.h"

namespace kvferry::sim {

// P process `gen`'s incarnation, as its registration and its messages name it.
std::string Incarnation(std::uint32_t gen);
// The engine id of silent engine `g`.
core::EngineId GhostEngine(std::uint32_t g);

class Registry {
 public:
  // What the registry asks of the cluster around it, and where its answers go.
  struct Hooks {
    std::function<bool()> p_dead;
    std::function<std::uint32_t()> p_gen;  // the P process that runs now (or ran last)
    std::function<bool()> d_alive;
    // D rank `r`'s lookup `id` found `engine`; or failed with `why`.
    std::function<void(std::uint32_t r, const protocol::PeerEngine& engine, std::uint64_t id)>
        found;
    std::function<void(std::uint32_t r, const core::EngineId& engine, const Status& why,
                       std::uint64_t id)>
        failed;
  };

  Registry(const SimConfig& config, EventLoop& loop, std::uint32_t lookup_kind, Hooks hooks)
      : c_(config), loop_(loop), lookup_kind_(lookup_kind), hooks_(std::move(hooks)) {}
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // D rank `r` asks for `lookup`; the answer (or failure) reaches the hooks later, unless D
  // died meanwhile or the engine is a silent one that never answers.
  void Lookup(std::uint32_t r, const protocol::LookupRequest& lookup);

  // Rank `p`'s side-channel address in P process `gen`.
  std::string PName(std::uint32_t gen, std::uint32_t p) const;
  // The process an address reaches: its own, or on a shared address whichever binds it now.
  std::uint32_t GenOf(const std::string& address) const;

 private:
  const SimConfig& c_;
  EventLoop& loop_;
  const std::uint32_t lookup_kind_;
  const Hooks hooks_;
};

}  // namespace kvferry::sim
