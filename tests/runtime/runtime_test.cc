// PrefillWorker + DecodeWorker in one process: real side channel (ZeroMQ over 127.0.0.1), real
// bootstrap service (HTTP), in-process data plane. Each test is a small end-to-end transfer.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "control/bootstrap_server.h"
#include "kvferry/transport/inprocess.h"
#include "runtime/decode_worker.h"
#include "runtime/prefill_worker.h"

namespace kvferry::runtime {
namespace {

using namespace std::chrono_literals;

constexpr std::uint64_t kPBlockLen = 64;  // per P rank: 1 of 2 heads
constexpr std::uint32_t kNumBlocks = 16;
const std::vector<core::BlockId> kSourceBlocks = {2, 3, 4};
const std::vector<core::BlockId> kDestBlocks = {5, 6, 7};

struct Cluster {
  std::shared_ptr<transport::InProcessFabric> fabric = transport::MakeInProcessFabric();
  control::BootstrapServer bootstrap;
  std::string bootstrap_addr;
  std::vector<std::unique_ptr<PrefillWorker>> p;
  std::unique_ptr<DecodeWorker> d;
  std::mutex mu;
  std::vector<core::HoldEvent> hold_events;
  std::vector<std::string> warnings;

  // P TP `p_tp` (2 KV heads) → D TP1; leases in seconds (0 = off).
  void Start(std::uint32_t p_tp, double p_lease_s, double d_lease_s,
             std::chrono::milliseconds pull_timeout = 5s) {
    auto port = bootstrap.Start("127.0.0.1", 0);
    ASSERT_TRUE(port.has_value()) << port.error().ToString();
    bootstrap_addr = "127.0.0.1:" + std::to_string(*port);
    ASSERT_NO_FATAL_FAILURE(StartPrefill(p_tp, p_lease_s, "inc-1"));
    ASSERT_NO_FATAL_FAILURE(StartDecode(d_lease_s, pull_timeout));
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
      o.hold.abort_request_timeout = 5s;
      o.bootstrap_address = bootstrap_addr;
      o.incarnation = incarnation;
      o.write_timeout = 2s;
      auto worker = PrefillWorker::Start(
          o, std::shared_ptr<transport::Engine>(std::move(*engine)),
          [](std::uint64_t) -> Result<std::vector<core::BlockId>> { return kSourceBlocks; },
          [this](const core::HoldEvent& e) {
            std::lock_guard<std::mutex> lock(mu);
            hold_events.push_back(e);
          });
      ASSERT_TRUE(worker.has_value()) << worker.error().ToString();
      // Rank r's KV: every byte of block b is (r + 1) * 16 + b.
      for (core::BlockId b : kSourceBlocks) {
        std::memset((*worker)->kv() + b * o.block_len, static_cast<int>((r + 1) * 16 + b),
                    o.block_len);
      }
      p.push_back(std::move(*worker));
    }
  }

  void StartDecode(double d_lease_s, std::chrono::milliseconds pull_timeout) {
    auto engine = transport::MakeInProcessEngine(fabric, {"d0", false});
    ASSERT_TRUE(engine.has_value());
    DecodeWorkerOptions o;
    o.engine_id = "decode";
    o.block_len = kPBlockLen * 2;
    o.num_blocks = kNumBlocks;
    o.lease = core::Seconds(d_lease_s);
    o.pull_timeout = pull_timeout;
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
      ASSERT_TRUE(worker->PrefillDone(id, 3).get().ok());
    }
  }

  RemoteSource Source(const core::TransferId& id) { return {id, "prefill", bootstrap_addr}; }

  std::vector<core::RequestId> released;  // requests whose quarantined blocks came back

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

  std::size_t FreedBlocksEvents() {
    std::lock_guard<std::mutex> lock(mu);
    return static_cast<std::size_t>(std::count_if(
        hold_events.begin(), hold_events.end(),
        [](const core::HoldEvent& e) { return e.kind == core::HoldEvent::Kind::kFreeBlocks; }));
  }

  ~Cluster() {
    d.reset();
    p.clear();
    bootstrap.Stop();
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
  EXPECT_EQ(stats.hold.released[static_cast<int>(core::ReleaseReason::kLeaseMismatch)], 1u);
  EXPECT_EQ(stats.hold_entries, 0u);
}

TEST(RuntimeEndToEnd, SecondLoadOfALoadingRequestIsRefused) {
  Cluster c;
  ASSERT_NO_FATAL_FAILURE(c.Start(1, 30, 30));
  c.Prefill("xfer-d");
  ASSERT_TRUE(c.d->StartLoad("req-d", c.Source("xfer-d"), kDestBlocks).ok());
  EXPECT_EQ(c.d->StartLoad("req-d", c.Source("xfer-d"), kDestBlocks).code(),
            ErrorCode::kAlreadyExists);
  EXPECT_TRUE(c.Receive("req-d", core::Clock::now() + 5s).ok);
}

TEST(RuntimeEndToEnd, TimedOutPeerIsQuarantinedUntilItRestarts) {
  Cluster c;
  ASSERT_NO_FATAL_FAILURE(c.Start(1, 30, 30, 300ms));
  // P admits but never finishes the prefill: the pull waits on P and times out on D. P may
  // still write later, so D must not reuse the blocks.
  ASSERT_TRUE(c.p[0]->Admit("xfer-stuck", 1).get().ok());
  ASSERT_TRUE(c.d->StartLoad("req-stuck", c.Source("xfer-stuck"), kDestBlocks).ok());
  ReceiveResult r = c.Receive("req-stuck", core::Clock::now() + 5s);
  EXPECT_FALSE(r.ok);
  EXPECT_TRUE(r.quarantined);
  EXPECT_EQ(c.d->Stats().quarantined_blocks, kDestBlocks.size());
  // P restarts: a new incarnation registers. D's next pull sees it; the old process cannot
  // write any more, so its quarantined blocks come back.
  c.p.clear();
  ASSERT_NO_FATAL_FAILURE(c.StartPrefill(1, 30, "inc-2"));
  c.Prefill("xfer-next");
  ASSERT_TRUE(c.d->StartLoad("req-next", c.Source("xfer-next"), {8, 9}).ok());
  EXPECT_TRUE(c.Receive("req-next", core::Clock::now() + 5s).ok);
  const auto deadline = core::Clock::now() + 2s;
  while (c.released.empty() && core::Clock::now() < deadline) {
    (void)c.Receive("none", core::Clock::now() + 100ms);
  }
  EXPECT_EQ(c.released, std::vector<core::RequestId>{"req-stuck"});
  EXPECT_EQ(c.d->Stats().quarantined_blocks, 0u);
}

}  // namespace
}  // namespace kvferry::runtime
