// Protocol sessions: what P pays to answer a renewal and to serve a ready pull, and what D pays
// for a renewal pass, through protocol::PrefillSession / DecodeSession, side by side with the
// minimal work the threaded code did inline before the sessions existed (decode, the core call,
// encode the reply). The ratio is the sessions' overhead; docs/performance.md records a run.
#include <benchmark/benchmark.h>

#include <string>
#include <variant>
#include <vector>

#include "kvferry/core/hold_table.h"
#include "kvferry/core/renewal_scheduler.h"
#include "kvferry/core/tp_plan.h"
#include "protocol/decode_session.h"
#include "protocol/prefill_session.h"
#include "wire/messages.h"

namespace {

using namespace kvferry;
using namespace std::chrono_literals;
using core::TimePoint;

constexpr TimePoint kT0{std::chrono::hours(1)};
constexpr int kRing = 4096;  // distinct pulls, reused round robin

std::string Xfer(int i) { return "xfer-0b1c2d3e-4f50-6172-8394-" + std::to_string(100000 + i); }

core::HoldConfig Hold(core::Duration lease) {
  core::HoldConfig c;
  c.lease = lease;
  c.max_tombstones = 0;  // ids are reused round robin: no late-pull memory in the way
  return c;
}

std::vector<std::uint8_t> RenewalBytes(int ids, bool accepts_notices = false) {
  wire::Renewal r;
  r.accepts_notices = accepts_notices;
  r.id = 7;
  r.d_engine_id = "decode-0";
  r.d_lease_ms = 30000;
  std::vector<core::TransferId> xfers;
  for (int i = 0; i < ids; ++i) xfers.push_back(Xfer(i));
  r.fingerprints = wire::FingerprintsOf(xfers);
  return wire::Encode(r);
}

template <typename Admit>
void AdmitReady(int ids, Admit&& admit) {
  for (int i = 0; i < ids; ++i) admit(Xfer(i));
}

// ---- P: renewal of 128 held transfers ----

void BM_RenewalInline(benchmark::State& state) {
  core::HoldTable table(Hold(30s));
  AdmitReady(128, [&](const std::string& x) {
    (void)table.Admit(x, 1, kT0);
    (void)table.PrefillDone(x, 4, kT0);
  });
  const std::vector<std::uint8_t> bytes = RenewalBytes(128);
  for (auto _ : state) {
    auto renewal = wire::DecodeRenewal(bytes);
    auto result = table.Renew(renewal->fingerprints, kT0 + 1s);
    wire::RenewalReply reply;
    reply.id = renewal->id;
    reply.extended = result->extended;
    reply.unknown = result->unknown;
    reply.p_lease_ms = 30000;
    benchmark::DoNotOptimize(wire::Encode(reply));
  }
}
BENCHMARK(BM_RenewalInline);

// Arg 1: the renewal asks for AbortNotices (accepts_notices), so P also remembers the socket
// for every held transfer it names.
void BM_RenewalSession(benchmark::State& state) {
  protocol::PrefillSessionOptions o;
  o.hold = Hold(30s);
  o.block_len = 2 << 20;  // as the pulls say
  protocol::PrefillSession session(o);
  AdmitReady(128, [&](const std::string& x) {
    (void)session.Admit(x, 1, kT0);
    (void)session.PrefillDone(x, {0, 1, 2, 3}, kT0);
  });
  const std::vector<std::uint8_t> bytes = RenewalBytes(128, state.range(0) != 0);
  const protocol::PeerAddress peer = "d0";
  for (auto _ : state) {
    session.OnMessage(peer, bytes, kT0 + 1s);
    for (protocol::Outgoing& out : session.TakeOutgoing()) {
      benchmark::DoNotOptimize(
          std::visit([](const auto& m) { return wire::Encode(m); }, out.message));
    }
  }
}
BENCHMARK(BM_RenewalSession)->Arg(0)->Arg(1);

// ---- P: a ready pull of one request (admit, prefill done, pull, write landed, FINISH) ----

std::vector<std::vector<std::uint8_t>> PullRing() {
  std::vector<std::vector<std::uint8_t>> ring;
  for (int i = 0; i < kRing; ++i) {
    wire::Pull p;
    p.id = static_cast<std::uint64_t>(i + 1);
    p.d_engine_id = "decode-0";
    p.d_lease_ms = 0;
    p.region_descriptor = std::vector<std::uint8_t>(320, 0x5a);
    p.block_len = 2 << 20;
    p.num_blocks = 20000;
    p.requests.push_back({"cmpl-" + std::to_string(i), Xfer(i), {1201, 1202, 1203, 1204}});
    ring.push_back(wire::Encode(p));
  }
  return ring;
}

void BM_PullInline(benchmark::State& state) {
  core::HoldTable table(Hold(0s));
  const auto ring = PullRing();
  int i = 0;
  for (auto _ : state) {
    const std::string xfer = Xfer(i);
    (void)table.Admit(xfer, 1, kT0);
    (void)table.PrefillDone(xfer, 4, kT0);
    auto pull = wire::DecodePull(ring[static_cast<std::size_t>(i)]);
    auto paired = core::PairedDecoderRanks(0, 1, pull->d_tp_size);
    const wire::PullRequest& r = pull->requests[0];
    benchmark::DoNotOptimize(wire::CheckBlockIds(r, pull->num_blocks));
    auto admission =
        table.AdmitPull(r.transfer_id, pull->d_tp_rank, static_cast<std::uint32_t>(paired->size()),
                        std::chrono::milliseconds(*pull->d_lease_ms), kT0);
    benchmark::DoNotOptimize(admission);
    (void)table.BeginSend(r.transfer_id, 0, kT0);
    (void)table.EndSend(r.transfer_id, 0, true, kT0);
    benchmark::DoNotOptimize(table.TakeEvents());
    wire::PullResponse finish;
    finish.id = pull->id;
    finish.ok.push_back(r.d_req_id);
    benchmark::DoNotOptimize(wire::Encode(finish));
    i = (i + 1) % kRing;
  }
}
BENCHMARK(BM_PullInline);

void BM_PullSession(benchmark::State& state) {
  protocol::PrefillSessionOptions o;
  o.hold = Hold(0s);
  o.block_len = 2 << 20;  // as the pulls say
  o.remembered_pull_ids = kRing / 2;  // ids come back after kRing pulls
  protocol::PrefillSession session(o);
  const auto ring = PullRing();
  const protocol::PeerAddress peer = "d0";
  int i = 0;
  for (auto _ : state) {
    const std::string xfer = Xfer(i);
    (void)session.Admit(xfer, 1, kT0);
    (void)session.PrefillDone(xfer, {0, 1, 2, 3}, kT0);
    session.OnMessage(peer, ring[static_cast<std::size_t>(i)], kT0);
    for (protocol::WriteJob& job : session.TakeWrites()) {
      session.OnWriteDone(job.ticket, protocol::WriteOutcome::Landed(), kT0);
    }
    benchmark::DoNotOptimize(session.TakeEngineEvents());
    for (protocol::Outgoing& out : session.TakeOutgoing()) {
      benchmark::DoNotOptimize(
          std::visit([](const auto& m) { return wire::Encode(m); }, out.message));
    }
    i = (i + 1) % kRing;
  }
}
BENCHMARK(BM_PullSession);

// ---- P: D releases a ready transfer (admit, prefill done, release, free, reply) ----

std::vector<std::vector<std::uint8_t>> ReleaseRing() {
  std::vector<std::vector<std::uint8_t>> ring;
  for (int i = 0; i < kRing; ++i) {
    wire::Release r;
    r.id = static_cast<std::uint64_t>(i + 1);
    r.d_engine_id = "decode-0";
    r.fingerprints.push_back(core::FingerprintOf(Xfer(i)));
    ring.push_back(wire::Encode(r));
  }
  return ring;
}

void BM_ReleaseInline(benchmark::State& state) {
  core::HoldTable table(Hold(30s));
  const auto ring = ReleaseRing();
  int i = 0;
  for (auto _ : state) {
    const std::string xfer = Xfer(i);
    (void)table.Admit(xfer, 1, kT0);
    (void)table.PrefillDone(xfer, 4, kT0);
    auto release = wire::DecodeRelease(ring[static_cast<std::size_t>(i)]);
    auto paired = core::PairedDecoderRanks(0, 1, release->d_tp_size);
    wire::ReleaseReply reply;
    reply.id = release->id;
    for (core::Fingerprint fp : release->fingerprints) {
      const auto out = table.ReleaseByDecoder(fp, release->d_tp_rank,
                                              static_cast<std::uint32_t>(paired->size()), kT0);
      reply.released += out.verdict == core::HoldTable::ReleaseOutcome::Verdict::kReleased;
    }
    benchmark::DoNotOptimize(table.TakeEvents());
    benchmark::DoNotOptimize(wire::Encode(reply));
    i = (i + 1) % kRing;
  }
}
BENCHMARK(BM_ReleaseInline);

void BM_ReleaseSession(benchmark::State& state) {
  protocol::PrefillSessionOptions o;
  o.hold = Hold(30s);
  o.block_len = 2 << 20;  // as the pulls say
  protocol::PrefillSession session(o);
  const auto ring = ReleaseRing();
  const protocol::PeerAddress peer = "d0";
  int i = 0;
  for (auto _ : state) {
    const std::string xfer = Xfer(i);
    (void)session.Admit(xfer, 1, kT0);
    (void)session.PrefillDone(xfer, {0, 1, 2, 3}, kT0);
    session.OnMessage(peer, ring[static_cast<std::size_t>(i)], kT0);
    benchmark::DoNotOptimize(session.TakeEngineEvents());
    for (protocol::Outgoing& out : session.TakeOutgoing()) {
      benchmark::DoNotOptimize(
          std::visit([](const auto& m) { return wire::Encode(m); }, out.message));
    }
    i = (i + 1) % kRing;
  }
}
BENCHMARK(BM_ReleaseSession);

// ---- D: one renewal pass over E engines x 128 transfers each (one P worker per engine) ----

void BM_RenewalPassInline(benchmark::State& state) {
  const int engines = static_cast<int>(state.range(0));
  core::RenewalScheduler scheduler(30s);
  for (int e = 0; e < engines; ++e) {
    for (int i = 0; i < 128; ++i) scheduler.Track(Xfer(e * 1000 + i), "p" + std::to_string(e));
  }
  TimePoint now = kT0;
  std::uint64_t id = 0;
  for (auto _ : state) {
    for (core::RenewalBatch& batch : scheduler.Poll(now)) {
      wire::Renewal r;
      r.id = ++id;
      r.d_engine_id = "decode-0";
      r.d_lease_ms = 30000;
      r.fingerprints = std::move(batch.ids);
      benchmark::DoNotOptimize(wire::Encode(r));
    }
    now += 5s;
  }
}
BENCHMARK(BM_RenewalPassInline)->Arg(1)->Arg(21);

void BM_RenewalPassSession(benchmark::State& state) {
  const int engines = static_cast<int>(state.range(0));
  protocol::DecodeSessionOptions o;
  o.block_len = 4096;
  o.num_blocks = 16;
  o.lease = 30s;
  protocol::DecodeSession session(o);
  for (int e = 0; e < engines; ++e) {
    const std::string engine = "p" + std::to_string(e);
    for (int i = 0; i < 128; ++i) {
      session.OnNewRequest("r" + std::to_string(e * 1000 + i),
                           {Xfer(e * 1000 + i), engine, engine + ":1"}, kT0);
    }
    session.OnLookup({engine, "1", 1, {"tcp://" + engine}}, kT0);
  }
  (void)session.TakeLookups();
  TimePoint now = kT0;
  for (auto _ : state) {
    session.OnTimeout(now);
    for (protocol::Transmit& t : session.TakeMessages()) {
      benchmark::DoNotOptimize(
          std::visit([](const auto& m) { return wire::Encode(m); }, t.message));
    }
    now += 5s;  // the replies' deadlines (lease/12) pass unanswered: counted as failures
  }
}
BENCHMARK(BM_RenewalPassSession)->Arg(1)->Arg(21);

}  // namespace

BENCHMARK_MAIN();
