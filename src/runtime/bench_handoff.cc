#include "runtime/bench_handoff.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <span>

#include "control/bootstrap_server.h"
#include "kvferry/transport/ucx.h"
#include "runtime/decode_worker.h"
#include "runtime/prefill_worker.h"
#include "transport/bench_baselines.h"

namespace kvferry::runtime {
namespace {

using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// One side's KV: `planes` caller-owned planes of `num_blocks` blocks each.
struct Memory {
  std::vector<std::vector<std::byte>> planes;
  std::vector<KvPlane> views;
  Memory(std::size_t count, std::uint64_t bytes) {
    planes.reserve(count);
    for (std::size_t i = 0; i < count; ++i) {
      planes.emplace_back(bytes);
      views.push_back({planes.back().data(), planes.back().size()});
    }
  }
};

struct Layout {
  const char* name;
  std::vector<core::BlockId> src, dst;
};

std::vector<Layout> Layouts(std::uint32_t n) {
  Layout contiguous{"contiguous", {}, {}};
  Layout scattered{"every other block", {}, {}};
  for (std::uint32_t i = 0; i < n; ++i) {
    contiguous.src.push_back(i);
    contiguous.dst.push_back(i);
    scattered.src.push_back(2 * i);
    scattered.dst.push_back(2 * i + 1);  // not where P had them
  }
  return {contiguous, scattered};
}

// Byte of block `b` of plane `p` in run `run`: every block and run differ.
std::byte Pattern(std::size_t p, core::BlockId b, std::uint32_t run) {
  return static_cast<std::byte>((p * 7 + b * 13 + run * 29 + 1) & 0xff);
}

Result<std::shared_ptr<transport::Engine>> Engine(const std::string& name,
                                                  const std::string& transport) {
  transport::UcxOptions o;
  o.name = name;
  o.config = {{"TLS", transport == "tcp" ? "tcp" : "posix,sysv,self"}, {"NET_DEVICES", "lo"}};
  auto engine = transport::MakeUcxEngine(o);
  if (!engine) return tl::unexpected(engine.error());
  return std::shared_ptr<transport::Engine>(std::move(*engine));
}

struct Row {
  std::string transport, layout;
  std::vector<double> handoff_ms;
  double memcpy_ms = 0;
};

// The baseline: the same bytes copied by this thread, as the layout lays them out.
double MemcpyMs(const Memory& from, Memory& to, const Layout& layout, std::uint64_t block_bytes,
                std::uint32_t runs, bool contiguous) {
  std::vector<double> ms;
  for (std::uint32_t r = 0; r < runs; ++r) {
    const auto t0 = Clock::now();
    for (std::size_t p = 0; p < from.planes.size(); ++p) {
      const std::byte* src = from.planes[p].data();
      std::byte* dst = to.planes[p].data();
      if (contiguous) {
        std::memcpy(dst, src, layout.src.size() * block_bytes);
        continue;
      }
      for (std::size_t i = 0; i < layout.src.size(); ++i) {
        std::memcpy(dst + layout.dst[i] * block_bytes, src + layout.src[i] * block_bytes,
                    block_bytes);
      }
    }
    ms.push_back(Ms(Clock::now() - t0));
  }
  return Median(ms);
}

Status RunTransport(const HandoffBenchOptions& o, const std::string& transport,
                    std::vector<Row>& rows) {
  const std::size_t planes = 2 * std::size_t{o.layers};
  const std::uint32_t num_blocks = 2 * o.blocks;  // room for every other block
  const std::uint64_t plane_bytes = num_blocks * o.block_bytes;
  Memory p_mem(planes, plane_bytes), d_mem(planes, plane_bytes);

  control::BootstrapServer bootstrap;
  auto port = bootstrap.Start("127.0.0.1", 0);
  if (!port) return port.error();
  const std::string bootstrap_address = fmt::format("127.0.0.1:{}", *port);

  auto p_engine = Engine("bench-p", transport);
  if (!p_engine) return p_engine.error();
  PrefillWorkerOptions po;
  po.engine_id = "bench-p";
  po.block_len = o.block_bytes;
  po.num_blocks = num_blocks;
  po.planes = p_mem.views;
  po.bootstrap_address = bootstrap_address;
  po.incarnation = "bench-1";
  auto p = PrefillWorker::Start(po, *p_engine, [](const core::HoldEvent&) {});
  if (!p) return p.error();

  auto d_engine = Engine("bench-d", transport);
  if (!d_engine) return d_engine.error();
  DecodeWorkerOptions dopt;
  dopt.engine_id = "bench-d";
  dopt.block_len = o.block_bytes;
  dopt.num_blocks = num_blocks;
  dopt.planes = d_mem.views;
  auto d = DecodeWorker::Start(dopt, *d_engine);
  if (!d) return d.error();

  std::uint64_t handle = 1;
  for (const Layout& layout : Layouts(o.blocks)) {
    Row row{transport, layout.name, {}, 0};
    for (std::uint32_t run = 0; run <= o.runs; ++run) {  // run 0: warm-up
      for (std::size_t pl = 0; pl < planes; ++pl) {
        for (core::BlockId b : layout.src) {
          std::memset(p_mem.planes[pl].data() + b * o.block_bytes,
                      static_cast<int>(Pattern(pl, b, run)), o.block_bytes);
        }
      }
      const std::string xfer = fmt::format("{}-{}-{}", transport, row.layout, run);
      const std::string req = "req-" + xfer;
      if (Status s = (*p)->Admit(xfer, handle++).get(); !s.ok()) return s;
      if (Status s = (*p)->PrefillDone(xfer, layout.src).get(); !s.ok()) return s;
      const auto t0 = Clock::now();
      if (Status s = (*d)->StartLoad(req, {xfer, "bench-p", bootstrap_address}, layout.dst);
          !s.ok()) {
        return s;
      }
      std::optional<ReceiveResult> got;
      const auto deadline = core::Clock::now() + std::chrono::seconds(120);
      while (!got && core::Clock::now() < deadline) {
        for (ReceiveResult& r : (*d)->WaitFinished(deadline).received) {
          if (r.request == req) got = std::move(r);
        }
      }
      const auto t1 = Clock::now();
      if (!got) return Status(ErrorCode::kTimeout, "handoff " + xfer + ": no completion");
      if (!got->ok) return got->error;
      (*d)->RequestFinished(req);
      for (std::size_t pl = 0; pl < planes; ++pl) {
        for (std::size_t i = 0; i < layout.dst.size(); ++i) {
          const std::byte* block = d_mem.planes[pl].data() + layout.dst[i] * o.block_bytes;
          const std::byte want = Pattern(pl, layout.src[i], run);
          if (block[0] != want || block[o.block_bytes - 1] != want ||
              std::memcmp(block, block + 1, o.block_bytes - 1) != 0) {
            return Status(ErrorCode::kInternal,
                          fmt::format("handoff {}: plane {} block {} holds the wrong bytes", xfer,
                                      pl, layout.dst[i]));
          }
        }
      }
      if (run > 0) row.handoff_ms.push_back(Ms(t1 - t0));
    }
    row.memcpy_ms = MemcpyMs(p_mem, d_mem, layout, o.block_bytes, o.runs,
                             std::string_view(layout.name) == "contiguous");
    rows.push_back(std::move(row));
  }
  (void)(*d)->Stop();
  (void)(*p)->Stop();
  return Status::Ok();
}

}  // namespace

int RunHandoffBench(const HandoffBenchOptions& o) {
  if (o.layers == 0 || o.blocks == 0 || o.block_bytes == 0 || o.runs == 0) {
    fmt::print(stderr, "handoff bench: layers, blocks, block bytes and runs must be > 0\n");
    return 2;
  }
  const double bytes = 2.0 * o.layers * o.blocks * static_cast<double>(o.block_bytes);
  fmt::print("handoff of one request: {} planes x {} blocks x {} KiB = {:.0f} MB; {} runs each "
             "(medians; after a warm-up handoff)\n\n",
             2 * o.layers, o.blocks, o.block_bytes / 1024, bytes / 1e6, o.runs);
  // The floor: the same bytes as one buffer, one memcpy (no planes, no blocks).
  double one_copy_ms = 0;
  {
    std::vector<std::byte> from(static_cast<std::size_t>(bytes), std::byte{1});
    std::vector<std::byte> to(from.size(), std::byte{2});
    std::vector<double> ms;
    for (std::uint32_t r = 0; r < o.runs; ++r) {
      const auto t0 = Clock::now();
      std::memcpy(to.data(), from.data(), from.size());
      ms.push_back(Ms(Clock::now() - t0));
    }
    one_copy_ms = Median(ms);
  }
  std::vector<Row> rows;
  int exit_code = 0;
  for (const std::string& t : o.transports) {
    if (t != "shm" && t != "tcp") {
      fmt::print(stderr, "handoff bench: unknown transport {} (shm, tcp)\n", t);
      return 2;
    }
    if (Status s = RunTransport(o, t, rows); !s.ok()) {
      fmt::print(stderr, "handoff bench over {}: {}\n", t, s.ToString());
      exit_code = 1;
    }
  }
  fmt::print("memcpy of the same bytes as one buffer: {:.1f} ms ({:.2f} GB/s)\n", one_copy_ms,
             bytes / (one_copy_ms * 1e6));
  // The wire's own limit for the tcp rows: a kvferry endpoint carries its writes on one tcp
  // connection (UCX's tcp lane to the peer; acks come back on another), so the yardstick is
  // one iperf3 stream, with iperf3's default writes and with 1 MiB writes (the segment size the
  // engine sets for UCX's tcp), the better of the two.
  double iperf = -1;
  const bool tcp = std::find(o.transports.begin(), o.transports.end(), "tcp") != o.transports.end();
  if (tcp && o.baselines && transport::bench::HaveProgram("iperf3")) {
    const double plain = transport::bench::Iperf(2, "", 1);
    const double large = transport::bench::Iperf(2, "1M", 1);
    iperf = std::max(plain, large);
    fmt::print("iperf3 on 127.0.0.1, one stream: {:.2f} GB/s (default writes), {:.2f} GB/s "
               "(-l 1M)\n",
               plain, large);
  } else if (tcp && o.baselines) {
    fmt::print("iperf3 is not installed: no wire baseline for the tcp rows\n");
  }
  fmt::print("\n| data plane | blocks | handoff ms (min..max) | GB/s | memcpy ms "
             "| handoff / memcpy | GB/s / iperf3 |\n");
  fmt::print("|---|---|---|---|---|---|---|\n");
  for (const Row& r : rows) {
    const double med = Median(r.handoff_ms);
    const auto [lo, hi] = std::minmax_element(r.handoff_ms.begin(), r.handoff_ms.end());
    const double gbps = bytes / (med * 1e6);
    const std::string vs_wire =
        r.transport == "tcp" && iperf > 0 ? fmt::format("{:.2f}x", gbps / iperf) : "-";
    fmt::print("| UCX {} | {} | {:.1f} ({:.1f}..{:.1f}) | {:.2f} | {:.1f} ({}) | {:.2f}x | {} |\n",
               r.transport, r.layout, med, *lo, *hi, gbps, r.memcpy_ms,
               r.layout == "contiguous" ? "one per plane" : "one per block", med / r.memcpy_ms,
               vs_wire);
  }
  return exit_code;
}

}  // namespace kvferry::runtime
