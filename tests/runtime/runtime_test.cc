// PrefillWorker + DecodeWorker in one process: real side channel (ZeroMQ over 127.0.0.1), real
// bootstrap service (HTTP), in-process data plane. Each test is a small end-to-end transfer.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "control/bootstrap_client.h"
#include "control/bootstrap_server.h"
#include "control/bootstrap_test_util.h"
#include "kvferry/transport/inprocess.h"
#include "runtime/decode_worker.h"
#include "runtime/prefill_worker.h"
#include "support/raw_socket.h"

namespace kvferry::runtime {
namespace {

using namespace std::chrono_literals;

constexpr std::uint64_t kPBlockLen = 64;  // per P rank: 1 of 2 heads
constexpr std::uint32_t kNumBlocks = 16;
const std::vector<core::BlockId> kSourceBlocks = {2, 3, 4};
const std::vector<core::BlockId> kDestBlocks = {5, 6, 7};

struct Cluster {
  std::shared_ptr<transport::InProcessFabric> fabric = transport::MakeInProcessFabric();
  // Cluster secrets (set before Start): P's (its listener, its registration and the bootstrap
  // service) and D's. Null: an open cluster.
  std::shared_ptr<const control::ClusterSecret> p_secret;
  std::shared_ptr<const control::ClusterSecret> d_secret;
  std::unique_ptr<control::BootstrapServer> bootstrap;
  std::string bootstrap_addr;
  std::vector<std::unique_ptr<PrefillWorker>> p;
  std::unique_ptr<DecodeWorker> d;
  std::mutex mu;
  std::vector<core::HoldEvent> hold_events;
  std::vector<std::string> warnings;

  // P's abort_request_timeout; D's copy of it is `d_abort` (the same value unless a test
  // misconfigures D to time out before P answers).
  std::chrono::milliseconds p_abort = 5s;
  // D releases what it gives up (DecodeWorkerOptions::send_releases).
  bool d_releases = true;
  // Caller-owned KV planes of each P rank and of D (runtime/kv_memory.h), as a serving engine
  // registers one tensor per layer and K/V half. 0: each worker allocates its one plane.
  std::size_t p_planes = 0;
  std::size_t d_planes = 0;
  // Whether each side's blocks keep a KV head's bytes together (PrefillWorkerOptions /
  // DecodeWorkerOptions::head_slices), and D's TP size (its one rank is rank 0).
  bool p_head_slices = true;
  bool d_head_slices = true;
  std::uint32_t d_tp = 1;
  // D's data plane fences its writers (transport::InProcessOptions::fence_writes).
  bool d_fences = false;
  std::vector<std::vector<std::byte>> memory;  // every caller-owned plane; outlives the workers

  std::vector<KvPlane> OwnPlanes(std::size_t count, std::uint64_t block_len) {
    std::vector<KvPlane> planes;
    for (std::size_t i = 0; i < count; ++i) {
      memory.emplace_back(block_len * kNumBlocks);
      planes.push_back({memory.back().data(), memory.back().size()});
    }
    return planes;
  }

  // P TP `p_tp` (2 KV heads) → D TP1; leases in seconds (0 = off). D's pull deadline must
  // exceed its abort_request_timeout + write bound (DecodeWorkerOptions).
  void Start(std::uint32_t p_tp, double p_lease_s, double d_lease_s,
             std::chrono::milliseconds pull_timeout = 20s,
             std::optional<std::chrono::milliseconds> d_abort = std::nullopt,
             std::chrono::milliseconds write_bound = 10s) {
    control::BootstrapServerOptions bootstrap_options;
    bootstrap_options.cluster_secret = p_secret;
    bootstrap = std::make_unique<control::BootstrapServer>(bootstrap_options);
    auto port = bootstrap->Start("127.0.0.1", 0);
    ASSERT_TRUE(port.has_value()) << port.error().ToString();
    bootstrap_addr = "127.0.0.1:" + std::to_string(*port);
    ASSERT_NO_FATAL_FAILURE(StartPrefill(p_tp, p_lease_s, "inc-1"));
    ASSERT_NO_FATAL_FAILURE(
        StartDecode(d_lease_s, pull_timeout, d_abort.value_or(p_abort), write_bound));
  }

  void StartPrefill(std::uint32_t p_tp, double p_lease_s, const std::string& incarnation) {
    for (std::uint32_t r = 0; r < p_tp; ++r) {
      auto engine = transport::MakeInProcessEngine(
          fabric, {"p" + std::to_string(r) + "-" + incarnation, false});
      ASSERT_TRUE(engine.has_value());
      PrefillWorkerOptions o;
      o.engine_id = "prefill";
      o.tp_size = p_tp;
      o.tp_rank = r;
      o.kv_heads = 2;
      o.block_len = kPBlockLen * 2 / p_tp;
      o.num_blocks = kNumBlocks;
      o.hold.lease = core::Seconds(p_lease_s);
      o.hold.abort_request_timeout = p_abort;
      o.bootstrap_address = bootstrap_addr;
      o.incarnation = incarnation;
      o.write_timeout = 2s;
      o.cluster_secret = p_secret;
      o.planes = OwnPlanes(p_planes, o.block_len);
      o.head_slices = p_head_slices;
      auto worker = PrefillWorker::Start(
          o, std::shared_ptr<transport::Engine>(std::move(*engine)),
          [this](const core::HoldEvent& e) {
            std::lock_guard<std::mutex> lock(mu);
            hold_events.push_back(e);
          });
      ASSERT_TRUE(worker.has_value()) << worker.error().ToString();
      // Rank r's KV: every byte of block b of plane i is (r + 1) * 16 + b + 64 * i.
      for (std::size_t i = 0; i < (*worker)->num_planes(); ++i) {
        for (core::BlockId b : kSourceBlocks) {
          std::memset((*worker)->kv(i) + b * o.block_len,
                      static_cast<int>((r + 1) * 16 + b + 64 * i), o.block_len);
        }
      }
      p.push_back(std::move(*worker));
    }
  }

  void StartDecode(double d_lease_s, std::chrono::milliseconds pull_timeout,
                   std::chrono::milliseconds d_abort, std::chrono::milliseconds write_bound) {
    auto engine = transport::MakeInProcessEngine(fabric, {"d0", false, d_fences});
    ASSERT_TRUE(engine.has_value());
    DecodeWorkerOptions o;
    o.engine_id = "decode";
    o.tp_size = d_tp;
    o.head_slices = d_head_slices;
    o.block_len = kPBlockLen * 2 / d_tp;
    o.num_blocks = kNumBlocks;
    o.lease = core::Seconds(d_lease_s);
    o.pull_timeout = pull_timeout;
    o.abort_request_timeout = d_abort;
    o.write_bound = write_bound;  // P: 2 s connect + 2 s write + 1 s close + 5 s fence
    o.send_releases = d_releases;
    o.cluster_secret = d_secret;
    o.planes = OwnPlanes(d_planes, o.block_len);
    auto worker = DecodeWorker::Start(o, std::shared_ptr<transport::Engine>(std::move(*engine)),
                                      [this](std::string_view w) {
                                        std::lock_guard<std::mutex> lock(mu);
                                        warnings.emplace_back(w);
                                      });
    ASSERT_TRUE(worker.has_value()) << worker.error().ToString();
    d = std::move(*worker);
  }

  void Prefill(const core::TransferId& id) {
    for (auto& worker : p) {
      ASSERT_TRUE(worker->Admit(id, 1).get().ok());
      ASSERT_TRUE(worker->PrefillDone(id, kSourceBlocks).get().ok());
    }
  }

  RemoteSource Source(const core::TransferId& id) { return {id, "prefill", bootstrap_addr}; }

  std::vector<core::RequestId> released;  // requests whose quarantined blocks came back

  // P prefills `xfer` (every rank) and D loads it as `req` into `blocks`: the receive's result.
  ReceiveResult PrefillAndLoad(const core::RequestId& req, const core::TransferId& xfer,
                               std::vector<core::BlockId> blocks = kDestBlocks) {
    Prefill(xfer);
    Status started = d->StartLoad(req, Source(xfer), std::move(blocks));
    if (!started.ok()) return {req, false, started, {}, false};
    return Receive(req, core::Clock::now() + 10s);
  }

  ReceiveResult Receive(const core::RequestId& req, core::TimePoint deadline) {
    while (core::Clock::now() < deadline) {
      DecodeFinished f = d->WaitFinished(deadline);
      for (auto& [request, blocks] : f.released) released.push_back(request);
      for (ReceiveResult& r : f.received) {
        if (r.request == req) return r;
      }
    }
    return {req, false, Status(ErrorCode::kTimeout, "test: no completion"), {}, false};
  }

  // Waits until D reports `req`'s quarantined blocks released (or `timeout` passes).
  bool WaitReleased(const core::RequestId& req, core::Duration timeout) {
    const auto deadline = core::Clock::now() + timeout;
    auto seen = [&] { return std::find(released.begin(), released.end(), req) != released.end(); };
    while (!seen() && core::Clock::now() < deadline) {
      (void)Receive("none", std::min(deadline, core::Clock::now() + 50ms));
    }
    return seen();
  }

  std::size_t FreedBlocksEvents() {
    std::lock_guard<std::mutex> lock(mu);
    return static_cast<std::size_t>(std::count_if(
        hold_events.begin(), hold_events.end(),
        [](const core::HoldEvent& e) { return e.kind == core::HoldEvent::Kind::kFreeBlocks; }));
  }

  ~Cluster() {
    d.reset();
    p.clear();
    if (bootstrap) bootstrap->Stop();
  }
};

TEST(RuntimeEndToEnd, PrefillTp2ToDecodeTp1LandsEverySliceAndFreesP) {
  Cluster c;
  ASSERT_NO_FATAL_FAILURE(c.Start(2, 30, 30));
  c.Prefill("xfer-1");
  c.d->OnNewRequest("req-1", c.Source("xfer-1"));
  ASSERT_TRUE(c.d->StartLoad("req-1", c.Source("xfer-1"), kDestBlocks).ok());
  ReceiveResult r = c.Receive("req-1", core::Clock::now() + 10s);
  ASSERT_TRUE(r.ok) << r.error.ToString();
  // D's block i holds P0's head slice, then P1's (P TP > D TP: offset p_rank · block_len).
  for (std::size_t i = 0; i < kDestBlocks.size(); ++i) {
    const std::byte* block = c.d->kv() + kDestBlocks[i] * kPBlockLen * 2;
    for (std::uint32_t rank = 0; rank < 2; ++rank) {
      const auto want = static_cast<std::byte>((rank + 1) * 16 + kSourceBlocks[i]);
      for (std::uint64_t k = 0; k < kPBlockLen; ++k) {
        ASSERT_EQ(block[rank * kPBlockLen + k], want) << "block " << i << " rank " << rank;
      }
    }
  }
  c.d->RequestFinished("req-1");
  // Each P rank was pulled by its one paired D rank: both free their blocks.
  const auto deadline = core::Clock::now() + 5s;
  while (c.FreedBlocksEvents() < 2 && core::Clock::now() < deadline)
    std::this_thread::sleep_for(5ms);
  EXPECT_EQ(c.FreedBlocksEvents(), 2u);
}

// A serving engine's KV is several tensors (vLLM: one per layer, K and V halves): every plane of
// D's caller-owned memory gets the same plane of each P rank's blocks, sliced by TP.
TEST(RuntimeEndToEnd, EveryPlaneOfCallerOwnedKvLandsInTheSamePlaneOfD) {
  Cluster c;
  c.p_planes = 3;
  c.d_planes = 3;
  ASSERT_NO_FATAL_FAILURE(c.Start(2, 30, 30));
  ASSERT_EQ(c.d->num_planes(), 3u);
  EXPECT_EQ(c.d->kv(2), c.memory.back().data()) << "D registered the caller's memory";
  ReceiveResult r = c.PrefillAndLoad("req-1", "xfer-1");
  ASSERT_TRUE(r.ok) << r.error.ToString();
  for (std::size_t plane = 0; plane < 3; ++plane) {
    for (std::size_t i = 0; i < kDestBlocks.size(); ++i) {
      const std::byte* block = c.d->kv(plane) + kDestBlocks[i] * kPBlockLen * 2;
      for (std::uint32_t rank = 0; rank < 2; ++rank) {
        const auto want = static_cast<std::byte>((rank + 1) * 16 + kSourceBlocks[i] + 64 * plane);
        for (std::uint64_t k = 0; k < kPBlockLen; ++k) {
          ASSERT_EQ(block[rank * kPBlockLen + k], want)
              << "plane " << plane << " block " << i << " rank " << rank;
        }
      }
    }
  }
  // Blocks D did not ask for are untouched in every plane.
  for (std::size_t plane = 0; plane < 3; ++plane) {
    EXPECT_EQ(c.d->kv(plane)[0], std::byte{0});
  }
}

// P and D of different models (or KV layouts) disagree on the plane count: nothing is written
// and the load fails naming both counts.
TEST(RuntimeEndToEnd, APlaneCountMismatchFailsTheLoadAndWritesNothing) {
  Cluster c;
  c.p_planes = 3;
  c.d_planes = 2;
  ASSERT_NO_FATAL_FAILURE(c.Start(1, 30, 30));
  ReceiveResult r = c.PrefillAndLoad("req-1", "xfer-1");
  ASSERT_FALSE(r.ok);
  EXPECT_NE(r.error.message().find("2 KV planes and this prefill worker 3"), std::string::npos)
      << r.error.ToString();
  EXPECT_FALSE(r.quarantined) << "P refused before writing: nothing to wait for";
  for (std::size_t plane = 0; plane < 2; ++plane) {
    for (core::BlockId b : kDestBlocks) {
      EXPECT_EQ(c.d->kv(plane)[b * kPBlockLen * 2], std::byte{0});
    }
  }
}

// A KV layout that does not keep a head's bytes together (token-major) cannot be sliced by
// head: with different TP sizes the side whose blocks would be cut refuses, with the reason,
// instead of moving the wrong bytes. D refuses before sending (P TP > D TP: D's blocks would be
// written in parts); P refuses the write (D TP > P TP: P's blocks would be read in parts).
TEST(RuntimeEndToEnd, ALayoutWithoutContiguousHeadsRefusesHeadSlicesOnEitherSide) {
  {
    Cluster c;
    c.d_head_slices = false;
    ASSERT_NO_FATAL_FAILURE(c.Start(2, 30, 30));
    ReceiveResult r = c.PrefillAndLoad("req-1", "xfer-1");
    ASSERT_FALSE(r.ok);
    EXPECT_NE(r.error.message().find("does not keep a head's bytes together"), std::string::npos)
        << r.error.ToString();
    EXPECT_FALSE(r.quarantined) << "refused before anything was sent";
    EXPECT_EQ(c.d->Stats().pulls_sent, 0u);
  }
  {
    Cluster c;
    c.p_head_slices = false;
    c.d_tp = 2;
    ASSERT_NO_FATAL_FAILURE(c.Start(1, 30, 30));
    ReceiveResult r = c.PrefillAndLoad("req-1", "xfer-1");
    ASSERT_FALSE(r.ok);
    EXPECT_NE(r.error.message().find("does not keep a head's bytes together"), std::string::npos)
        << r.error.ToString();
    for (core::BlockId b : kDestBlocks) EXPECT_EQ(c.d->kv()[b * kPBlockLen], std::byte{0});
  }
  {
    Cluster c;  // the same TP on both sides: whole blocks, whatever the layout
    c.p_head_slices = false;
    c.d_head_slices = false;
    ASSERT_NO_FATAL_FAILURE(c.Start(1, 30, 30));
    ReceiveResult r = c.PrefillAndLoad("req-1", "xfer-1");
    EXPECT_TRUE(r.ok) << r.error.ToString();
  }
}

// A pull ZeroMQ never took (no connection to P: P's process is gone) has provably not left:
// after the connect wait (3 s) D looks the engine up again and sends it once more (a restarted
// P may live at a new side channel); the registration still names the dead one, so after a
// second connect wait it fails as a plain failure, without quarantine. And if its engine was
// declared down meanwhile (its blocks quarantined then), the quarantine is lifted.
TEST(RuntimeEndToEnd, APullThatNeverLeftIsAPlainFailureAndLiftsAQuarantine) {
  Cluster c;
  ASSERT_NO_FATAL_FAILURE(c.Start(1, 30, 30));
  ASSERT_TRUE(c.PrefillAndLoad("req-1", "xfer-1").ok);  // connected, engine known
  ASSERT_TRUE(c.p[0]->Stop().ok());  // P's side channel closes: the connection goes down
  std::this_thread::sleep_for(200ms);

  const auto start = core::Clock::now();
  ASSERT_TRUE(c.d->StartLoad("req-2", c.Source("xfer-2"), kDestBlocks).ok());
  ReceiveResult r = c.Receive("req-2", core::Clock::now() + 10s);
  EXPECT_FALSE(r.ok);
  EXPECT_FALSE(r.quarantined) << "a pull that never left cannot be written for";
  EXPECT_NE(r.error.message().find("no connection"), std::string::npos) << r.error.ToString();
  EXPECT_LT(core::Clock::now() - start, 8s);  // two connect waits and a lookup
  EXPECT_EQ(c.d->Stats().loads_retried, 1u);

  // req-2's unsent pull made D look the engine up again first (the registration still names
  // the dead side channel): wait until req-3's pull is on its way there.
  const std::uint64_t sent = c.d->Stats().pulls_sent;
  ASSERT_TRUE(c.d->StartLoad("req-3", c.Source("xfer-3"), {8, 9}).ok());
  for (auto until = core::Clock::now() + 5s;
       c.d->Stats().pulls_sent == sent && core::Clock::now() < until;) {
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_GT(c.d->Stats().pulls_sent, sent);
  c.d->EngineDown("prefill", Status(ErrorCode::kUnavailable, "left etcd"));
  r = c.Receive("req-3", core::Clock::now() + 2s);
  EXPECT_FALSE(r.ok);
  EXPECT_TRUE(r.quarantined) << "given up on while it might have left";
  EXPECT_TRUE(c.WaitReleased("req-3", 6s)) << "the quarantine of a pull that never left stayed";
  EXPECT_EQ(c.d->Stats().quarantined_blocks, 0u);
}

// Receiver-side fencing. D declares a P engine down while P holds a pull it has not answered
// (the prefill is not done: P parked it). D's fence revokes that pull's write key, so the
// quarantine lifts at once; and when the P that was declared dead (only cut off, say) finishes
// the prefill and writes, D refuses the write: not a byte lands in the blocks D gave back.
TEST(RuntimeEndToEnd, AFenceOfAnEngineDeclaredDownLiftsTheQuarantineAndRefusesItsLateWrite) {
  Cluster c;
  c.d_fences = true;
  // Without releases: D would release xfer-2 to the P it declared down (that P may live on),
  // and P would drop the transfer instead of writing; this test needs the late write.
  c.d_releases = false;
  ASSERT_NO_FATAL_FAILURE(c.Start(1, 30, 30));
  ReceiveResult first = c.PrefillAndLoad("req-1", "xfer-1");
  ASSERT_TRUE(first.ok) << "a live P's writes carry their pull's key: " << first.error.ToString();
  const std::uint64_t block_len = kPBlockLen * 2;
  const std::vector<core::BlockId> blocks = {8, 9};
  for (core::BlockId b : blocks) std::memset(c.d->kv() + b * block_len, 0, block_len);

  ASSERT_TRUE(c.p[0]->Admit("xfer-2", 1).get().ok());  // not prefilled: P parks the pull
  ASSERT_TRUE(c.d->StartLoad("req-2", c.Source("xfer-2"), blocks).ok());
  std::this_thread::sleep_for(300ms);
  const auto down_at = core::Clock::now();
  c.d->EngineDown("prefill", Status(ErrorCode::kUnavailable, "left etcd"));
  ReceiveResult r = c.Receive("req-2", core::Clock::now() + 2s);
  EXPECT_FALSE(r.ok);
  EXPECT_TRUE(r.quarantined) << "given up on while P held the pull";
  ASSERT_TRUE(c.WaitReleased("req-2", 3s)) << "the fence did not lift the quarantine";
  EXPECT_LT(core::Clock::now() - down_at, 1s);
  DecodeWorkerStats stats = c.d->Stats();
  EXPECT_EQ(stats.quarantined_blocks, 0u);
  EXPECT_GE(stats.fences_requested, 1u);
  EXPECT_EQ(stats.fences_failed, 0u);

  // The P declared down was alive after all: it finishes the prefill and writes for the pull.
  ASSERT_TRUE(c.p[0]->PrefillDone("xfer-2", kSourceBlocks).get().ok());
  std::this_thread::sleep_for(500ms);
  for (core::BlockId b : blocks) {
    const std::byte* block = c.d->kv() + b * block_len;
    EXPECT_TRUE(std::all_of(block, block + block_len, [](std::byte x) { return x == std::byte{0}; }))
        << "P's write under a revoked key landed in block " << b;
  }
}

TEST(KvMemoryTest, PlanesShorterThanTheirBlocksOverlappingOrTooManyAreRefused) {
  auto fabric = transport::MakeInProcessFabric();
  auto made = transport::MakeInProcessEngine(fabric, {"e", false});
  ASSERT_TRUE(made.has_value());
  std::shared_ptr<transport::Engine> engine(std::move(*made));
  std::vector<std::byte> buffer(1024);
  const KvPlane short_plane{buffer.data(), 1023};
  auto refused = KvMemory::Register(engine, std::span(&short_plane, 1), 64, 16);
  ASSERT_FALSE(refused.has_value());
  EXPECT_EQ(refused.error().code(), ErrorCode::kInvalidArgument);
  const KvPlane null_plane{nullptr, 1024};
  EXPECT_FALSE(KvMemory::Register(engine, std::span(&null_plane, 1), 64, 16).has_value());
  std::vector<KvPlane> too_many(kMaxKvPlanes + 1, KvPlane{buffer.data(), 1024});
  EXPECT_FALSE(KvMemory::Register(engine, too_many, 64, 16).has_value());
  EXPECT_FALSE(KvMemory::Register(engine, {}, std::uint64_t{1} << 62, 1u << 8).has_value())
      << "a size that overflows";
  std::vector<std::byte> two(2048);
  const KvPlane overlapping[] = {{two.data(), 1024}, {two.data() + 1000, 1024}};
  auto overlap = KvMemory::Register(engine, overlapping, 64, 16);
  ASSERT_FALSE(overlap.has_value());
  EXPECT_NE(overlap.error().message().find("overlap"), std::string::npos);
  const KvPlane twice[] = {{two.data(), 1024}, {two.data(), 1024}};
  EXPECT_FALSE(KvMemory::Register(engine, twice, 64, 16).has_value()) << "the same plane twice";
  const KvPlane adjacent[] = {{two.data() + 1024, 1024}, {two.data(), 1024}};
  auto side_by_side = KvMemory::Register(engine, adjacent, 64, 16);
  ASSERT_TRUE(side_by_side.has_value()) << side_by_side.error().ToString();
  EXPECT_TRUE(side_by_side->Deregister(core::Clock::now() + 1s).ok());
  const KvPlane ok_plane{buffer.data(), 1024};
  auto ok = KvMemory::Register(engine, std::span(&ok_plane, 1), 64, 16);
  ASSERT_TRUE(ok.has_value()) << ok.error().ToString();
  EXPECT_EQ(ok->plane(0), buffer.data());
  EXPECT_TRUE(ok->Deregister(core::Clock::now() + 1s).ok());
  EXPECT_TRUE(ok->Deregister(core::Clock::now() + 1s).ok()) << "idempotent";
}

TEST(RuntimeEndToEnd, LatePullFailsWithinMilliseconds) {
  Cluster c;
  ASSERT_NO_FATAL_FAILURE(c.Start(1, 0.3, 0.3));
  c.Prefill("xfer-late");
  // Nobody renews: P's hold expires after 0.3 s and leaves a tombstone.
  const auto expired_by = core::Clock::now() + 3s;
  while (c.FreedBlocksEvents() < 1 && core::Clock::now() < expired_by) {
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_EQ(c.FreedBlocksEvents(), 1u);
  const auto start = core::Clock::now();
  ASSERT_TRUE(c.d->StartLoad("req-late", c.Source("xfer-late"), kDestBlocks).ok());
  ReceiveResult r = c.Receive("req-late", start + 5s);
  const auto took = core::Clock::now() - start;
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.error.message().find("late pull"), std::string::npos) << r.error.ToString();
  EXPECT_LT(took, 500ms) << "a late pull (bootstrap lookup included) must not wait for a timeout";
  EXPECT_EQ(r.invalid, kDestBlocks);
}

TEST(RuntimeEndToEnd, RenewalsKeepKvForAQueuedRequest) {
  Cluster c;
  ASSERT_NO_FATAL_FAILURE(c.Start(1, 0.6, 0.6));
  c.d->OnNewRequest("req-q", c.Source("xfer-q"));  // D saw it, it is still queued
  c.Prefill("xfer-q");
  std::this_thread::sleep_for(1500ms);  // 2.5 leases: only renewals keep it alive
  EXPECT_EQ(c.FreedBlocksEvents(), 0u);
  ASSERT_TRUE(c.d->StartLoad("req-q", c.Source("xfer-q"), kDestBlocks).ok());
  ReceiveResult r = c.Receive("req-q", core::Clock::now() + 5s);
  EXPECT_TRUE(r.ok) << r.error.ToString();
  EXPECT_GT(c.d->Stats().renewals_accepted, 0u);
}

TEST(RuntimeEndToEnd, LeaseMismatchFailsNamingBothValues) {
  Cluster c;
  ASSERT_NO_FATAL_FAILURE(c.Start(1, 30, 0));
  c.Prefill("xfer-m");
  ASSERT_TRUE(c.d->StartLoad("req-m", c.Source("xfer-m"), kDestBlocks).ok());
  ReceiveResult r = c.Receive("req-m", core::Clock::now() + 5s);
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(r.error.code(), ErrorCode::kLeaseMismatch) << r.error.ToString();
  EXPECT_NE(r.error.message().find("30s"), std::string::npos) << r.error.message();
  EXPECT_NE(r.error.message().find("off"), std::string::npos) << r.error.message();
  // P freed the refused transfer's KV at once, not after abort_request_timeout.
  const control::ListenerStats stats = c.p[0]->listener().Stats();
  EXPECT_EQ(stats.hold.released[core::ReleaseReason::kLeaseMismatch], 1u);
  EXPECT_EQ(stats.hold_entries, 0u);
}

TEST(RuntimeEndToEnd, SecondLoadOfALoadingRequestIsRefused) {
  Cluster c;
  ASSERT_NO_FATAL_FAILURE(c.Start(1, 30, 30));
  // Not prefilled yet: P parks the pull, so the first load is provably still loading when the
  // second comes (a prefilled one may land in a few milliseconds, and a landed request may load
  // again at this layer).
  ASSERT_TRUE(c.p[0]->Admit("xfer-d", 1).get().ok());
  ASSERT_TRUE(c.d->StartLoad("req-d", c.Source("xfer-d"), kDestBlocks).ok());
  EXPECT_EQ(c.d->StartLoad("req-d", c.Source("xfer-d"), kDestBlocks).code(),
            ErrorCode::kAlreadyExists);
  ASSERT_TRUE(c.p[0]->PrefillDone("xfer-d", kSourceBlocks).get().ok());
  ReceiveResult r = c.Receive("req-d", core::Clock::now() + 5s);
  EXPECT_TRUE(r.ok) << r.error.ToString();
}

// Hole 3: D's deadline passed before P answered (D misconfigured with a shorter
// abort_request_timeout than P's): the blocks are quarantined, and P's late answer — P is
// alive and answers every pull within its own abort_request_timeout — releases them. Before,
// D dropped the channel and the blocks stayed quarantined until P re-registered.
TEST(RuntimeEndToEnd, TimedOutPullIsReleasedByTheLateAnswerOfALivePrefill) {
  Cluster c;
  c.p_abort = 1500ms;
  ASSERT_NO_FATAL_FAILURE(c.Start(1, 30, 30, 400ms, /*d_abort=*/200ms, /*write_bound=*/100ms));
  // P admits but never finishes the prefill: the pull waits on P, D times out first.
  ASSERT_TRUE(c.p[0]->Admit("xfer-stuck", 1).get().ok());
  ASSERT_TRUE(c.d->StartLoad("req-stuck", c.Source("xfer-stuck"), kDestBlocks).ok());
  ReceiveResult r = c.Receive("req-stuck", core::Clock::now() + 5s);
  EXPECT_FALSE(r.ok);
  EXPECT_TRUE(r.quarantined);
  EXPECT_EQ(c.d->Stats().quarantined_blocks, kDestBlocks.size());
  // P's answer comes at its wait deadline (1.5 s) and is still applied.
  EXPECT_TRUE(c.WaitReleased("req-stuck", 5s));
  EXPECT_EQ(c.d->Stats().quarantined_blocks, 0u);
  EXPECT_EQ(c.d->Stats().late_replies, 1u);
}

// Hole 3's other case: P refused its copy of the request (an overload 503), so it never admits
// the transfer. D's pull waits on P until P's abort_request_timeout and then gets `err`; since
// D's deadline is longer than that (the pull_timeout rule), nothing is quarantined.
TEST(RuntimeEndToEnd, PullForATransferPNeverAdmitsFailsWithoutQuarantine) {
  Cluster c;
  c.p_abort = 1000ms;
  ASSERT_NO_FATAL_FAILURE(c.Start(1, 30, 30, 1500ms, /*d_abort=*/1000ms, /*write_bound=*/100ms));
  ASSERT_TRUE(c.d->StartLoad("req-refused", c.Source("xfer-refused"), kDestBlocks).ok());
  ReceiveResult r = c.Receive("req-refused", core::Clock::now() + 5s);
  EXPECT_FALSE(r.ok);
  EXPECT_FALSE(r.quarantined) << r.error.ToString();
  EXPECT_EQ(r.error.code(), ErrorCode::kTimeout) << r.error.ToString();  // P's wait deadline
  EXPECT_EQ(c.d->Stats().quarantined_blocks, 0u);
  EXPECT_EQ(c.d->Stats().pull_timeouts, 0u);
  EXPECT_EQ(c.p[0]->listener().Stats().hold_entries, 0u);
}

// Hole 4: a second registration of the engine id (a restart, another bootstrap, or a forgery)
// releases nothing by itself: the first process may still be writing. Only its own answer does.
TEST(RuntimeEndToEnd, SecondRegistrationOfALiveEngineReleasesNothing) {
  Cluster c;
  c.p_abort = 2500ms;
  // Without releases: D's release of the failed receive would make P answer at once (and so
  // end the quarantine before the second registration; see the next test).
  c.d_releases = false;
  ASSERT_NO_FATAL_FAILURE(c.Start(1, 30, 30, 400ms, /*d_abort=*/200ms, /*write_bound=*/100ms));
  ASSERT_TRUE(c.p[0]->Admit("xfer-stuck", 1).get().ok());
  ASSERT_TRUE(c.d->StartLoad("req-stuck", c.Source("xfer-stuck"), kDestBlocks).ok());
  ASSERT_TRUE(c.Receive("req-stuck", core::Clock::now() + 5s).quarantined);
  // Another process registers the same engine id with a new incarnation; D's next load sees it.
  ASSERT_NO_FATAL_FAILURE(c.StartPrefill(1, 30, "inc-2"));
  ASSERT_TRUE(c.p[1]->Admit("xfer-next", 1).get().ok());
  ASSERT_TRUE(c.p[1]->PrefillDone("xfer-next", kSourceBlocks).get().ok());
  ASSERT_TRUE(c.d->StartLoad("req-next", c.Source("xfer-next"), {8, 9, 10}).ok());
  ReceiveResult next = c.Receive("req-next", core::Clock::now() + 5s);
  EXPECT_TRUE(next.ok) << next.error.ToString();
  EXPECT_EQ(c.d->Stats().quarantined_blocks, kDestBlocks.size())
      << "a registration released blocks the first process may still write";
  EXPECT_TRUE(c.released.empty());
  // The first process answers at its wait deadline: now the blocks come back.
  EXPECT_TRUE(c.WaitReleased("req-stuck", 5s));
  EXPECT_EQ(c.d->Stats().quarantined_blocks, 0u);
}

// The same stuck pull with releases on: D's failed receive releases the transfer, P fails the
// parked pull at once, and that answer ends the quarantine — long before P's wait deadline.
TEST(RuntimeEndToEnd, ReleaseOfATimedOutPullEndsItsQuarantineAtOnce) {
  Cluster c;
  c.p_abort = 5000ms;
  ASSERT_NO_FATAL_FAILURE(c.Start(1, 30, 30, 400ms, /*d_abort=*/200ms, /*write_bound=*/100ms));
  ASSERT_TRUE(c.p[0]->Admit("xfer-stuck", 1).get().ok());
  const auto start = core::Clock::now();
  ASSERT_TRUE(c.d->StartLoad("req-stuck", c.Source("xfer-stuck"), kDestBlocks).ok());
  ASSERT_TRUE(c.Receive("req-stuck", core::Clock::now() + 5s).quarantined);
  EXPECT_TRUE(c.WaitReleased("req-stuck", 2s));
  EXPECT_LT(core::Clock::now() - start, 2s) << "the quarantine waited for P's wait deadline";
  EXPECT_EQ(c.d->Stats().quarantined_blocks, 0u);
  const control::ListenerStats stats = c.p[0]->listener().Stats();
  EXPECT_EQ(stats.released_entries, 1u);
  EXPECT_EQ(stats.hold_entries, 0u) << "P freed the transfer nobody will pull";
}

// Hole 5 in real processes: D renews transfers with a live P and with 20 silent P engines — 10
// whose bootstrap never answers, 10 whose workers never reply. With a 1.2 s lease, the live
// transfer must survive 5 leases. Before, the serial renewal pass paid 1 s per silent worker and
// 5 s per silent bootstrap, so P expired the live decoder's KV within the first lease.
TEST(RuntimeEndToEnd, TwentySilentEnginesCannotCostALiveDecoderItsKv) {
  Cluster c;
  ASSERT_NO_FATAL_FAILURE(c.Start(1, 1.2, 1.2));
  kvferry::testing::SilentListener dead_bootstrap;
  const std::string dead_address = "127.0.0.1:" + std::to_string(dead_bootstrap.port());
  auto client = control::BootstrapClient::Create(c.bootstrap_addr);
  ASSERT_TRUE(client.has_value());
  for (int i = 0; i < 10; ++i) {
    control::WorkerRegistration silent =
        control::testing::MakeWorker("silent-" + std::to_string(i), 0, 1, "inc-a",
                                     /*dp_rank=*/static_cast<std::uint32_t>(i + 1));
    silent.side_channel = "tcp://127.0.0.1:1";  // nothing listens: renewals are never answered
    silent.kv_lease_duration = 1.2;
    const Status registered = client->Register(silent, 2s);
    ASSERT_TRUE(registered.ok()) << registered.ToString();
  }
  c.Prefill("xfer-live");
  c.d->OnNewRequest("req-live", c.Source("xfer-live"));
  for (int i = 0; i < 20; ++i) {
    const std::string name = "silent-" + std::to_string(i);
    c.d->OnNewRequest("req-" + name,
                      {"xfer-" + name, name, i < 10 ? c.bootstrap_addr : dead_address});
  }
  const auto end = core::Clock::now() + 6s;  // 5 leases
  while (core::Clock::now() < end) {
    std::this_thread::sleep_for(100ms);
    ASSERT_EQ(c.p[0]->listener().Stats().hold_entries, 1u)
        << "P expired a live decoder's KV while 20 other engines were silent";
  }
  // The KV is still there to pull.
  ASSERT_TRUE(c.d->StartLoad("req-live", c.Source("xfer-live"), kDestBlocks).ok());
  ReceiveResult r = c.Receive("req-live", core::Clock::now() + 5s);
  EXPECT_TRUE(r.ok) << r.error.ToString();
  const DecodeWorkerStats stats = c.d->Stats();
  EXPECT_GT(stats.renewals_accepted, 20u);  // every lease/6 = 0.2 s for 6 s
  EXPECT_GT(stats.renewal_failures, 0u);
  for (int i = 0; i < 20; ++i) c.d->RequestFinished("req-silent-" + std::to_string(i));
}

std::shared_ptr<const control::ClusterSecret> TestSecret(char fill) {
  auto secret = control::ClusterSecret::FromBytes(std::string(48, fill));
  EXPECT_TRUE(secret.has_value());
  return std::make_shared<const control::ClusterSecret>(std::move(*secret));
}

// The lease, late-pull and TP-slicing paths once more with cluster authentication on: signed
// registration and lookups, CURVE on every side channel.
TEST(RuntimeEndToEnd, AuthenticatedClusterRenewsTransfersAndFailsLatePullsAsAnOpenOne) {
  Cluster c;
  c.p_secret = c.d_secret = TestSecret('k');
  ASSERT_NO_FATAL_FAILURE(c.Start(2, 0.6, 0.6));
  c.d->OnNewRequest("req-q", c.Source("xfer-q"));  // queued on D: renewed from now on
  c.Prefill("xfer-q");
  std::this_thread::sleep_for(1500ms);  // 2.5 leases: only renewals keep the KV
  ASSERT_TRUE(c.d->StartLoad("req-q", c.Source("xfer-q"), kDestBlocks).ok());
  ReceiveResult r = c.Receive("req-q", core::Clock::now() + 10s);
  ASSERT_TRUE(r.ok) << r.error.ToString();
  for (std::size_t i = 0; i < kDestBlocks.size(); ++i) {
    const std::byte* block = c.d->kv() + kDestBlocks[i] * kPBlockLen * 2;
    for (std::uint32_t rank = 0; rank < 2; ++rank) {
      EXPECT_EQ(block[rank * kPBlockLen],
                static_cast<std::byte>((rank + 1) * 16 + kSourceBlocks[i]))
          << "block " << i << " rank " << rank;
    }
  }
  c.d->RequestFinished("req-q");
  EXPECT_GT(c.d->Stats().renewals_accepted, 0u);

  // Nobody renews this one: P frees it after a lease; the pull then fails at once.
  c.Prefill("xfer-late");
  const auto expired_by = core::Clock::now() + 3s;
  while (c.FreedBlocksEvents() < 4 && core::Clock::now() < expired_by) {
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_EQ(c.FreedBlocksEvents(), 4u);  // xfer-q and xfer-late, on both P ranks
  const auto start = core::Clock::now();
  ASSERT_TRUE(c.d->StartLoad("req-late", c.Source("xfer-late"), kDestBlocks).ok());
  ReceiveResult late = c.Receive("req-late", start + 5s);
  EXPECT_FALSE(late.ok);
  EXPECT_NE(late.error.message().find("late pull"), std::string::npos) << late.error.ToString();
  EXPECT_LT(core::Clock::now() - start, 500ms);
  for (auto& worker : c.p) EXPECT_EQ(worker->listener().Stats().auth_refusals, 0u);
}

// A D without the cluster's secret (none, or another) cannot pair: its lookup fails with the
// reason, so its load fails at once, nothing is pulled and nothing is quarantined.
TEST(RuntimeEndToEnd, DecoderWithoutTheClusterSecretFailsItsLoadAtOnceWithTheReason) {
  for (const bool other_secret : {false, true}) {
    SCOPED_TRACE(other_secret ? "another secret" : "no secret");
    Cluster c;
    c.p_secret = TestSecret('k');
    if (other_secret) c.d_secret = TestSecret('o');
    ASSERT_NO_FATAL_FAILURE(c.Start(1, 30, 30));
    c.Prefill("xfer-1");
    const auto start = core::Clock::now();
    ASSERT_TRUE(c.d->StartLoad("req-1", c.Source("xfer-1"), kDestBlocks).ok());
    ReceiveResult r = c.Receive("req-1", start + 5s);
    EXPECT_FALSE(r.ok);
    EXPECT_EQ(r.error.code(), ErrorCode::kUnauthenticated) << r.error.ToString();
    EXPECT_NE(r.error.message().find(other_secret ? "does not match" : "has no cluster secret"),
              std::string::npos)
        << r.error.ToString();
    EXPECT_FALSE(r.quarantined);
    EXPECT_LT(core::Clock::now() - start, 2s);
    EXPECT_EQ(c.d->Stats().pulls_sent, 0u);
    EXPECT_EQ(c.p[0]->listener().Stats().pulls_received, 0u);
  }
}

TEST(RuntimeEndToEnd, PullTimeoutBelowWhatPMayTakeIsRefused) {
  auto fabric = transport::MakeInProcessFabric();
  auto engine = transport::MakeInProcessEngine(fabric, {"d0", false});
  ASSERT_TRUE(engine.has_value());
  DecodeWorkerOptions o;
  o.block_len = 64;
  o.num_blocks = 4;
  o.pull_timeout = 120s;  // below abort_request_timeout (480 s) + write bound (70 s)
  auto worker = DecodeWorker::Start(o, std::shared_ptr<transport::Engine>(std::move(*engine)));
  ASSERT_FALSE(worker.has_value());
  EXPECT_EQ(worker.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(worker.error().message().find("abort_request_timeout"), std::string::npos)
      << worker.error().message();
}

}  // namespace
}  // namespace kvferry::runtime
