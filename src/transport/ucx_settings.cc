#include "ucx_settings.h"

#include <algorithm>
#include <cstdlib>

#include "ucx_am_protocol.h"

namespace kvferry::transport::internal {

namespace {

// UCX_TLS as this engine will use it: the caller's config over the environment, "all" if
// neither says.
std::string Transports(const UcxOptions& options, const EnvLookup& env) {
  const char* from_env = env("UCX_TLS");
  std::string tls = from_env != nullptr ? from_env : "all";
  for (const auto& [name, value] : options.config) {
    if (name == "TLS") tls = value;
  }
  return tls;
}

}  // namespace

Result<UcxSettingsPlan> PlanUcxSettings(const UcxOptions& options, const EnvLookup& env) {
  UcxSettingsPlan plan;
  const std::string tls = Transports(options, env);
  auto uses = [&](const char* tl) { return tls.find(tl) != std::string::npos; };
  // UCX 1.13 leaves error handling off on its shared-memory transports, which excludes them
  // from peer-error-mode endpoints ("no peer failure handler"). Only where shared memory is in
  // UCX_TLS (UCX warns about unused variables).
  if (uses("all") || uses("shm") || uses("posix")) {
    plan.environment.emplace_back("UCX_POSIX_ERROR_HANDLING", "y");
  }
  if (uses("all") || uses("shm") || uses("sysv")) {
    plan.environment.emplace_back("UCX_SYSV_ERROR_HANDLING", "y");
  }
  // tcp segment size: UCX 1.13's default 8 KiB segments cap a tcp endpoint at ~3.7 GB/s on
  // loopback (one fragment, one handler call and one small send per 8 KiB); 1 MiB segments
  // reach 6-8 GB/s for >= 1 MiB writes and ~3.5 GB/s for scattered 64 KiB ops (measured,
  // docs/transport.md). Cost: the tcp transport keeps up to about one TX and one RX segment
  // per active connection. Both or neither: UCX refuses RX < TX segments ("RX segment size must
  // be >= TX segment size", worker creation fails), so if the user set either one (in the
  // environment or in UcxOptions::config) both are left alone.
  const char* tx_env = env("UCX_TCP_TX_SEG_SIZE");
  std::string tx_segment = tx_env != nullptr ? tx_env : "8k";  // UCX's own default
  if (uses("all") || uses("tcp")) {
    bool user_set = tx_env != nullptr || env("UCX_TCP_RX_SEG_SIZE") != nullptr;
    for (const auto& kv : options.config) {
      if (kv.first == "TCP_TX_SEG_SIZE" || kv.first == "TCP_RX_SEG_SIZE") user_set = true;
    }
    if (!user_set) {
      plan.environment.emplace_back("UCX_TCP_TX_SEG_SIZE", "1m");
      plan.environment.emplace_back("UCX_TCP_RX_SEG_SIZE", "1m");
      tx_segment = "1m";
    }
  }
  for (const auto& [name, value] : options.config) {
    if (name == "TCP_TX_SEG_SIZE") tx_segment = value;
  }
  plan.pack_small_ops = ParseUcxSize(tx_segment) >= ucx_am::kPackMaxOp;

  // A short keepalive, so a dead peer is detected within seconds.
  if (env("UCX_KEEPALIVE_INTERVAL") == nullptr) {
    plan.defaults.emplace_back("KEEPALIVE_INTERVAL",
                               std::to_string(options.keepalive_interval.count()) + "ms");
  }
  if (options.fence_writes) {
    // A fence must hold against a writer that resumes later (a frozen P): a rendezvous into
    // this engine must not let the sender's own CPU or NIC copy into our memory with a remote
    // key UCX hands it for the receive (the put scheme over shared memory or RDMA), since a
    // sender frozen mid-copy can resume after its receive failed. So where such lanes may
    // exist, this engine drives every rendezvous (it reads the sender's buffer). Not over tcp
    // alone, where it is not needed: every byte is applied by this engine's progress thread on
    // a connection UCX closes when the receive fails (and get over tcp is emulated).
    for (const auto& [name, value] : options.config) {
      if (name == "RNDV_SCHEME" && value != "get_zcopy" && value != "auto") {
        return Err(ErrorCode::kInvalidArgument,
                   "fence_writes refuses RNDV_SCHEME=" + value +
                       " (the sender would copy into this engine's memory itself)");
      }
    }
    const bool tcp_only = tls == "tcp" || tls == "tcp,self" || tls == "self,tcp";
    plan.receiver_drives_rendezvous = !tcp_only;
  }
  plan.config = options.config;
  return plan;
}

std::size_t ParseUcxSize(std::string_view text) {
  const std::string s(text);
  char* end = nullptr;
  const unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  if (end == s.c_str()) return 0;
  switch (*end) {
    case 'k':
    case 'K':
      return static_cast<std::size_t>(v) << 10;
    case 'm':
    case 'M':
      return static_cast<std::size_t>(v) << 20;
    case 'g':
    case 'G':
      return static_cast<std::size_t>(v) << 30;
    default:
      return static_cast<std::size_t>(v);
  }
}

Lanes ReadLanes(std::string_view info) {
  // Lane lines look like "lane[1]:  2:posix/memory.0 md[2] ... rma_bw#0 ...": the transport is
  // the word before the first '/'.
  std::vector<std::string> tls;
  bool any_rma = false, rma_tcp = false, any_tcp = false;
  std::size_t pos = 0;
  while ((pos = info.find("lane[", pos)) != std::string_view::npos) {
    std::size_t end = info.find('\n', pos);
    if (end == std::string_view::npos) end = info.size();
    const std::string_view line = info.substr(pos, end - pos);
    pos = end;
    const std::size_t slash = line.find('/');
    if (slash == std::string_view::npos) continue;
    const std::size_t start = line.find_last_of(" :", slash);
    const std::size_t from = start == std::string_view::npos ? 0 : start + 1;
    const std::string tl(line.substr(from, slash - from));
    if (std::find(tls.begin(), tls.end(), tl) == tls.end()) tls.push_back(tl);
    any_tcp |= tl == "tcp";
    if (line.find("rma_bw") != std::string_view::npos) {
      any_rma = true;
      rma_tcp |= tl == "tcp";
    }
  }
  Lanes out;
  // Shared memory has no rma_bw lane: its puts are chosen per remote key ("put[i]: ..." lines)
  // and ride the posix/sysv lanes, which is fine as long as no lane is tcp.
  out.rma_ok = any_rma ? !rma_tcp : !any_tcp && info.find("put[") != std::string_view::npos;
  for (const auto& tl : tls) out.transports += (out.transports.empty() ? "" : "+") + tl;
  return out;
}

}  // namespace kvferry::transport::internal
