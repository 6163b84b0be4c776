#include "bench_transfer.h"

#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "kvferry/transport/ucx.h"
#include "bench_baselines.h"
#include "peer_process.h"

namespace kvferry::transport {
namespace {

using namespace std::chrono_literals;
using internal::PeerProcess;
using namespace bench;

constexpr std::size_t kBlock = 64 << 10;
constexpr std::size_t kRegion = 128 << 20;  // room for 64 MiB of scattered 64 KiB slots
constexpr std::uint64_t kSeed = 7;

struct TransportSpec {
  std::string name;
  std::string tls;
  // The receiver fences its writers (UcxOptions::fence_writes): no remote keys, so active
  // messages only, and a rendezvous the receiver drives; every batch carries a write key.
  bool fence = false;
  std::string base;  // the transport's name without the fence (its baselines are shared)
};
// What every batch of the benchmark is stamped with (a receiver that fences refuses none).
constexpr WriteKey kBenchKey = 1;

struct Row {
  std::string transport;
  std::size_t size = 0;
  std::string layout;  // "1 op" or "N x 64K"
  double gbps = -1;
  std::string path;
  bool verified = false;
  double perf_put = -1, perf_am = -1, perf_tag = -1;
};

std::string SizeName(std::size_t n) {
  if (n >= (1 << 20)) return fmt::format("{} MiB", n >> 20);
  return fmt::format("{} KiB", n >> 10);
}

std::string Gbps(double v) { return v < 0 ? "-" : fmt::format("{:.2f}", v); }
std::string Ratio(double a, double b) {
  return (a < 0 || b <= 0) ? "-" : fmt::format("{:.0f}%", 100 * a / b);
}

double Memcpy(std::size_t size, double seconds) {
  static std::byte* a = nullptr;
  static std::byte* b = nullptr;
  constexpr std::size_t kBuf = 64 << 20;
  if (a == nullptr) {
    a = static_cast<std::byte*>(mmap(nullptr, kBuf, PROT_READ | PROT_WRITE,
                                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0));
    b = static_cast<std::byte*>(mmap(nullptr, kBuf, PROT_READ | PROT_WRITE,
                                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0));
    if (a == MAP_FAILED || b == MAP_FAILED) return -1;
    std::memset(a, 1, kBuf);
  }
  std::size_t bytes = 0;
  auto start = Clock::now();
  do {
    std::memcpy(b, a, size);
    bytes += size;
  } while (Clock::now() - start < core::Seconds(seconds));
  return static_cast<double>(bytes) / core::ToSeconds(Clock::now() - start) / 1e9;
}

// Keeps `in_flight_wanted` batches in flight (0: a window of 64 MiB, 2..16 batches) for `seconds`;
// returns GB/s, or nullopt on a failed batch.
std::optional<double> Measure(Engine& engine, ConnectionId peer, const std::vector<WriteOp>& ops,
                              std::size_t bytes, double seconds, std::size_t in_flight_wanted,
                              std::string* error) {
  std::mutex mu;
  std::condition_variable cv;
  int in_flight = 0;
  std::size_t done_bytes = 0;
  Status failed;
  auto cb = [&](BatchId, Status s) {
    std::lock_guard<std::mutex> lock(mu);
    --in_flight;
    if (s.ok()) {
      done_bytes += bytes;
    } else if (failed.ok()) {
      failed = s;
    }
    cv.notify_all();
  };
  const int window = static_cast<int>(
      in_flight_wanted != 0 ? std::min<std::size_t>(in_flight_wanted, 1024)
                            : std::clamp<std::size_t>((64 << 20) / bytes, 2, 16));
  auto run = [&](double secs, int min_batches) -> bool {
    auto start = Clock::now();
    int submitted = 0;
    std::unique_lock<std::mutex> lock(mu);
    while ((Clock::now() - start < core::Seconds(secs) || submitted < min_batches) && failed.ok()) {
      while (in_flight < window) {
        ++in_flight;
        ++submitted;
        lock.unlock();
        auto r = engine.SubmitWrites(peer, ops, kBenchKey, cb);
        lock.lock();
        if (!r) {
          --in_flight;
          failed = r.error();
          break;
        }
      }
      cv.wait_for(lock, 100ms, [&] { return in_flight < window || !failed.ok(); });
    }
    return cv.wait_for(lock, 30s, [&] { return in_flight == 0; }) && failed.ok();
  };
  if (!run(0, 2)) {  // warm-up: connection lanes, registration caches, page tables
    *error = failed.ToString();
    return std::nullopt;
  }
  done_bytes = 0;
  auto start = Clock::now();
  if (!run(seconds, 3)) {
    *error = failed.ToString();
    return std::nullopt;
  }
  return static_cast<double>(done_bytes) / core::ToSeconds(Clock::now() - start) / 1e9;
}

std::string DefaultPeerBinary() {
  char path[4096];
  ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) return "kvferry_transport_peer";
  std::string self(path, static_cast<std::size_t>(n));
  std::string dir = self.substr(0, self.rfind('/'));
  for (const char* candidate : {"/kvferry_transport_peer", "/../transport/kvferry_transport_peer",
                                "/../src/transport/kvferry_transport_peer"}) {
    std::string p = dir + candidate;
    if (access(p.c_str(), X_OK) == 0) return p;
  }
  return "kvferry_transport_peer";
}

}  // namespace

bool ParseBenchFlags(int argc, char** argv, BenchOptions* options) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--quick") {
      options->quick = true;
    } else if (a == "--no-baselines") {
      options->baselines = false;
    } else if (a.rfind("--transport=", 0) == 0) {
      std::stringstream list(a.substr(12));
      std::string t;
      while (std::getline(list, t, ',')) options->transports.push_back(t);
    } else if (a.rfind("--peer=", 0) == 0) {
      options->peer_binary = a.substr(7);
    } else if (a.rfind("--seconds=", 0) == 0) {
      options->seconds_per_point = std::strtod(a.c_str() + 10, nullptr);
    } else if (a.rfind("--in-flight=", 0) == 0) {
      options->in_flight = std::strtoul(a.c_str() + 12, nullptr, 10);
    } else {
      std::fprintf(stderr,
                   "usage: %s [--quick] [--transport=shm,cma,tcp,shmF,tcpF] [--peer=PATH] "
                   "[--no-baselines] [--seconds=S] [--in-flight=N]\n",
                   argv[0]);
      return false;
    }
  }
  return true;
}

int RunTransferBench(const BenchOptions& options) {
  const bool quick = options.quick;
  const double secs = quick ? std::min(options.seconds_per_point, 0.12) : options.seconds_per_point;
  std::vector<std::size_t> sizes =
      quick ? std::vector<std::size_t>{64 << 10, 1 << 20, 16 << 20}
            : std::vector<std::size_t>{64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20};
  std::vector<TransportSpec> all = {{"shm", "posix,sysv,self", false, "shm"},
                                    {"tcp", "tcp", false, "tcp"},
                                    {"cma", "cma,tcp,self", false, "cma"},
                                    {"shmF", "posix,sysv,self", true, "shm"},
                                    {"tcpF", "tcp", true, "tcp"}};
  std::vector<TransportSpec> specs;
  for (const auto& t : all) {
    bool wanted = options.transports.empty()
                      ? t.name != "cma"  // cma is unused by peer-error-mode endpoints (docs)
                      : std::find(options.transports.begin(), options.transports.end(), t.name) !=
                            options.transports.end();
    if (wanted) specs.push_back(t);
  }
  std::string peer_binary = options.peer_binary.empty() ? DefaultPeerBinary() : options.peer_binary;
  const bool perftest = options.baselines && HaveProgram("ucx_perftest");
  const bool iperf = options.baselines && HaveProgram("iperf3");
  int rc = 0;
  std::vector<Row> rows;
  auto bench_start = Clock::now();

  for (const auto& spec : specs) {
    std::vector<std::string> peer_args = {"--region-bytes", std::to_string(kRegion)};
    if (spec.fence) peer_args.insert(peer_args.end(), {"--fence-writes", "1"});
    auto peer = PeerProcess::Spawn(peer_binary, peer_args,
                                   {"UCX_TLS=" + spec.tls, "UCX_NET_DEVICES=lo"},
                                   Clock::now() + 20s);
    if (!peer) {
      std::fprintf(stderr, "%s: cannot start %s: %s\n", spec.name.c_str(), peer_binary.c_str(),
                   peer.error().ToString().c_str());
      return 1;
    }
    UcxOptions uo;
    uo.name = "kvferry-bench";
    uo.config = {{"TLS", spec.tls}, {"NET_DEVICES", "lo"}};
    auto engine = MakeUcxEngine(uo);
    if (!engine) {
      std::fprintf(stderr, "%s: %s\n", spec.name.c_str(), engine.error().ToString().c_str());
      return 1;
    }
    auto src = (*engine)->AllocateRegion(kRegion);
    if (!src) return 1;
    internal::FillPattern(src->base, src->length, kSeed, 0);
    auto peer_id = (*engine)->Connect(peer->descriptor(), Clock::now() + 10s);
    if (!peer_id) {
      std::fprintf(stderr, "%s: connect: %s\n", spec.name.c_str(),
                   peer_id.error().ToString().c_str());
      return 1;
    }
    auto info = (*engine)->DescribePeer(*peer_id);
    std::string path = info ? info->path + "/" + info->transports : "?";
    RegionId remote = ParseDescriptor(peer->descriptor())->regions.at(0).id;
    std::vector<std::uint64_t> src_slots(kRegion / kBlock), dst_slots(kRegion / kBlock);
    std::iota(src_slots.begin(), src_slots.end(), 0);
    std::iota(dst_slots.begin(), dst_slots.end(), 0);
    std::shuffle(src_slots.begin(), src_slots.end(), std::mt19937_64(1));
    std::shuffle(dst_slots.begin(), dst_slots.end(), std::mt19937_64(2));

    for (std::size_t size : sizes) {
      for (bool scattered : {false, true}) {
        if (scattered && size <= kBlock) continue;
        std::vector<WriteOp> ops;
        if (scattered) {
          for (std::size_t i = 0; i < size / kBlock; ++i) {
            ops.push_back(
                WriteOp{src->id, remote, src_slots[i] * kBlock, dst_slots[i] * kBlock, kBlock});
          }
        } else {
          ops.push_back(WriteOp{src->id, remote, 0, 0, size});
        }
        (void)peer->Command("ZERO", Clock::now() + 10s);
        Row row;
        row.transport = spec.name;
        row.size = size;
        row.layout = scattered ? fmt::format("{} x 64K", size / kBlock) : "1 op";
        row.path = path;
        std::string error;
        auto gbps = Measure(**engine, *peer_id, ops, size, secs, options.in_flight, &error);
        if (!gbps) {
          std::fprintf(stderr, "%s %s: transfer failed: %s\n", spec.name.c_str(),
                       SizeName(size).c_str(), error.c_str());
          rc = 1;
        } else {
          row.gbps = *gbps;
          row.verified = true;
          for (const WriteOp& op : ops) {
            auto r = peer->Command(fmt::format("CHECK {} {} {} {}", op.remote_offset, op.length,
                                               op.local_offset, kSeed),
                                   Clock::now() + 10s);
            if (!r || *r != "OK") {
              row.verified = false;
              rc = 1;
              break;
            }
          }
        }
        rows.push_back(row);
      }
    }
    (void)(*engine)->ClosePeer(*peer_id, Clock::now() + 5s);
    engine->reset();
    (void)peer->Command("EXIT", Clock::now() + 5s);
    peer->Kill();

    if (perftest && !spec.fence) {
      // Same transport and sizes, one message per iteration, as a bytes budget per point.
      const double budget = (spec.name == "tcp" ? 0.25e9 : 1e9) * (quick ? 0.25 : 1.0);
      for (Row& row : rows) {
        if (row.transport != spec.name || row.layout != "1 op") continue;
        auto iters = static_cast<std::size_t>(
            std::clamp(budget / static_cast<double>(row.size), 8.0, 20000.0));
        row.perf_am = Perftest(spec.tls, "ucp_am_bw", row.size, iters);
        // Tag rendezvous is UCX's best-tuned bulk path over tcp.
        if (spec.name == "tcp") row.perf_tag = Perftest(spec.tls, "tag_bw", row.size, iters);
        // put over tcp is emulated (tens of MB/s at 64 MiB): measure it only up to 4 MiB.
        if (spec.name != "tcp" || row.size <= (4 << 20)) {
          std::size_t put_iters = spec.name == "tcp" ? std::max<std::size_t>(8, iters / 8) : iters;
          row.perf_put = Perftest(spec.tls, "ucp_put_bw", row.size, put_iters);
        }
      }
      // Scattered rows compare against the same total size in one message.
      for (Row& row : rows) {
        if (row.transport != spec.name || row.layout == "1 op") continue;
        for (const Row& one : rows) {
          if (one.transport == row.transport && one.size == row.size && one.layout == "1 op") {
            row.perf_am = one.perf_am;
            row.perf_tag = one.perf_tag;
            row.perf_put = one.perf_put;
          }
        }
      }
    }
  }

  // Fenced rows share their transport's baselines: the fence's cost reads off beside them.
  for (Row& row : rows) {
    const auto spec = std::find_if(specs.begin(), specs.end(),
                                   [&](const TransportSpec& s) { return s.name == row.transport; });
    if (spec == specs.end() || !spec->fence) continue;
    for (const Row& plain : rows) {
      if (plain.transport == spec->base && plain.size == row.size && plain.layout == row.layout) {
        row.perf_am = plain.perf_am;
        row.perf_tag = plain.perf_tag;
        row.perf_put = plain.perf_put;
      }
    }
  }
  double iperf_default = -1, iperf_1m = -1;
  if (iperf) {
    iperf_default = Iperf(quick ? 1 : 2, "");
    iperf_1m = Iperf(quick ? 1 : 2, "1M");
  }
  std::vector<std::pair<std::size_t, double>> mem;
  if (options.baselines) {
    for (std::size_t s : sizes) mem.emplace_back(s, Memcpy(s, quick ? 0.05 : 0.2));
  }

  std::printf(
      "\nkvferry transfer benchmark (GB/s = 1e9 bytes/s; receiver in another process;\n"
      "every received byte verified)\n\n");
  std::printf("%-4s %-7s %-10s %-15s %8s %3s | %8s %8s %8s %6s | %6s | %7s\n", "tl", "size",
              "layout", "kvferry path", "kvferry", "ok", "pf put", "pf am", "pf tag", "ratio",
              "vs tcp", "memcpy");
  double iperf_best = std::max(iperf_default, iperf_1m);
  for (const Row& r : rows) {
    double best = std::max({r.perf_put, r.perf_am, r.perf_tag});
    double mc = -1;
    for (const auto& [s, v] : mem) {
      if (s == r.size) mc = v;
    }
    std::printf("%-4s %-7s %-10s %-15s %8s %3s | %8s %8s %8s %6s | %6s | %7s\n",
                r.transport.c_str(), SizeName(r.size).c_str(), r.layout.c_str(), r.path.c_str(),
                Gbps(r.gbps).c_str(), r.verified ? "yes" : "NO", Gbps(r.perf_put).c_str(),
                Gbps(r.perf_am).c_str(), Gbps(r.perf_tag).c_str(), Ratio(r.gbps, best).c_str(),
                r.transport.rfind("tcp", 0) == 0 ? Ratio(r.gbps, iperf_best).c_str() : "",
                Gbps(mc).c_str());
  }
  std::printf(
      "\nratio  = kvferry / best ucx_perftest (ucp_put_bw, ucp_am_bw, tag_bw on tcp) on the "
      "same transport and size, one message per iteration\n");
  std::printf(
      "vs tcp = kvferry / best single-stream iperf3 on 127.0.0.1: default writes %s GB/s, "
      "-l 1M %s GB/s\n",
      Gbps(iperf_default).c_str(), Gbps(iperf_1m).c_str());
  std::printf(
      "shmF, tcpF = the same transport with a receiver that fences its writers (fence_writes: "
      "no remote keys, receiver-driven rendezvous, every write keyed); baselines as without\n");
  std::printf("total time %.1f s\n", core::ToSeconds(Clock::now() - bench_start));
  return rc;
}

}  // namespace kvferry::transport
