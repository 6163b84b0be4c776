// What a UcxEngine asks of UCX, decided apart from UCX: the settings it starts with
// (PlanUcxSettings) and what an endpoint's description says about its lanes (ReadLanes). Both
// are plain functions of their inputs (the environment is passed in, never read), so their rules
// are tested without a UCX context; ucx_engine.cc applies what they decide.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvferry/status.h"
#include "kvferry/transport/ucx.h"

namespace kvferry::transport::internal {

// getenv's shape: the value of a variable, or null when it is unset.
using EnvLookup = std::function<const char*(const char* name)>;

using UcxSetting = std::pair<std::string, std::string>;

struct UcxSettingsPlan {
  // Transport-level settings ucp_config_modify does not reach, for the process environment:
  // the engine sets each only where the variable is still unset when it applies them. Full
  // names (UCX_POSIX_ERROR_HANDLING, UCX_TCP_TX_SEG_SIZE, ...).
  std::vector<UcxSetting> environment;
  // For ucp_config_modify (names without "UCX_"), in this order: kvferry's defaults the
  // environment did not choose, then (receiver_drives_rendezvous) RNDV_SCHEME=get_zcopy, then
  // the caller's UcxOptions::config verbatim.
  std::vector<UcxSetting> defaults;
  // fence_writes over transports other than tcp alone: a rendezvous into this engine must be
  // driven by it (the sender must get no remote key to copy into our memory with), so
  // RNDV_SCHEME=get_zcopy is required, and a UCX that refuses it cannot fence (kUnavailable).
  bool receiver_drives_rendezvous = false;
  std::vector<UcxSetting> config;
  // Gather runs of small ops into one active message (WRITEV, ucx_am_protocol.h): only when tcp
  // segments hold them (kPackMaxOp or more), since with UCX's 8 KiB default an iov message of
  // ~1 MiB took a slower rendezvous than separate sends (0.7-1.2 vs 2.2 GB/s for 64 KiB ops).
  bool pack_small_ops = false;
};

// The plan for `options` in an environment read through `env`. Errors: kInvalidArgument when
// fence_writes meets a config asking for a rendezvous scheme the sender would drive.
[[nodiscard]] Result<UcxSettingsPlan> PlanUcxSettings(const UcxOptions& options,
                                                      const EnvLookup& env);

// "1m", "256k", "65536", "8KB": a UCX memory-unit value in bytes (0 when it does not start with
// a number).
std::size_t ParseUcxSize(std::string_view text);

// What an endpoint's ucp_ep_print_info says (UCX 1.13 has no transport query in ucp_ep_query).
struct Lanes {
  std::string transports;  // the lanes' transports in order of appearance, "+"-joined: "sysv+posix"
  // One-sided puts are a real copy to the peer: dedicated rma_bw lanes none of which is tcp
  // (RDMA, cma), or, with no rma_bw lane, no tcp lane and per-remote-key put protocols ("put[i]"
  // lines: shared memory). Put over tcp is emulated and 10-20× slower than active messages
  // (docs/transport.md), so a tcp lane among them means no.
  bool rma_ok = false;
};
Lanes ReadLanes(std::string_view ep_info);

}  // namespace kvferry::transport::internal
