// The UCX (ucp) backend of the data plane. UCX headers stay in src/transport/ucx_engine.cc.
//
// Transports and devices come from UCX's own environment (UCX_TLS, UCX_NET_DEVICES, ...);
// `config` below overrides them per engine without touching the environment.
//
// Two ways to carry a write (see docs/transport.md for the measurements behind the choice):
//   put  one-sided ucp_put_nbx into the peer's region, then ucp_ep_flush_nbx: the flush completes
//        only when the puts are remotely complete, so completion means "in the peer's memory".
//        Single copy over shm (posix/sysv, into UCX-allocated regions) and cma; RDMA on real NICs.
//   am   ucp_am_send_nbx (UCX picks eager or rendezvous by size). The receiver checks
//        (region, offset, length) against its registrations, copies (or lets the rendezvous land
//        the data) into the region, and acks the batch once every op has landed; the sender
//        completes a batch only after that ack. This is the fast path over tcp, where UCX's put
//        is emulated and ~10x slower than AM rendezvous.
// kAuto picks put when every rma lane of the endpoint is a shared-memory or RDMA transport and
// the peer's regions carry remote keys, and am otherwise (e.g. any tcp lane).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kvferry/transport/transport.h"

namespace kvferry::transport {

enum class UcxMode { kAuto, kPut, kAm };

struct UcxOptions {
  std::string name = "kvferry";  // worker name in UCX logs
  UcxMode mode = UcxMode::kAuto;
  // Peer-failure detection bound: UCX_KEEPALIVE_INTERVAL unless the environment sets it. A dead
  // peer surfaces as kUnavailable within a few intervals.
  std::chrono::milliseconds keepalive_interval{1000};
  // Extra UCX config applied with ucp_config_modify after reading the environment, e.g.
  // {"TLS", "tcp"}; names without the "UCX_" prefix.
  std::vector<std::pair<std::string, std::string>> config;
  // While batches are in flight the progress thread spins; when idle it sleeps on UCX's event fd
  // (no CPU burnt by an idle engine). Set to spin always (lowest latency, one core per engine).
  bool busy_poll = false;
  // Receiver-side fencing (Engine::fences_writes). Descriptors then carry no remote keys, so
  // every peer writes through active messages, which this engine receives itself and can refuse
  // (by write key); that gives up the one-sided put path (shared memory, RDMA) for writes into
  // this engine. A peer in UcxMode::kPut cannot connect to it.
  bool fence_writes = false;
  // How long the destructor lets in-flight batches finish before cancelling them.
  std::chrono::milliseconds shutdown_drain{2000};
};

// Creates a UCX engine with its own context, worker and progress thread. Errors: kUnavailable
// when UCX cannot initialise (no usable transport, bad config).
Result<std::unique_ptr<Engine>> MakeUcxEngine(const UcxOptions& options);

// The version of the UCX library loaded in this process ("1.13.1"), which may differ from the
// headers it was built against: which one the dynamic loader picked (Debian's libucp.so.0 or a
// libucx wheel's) decides, for one, whether CUDA memory can be registered.
std::string UcxLibraryVersion();

}  // namespace kvferry::transport
