// DecodeSession, sans-IO: engine calls, lookups, replies and fence results in; lookups,
// messages, fences and receive events out. Virtual time only. "Hole N" names the hole of the
// protocol-sessions issue a test closes; each failed on the threaded DecodeWorker it replaces.
#include "protocol/decode_session.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include "kvferry/core/tp_plan.h"
#include "protocol/prefill_session.h"

namespace kvferry::protocol {
namespace {

using namespace std::chrono_literals;
using core::TimePoint;

constexpr TimePoint kT0{std::chrono::hours(1)};

DecodeSessionOptions Options(core::Duration lease = 0s) {
  DecodeSessionOptions o;
  o.engine_id = "d";
  o.block_len = 4096;
  o.num_blocks = 1024;
  o.region_descriptor = {1, 2, 3};
  o.lease = lease;
  o.abort_request_timeout = 480s;
  o.write_bound = 35s;
  o.pull_timeout = 600s;
  return o;
}

PeerEngine Engine(const std::string& name, std::uint32_t tp = 1, const std::string& inc = "1") {
  PeerEngine e{name, inc, tp, {}, wire::kProtocolFeatures};
  for (std::uint32_t r = 0; r < tp; ++r) e.side_channels.push_back(name + "/" + std::to_string(r));
  return e;
}

RemoteSource Source(const std::string& xfer, const std::string& engine = "p") {
  return {xfer, engine, engine + ":8998"};
}

wire::PullResponse Finish(std::uint64_t id, std::vector<core::RequestId> ok,
                          std::vector<wire::RequestError> err = {}) {
  wire::PullResponse r;
  r.id = id;
  r.status = wire::PullStatus::kFinish;
  r.ok = std::move(ok);
  r.err = std::move(err);
  return r;
}

class DecodeSessionTest : public ::testing::Test {
 protected:
  void Make(DecodeSessionOptions options = Options()) {
    ASSERT_TRUE(DecodeSession::ValidateOptions(options).ok());
    session_.emplace(std::move(options));
  }
  DecodeSession& s() { return *session_; }

  std::vector<wire::Pull> Pulls() {
    std::vector<wire::Pull> out;
    for (Transmit& t : s().TakeMessages()) {
      if (auto* p = std::get_if<wire::Pull>(&t.message)) {
        last_endpoints_.push_back(t.endpoint);
        out.push_back(std::move(*p));
      }
    }
    return out;
  }
  std::vector<ReceiveDone> Done() {
    std::vector<ReceiveDone> out;
    for (DecodeEvent& e : s().TakeEvents()) {
      if (auto* d = std::get_if<ReceiveDone>(&e)) out.push_back(std::move(*d));
    }
    return out;
  }
  std::vector<BlocksReleased> Released() {
    std::vector<BlocksReleased> out;
    for (DecodeEvent& e : s().TakeEvents()) {
      if (auto* d = std::get_if<BlocksReleased>(&e)) out.push_back(std::move(*d));
    }
    return out;
  }

  // A leased session tracking r1/x1 with engine "p" known, after one renewal pass: what it sent.
  std::vector<Transmit> AfterRenewalPass(bool with_load = false) {
    Make(Options(30s));
    s().OnNewRequest("r1", Source("x1"), kT0);
    s().OnLookup(Engine("p"), kT0);
    if (with_load && !s().StartLoad("r1", Source("x1"), {1}, kT0).ok()) ADD_FAILURE();
    s().OnTimeout(kT0);
    return s().TakeMessages();
  }
  // A load of `request` from engine "p" whose pull deadline passed unanswered: the fences asked.
  std::vector<FenceRequest> TimedOutLoad(const core::RequestId& request,
                                         DecodeSessionOptions options = Options()) {
    Make(options);
    s().OnLookup(Engine("p"), kT0);
    if (!s().StartLoad(request, Source("x-" + request), {1}, kT0).ok()) ADD_FAILURE();
    s().OnTimeout(kT0 + 600s);
    return s().TakeFences();
  }
  // A session with engine "p" known and one load of `request` (blocks 7, 8) pulled: its pull.
  wire::Pull OneLoadPulled(const core::RequestId& request) {
    Make();
    s().OnLookup(Engine("p"), kT0);
    if (!s().StartLoad(request, Source("x-" + request), {7, 8}, kT0).ok()) ADD_FAILURE();
    std::vector<wire::Pull> pulls = Pulls();
    if (pulls.size() != 1) ADD_FAILURE() << pulls.size() << " pulls";
    return pulls.empty() ? wire::Pull{} : pulls[0];
  }
  static wire::PullResponse UnreadableIdError() {
    wire::PullResponse error;
    error.id = 0;
    error.status = wire::PullStatus::kError;
    error.code = ErrorCode::kProtocol;
    error.message = "unknown message type 2";
    return error;
  }

  std::optional<DecodeSession> session_;
  std::vector<EndpointId> last_endpoints_;
};

TEST_F(DecodeSessionTest, LoadLooksUpOnceThenPullsEveryPairedPrefillRank) {
  Make();
  ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {1, 2}, kT0).ok());
  ASSERT_TRUE(s().StartLoad("r2", Source("x2"), {3, 4}, kT0).ok());
  std::vector<LookupRequest> lookups = s().TakeLookups();
  ASSERT_EQ(lookups.size(), 1u) << "one lookup per engine, shared by both loads";
  EXPECT_EQ(lookups[0].bootstrap_address, "p:8998");
  s().OnLookup(Engine("p", 2), kT0);
  std::vector<wire::Pull> pulls = Pulls();
  ASSERT_EQ(pulls.size(), 4u);  // P TP2 -> D TP1: each request from both P ranks
  EXPECT_EQ(pulls[0].requests[0].block_ids, (std::vector<core::BlockId>{1, 2}));
  EXPECT_EQ(pulls[0].region_descriptor, (std::vector<std::uint8_t>{1, 2, 3}));
  // r1 completes only once both peers answered.
  s().OnPullResponse(last_endpoints_[0], Finish(pulls[0].id, {"r1"}), kT0 + 1ms);
  EXPECT_TRUE(Done().empty());
  s().OnPullResponse(last_endpoints_[1], Finish(pulls[1].id, {"r1"}), kT0 + 2ms);
  std::vector<ReceiveDone> done = Done();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].request, "r1");
  EXPECT_TRUE(done[0].ok);
  EXPECT_EQ(s().stats().pulls_in_flight, 2u);
}

// Hole 8 (D): a reply settles only the requests its pull asked for.
TEST_F(DecodeSessionTest, ReplySettlesOnlyTheRequestsItsPullAskedFor) {
  Make();
  ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {1}, kT0).ok());
  ASSERT_TRUE(s().StartLoad("r2", Source("x2"), {2}, kT0).ok());
  s().OnLookup(Engine("p"), kT0);
  std::vector<wire::Pull> pulls = Pulls();
  ASSERT_EQ(pulls.size(), 2u);
  // The answer to r1's pull also claims r2 failed: r2 must not settle (its writer may run).
  s().OnPullResponse(last_endpoints_[0],
                     Finish(pulls[0].id, {"r1"}, {{"r2", ErrorCode::kInternal, "bogus"}}), kT0);
  std::vector<ReceiveDone> done = Done();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].request, "r1");
  EXPECT_EQ(s().stats().receiving, 1u);
}

// Holes 5 and 6: a failed lookup is cached, and loads from that engine fail at once.
TEST_F(DecodeSessionTest, FailedLookupIsCachedAndFailsLoadsAtOnceWithoutQuarantine) {
  DecodeSessionOptions o = Options();
  o.lookup_failure_ttl = 2s;
  Make(o);
  ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {1}, kT0).ok());
  ASSERT_EQ(s().TakeLookups().size(), 1u);
  s().OnLookupFailed("p", Status(ErrorCode::kUnavailable, "connection refused"), kT0 + 1ms);
  std::vector<ReceiveDone> done = Done();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_FALSE(done[0].ok);
  EXPECT_FALSE(done[0].quarantined);
  EXPECT_NE(done[0].error.message().find("connection refused"), std::string::npos);
  ASSERT_TRUE(s().StartLoad("r2", Source("x2"), {2}, kT0 + 1s).ok());
  EXPECT_TRUE(s().TakeLookups().empty()) << "the failure is believed for lookup_failure_ttl";
  EXPECT_EQ(Done().size(), 1u);
  ASSERT_TRUE(s().StartLoad("r3", Source("x3"), {3}, kT0 + 3s).ok());
  EXPECT_EQ(s().TakeLookups().size(), 1u);
}

// Issue 20 item 11: lookups and their failures are per bootstrap address until D has paired.
TEST_F(DecodeSessionTest, AFailedLookupAtOneAddressFailsOnlyTheLoadsThatNamedIt) {
  Make();
  const RemoteSource bad{"x1", "p", "http://bad:1"};
  ASSERT_TRUE(s().StartLoad("r1", bad, {1}, kT0).ok());
  ASSERT_TRUE(s().StartLoad("r2", Source("x2"), {2}, kT0).ok());
  std::vector<LookupRequest> lookups = s().TakeLookups();
  ASSERT_EQ(lookups.size(), 2u) << "one per address named, without waiting for the other";
  EXPECT_EQ(lookups[0].bootstrap_address, "http://bad:1");
  EXPECT_EQ(lookups[1].bootstrap_address, "p:8998");
  s().OnLookupFailed("p", Status(ErrorCode::kUnavailable, "connection refused"), kT0 + 1ms,
                     lookups[0].id);
  std::vector<ReceiveDone> done = Done();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].request, "r1");
  EXPECT_FALSE(done[0].ok);
  // The failure is believed for the bad address only.
  ASSERT_TRUE(s().StartLoad("r3", bad, {3}, kT0 + 2ms).ok());
  ASSERT_EQ(Done().size(), 1u);
  ASSERT_TRUE(s().StartLoad("r4", Source("x4"), {4}, kT0 + 2ms).ok());
  EXPECT_TRUE(Done().empty()) << "r4 waits for the lookup in flight at its own address";
  EXPECT_TRUE(s().TakeLookups().empty());
  s().OnLookup(Engine("p"), kT0 + 3ms, lookups[1].id);
  std::vector<wire::Pull> pulls = Pulls();
  ASSERT_EQ(pulls.size(), 2u);
  EXPECT_EQ(pulls[0].requests[0].d_req_id, "r2");
  EXPECT_EQ(pulls[1].requests[0].d_req_id, "r4");
}

TEST_F(DecodeSessionTest, AHangingLookupAtOneAddressHoldsUpNoLoadNamingAnother) {
  Make();
  ASSERT_TRUE(s().StartLoad("r1", {"x1", "p", "http://hangs:1"}, {1}, kT0).ok());
  ASSERT_TRUE(s().StartLoad("r2", Source("x2"), {2}, kT0 + 1ms).ok());
  std::vector<LookupRequest> lookups = s().TakeLookups();
  ASSERT_EQ(lookups.size(), 2u);
  s().OnLookup(Engine("p"), kT0 + 2ms, lookups[1].id);
  EXPECT_EQ(Pulls().size(), 2u) << "paired: r1 goes to the engine too";
  s().OnTimeout(kT0 + 5s);  // the hanging lookup's deadline: paired, so it fails nothing
  EXPECT_TRUE(Done().empty());
  EXPECT_GT(s().NextDeadline(), kT0 + 5s) << "no lookup left in flight";
}

TEST_F(DecodeSessionTest, LookupsOfOneEngineAtManyAddressesAreCapped) {
  Make();
  for (int i = 0; i < 10; ++i) {
    const std::string n = std::to_string(i);
    ASSERT_TRUE(s().StartLoad("r" + n, {"x" + n, "p", "http://a" + n}, {1u + i}, kT0).ok());
  }
  std::vector<LookupRequest> lookups = s().TakeLookups();
  ASSERT_EQ(lookups.size(), 4u) << "the rest wait for one of these";
  for (const LookupRequest& l : lookups) {
    s().OnLookupFailed("p", Status(ErrorCode::kUnavailable, "refused"), kT0 + 1ms, l.id);
  }
  EXPECT_EQ(Done().size(), 4u);
  std::vector<LookupRequest> next = s().TakeLookups();
  ASSERT_EQ(next.size(), 4u) << "the next addresses' turn";
  EXPECT_EQ(next[0].bootstrap_address, "http://a4");
}

TEST_F(DecodeSessionTest, UnansweredLookupFailsAtItsDeadline) {
  Make();
  ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {1}, kT0).ok());
  ASSERT_EQ(s().TakeLookups().size(), 1u);
  EXPECT_EQ(s().NextDeadline(), kT0 + 5s);
  s().OnTimeout(kT0 + 5s);
  std::vector<ReceiveDone> done = Done();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].error.code(), ErrorCode::kTimeout);
}

// A lookup answered after its deadline (a slow bootstrap): its loads failed at the deadline,
// but the answer is still the freshest word about the engine, so D pairs with it and the next
// load pulls at once instead of believing the timeout for lookup_failure_ttl.
TEST_F(DecodeSessionTest, ALookupAnsweredAfterItsDeadlineStillPairsTheEngine) {
  Make();
  ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {1}, kT0).ok());
  std::vector<LookupRequest> lookups = s().TakeLookups();
  ASSERT_EQ(lookups.size(), 1u);
  s().OnTimeout(kT0 + 5s);
  ASSERT_EQ(Done().size(), 1u);  // r1 failed at the lookup's deadline
  s().OnLookup(Engine("p"), kT0 + 6s, lookups[0].id);
  ASSERT_TRUE(s().StartLoad("r2", Source("x2"), {2}, kT0 + 6s).ok());
  EXPECT_TRUE(s().TakeLookups().empty());
  std::vector<wire::Pull> pulls = Pulls();
  ASSERT_EQ(pulls.size(), 1u);
  EXPECT_EQ(pulls[0].requests[0].d_req_id, "r2");
  EXPECT_TRUE(Done().empty());
}

// Hole 6: pulls are messages, not threads: a P that never answers delays nothing else.
TEST_F(DecodeSessionTest, SilentPrefillDelaysNoPullToALiveOne) {
  Make();
  s().OnLookup(Engine("dead"), kT0);
  s().OnLookup(Engine("live"), kT0);
  for (int i = 0; i < 64; ++i) {
    ASSERT_TRUE(s().StartLoad("dead-" + std::to_string(i), Source("xd" + std::to_string(i), "dead"),
                              {static_cast<core::BlockId>(i)}, kT0)
                    .ok());
  }
  ASSERT_TRUE(s().StartLoad("r-live", Source("x-live", "live"), {100}, kT0).ok());
  std::vector<wire::Pull> pulls = Pulls();
  ASSERT_EQ(pulls.size(), 65u);  // all out at once
  s().OnPullResponse(last_endpoints_.back(), Finish(pulls.back().id, {"r-live"}), kT0 + 1ms);
  std::vector<ReceiveDone> done = Done();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].request, "r-live");
  EXPECT_TRUE(done[0].ok);
}

// Hole 3: after a pull's deadline the blocks are quarantined, a fence is asked for, and a late
// reply (the fence failed: the transport cannot prove it) still releases them.
TEST_F(DecodeSessionTest, LateReplyAfterTheDeadlineReleasesTheQuarantine) {
  Make();
  s().OnLookup(Engine("p"), kT0);
  ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {7, 8}, kT0).ok());
  std::vector<wire::Pull> pulls = Pulls();
  ASSERT_EQ(pulls.size(), 1u);
  EXPECT_EQ(s().NextDeadline(), kT0 + 600s);
  s().OnTimeout(kT0 + 600s);
  std::vector<ReceiveDone> done = Done();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_FALSE(done[0].ok);
  EXPECT_TRUE(done[0].quarantined);
  EXPECT_EQ(s().stats().quarantined_blocks, 2u);
  std::vector<FenceRequest> fences = s().TakeFences();
  ASSERT_EQ(fences.size(), 1u);
  s().OnFenceDone(fences[0].id, Status(ErrorCode::kRejected, "no receiver-side fence"), kT0 + 600s);
  EXPECT_EQ(s().stats().quarantined_blocks, 2u);
  s().OnPullResponse(last_endpoints_[0],
                     Finish(pulls[0].id, {}, {{"r1", ErrorCode::kTimeout, "prefill never ran"}}),
                     kT0 + 700s);
  std::vector<BlocksReleased> released = Released();
  ASSERT_EQ(released.size(), 1u);
  EXPECT_EQ(released[0].blocks, (std::vector<core::BlockId>{7, 8}));
  EXPECT_EQ(s().stats().quarantined_blocks, 0u);
  EXPECT_EQ(s().stats().late_replies, 1u);
  EXPECT_EQ(s().stats().pulls_in_flight, 0u);
}

// Item 6: P's write failed with bytes that may still land (`unsettled`): the load fails at once
// with P's reason, its blocks stay quarantined and the writer is fenced; the fence releases them.
TEST_F(DecodeSessionTest, AnUnsettledErrFailsTheLoadAtOnceAndQuarantinesItsBlocksUntilAFence) {
  const wire::Pull pull = OneLoadPulled("r1");
  wire::RequestError unsettled{"r1", ErrorCode::kTimeout, "write did not complete", true};
  s().OnPullResponse(last_endpoints_[0], Finish(pull.id, {}, {unsettled}), kT0 + 1s);
  std::vector<ReceiveDone> done = Done();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_FALSE(done[0].ok);
  EXPECT_TRUE(done[0].quarantined);
  EXPECT_EQ(done[0].error.code(), ErrorCode::kTimeout);
  EXPECT_NE(done[0].error.message().find("write did not complete"), std::string::npos);
  EXPECT_EQ(s().stats().quarantined_blocks, 2u);
  EXPECT_EQ(s().stats().unsettled_writes, 1u);
  std::vector<FenceRequest> fences = s().TakeFences();
  ASSERT_EQ(fences.size(), 1u);
  s().OnFenceDone(fences[0].id, Status::Ok(), kT0 + 2s);
  std::vector<BlocksReleased> released = Released();
  ASSERT_EQ(released.size(), 1u);
  EXPECT_EQ(released[0].blocks, (std::vector<core::BlockId>{7, 8}));
  EXPECT_EQ(s().stats().quarantined_blocks, 0u);
}

// A copy of an unsettled answer, or one that comes only after the pull's deadline, proves no
// more than the first: the blocks stay quarantined until the fence holds (found by exploration
// with duplicated answers: the copy settled the request as finished and D freed blocks the
// write then landed in).
TEST_F(DecodeSessionTest, ACopyOrALateUnsettledAnswerReleasesNothingOnlyTheFenceDoes) {
  const wire::Pull pull = OneLoadPulled("r1");
  const wire::PullResponse answer =
      Finish(pull.id, {}, {{"r1", ErrorCode::kTimeout, "write did not complete", true}});
  s().OnPullResponse(last_endpoints_[0], answer, kT0 + 1s);
  ASSERT_EQ(Done().size(), 1u);
  s().OnPullResponse(last_endpoints_[0], answer, kT0 + 2s);  // the copy
  EXPECT_TRUE(Released().empty());
  EXPECT_EQ(s().stats().quarantined_blocks, 2u);
  EXPECT_EQ(s().stats().unsettled_writes, 1u);
  std::vector<FenceRequest> fences = s().TakeFences();
  ASSERT_EQ(fences.size(), 1u);
  s().OnFenceDone(fences[0].id, Status::Ok(), kT0 + 3s);
  EXPECT_EQ(Released().size(), 1u);

  // The deadline first, then the unsettled answer: still only the fence releases.
  ASSERT_TRUE(s().StartLoad("r2", Source("x-r2"), {3, 4}, kT0 + 4s).ok());
  const std::vector<wire::Pull> pulls = Pulls();
  ASSERT_EQ(pulls.size(), 1u);
  s().OnTimeout(kT0 + 4s + 601s);
  ASSERT_EQ(Done().size(), 1u);
  fences = s().TakeFences();
  ASSERT_EQ(fences.size(), 1u);
  s().OnPullResponse(last_endpoints_[0],
                     Finish(pulls[0].id, {}, {{"r2", ErrorCode::kTimeout, "late", true}}),
                     kT0 + 4s + 602s);
  EXPECT_TRUE(Released().empty());
  EXPECT_EQ(s().stats().quarantined_blocks, 2u);
  s().OnFenceDone(fences[0].id, Status::Ok(), kT0 + 4s + 603s);
  EXPECT_EQ(Released().size(), 1u);
  EXPECT_EQ(s().stats().quarantined_blocks, 0u);
}

// The same err without the flag: nothing more can land, the blocks are free at once.
TEST_F(DecodeSessionTest, APlainErrFailsTheLoadWithoutQuarantine) {
  const wire::Pull pull = OneLoadPulled("r1");
  s().OnPullResponse(last_endpoints_[0],
                     Finish(pull.id, {}, {{"r1", ErrorCode::kRejected, "refused"}}), kT0 + 1s);
  std::vector<ReceiveDone> done = Done();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_FALSE(done[0].ok);
  EXPECT_FALSE(done[0].quarantined);
  EXPECT_TRUE(s().TakeFences().empty());
  EXPECT_EQ(s().stats().quarantined_blocks, 0u);
}

// Hole 3: a fence that succeeds releases what it covers — and never what it does not: pulls sent
// after it was asked for are a new epoch of the peer.
TEST_F(DecodeSessionTest, FenceReleasesTheTimedOutEpochOnly) {
  std::vector<FenceRequest> fences = TimedOutLoad("old");
  ASSERT_EQ(fences.size(), 1u);
  ASSERT_TRUE(s().StartLoad("new", Source("x2"), {2}, kT0 + 601s).ok());
  (void)Pulls();
  s().OnFenceDone(fences[0].id, Status::Ok(), kT0 + 602s);
  std::vector<DecodeEvent> events = s().TakeEvents();
  bool old_released = false;
  for (const DecodeEvent& e : events) {
    if (const auto* r = std::get_if<BlocksReleased>(&e)) old_released |= r->request == "old";
    if (const auto* d = std::get_if<ReceiveDone>(&e)) {
      EXPECT_NE(d->request, "new") << "the fence settled a pull of a later epoch";
    }
  }
  EXPECT_TRUE(old_released);
  EXPECT_EQ(s().stats().receiving, 1u);
}

// Write keys: each epoch's pulls carry their own key, and a fence lists exactly the keys of the
// epochs it covers — including an older one whose fence failed — so a data plane that revokes
// them stops those pulls' writes and no later pull's.
TEST_F(DecodeSessionTest, PullsCarryTheirEpochsWriteKeyAndAFenceListsTheKeysItCovers) {
  DecodeSessionOptions o = Options();
  o.write_key_base = 0x1000;
  Make(o);
  s().OnLookup(Engine("p"), kT0);
  ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {1}, kT0).ok());
  std::vector<wire::Pull> first = Pulls();
  ASSERT_EQ(first.size(), 1u);
  EXPECT_NE(first[0].write_key, 0u);
  s().OnTimeout(kT0 + 600s);
  std::vector<FenceRequest> fence1 = s().TakeFences();
  ASSERT_EQ(fence1.size(), 1u);
  EXPECT_EQ(fence1[0].write_keys, std::vector<std::uint64_t>{first[0].write_key});
  s().OnFenceDone(fence1[0].id, Status(ErrorCode::kTimeout, "writes still landing"), kT0 + 600s);

  // A pull after the fence is a new epoch with a new key.
  s().OnLookup(Engine("p"), kT0 + 601s);
  ASSERT_TRUE(s().StartLoad("r2", Source("x2"), {2}, kT0 + 601s).ok());
  std::vector<wire::Pull> second = Pulls();
  ASSERT_EQ(second.size(), 1u);
  EXPECT_NE(second[0].write_key, 0u);
  EXPECT_NE(second[0].write_key, first[0].write_key);
  // The engine goes down: both epochs are fenced (the first one's fence failed), one fence
  // each, so an epoch whose writes are still landing holds up no other.
  s().OnEngineDown("p", Status(ErrorCode::kUnavailable, "left etcd"), kT0 + 602s);
  std::vector<FenceRequest> fence2 = s().TakeFences();
  ASSERT_EQ(fence2.size(), 2u);
  std::vector<std::uint64_t> keys;
  for (const FenceRequest& f : fence2) {
    ASSERT_EQ(f.write_keys.size(), 1u);
    keys.push_back(f.write_keys[0]);
  }
  std::sort(keys.begin(), keys.end());
  std::vector<std::uint64_t> expected{first[0].write_key, second[0].write_key};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(keys, expected);
  for (const FenceRequest& f : fence2) s().OnFenceDone(f.id, Status::Ok(), kT0 + 603s);
  EXPECT_EQ(s().stats().quarantined_blocks, 0u);
}

// Found by review: a fence that timed out (the writer stalled with writes landing) was never
// asked again when no later deadline or engine-down came, and its blocks stayed quarantined for
// good. It is asked again, backing off (1 s, 2 s, ...), until it holds; a data plane that
// cannot fence at all (kRejected) is not asked again this way.
TEST_F(DecodeSessionTest, AFenceThatFoundWritesStillLandingIsAskedAgainUntilItHolds) {
  DecodeSessionOptions o = Options();
  o.write_key_base = 0x3000;
  std::vector<FenceRequest> fences = TimedOutLoad("r1", o);
  ASSERT_EQ(fences.size(), 1u);
  s().OnFenceDone(fences[0].id, Status(ErrorCode::kTimeout, "still landing"), kT0 + 605s);
  EXPECT_LE(s().NextDeadline(), kT0 + 606s);
  s().OnTimeout(kT0 + 605900ms);
  EXPECT_TRUE(s().TakeFences().empty());
  s().OnTimeout(kT0 + 606s);
  std::vector<FenceRequest> again = s().TakeFences();
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(again[0].write_keys, fences[0].write_keys);
  s().OnFenceDone(again[0].id, Status(ErrorCode::kTimeout, "still landing"), kT0 + 611s);
  s().OnTimeout(kT0 + 612900ms);
  EXPECT_TRUE(s().TakeFences().empty()) << "the wait doubles";
  s().OnTimeout(kT0 + 613s);
  again = s().TakeFences();
  ASSERT_EQ(again.size(), 1u);
  s().OnFenceDone(again[0].id, Status::Ok(), kT0 + 613s);
  EXPECT_EQ(s().stats().quarantined_blocks, 0u);
  s().OnTimeout(kT0 + 800s);
  EXPECT_TRUE(s().TakeFences().empty()) << "a fence that held is not asked again";

  std::vector<FenceRequest> unsupported = TimedOutLoad("r2", o);
  ASSERT_EQ(unsupported.size(), 1u);
  s().OnFenceDone(unsupported[0].id, Status(ErrorCode::kRejected, "cannot fence"), kT0 + 605s);
  s().OnTimeout(kT0 + 700s);
  EXPECT_TRUE(s().TakeFences().empty());
  EXPECT_GT(s().stats().quarantined_blocks, 0u);
}

TEST_F(DecodeSessionTest, WithoutAWriteKeyBasePullsCarryNoKeyAndFencesListNone) {
  std::vector<FenceRequest> fences = TimedOutLoad("r1");
  ASSERT_EQ(fences.size(), 1u);
  EXPECT_TRUE(fences[0].write_keys.empty());
  DecodeSessionOptions o = Options();
  o.write_key_base = std::uint64_t{1} << 63;
  EXPECT_FALSE(DecodeSession::ValidateOptions(o).ok()) << "a base that could wrap to 0 is refused";
}

// A P that restarted within its registry TTL (etcd: keys replaced, not deleted): the old
// process's pulls fail and are fenced by their own keys only; the new process, behind the same
// address, keeps its pull and completes it.
TEST_F(DecodeSessionTest, AProcessGoneFailsAndFencesOnlyItsOwnPullsWhileTheNewProcessServesOn) {
  DecodeSessionOptions o = Options();
  o.write_key_base = 0x2000;
  Make(o);
  s().OnLookup(Engine("p", 1, "first"), kT0);
  ASSERT_TRUE(s().StartLoad("old", Source("x1"), {1}, kT0).ok());
  std::vector<wire::Pull> old_pull = Pulls();
  ASSERT_EQ(old_pull.size(), 1u);
  const EndpointId endpoint = last_endpoints_.back();
  // D learns the new process before the registry says the old one is gone (the new one
  // registered; the old one's keys are replaced at the registry's next poll). A restart found
  // at the source D learned the engine from fails the old process's pull here already.
  s().OnLookup(Engine("p", 1, "second"), kT0 + 1s, 0);
  ASSERT_EQ(Done().size(), 1u);
  std::vector<FenceRequest> fences = s().TakeFences();
  ASSERT_EQ(fences.size(), 1u);
  EXPECT_EQ(fences[0].write_keys, std::vector<std::uint64_t>{old_pull[0].write_key});
  ASSERT_TRUE(s().StartLoad("new", Source("x2"), {2}, kT0 + 1s).ok());
  std::vector<wire::Pull> new_pull = Pulls();
  ASSERT_EQ(new_pull.size(), 1u);
  ASSERT_EQ(last_endpoints_.back(), endpoint);
  (void)s().TakeEvents();

  // The registry's word changes nothing more: the old process's pull was given up on once,
  // and only its epoch's key is revoked; the new process's pull is untouched.
  s().OnProcessGone("p", "first", Status(ErrorCode::kUnavailable, "restarted"), kT0 + 2s);
  EXPECT_TRUE(Done().empty());
  EXPECT_EQ(s().stats().receiving, 1u);
  EXPECT_GT(s().stats().quarantined_blocks, 0u) << "the old process may have been writing";
  EXPECT_EQ(s().stats().fences_requested, 1u);
  ASSERT_EQ(s().stats().pulls_abandoned, 1u);
  s().OnPullResponse(endpoint, Finish(new_pull[0].id, {"new"}), kT0 + 4s);
  std::vector<ReceiveDone> done = Done();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].request, "new");
  EXPECT_TRUE(done[0].ok);
}

// The registry reports a process gone before any lookup found its successor: its pulls fail
// now, quarantined, and are fenced by their own keys only.
TEST_F(DecodeSessionTest, AProcessGoneFromTheRegistryFailsItsPullsAndFencesOnlyTheirKeys) {
  DecodeSessionOptions o = Options();
  o.write_key_base = 0x2000;
  Make(o);
  s().OnLookup(Engine("p", 1, "first"), kT0);
  ASSERT_TRUE(s().StartLoad("old", Source("x1"), {1}, kT0).ok());
  std::vector<wire::Pull> old_pull = Pulls();
  ASSERT_EQ(old_pull.size(), 1u);
  s().OnProcessGone("p", "first", Status(ErrorCode::kUnavailable, "restarted"), kT0 + 2s);
  std::vector<ReceiveDone> done = Done();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].request, "old");
  EXPECT_FALSE(done[0].ok);
  EXPECT_TRUE(done[0].quarantined) << "the old process may have been writing";
  EXPECT_NE(done[0].error.message().find("process first"), std::string::npos)
      << done[0].error.ToString();
  std::vector<FenceRequest> fences = s().TakeFences();
  ASSERT_EQ(fences.size(), 1u);
  EXPECT_EQ(fences[0].write_keys, std::vector<std::uint64_t>{old_pull[0].write_key});
  s().OnFenceDone(fences[0].id, Status::Ok(), kT0 + 3s);
  EXPECT_EQ(s().stats().quarantined_blocks, 0u);
}

// A P restarted on the same address gets the pulls D still sends under its view of the old
// process: D gives them up when the old process is reported gone, but cannot fence them while
// the new one lives (a data plane that cannot fence a live writer). When the new process is
// reported gone too, that death is their proof: they are fenced again (found by the simulator:
// their blocks stayed quarantined for as long as the engine lived).
TEST_F(DecodeSessionTest, APullGivenUpOnUnderAnOlderViewIsFencedAgainWhenTheNextProcessIsGone) {
  DecodeSessionOptions o = Options();
  o.write_key_base = 0x2000;
  Make(o);
  s().OnLookup(Engine("p", 1, "first"), kT0);
  ASSERT_TRUE(s().StartLoad("a", Source("xa"), {1}, kT0).ok());
  std::vector<wire::Pull> a = Pulls();
  ASSERT_EQ(a.size(), 1u);
  s().OnProcessGone("p", "first", Status(ErrorCode::kUnavailable, "restarted"), kT0 + 1s);
  ASSERT_EQ(Done().size(), 1u);
  std::vector<FenceRequest> fences = s().TakeFences();
  ASSERT_EQ(fences.size(), 1u);
  s().OnFenceDone(fences[0].id,
                  Status(ErrorCode::kRejected, "the data plane cannot fence a live peer"),
                  kT0 + 1s);
  ASSERT_GT(s().stats().quarantined_blocks, 0u);
  // The new process serves a load of its own to the end: none of its pulls is in flight.
  ASSERT_TRUE(s().StartLoad("b", Source("xb"), {2}, kT0 + 2s).ok());
  std::vector<LookupRequest> lookups = s().TakeLookups();
  ASSERT_EQ(lookups.size(), 1u);
  s().OnLookup(Engine("p", 1, "second"), kT0 + 2s, lookups[0].id);
  std::vector<wire::Pull> b = Pulls();
  ASSERT_EQ(b.size(), 1u);
  s().OnPullResponse(last_endpoints_.back(), Finish(b[0].id, {"b"}), kT0 + 3s);
  ASSERT_EQ(Done().size(), 1u);

  s().OnProcessGone("p", "second", Status(ErrorCode::kUnavailable, "gone"), kT0 + 10s);
  fences = s().TakeFences();
  ASSERT_EQ(fences.size(), 1u) << "the pull given up on under the first view is fenced again";
  EXPECT_EQ(fences[0].write_keys, std::vector<std::uint64_t>{a[0].write_key});
  s().OnFenceDone(fences[0].id, Status::Ok(), kT0 + 10s);
  EXPECT_EQ(s().stats().quarantined_blocks, 0u);
}

// A FINISH that leaves a request out (a P that dropped it, or predates per-request answers)
// says nothing more comes for that pull: the request fails with a reason, and its blocks are
// not quarantined, since P wrote nothing it did not report.
TEST_F(DecodeSessionTest, AFinishThatLeavesARequestOutFailsItWithoutQuarantine) {
  const wire::Pull pull = OneLoadPulled("r1");
  s().OnPullResponse(last_endpoints_.back(), Finish(pull.id, {}), kT0 + 1s);
  std::vector<ReceiveDone> done = Done();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].request, "r1");
  EXPECT_FALSE(done[0].ok);
  EXPECT_FALSE(done[0].quarantined);
  EXPECT_FALSE(done[0].error.message().empty());
  EXPECT_EQ(s().stats().quarantined_blocks, 0u);
  EXPECT_EQ(s().stats().receiving, 0u);
}

// The gone process is the one D knows: loads are not failed for want of a view; they look the
// engine up again and go to the new process.
TEST_F(DecodeSessionTest, AProcessGoneThatDKnewMakesLoadsLookTheEngineUpAgainInsteadOfFailing) {
  Make();
  s().OnLookup(Engine("p", 1, "first"), kT0);
  ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {1}, kT0).ok());
  (void)Pulls();
  (void)s().TakeLookups();
  s().OnProcessGone("p", "first", Status(ErrorCode::kUnavailable, "restarted"), kT0 + 1s);
  std::vector<ReceiveDone> done = Done();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_FALSE(done[0].ok);
  ASSERT_TRUE(s().StartLoad("r2", Source("x2"), {2}, kT0 + 1s).ok());
  EXPECT_TRUE(Done().empty()) << "a load failed although the engine lives on";
  EXPECT_TRUE(Pulls().empty()) << "a pull went to the process that is gone";
  std::vector<LookupRequest> lookups = s().TakeLookups();
  ASSERT_EQ(lookups.size(), 1u);
  s().OnLookup(Engine("p", 1, "second"), kT0 + 2s, lookups[0].id);
  std::vector<wire::Pull> pulls = Pulls();
  ASSERT_EQ(pulls.size(), 1u);
  EXPECT_EQ(pulls[0].requests[0].d_req_id, "r2");
}

// A liveness source's down is advisory: a P frozen or cut off past its registry TTL lives on and
// holds the KV of D's requests, so D still sends it the releases of requests it gives up —
// queued at the down and later ones — or that P keeps the KV until its lease runs out.
TEST_F(DecodeSessionTest, ReleasesStillGoToAnEngineDeclaredDownWhichMayLiveOn) {
  Make();
  s().OnLookup(Engine("p"), kT0);
  s().OnNewRequest("r1", Source("x1"), kT0);
  s().OnNewRequest("r2", Source("x2"), kT0);
  (void)s().TakeMessages();
  s().RequestFinished("r1", kT0 + 1s);  // queued (release_delay) when the down comes
  s().OnEngineDown("p", Status(ErrorCode::kUnavailable, "left etcd"), kT0 + 1s);
  s().RequestFinished("r2", kT0 + 2s);
  s().OnTimeout(kT0 + 3s);
  std::vector<core::Fingerprint> released;
  for (Transmit& t : s().TakeMessages()) {
    if (auto* r = std::get_if<wire::Release>(&t.message)) {
      EXPECT_EQ(t.address, "p/0");
      released.insert(released.end(), r->fingerprints.begin(), r->fingerprints.end());
    }
  }
  std::sort(released.begin(), released.end());
  std::vector<core::Fingerprint> expected{core::FingerprintOf("x1"), core::FingerprintOf("x2")};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(released, expected);
  EXPECT_EQ(s().stats().releases_dropped, 0u);
}

// Found by review: renewals to an engine declared down stopped once its failure was no longer
// believed (lookup_failure_ttl, 2 s) and the lookup failed, so a P frozen past its registry TTL
// and then its lease freed the KV D still wanted. They go on while D wants the transfer.
TEST_F(DecodeSessionTest, RenewalsKeepGoingToAnEngineDeclaredDownPastTheFailureTtl) {
  Make(Options(30s));
  s().OnLookup(Engine("p"), kT0);
  s().OnNewRequest("r1", Source("x1"), kT0);
  (void)s().TakeMessages();
  s().OnEngineDown("p", Status(ErrorCode::kUnavailable, "left etcd"), kT0 + 1s);
  int renewals = 0;
  for (int i = 1; i <= 6; ++i) {  // passes every lease/6 = 5 s
    const TimePoint now = kT0 + 1s + i * 5s;
    s().OnTimeout(now);
    for (Transmit& t : s().TakeMessages()) {
      if (std::holds_alternative<wire::Renewal>(t.message) && t.address == "p/0") ++renewals;
    }
    for (const LookupRequest& l : s().TakeLookups()) {  // the engine is gone from etcd
      s().OnLookupFailed(l.engine_id, Status(ErrorCode::kNotFound, "not in etcd"), now, l.id);
    }
  }
  EXPECT_GE(renewals, 5);
}

// Found by review: with a data plane that cannot fence (kRejected), every pull timeout asked a
// fence of every earlier epoch again — quadratic in timeouts. Only epochs whose pulls are still
// known (given up on, awaiting proof) are fenced; one whose pull was answered late needs none.
TEST_F(DecodeSessionTest, OnlyEpochsWithPullsAwaitingProofAreFenced) {
  std::vector<FenceRequest> first = TimedOutLoad("r1");
  ASSERT_EQ(first.size(), 1u);
  const EndpointId endpoint = first[0].endpoint;
  s().OnFenceDone(first[0].id, Status(ErrorCode::kRejected, "cannot fence"), kT0 + 600s);
  s().OnLookup(Engine("p"), kT0 + 600s);
  ASSERT_TRUE(s().StartLoad("r2", Source("x2"), {2}, kT0 + 600s).ok());
  std::vector<wire::Pull> pulls = Pulls();  // r1's (never taken by TimedOutLoad) and r2's
  ASSERT_EQ(pulls.size(), 2u);
  ASSERT_EQ(pulls[0].requests[0].d_req_id, "r1");
  // r1's late answer settles its epoch: nothing of it is quarantined any more.
  s().OnPullResponse(endpoint, Finish(pulls[0].id, {"r1"}), kT0 + 601s);
  EXPECT_EQ(s().stats().quarantined_blocks, 0u);
  s().OnTimeout(kT0 + 1200s);  // r2 times out
  std::vector<FenceRequest> second = s().TakeFences();
  ASSERT_EQ(second.size(), 1u) << "only r2's epoch awaits proof";
}

// Found by exploration: a fence that failed (P alive) leaves its epoch to the next fence, e.g.
// the one asked for once the engine is known down.
TEST_F(DecodeSessionTest, EngineDownFencesEpochsWhoseEarlierFenceFailed) {
  std::vector<FenceRequest> first = TimedOutLoad("r1");
  ASSERT_EQ(first.size(), 1u);
  s().OnFenceDone(first[0].id, Status(ErrorCode::kRejected, "P alive, cannot fence"), kT0 + 600s);
  s().OnEngineDown("p", Status(ErrorCode::kUnavailable, "registry lease expired"), kT0 + 700s);
  std::vector<FenceRequest> second = s().TakeFences();
  ASSERT_EQ(second.size(), 1u);
  s().OnFenceDone(second[0].id, Status::Ok(), kT0 + 700s);
  EXPECT_EQ(s().stats().quarantined_blocks, 0u);
  EXPECT_EQ(s().stats().pulls_in_flight, 0u);
  // Loads from a dead engine fail at once, unsent.
  (void)s().TakeEvents();
  ASSERT_TRUE(s().StartLoad("r2", Source("x2"), {2}, kT0 + 700s).ok());
  std::vector<ReceiveDone> done = Done();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_FALSE(done[0].ok);
  EXPECT_FALSE(done[0].quarantined);
}

// Hole 4: a lookup naming another incarnation settles nothing: the old process's pull ends by
// its own reply.
// A lookup answer from another bootstrap than the one D learned the engine from says nothing
// of the old process (any client may name any bootstrap): it settles nothing by itself.
TEST_F(DecodeSessionTest, ANewIncarnationAtAnotherBootstrapSettlesNothingByItself) {
  Make();
  ASSERT_TRUE(s().StartLoad("r0", Source("x0"), {1}, kT0).ok());
  std::vector<LookupRequest> lookups = s().TakeLookups();
  ASSERT_EQ(lookups.size(), 1u);
  s().OnLookup(Engine("p", 1, "first"), kT0, lookups[0].id);
  ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {2}, kT0).ok());
  std::vector<wire::Pull> pulls = Pulls();
  ASSERT_EQ(pulls.size(), 2u);
  const EndpointId old_endpoint = last_endpoints_[1];
  // r0's pull never left: the view is stale (r0 is looked up again where it named the engine),
  // and r2, naming another bootstrap, looks it up there.
  s().OnSendFailed(last_endpoints_[0], pulls[0].id, Status(ErrorCode::kUnavailable, "gone"),
                   kT0 + 3s);
  EXPECT_TRUE(Done().empty());
  ASSERT_TRUE(s().StartLoad("r2", {"x2", "p", "elsewhere:1"}, {3}, kT0 + 3s).ok());
  lookups = s().TakeLookups();
  ASSERT_EQ(lookups.size(), 2u);
  auto elsewhere = std::find_if(lookups.begin(), lookups.end(), [](const LookupRequest& l) {
    return l.bootstrap_address == "elsewhere:1";
  });
  ASSERT_NE(elsewhere, lookups.end());
  s().OnLookup(Engine("p", 1, "forged"), kT0 + 3s, elsewhere->id);
  EXPECT_TRUE(Done().empty()) << "r1 still waits for its own answer";
  EXPECT_TRUE(s().TakeFences().empty());
  s().OnPullResponse(old_endpoint, Finish(pulls[1].id, {"r1"}), kT0 + 4s);
  std::vector<ReceiveDone> done = Done();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].request, "r1");
  EXPECT_TRUE(done[0].ok);
}

// P restarted without etcd: the bootstrap D learned it from now names another process. The old
// process's pulls will get no answer: they fail at once (quarantined: it may have been
// writing) and are fenced by their own keys, while new loads go to the new process.
TEST_F(DecodeSessionTest, ARestartSeenAtTheSameBootstrapFailsTheOldProcesssPullsAtOnce) {
  DecodeSessionOptions o = Options();
  o.write_key_base = 0x3000;
  Make(o);
  ASSERT_TRUE(s().StartLoad("r0", Source("x0"), {1}, kT0).ok());
  std::vector<LookupRequest> lookups = s().TakeLookups();
  s().OnLookup(Engine("p", 1, "first"), kT0, lookups[0].id);
  ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {2}, kT0).ok());
  std::vector<wire::Pull> pulls = Pulls();
  ASSERT_EQ(pulls.size(), 2u);
  s().OnSendFailed(last_endpoints_[0], pulls[0].id, Status(ErrorCode::kUnavailable, "gone"),
                   kT0 + 3s);
  EXPECT_TRUE(Done().empty()) << "r0's pull never left: it goes again after the lookup";
  ASSERT_TRUE(s().StartLoad("r2", Source("x2"), {3}, kT0 + 3s).ok());
  lookups = s().TakeLookups();
  ASSERT_EQ(lookups.size(), 1u);
  s().OnLookup({"p", "second", 1, {"p/new"}, wire::kProtocolFeatures}, kT0 + 3s, lookups[0].id);
  std::vector<ReceiveDone> done = Done();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].request, "r1");
  EXPECT_FALSE(done[0].ok);
  EXPECT_TRUE(done[0].quarantined);
  EXPECT_NE(done[0].error.message().find("restarted"), std::string::npos)
      << done[0].error.ToString();
  std::vector<FenceRequest> fences = s().TakeFences();
  ASSERT_EQ(fences.size(), 1u);
  EXPECT_EQ(fences[0].write_keys, std::vector<std::uint64_t>{pulls[1].write_key});
  std::vector<wire::Pull> fresh = Pulls();
  ASSERT_EQ(fresh.size(), 2u);
  EXPECT_EQ(fresh[0].requests[0].d_req_id, "r0");
  EXPECT_EQ(fresh[1].requests[0].d_req_id, "r2");
  EXPECT_EQ(s().AddressOf(last_endpoints_.back()), "p/new");
  EXPECT_EQ(s().stats().processes_replaced, 1u);
}

TEST_F(DecodeSessionTest, UnsentPullIsAPlainFailureOnceItWasRetried) {
  Make();
  s().OnLookup(Engine("p"), kT0);
  ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {1}, kT0).ok());
  std::vector<wire::Pull> pulls = Pulls();
  s().OnSendFailed(last_endpoints_[0], pulls[0].id, Status(ErrorCode::kUnavailable, "queue full"),
                   kT0);
  EXPECT_TRUE(Done().empty()) << "looked up again first";
  std::vector<LookupRequest> lookups = s().TakeLookups();
  ASSERT_EQ(lookups.size(), 1u);
  s().OnLookup(Engine("p"), kT0 + 1ms, lookups[0].id);
  pulls = Pulls();
  ASSERT_EQ(pulls.size(), 1u);
  s().OnSendFailed(last_endpoints_[0], pulls[0].id, Status(ErrorCode::kUnavailable, "queue full"),
                   kT0 + 2ms);
  std::vector<ReceiveDone> done = Done();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_FALSE(done[0].ok);
  EXPECT_FALSE(done[0].quarantined);
}

// A P restarted without etcd binds a new side channel: pulls to the old address fail unsent
// (nothing listens there). The engine is then looked up again, and the next load goes to the
// process the lookup finds, as does the next renewal pass (found by attacking real processes:
// before, only a pull timing out made D ask again, so a restarted P never got a pull).
TEST_F(DecodeSessionTest, AnUnsentPullMakesTheNextLoadAndRenewalLookTheEngineUpAgain) {
  Make(Options(30s));
  s().OnNewRequest("r1", Source("x1"), kT0);
  s().OnLookup(Engine("p", 1, "first"), kT0);
  ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {1}, kT0).ok());
  std::vector<wire::Pull> pulls = Pulls();
  ASSERT_EQ(pulls.size(), 1u);
  (void)s().TakeLookups();
  s().OnSendFailed(last_endpoints_[0], pulls[0].id,
                   Status(ErrorCode::kUnavailable, "no connection within 3000 ms"), kT0 + 3s);
  EXPECT_TRUE(Done().empty()) << "r1's pull never left: it waits for the lookup, to go again";
  s().OnTimeout(kT0 + 3s + 2ms);
  // r1 is still tracked, so the renewal pass renews x1 with the known process (renewals never
  // wait for a refresh); nothing else goes out before the lookup answers.
  for (const Transmit& t : s().TakeMessages()) {
    EXPECT_TRUE(std::holds_alternative<wire::Renewal>(t.message)) << t.address;
  }
  std::vector<LookupRequest> lookups = s().TakeLookups();
  ASSERT_EQ(lookups.size(), 1u);
  // The next load waits for that lookup instead of pulling from the dead address.
  s().OnNewRequest("r2", Source("x2"), kT0 + 4s);
  ASSERT_TRUE(s().StartLoad("r2", Source("x2"), {2}, kT0 + 4s).ok());
  EXPECT_TRUE(s().TakeMessages().empty());
  EXPECT_TRUE(s().TakeLookups().empty()) << "one lookup in flight per engine";
  PeerEngine restarted{"p", "second", 1, {"p/new-port"}, wire::kProtocolFeatures};
  s().OnLookup(restarted, kT0 + 4s, lookups[0].id);
  std::vector<Transmit> out = s().TakeMessages();
  ASSERT_EQ(out.size(), 2u);
  for (const Transmit& t : out) EXPECT_EQ(t.address, "p/new-port");
  ASSERT_TRUE(std::holds_alternative<wire::Pull>(out[0].message));
  EXPECT_EQ(std::get<wire::Pull>(out[0].message).requests[0].d_req_id, "r1");  // again
  ASSERT_TRUE(std::holds_alternative<wire::Pull>(out[1].message));
  EXPECT_EQ(std::get<wire::Pull>(out[1].message).requests[0].d_req_id, "r2");
  // A renewal that could not be sent also makes the next pass look the engine up first.
  s().OnTimeout(kT0 + 10s);
  std::vector<Transmit> sent = s().TakeMessages();
  ASSERT_EQ(sent.size(), 1u);
  ASSERT_TRUE(std::holds_alternative<wire::Renewal>(sent[0].message));
  EXPECT_EQ(sent[0].address, "p/new-port");
  EXPECT_TRUE(s().TakeLookups().empty());
  s().OnSendFailed(sent[0].endpoint, std::get<wire::Renewal>(sent[0].message).id,
                   Status(ErrorCode::kUnavailable, "no connection within 3000 ms"), kT0 + 13s);
  s().OnTimeout(kT0 + 15s);
  EXPECT_EQ(s().TakeLookups().size(), 1u);
}

// Hole 2 of the engine-adapter issue: D kept every side channel it ever opened and died of
// EMFILE at its 1,024th P address (each P restart binds a new port). Endpoints with nothing in
// flight now close beyond max_idle_endpoints, least recently idle first, whatever the churn.
TEST_F(DecodeSessionTest, EndpointsStayBoundedWhateverTheChurnOfPAddresses) {
  DecodeSessionOptions o = Options();
  o.max_idle_endpoints = 16;
  Make(o);
  std::set<EndpointId> closed;
  for (int i = 0; i < 2000; ++i) {
    const std::string engine = "p" + std::to_string(i);
    const core::TimePoint now = kT0 + std::chrono::milliseconds(i);
    s().OnLookup(Engine(engine), now);
    ASSERT_TRUE(s().StartLoad("r" + std::to_string(i), Source("x" + std::to_string(i), engine),
                              {1}, now)
                    .ok());
    std::vector<wire::Pull> pulls = Pulls();
    ASSERT_EQ(pulls.size(), 1u);
    // Every other P answers; the rest are gone (their pulls fail unsent).
    if (i % 2 == 0) {
      s().OnPullResponse(last_endpoints_.back(), Finish(pulls[0].id, {pulls[0].requests[0].d_req_id}),
                         now);
    } else {
      s().OnSendFailed(last_endpoints_.back(), pulls[0].id,
                       Status(ErrorCode::kUnavailable, "no connection"), now);
    }
    for (EndpointId id : s().TakeClosedEndpoints()) EXPECT_TRUE(closed.insert(id).second);
    ASSERT_LE(s().stats().endpoints, 16u + 1);
  }
  EXPECT_EQ(closed.size(), 2000u - 16u);
  EXPECT_EQ(s().stats().endpoints_closed, 2000u - 16u);
  // A late answer on a closed endpoint changes nothing; a closed address opens anew.
  const std::uint64_t unmatched = s().stats().replies_unmatched;
  s().OnPullResponse(*closed.begin(), Finish(1, {"r0"}), kT0 + 10s);
  EXPECT_EQ(s().stats().replies_unmatched, unmatched + 1);
  EXPECT_TRUE(s().AddressOf(*closed.begin()).empty());
  ASSERT_TRUE(s().StartLoad("again", Source("x-again", "p0"), {2}, kT0 + 10s).ok());
  ASSERT_EQ(Pulls().size(), 1u);
  EXPECT_EQ(closed.count(last_endpoints_.back()), 0u) << "ids are never reused";
  EXPECT_EQ(s().AddressOf(last_endpoints_.back()), "p0/0");
}

// When every open endpoint has something in flight, a load that needs one more fails at once
// (unsent) instead of opening sockets without bound; it succeeds again once one is idle.
TEST_F(DecodeSessionTest, ALoadNeedingAnEndpointBeyondTheCapFailsAtOnceUntilOneIsIdle) {
  DecodeSessionOptions o = Options();
  o.max_endpoints = 2;
  o.max_idle_endpoints = 1;
  Make(o);
  for (const char* p : {"a", "b", "c"}) s().OnLookup(Engine(p), kT0);
  ASSERT_TRUE(s().StartLoad("r1", Source("x1", "a"), {1}, kT0).ok());
  ASSERT_TRUE(s().StartLoad("r2", Source("x2", "b"), {2}, kT0).ok());
  std::vector<wire::Pull> pulls = Pulls();
  ASSERT_EQ(pulls.size(), 2u);
  ASSERT_TRUE(s().StartLoad("r3", Source("x3", "c"), {3}, kT0).ok());
  std::vector<ReceiveDone> done = Done();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].request, "r3");
  EXPECT_EQ(done[0].error.code(), ErrorCode::kResourceExhausted) << done[0].error.ToString();
  EXPECT_FALSE(done[0].quarantined);
  EXPECT_EQ(s().stats().endpoints_exhausted, 1u) << "counted: a decoder at its cap";
  s().OnPullResponse(last_endpoints_[0], Finish(pulls[0].id, {"r1"}), kT0 + 1s);
  ASSERT_EQ(Done().size(), 1u);
  (void)s().TakeClosedEndpoints();
  ASSERT_TRUE(s().StartLoad("r4", Source("x4", "c"), {4}, kT0 + 1s).ok());
  EXPECT_EQ(Pulls().size(), 1u);
  EXPECT_EQ(s().TakeClosedEndpoints().size(), 1u) << "the idle one made room";
  EXPECT_LE(s().stats().endpoints, 2u);
}

// A decoder at its side-channel cap cannot keep P's leases, so an operator must hear of it:
// a Warning at the 1st, 10th, 100th... message that found no free endpoint, not one per message.
TEST_F(DecodeSessionTest, MessagesThatFindEveryEndpointInUseAreWarnedOfAtTheFirstTenthAndHundredth) {
  DecodeSessionOptions o = Options();
  o.max_endpoints = 1;
  o.max_idle_endpoints = 1;
  Make(o);
  s().OnLookup(Engine("a"), kT0);
  s().OnLookup(Engine("b"), kT0);
  ASSERT_TRUE(s().StartLoad("r0", Source("x0", "a"), {0}, kT0).ok());
  ASSERT_EQ(Pulls().size(), 1u) << "the one endpoint now has a pull in flight";
  std::vector<std::string> warnings;
  std::size_t failed = 0;
  for (int i = 1; i <= 100; ++i) {
    const std::string r = "r" + std::to_string(i);
    ASSERT_TRUE(s().StartLoad(r, Source("x" + std::to_string(i), "b"), {1}, kT0).ok());
    for (DecodeEvent& e : s().TakeEvents()) {
      if (auto* w = std::get_if<Warning>(&e)) {
        EXPECT_EQ(w->kind, Warning::Kind::kEndpointsExhausted);
        warnings.push_back(w->text);
      } else if (auto* d = std::get_if<ReceiveDone>(&e)) {
        EXPECT_EQ(d->error.code(), ErrorCode::kResourceExhausted);
        ++failed;
      }
    }
  }
  EXPECT_EQ(failed, 100u);
  EXPECT_EQ(s().stats().endpoints_exhausted, 100u);
  ASSERT_EQ(warnings.size(), 3u) << "at the 1st, 10th and 100th";
  EXPECT_NE(warnings[0].find("max_endpoints"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[2].find("100 message(s)"), std::string::npos) << warnings[2];
}

// A P worker no renewal has reached for a whole lease (each failed unsent: provably not
// delivered) has dropped the transfers D tracks there if it lives, and answers nothing if it
// is gone: its pulls fail then, quarantined and fenced, instead of at their deadline. Any
// message from the worker in between starts the count again.
TEST_F(DecodeSessionTest, PullsToAWorkerNoRenewalReachedForALeaseFailAndAreFenced) {
  Make(Options(30s));
  s().OnNewRequest("r1", Source("x1"), kT0);
  s().OnLookup(Engine("p"), kT0);
  ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {1}, kT0).ok());
  ASSERT_EQ(Pulls().size(), 1u);
  const EndpointId endpoint = last_endpoints_.back();
  // Renewal passes every lease/6 = 5 s; each renewal fails unsent 3 s later, as the runtime
  // reports it: after its reply deadline (lease/12 = 2.5 s) has already counted it failed.
  auto pass = [&](core::TimePoint at, bool unsent) {
    s().OnTimeout(at);
    std::vector<Transmit> sent = s().TakeMessages();
    s().OnTimeout(at + 2600ms);
    for (Transmit& t : sent) {
      auto* renewal = std::get_if<wire::Renewal>(&t.message);
      if (renewal == nullptr) continue;
      if (unsent) {
        s().OnSendFailed(t.endpoint, renewal->id, Status(ErrorCode::kUnavailable, "no connection"),
                         at + 3s);
      } else {
        wire::RenewalReply reply;
        reply.id = renewal->id;
        reply.status = wire::RenewalStatus::kAccepted;
        s().OnRenewalReply(t.endpoint, reply, at + 2700ms);  // late, but an answer
      }
    }
  };
  pass(kT0 + 5s, true);
  pass(kT0 + 10s, true);
  pass(kT0 + 15s, false);  // P answered: the count starts again
  for (int i = 4; i <= 9; ++i) pass(kT0 + std::chrono::seconds(5 * i), true);
  EXPECT_TRUE(Done().empty()) << "unsent since 20 s: not a lease yet at 48 s";
  pass(kT0 + 50s, true);  // its failure at 53 s: a lease (30 s) since the renewal sent at 20 s
  std::vector<ReceiveDone> done = Done();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_FALSE(done[0].ok);
  EXPECT_TRUE(done[0].quarantined) << "a P that lives may still be writing";
  EXPECT_NE(done[0].error.message().find("no renewal reached"), std::string::npos)
      << done[0].error.ToString();
  std::vector<FenceRequest> fences = s().TakeFences();
  ASSERT_EQ(fences.size(), 1u);
  EXPECT_EQ(fences[0].endpoint, endpoint);
  EXPECT_EQ(s().stats().pulls_abandoned, 1u);
}

// A renewal the transport took (OnSent) may have reached P: renewals failing unsent around it
// do not add up to a lease without one.
TEST_F(DecodeSessionTest, ARenewalThatLeftRestartsTheCountOfUnsentOnes) {
  Make(Options(30s));
  s().OnNewRequest("r1", Source("x1"), kT0);
  s().OnLookup(Engine("p"), kT0);
  ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {1}, kT0).ok());
  ASSERT_EQ(Pulls().size(), 1u);
  for (int i = 1; i <= 12; ++i) {
    const core::TimePoint at = kT0 + std::chrono::seconds(5 * i);
    s().OnTimeout(at);
    for (Transmit& t : s().TakeMessages()) {
      const auto* renewal = std::get_if<wire::Renewal>(&t.message);
      if (renewal == nullptr) continue;
      if (i == 6) {
        s().OnSent(t.endpoint, renewal->id, at);  // this one left
      } else {
        s().OnSendFailed(t.endpoint, renewal->id, Status(ErrorCode::kUnavailable, "no connection"),
                         at + 3s);
      }
    }
    if (i < 12) {
      EXPECT_TRUE(Done().empty()) << "pass " << i;
    }
  }
  // Unsent since the pass at 35 s; the one sent at 60 s failed at 63 s: 28 s, not a lease.
  EXPECT_TRUE(Done().empty());
  s().OnTimeout(kT0 + 65s);
  for (Transmit& t : s().TakeMessages()) {
    if (const auto* renewal = std::get_if<wire::Renewal>(&t.message)) {
      s().OnSendFailed(t.endpoint, renewal->id, Status(ErrorCode::kUnavailable, "no connection"),
                       kT0 + 68s);
    }
  }
  EXPECT_EQ(Done().size(), 1u) << "33 s without a renewal leaving";
}

TEST_F(DecodeSessionTest, SecondLoadOfALoadingRequestIsRefused) {
  Make();
  ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {1}, kT0).ok());
  EXPECT_EQ(s().StartLoad("r1", Source("x1"), {1}, kT0).code(), ErrorCode::kAlreadyExists);
  EXPECT_EQ(s().StartLoad("r2", Source("x2"), {5000}, kT0).code(), ErrorCode::kOutOfRange);
  EXPECT_TRUE(s().StartLoad("r3", Source("x3"), {}, kT0).ok());  // notify-only
  EXPECT_EQ(s().stats().receiving, 1u);
}

// Hole 9: D stops renewing a transfer once its receive settled.
TEST_F(DecodeSessionTest, RenewingStopsWhenTheReceiveSettles) {
  Make(Options(30s));
  s().OnNewRequest("r1", Source("x1"), kT0);
  s().OnLookup(Engine("p"), kT0);
  EXPECT_EQ(s().stats().tracked, 1u);
  ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {1}, kT0).ok());
  std::vector<wire::Pull> pulls = Pulls();
  s().OnPullResponse(last_endpoints_[0], Finish(pulls[0].id, {"r1"}), kT0);
  EXPECT_EQ(s().stats().tracked, 0u);
  s().OnTimeout(kT0 + 10s);
  for (const Transmit& t : s().TakeMessages()) {
    EXPECT_FALSE(std::holds_alternative<wire::Renewal>(t.message));
  }
}

TEST_F(DecodeSessionTest, RejectedRenewalsWarnOncePerEngineAndStop) {
  std::vector<Transmit> out = AfterRenewalPass();
  ASSERT_EQ(out.size(), 1u);
  wire::RenewalReply reply;
  reply.id = std::get<wire::Renewal>(out[0].message).id;
  reply.status = wire::RenewalStatus::kRejected;
  s().OnRenewalReply(out[0].endpoint, reply, kT0 + 1ms);
  int warnings = 0;
  for (const DecodeEvent& e : s().TakeEvents()) warnings += std::holds_alternative<Warning>(e);
  EXPECT_EQ(warnings, 1);
  s().OnTimeout(kT0 + 5s);
  EXPECT_TRUE(s().TakeMessages().empty());
}

// Mixed versions (protocol §6): a P that predates renewals answers one with a PullResponse
// ERROR; D takes it as a rejection.
TEST_F(DecodeSessionTest, OldPrefillerErrorOnRenewalCountsAsRejection) {
  std::vector<Transmit> out = AfterRenewalPass();
  ASSERT_EQ(out.size(), 1u);
  wire::PullResponse error = UnreadableIdError();
  error.id = std::get<wire::Renewal>(out[0].message).id;  // this P read the id
  s().OnPullResponse(out[0].endpoint, error, kT0 + 1ms);
  EXPECT_EQ(s().stats().renewals_rejected, 1u);
  s().OnTimeout(kT0 + 5s);
  EXPECT_TRUE(s().TakeMessages().empty()) << "renewals to it stop";
}

// Found in review: an ERROR with id 0 (P could not read the message's id) is attributed only
// when a single message is outstanding on that socket. An old P's id-0 ERROR to a renewal must
// never settle a pull that P may still be writing.
TEST_F(DecodeSessionTest, UnreadableIdErrorSettlesNothingWhenSeveralAreOutstanding) {
  std::vector<Transmit> out = AfterRenewalPass(/*with_load=*/true);
  ASSERT_EQ(out.size(), 2u);  // a pull and a renewal outstanding on one socket
  s().OnPullResponse(out[0].endpoint, UnreadableIdError(), kT0 + 1ms);
  EXPECT_TRUE(Done().empty()) << "an unattributable ERROR settled a pull";
  EXPECT_EQ(s().stats().receiving, 1u);
  EXPECT_EQ(s().stats().replies_unmatched, 1u);
}

TEST_F(DecodeSessionTest, UnreadableIdErrorToTheOnlyRenewalIsARejection) {
  std::vector<Transmit> out = AfterRenewalPass();
  ASSERT_EQ(out.size(), 1u);
  s().OnPullResponse(out[0].endpoint, UnreadableIdError(), kT0 + 1ms);
  EXPECT_EQ(s().stats().renewals_rejected, 1u);
}

// Found in review: a request whose blocks are still quarantined cannot start a second load
// (it would get a second ReceiveDone for the same id); nor can one the wire cannot carry.
TEST_F(DecodeSessionTest, LoadOfAQuarantinedOrOversizedRequestIsRefused) {
  ASSERT_EQ(TimedOutLoad("r1").size(), 1u);
  ASSERT_EQ(Done().size(), 1u);
  EXPECT_EQ(s().StartLoad("r1", Source("x-r1"), {2}, kT0 + 601s).code(), ErrorCode::kAlreadyExists);
  EXPECT_EQ(s().StartLoad(std::string(300, 'r'), Source("x2"), {3}, kT0).code(),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(s().StartLoad("r3", Source(std::string(300, 'x')), {3}, kT0).code(),
            ErrorCode::kInvalidArgument);
  EXPECT_TRUE(Done().empty());
}

// ---- Releases (wire::Release) and notices (wire::AbortNotice) ----

// The Release messages among `out` (with the endpoint each goes to).
std::vector<Transmit> ReleasesIn(std::vector<Transmit> out) {
  std::vector<Transmit> releases;
  for (Transmit& t : out) {
    if (std::holds_alternative<wire::Release>(t.message)) releases.push_back(std::move(t));
  }
  return releases;
}
const wire::Release& ReleaseOf(const Transmit& t) { return std::get<wire::Release>(t.message); }

wire::AbortNotice Notice(const core::TransferId& xfer, const std::string& engine = "p",
                         ErrorCode code = ErrorCode::kCancelled,
                         const std::string& reason = "engine aborted it") {
  wire::AbortNotice notice;
  notice.p_engine_id = engine;
  notice.p_tp_rank = 0;
  notice.aborted.push_back({xfer, code, reason});
  return notice;
}

std::vector<TransferAborted> AbortedIn(std::vector<DecodeEvent> events) {
  std::vector<TransferAborted> out;
  for (DecodeEvent& e : events) {
    if (auto* a = std::get_if<TransferAborted>(&e)) out.push_back(std::move(*a));
  }
  return out;
}

TEST_F(DecodeSessionTest, RequestFinishedBeforeItsLoadReleasesTheTransferAfterTheDelay) {
  DecodeSessionOptions o = Options();
  o.tp_size = 2;
  o.tp_rank = 1;
  o.release_delay = 2ms;
  Make(o);
  s().OnLookup(Engine("p"), kT0);
  s().OnNewRequest("r1", Source("x1"), kT0);
  s().RequestFinished("r1", kT0 + 1ms);
  EXPECT_TRUE(s().TakeMessages().empty()) << "batched for release_delay";
  EXPECT_EQ(s().NextDeadline(), kT0 + 3ms);
  s().OnTimeout(kT0 + 2ms);
  EXPECT_TRUE(s().TakeMessages().empty()) << "not due yet";
  s().OnTimeout(s().NextDeadline());
  std::vector<Transmit> out = s().TakeMessages();
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].address, "p/0");
  const wire::Release& release = ReleaseOf(out[0]);
  EXPECT_NE(release.id, 0u);
  EXPECT_EQ(release.d_engine_id, "d");
  EXPECT_EQ(release.d_tp_size, 2u);
  EXPECT_EQ(release.d_tp_rank, 1u);
  EXPECT_EQ(release.fingerprints, std::vector<core::Fingerprint>{core::FingerprintOf("x1")});
  EXPECT_TRUE(wire::Validate(release).ok());
  EXPECT_EQ(s().stats().release_messages, 1u);
  EXPECT_EQ(s().stats().releases_sent, 1u);
  // Once only.
  s().RequestFinished("r1", kT0 + 10ms);
  s().OnTimeout(kT0 + 20ms);
  EXPECT_TRUE(ReleasesIn(s().TakeMessages()).empty());
}

TEST_F(DecodeSessionTest, ReleaseGoesToEveryPrefillRankTheRequestPullsFrom) {
  DecodeSessionOptions o = Options();
  o.release_delay = 0ms;  // at once
  Make(o);
  s().OnLookup(Engine("p", 2), kT0);
  s().OnNewRequest("r1", Source("x1"), kT0);
  s().RequestFinished("r1", kT0);
  std::vector<Transmit> out = ReleasesIn(s().TakeMessages());
  ASSERT_EQ(out.size(), 2u) << "P TP2 -> D TP1: both P ranks hold the transfer";
  std::set<std::string> addresses;
  for (const Transmit& t : out) {
    addresses.insert(t.address);
    EXPECT_EQ(ReleaseOf(t).fingerprints, std::vector<core::Fingerprint>{core::FingerprintOf("x1")});
    EXPECT_EQ(ReleaseOf(t).d_tp_size, 1u);
  }
  EXPECT_EQ(addresses, (std::set<std::string>{"p/0", "p/1"}));
  EXPECT_EQ(s().stats().releases_sent, 2u) << "per P rank";
}

// Found by review: with release_delay 0, a load waiting for a refresh when its engine was declared
// down failed before the view was kept as the declared-down one, so its release, sent at once,
// found nowhere to go and was dropped; P kept the KV it had prefilled until its lease ran out.
TEST_F(DecodeSessionTest, AWaitingLoadFailedByADownIsReleasedToTheProcessDeclaredDownAtOnce) {
  DecodeSessionOptions o = Options();
  o.release_delay = 0ms;
  Make(o);
  s().OnLookup(Engine("p"), kT0);
  ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {1, 2}, kT0).ok());
  std::vector<Transmit> out = s().TakeMessages();
  ASSERT_EQ(out.size(), 1u);
  s().OnSendFailed(out[0].endpoint, std::get<wire::Pull>(out[0].message).id,
                   Status(ErrorCode::kUnavailable, "no connection"), kT0 + 3s);
  ASSERT_EQ(s().TakeLookups().size(), 1u) << "the load waits for a refresh";
  s().OnEngineDown("p", Status(ErrorCode::kUnavailable, "left etcd"), kT0 + 3s);
  std::vector<ReceiveDone> done = Done();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_FALSE(done[0].ok);
  std::vector<Transmit> releases = ReleasesIn(s().TakeMessages());
  ASSERT_EQ(releases.size(), 1u) << "dropped: " << s().stats().releases_dropped;
  EXPECT_EQ(releases[0].address, "p/0");
  EXPECT_EQ(ReleaseOf(releases[0]).fingerprints,
            std::vector<core::Fingerprint>{core::FingerprintOf("x1")});
  EXPECT_EQ(s().stats().releases_dropped, 0u);
}

// Found by review of the KnownEngines split: after a failed refresh, the loads that waited go to
// the known view; one that fails there at once (this rank cannot take head slices of a larger
// TP) is released while the view is still doubted, and that release must go with the others to
// the known view, not wait for yet another lookup.
TEST_F(DecodeSessionTest, AReleaseQueuedWhileAFailedRefreshSendsItsLoadsGoesToTheKnownViewAtOnce) {
  DecodeSessionOptions o = Options();
  o.release_delay = 0ms;
  o.head_slices = false;
  Make(o);
  s().OnLookup(Engine("p", 2), kT0);
  s().OnNewRequest("r0", Source("x0"), kT0);
  s().RequestFinished("r0", kT0);  // its release goes to both P ranks
  std::vector<Transmit> out = ReleasesIn(s().TakeMessages());
  ASSERT_EQ(out.size(), 2u);
  s().OnSendFailed(out[0].endpoint, ReleaseOf(out[0]).id,
                   Status(ErrorCode::kUnavailable, "no connection"), kT0 + 1s);  // view doubted
  ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {1}, kT0 + 1s).ok());
  EXPECT_TRUE(s().TakeMessages().empty()) << "the load waits for the refresh";
  std::vector<LookupRequest> lookups = s().TakeLookups();
  ASSERT_EQ(lookups.size(), 1u);
  s().OnLookupFailed("p", Status(ErrorCode::kUnavailable, "bootstrap down"), kT0 + 2s,
                     lookups[0].id);
  std::vector<ReceiveDone> done = Done();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_FALSE(done[0].ok) << "TP 2 to this rank needs head slices";
  std::vector<Transmit> releases = ReleasesIn(s().TakeMessages());
  ASSERT_EQ(releases.size(), 2u) << "x1's release waited for another lookup";
  for (const Transmit& t : releases) {
    EXPECT_EQ(ReleaseOf(t).fingerprints, std::vector<core::Fingerprint>{core::FingerprintOf("x1")});
  }
}

TEST_F(DecodeSessionTest, SeveralRequestsFinishedWithinTheDelayGoInOneRelease) {
  Make();
  s().OnLookup(Engine("p"), kT0);
  for (int i = 0; i < 3; ++i) {
    s().OnNewRequest("r" + std::to_string(i), Source("x" + std::to_string(i)), kT0);
  }
  s().RequestFinished("r0", kT0);
  s().RequestFinished("r1", kT0 + 1ms);
  s().RequestFinished("r2", kT0 + 2ms - 1us);
  EXPECT_EQ(s().NextDeadline(), kT0 + 2ms) << "the first release sets when the batch goes";
  s().OnTimeout(kT0 + 2ms);
  std::vector<Transmit> out = ReleasesIn(s().TakeMessages());
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(ReleaseOf(out[0]).fingerprints,
            (std::vector<core::Fingerprint>{core::FingerprintOf("x0"), core::FingerprintOf("x1"),
                                            core::FingerprintOf("x2")}));
  EXPECT_EQ(s().stats().release_messages, 1u);
  EXPECT_EQ(s().stats().releases_sent, 3u);
}

TEST_F(DecodeSessionTest, ReleaseAllSendsEveryTrackedTransfersReleaseAtOnceAndOnlyOnce) {
  Make();  // release_delay 2 ms: a stopping engine has no later pass to send a batch
  s().OnLookup(Engine("p"), kT0);
  for (int i = 0; i < 3; ++i) {
    s().OnNewRequest("r" + std::to_string(i), Source("x" + std::to_string(i)), kT0);
  }
  s().RequestFinished("r0", kT0);  // already finished: released by the same message
  s().ReleaseAll(kT0 + 1us);
  std::vector<Transmit> out = ReleasesIn(s().TakeMessages());
  ASSERT_EQ(out.size(), 1u);
  std::vector<core::Fingerprint> released = ReleaseOf(out[0]).fingerprints;
  std::sort(released.begin(), released.end());
  std::vector<core::Fingerprint> expected = {core::FingerprintOf("x0"), core::FingerprintOf("x1"),
                                             core::FingerprintOf("x2")};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(released, expected);
  EXPECT_EQ(s().stats().releases_sent, 3u);
  s().ReleaseAll(kT0 + 1ms);
  s().RequestFinished("r1", kT0 + 1ms);
  s().OnTimeout(kT0 + 10ms);
  EXPECT_TRUE(ReleasesIn(s().TakeMessages()).empty()) << "nothing is tracked any more";
}

// A P restarted on a new side channel without a registry: D's pull goes to the old address and
// never leaves. Nothing can have been written, so the load is looked up again and sent to
// where the engine is now — once (measured in the real-vLLM tier: every first request after
// such a restart failed until this). A second pull that never leaves fails the load, plainly.
// A release to a P that is gone waits 2 s for its reply, its send 3 s for a connection: with
// no idle endpoint kept, the endpoint closes in between. The unsent report that comes after
// still marks the address stale, so the next load looks the engine up instead of pulling from
// the dead process (found by the simulator: max_idle_endpoints 0, a P restarted on new ports).
TEST_F(DecodeSessionTest, AnUnsentReportForAnEndpointClosedMeanwhileStillMarksItsAddressStale) {
  DecodeSessionOptions o = Options();
  o.max_idle_endpoints = 0;
  Make(o);
  s().OnLookup(Engine("p", 1, "first"), kT0);
  s().OnNewRequest("r1", Source("x1"), kT0);
  s().RequestFinished("r1", kT0);
  s().OnTimeout(kT0 + 2ms);  // the release's batching delay
  std::vector<Transmit> out = ReleasesIn(s().TakeMessages());
  ASSERT_EQ(out.size(), 1u);
  s().OnTimeout(kT0 + 2s + 10ms);  // no reply: the release's wait ends, the endpoint is idle
  ASSERT_EQ(s().TakeClosedEndpoints(), std::vector<EndpointId>{out[0].endpoint});
  s().OnSendFailed(out[0].endpoint, ReleaseOf(out[0]).id,
                   Status(ErrorCode::kUnavailable, "no connection within 3000 ms"), kT0 + 3s);
  (void)s().TakeLookups();
  ASSERT_TRUE(s().StartLoad("r2", Source("x2"), {2}, kT0 + 4s).ok());
  EXPECT_TRUE(s().TakeMessages().empty()) << "a pull went to the dead address";
  std::vector<LookupRequest> lookups = s().TakeLookups();
  ASSERT_EQ(lookups.size(), 1u);
  s().OnLookup(PeerEngine{"p", "second", 1, {"p/new-port"}, wire::kProtocolFeatures}, kT0 + 4s,
               lookups[0].id);
  out = s().TakeMessages();
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].address, "p/new-port");
}

// The engine finishes the request (a client abort) while its retried load waits for the fresh
// lookup: as for a first load waiting for one, the load goes on and ends exactly once (the
// engine frees its blocks then), and the transfer's release goes to the process the lookup
// found, not to the dead address.
TEST_F(DecodeSessionTest, ARequestFinishedWhileItsRetriedLoadWaitsForTheLookupEndsOnce) {
  Make();
  s().OnLookup(Engine("p"), kT0);
  s().OnNewRequest("r1", Source("x1"), kT0);
  ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {1, 2}, kT0).ok());
  std::vector<Transmit> out = s().TakeMessages();
  ASSERT_EQ(out.size(), 1u);
  s().OnSendFailed(out[0].endpoint, std::get<wire::Pull>(out[0].message).id,
                   Status(ErrorCode::kUnavailable, "no connection"), kT0 + 3s);
  std::vector<LookupRequest> lookups = s().TakeLookups();
  ASSERT_EQ(lookups.size(), 1u);
  ASSERT_EQ(s().stats().loads_retried, 1u);

  s().RequestFinished("r1", kT0 + 3s + 1ms);
  EXPECT_TRUE(Done().empty()) << "the load waits for its lookup, as a first load does";
  EXPECT_TRUE(s().TakeMessages().empty()) << "nothing goes to the dead address";
  s().OnLookup(PeerEngine{"p", "2", 1, {"p-new/0"}, wire::kProtocolFeatures}, kT0 + 3s + 2ms,
               lookups[0].id);
  s().OnTimeout(kT0 + 3s + 10ms);  // the release's batching delay
  out = s().TakeMessages();
  std::vector<Transmit> pulls;
  for (const Transmit& t : out) {
    EXPECT_EQ(t.address, "p-new/0");
    if (std::holds_alternative<wire::Pull>(t.message)) pulls.push_back(t);
  }
  ASSERT_EQ(pulls.size(), 1u);
  std::vector<Transmit> releases = ReleasesIn(out);
  ASSERT_EQ(releases.size(), 1u);
  EXPECT_EQ(ReleaseOf(releases[0]).fingerprints,
            std::vector<core::Fingerprint>{core::FingerprintOf("x1")});
  const wire::Pull& pull = std::get<wire::Pull>(pulls[0].message);
  s().OnSent(pulls[0].endpoint, pull.id, kT0 + 3s + 11ms);
  s().OnPullResponse(pulls[0].endpoint, Finish(pull.id, {"r1"}), kT0 + 3s + 20ms);
  std::vector<ReceiveDone> done = Done();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].request, "r1");
  EXPECT_EQ(s().stats().receiving, 0u);
  EXPECT_EQ(s().stats().quarantined_blocks, 0u);
  EXPECT_EQ(s().stats().loads_retried, 1u);
  s().OnTimeout(kT0 + 10s);
  EXPECT_TRUE(Done().empty()) << "ended once";
}

TEST_F(DecodeSessionTest, ALoadWhoseOnlyPullNeverLeftIsLookedUpAgainAndSentOnce) {
  for (const bool successor : {true, false}) {
    SCOPED_TRACE(successor ? "the engine lives at a new side channel" : "it is gone");
    Make();
    s().OnLookup(Engine("p"), kT0);
    ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {1, 2}, kT0).ok());
    std::vector<Transmit> out = s().TakeMessages();
    ASSERT_EQ(out.size(), 1u);
    s().OnSendFailed(out[0].endpoint, std::get<wire::Pull>(out[0].message).id,
                     Status(ErrorCode::kUnavailable, "no connection"), kT0 + 3s);
    EXPECT_TRUE(Done().empty()) << "not failed: looked up again";
    std::vector<LookupRequest> lookups = s().TakeLookups();
    ASSERT_EQ(lookups.size(), 1u);
    EXPECT_EQ(s().stats().loads_retried, 1u);
    EXPECT_EQ(s().stats().quarantined_blocks, 0u);
    const std::string address = successor ? "p-new/0" : "p/0";
    s().OnLookup(PeerEngine{"p", successor ? "2" : "1", 1, {address}, wire::kProtocolFeatures},
                 kT0 + 3s + 1ms, lookups[0].id);
    out = s().TakeMessages();
    ASSERT_EQ(out.size(), 1u);
    EXPECT_EQ(out[0].address, address);
    const wire::Pull& pull = std::get<wire::Pull>(out[0].message);
    EXPECT_EQ(pull.requests[0].block_ids, (std::vector<core::BlockId>{1, 2}));
    if (successor) {
      s().OnSent(out[0].endpoint, pull.id, kT0 + 3s + 2ms);
      s().OnPullResponse(out[0].endpoint, Finish(pull.id, {"r1"}), kT0 + 3s + 5ms);
      std::vector<ReceiveDone> done = Done();
      ASSERT_EQ(done.size(), 1u);
      EXPECT_TRUE(done[0].ok) << done[0].error.ToString();
    } else {
      s().OnSendFailed(out[0].endpoint, pull.id, Status(ErrorCode::kUnavailable, "no connection"),
                       kT0 + 6s);
      std::vector<ReceiveDone> done = Done();
      ASSERT_EQ(done.size(), 1u);
      EXPECT_FALSE(done[0].ok);
      EXPECT_FALSE(done[0].quarantined);
      EXPECT_NE(done[0].error.message().find("not sent"), std::string::npos)
          << done[0].error.ToString();
      EXPECT_EQ(s().stats().loads_retried, 1u) << "once";
    }
  }
}

// A pull that left is never sent again, whatever happens to it next: P may be writing for it.
TEST_F(DecodeSessionTest, APullThatLeftIsNeverSentAgain) {
  Make();
  s().OnLookup(Engine("p"), kT0);
  ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {1}, kT0).ok());
  std::vector<Transmit> out = s().TakeMessages();
  ASSERT_EQ(out.size(), 1u);
  const std::uint64_t id = std::get<wire::Pull>(out[0].message).id;
  s().OnSent(out[0].endpoint, id, kT0 + 1ms);
  s().OnSendFailed(out[0].endpoint, id, Status(ErrorCode::kUnavailable, "broken"), kT0 + 2ms);
  EXPECT_EQ(s().stats().loads_retried, 0u);
  std::vector<ReceiveDone> done = Done();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_FALSE(done[0].ok);
}

// A pull that timed out makes D doubt its view of the engine (it may have restarted on a new
// side channel): a release due then waits for a fresh lookup and goes where it finds the
// engine — the successor, which may hold the KV — or, if the lookup fails, to the old view.
TEST_F(DecodeSessionTest, AReleaseDueWhileTheViewIsStaleGoesWhereAFreshLookupFindsTheEngine) {
  for (const bool lookup_answers : {true, false}) {
    SCOPED_TRACE(lookup_answers ? "the lookup finds a successor" : "the lookup fails");
    Make();
    s().OnLookup(Engine("p"), kT0);
    ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {1}, kT0).ok());
    ASSERT_EQ(Pulls().size(), 1u);
    const TimePoint timed_out = kT0 + s().options().pull_timeout;
    s().OnTimeout(timed_out);
    ASSERT_EQ(Done().size(), 1u);  // r1 failed at its deadline: the view is stale now
    s().OnNewRequest("r2", Source("x2"), timed_out);
    s().RequestFinished("r2", timed_out);
    s().OnTimeout(timed_out + 2ms);
    EXPECT_TRUE(ReleasesIn(s().TakeMessages()).empty()) << "it waits for the lookup";
    std::vector<LookupRequest> lookups = s().TakeLookups();
    ASSERT_EQ(lookups.size(), 1u);
    if (lookup_answers) {
      s().OnLookup(PeerEngine{"p", "2", 1, {"p-new/0"}, wire::kProtocolFeatures},
                   timed_out + 3ms, lookups[0].id);
    } else {
      s().OnLookupFailed("p", Status(ErrorCode::kUnavailable, "bootstrap down"), timed_out + 3ms,
                         lookups[0].id);
    }
    std::vector<Transmit> out = ReleasesIn(s().TakeMessages());
    ASSERT_EQ(out.size(), 1u);
    EXPECT_EQ(out[0].address, lookup_answers ? "p-new/0" : "p/0");
    // x2, and x1, whose load D gave up on at its deadline.
    std::vector<core::Fingerprint> released = ReleaseOf(out[0]).fingerprints;
    std::sort(released.begin(), released.end());
    std::vector<core::Fingerprint> expected = {core::FingerprintOf("x1"),
                                               core::FingerprintOf("x2")};
    std::sort(expected.begin(), expected.end());
    EXPECT_EQ(released, expected);
  }
}

TEST_F(DecodeSessionTest, ReleaseBeforeAnyLookupWaitsForTheLookup) {
  Make();
  s().OnNewRequest("r1", Source("x1"), kT0);
  s().RequestFinished("r1", kT0);
  s().OnTimeout(kT0 + 2ms);
  EXPECT_TRUE(s().TakeMessages().empty());
  std::vector<LookupRequest> lookups = s().TakeLookups();
  ASSERT_EQ(lookups.size(), 1u);
  EXPECT_EQ(lookups[0].engine_id, "p");
  s().OnLookup(Engine("p"), kT0 + 3ms);
  std::vector<Transmit> out = ReleasesIn(s().TakeMessages());
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(ReleaseOf(out[0]).fingerprints,
            std::vector<core::Fingerprint>{core::FingerprintOf("x1")});
}

TEST_F(DecodeSessionTest, SuccessfulReceiveReleasesNothing) {
  Make();
  s().OnLookup(Engine("p"), kT0);
  s().OnNewRequest("r1", Source("x1"), kT0);
  ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {1}, kT0).ok());
  std::vector<wire::Pull> pulls = Pulls();
  ASSERT_EQ(pulls.size(), 1u);
  s().OnPullResponse(last_endpoints_[0], Finish(pulls[0].id, {"r1"}), kT0 + 1ms);
  ASSERT_EQ(Done().size(), 1u);
  s().RequestFinished("r1", kT0 + 2ms);
  s().OnTimeout(kT0 + 10ms);
  EXPECT_TRUE(s().TakeMessages().empty()) << "P freed it when the write landed";
  EXPECT_EQ(s().stats().release_messages, 0u);
  EXPECT_EQ(s().NextDeadline(), core::kNever) << "nothing left to send or await";
}

TEST_F(DecodeSessionTest, FailedReceiveReleasesTheTransferOnce) {
  Make();
  s().OnLookup(Engine("p"), kT0);
  ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {1}, kT0).ok());
  std::vector<wire::Pull> pulls = Pulls();
  ASSERT_EQ(pulls.size(), 1u);
  s().OnPullResponse(last_endpoints_[0],
                     Finish(pulls[0].id, {}, {{"r1", ErrorCode::kUnavailable, "write failed"}}),
                     kT0 + 1ms);
  std::vector<ReceiveDone> done = Done();
  ASSERT_EQ(done.size(), 1u);
  ASSERT_FALSE(done[0].ok);
  s().OnTimeout(kT0 + 3ms);
  std::vector<Transmit> out = ReleasesIn(s().TakeMessages());
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].address, "p/0");
  EXPECT_EQ(ReleaseOf(out[0]).fingerprints,
            std::vector<core::Fingerprint>{core::FingerprintOf("x1")});
  // The engine then finishes the request: nothing more.
  s().RequestFinished("r1", kT0 + 4ms);
  s().OnTimeout(kT0 + 10ms);
  EXPECT_TRUE(ReleasesIn(s().TakeMessages()).empty());
  EXPECT_EQ(s().stats().releases_sent, 1u);
}

TEST_F(DecodeSessionTest, ReleasesAreSentWithTheLeaseOff) {
  Make(Options(/*lease=*/0s));
  s().OnLookup(Engine("p"), kT0);
  s().OnNewRequest("r1", Source("x1"), kT0);
  EXPECT_EQ(s().stats().tracked, 0u) << "nothing to renew without a lease";
  s().OnTimeout(kT0 + 10s);
  EXPECT_TRUE(s().TakeMessages().empty()) << "no renewals";
  s().RequestFinished("r1", kT0 + 10s);
  ASSERT_EQ(s().NextDeadline(), kT0 + 10s + 2ms);
  s().OnTimeout(s().NextDeadline());
  std::vector<Transmit> out = s().TakeMessages();
  ASSERT_EQ(out.size(), 1u);
  ASSERT_TRUE(std::holds_alternative<wire::Release>(out[0].message));
  EXPECT_EQ(ReleaseOf(out[0]).fingerprints,
            std::vector<core::Fingerprint>{core::FingerprintOf("x1")});
}

TEST_F(DecodeSessionTest, NoReleasesWhenTheyAreSwitchedOff) {
  DecodeSessionOptions o = Options();
  o.send_releases = false;
  Make(o);
  s().OnLookup(Engine("p"), kT0);
  s().OnNewRequest("r1", Source("x1"), kT0);
  s().RequestFinished("r1", kT0);
  s().OnTimeout(kT0 + 1s);
  EXPECT_TRUE(s().TakeMessages().empty());
  EXPECT_EQ(s().stats().releases_sent, 0u);
}

TEST_F(DecodeSessionTest, ErrorAnsweringAReleaseMarksTheEngineWithoutReleases) {
  Make();
  s().OnLookup(Engine("p"), kT0);
  s().OnNewRequest("r1", Source("x1"), kT0);
  s().OnNewRequest("r2", Source("x2"), kT0);
  s().OnNewRequest("r3", Source("x3"), kT0);
  s().RequestFinished("r1", kT0);
  s().OnTimeout(kT0 + 2ms);
  s().RequestFinished("r2", kT0 + 2ms);
  s().OnTimeout(kT0 + 4ms);
  std::vector<Transmit> out = ReleasesIn(s().TakeMessages());
  ASSERT_EQ(out.size(), 2u);
  // An old P cannot dispatch type 5 and answers ERROR with the message's id.
  wire::PullResponse error = UnreadableIdError();
  error.message = "unknown message type 5";
  error.id = ReleaseOf(out[0]).id;
  s().OnPullResponse(out[0].endpoint, error, kT0 + 5ms);
  error.id = ReleaseOf(out[1]).id;
  s().OnPullResponse(out[1].endpoint, error, kT0 + 5ms);
  int warnings = 0;
  for (const DecodeEvent& e : s().TakeEvents()) {
    const auto* w = std::get_if<Warning>(&e);
    ASSERT_NE(w, nullptr);
    EXPECT_EQ(w->kind, Warning::Kind::kNoRelease);
    EXPECT_NE(w->text.find("p"), std::string::npos);
    ++warnings;
  }
  EXPECT_EQ(warnings, 1) << "once per engine";
  EXPECT_EQ(s().stats().release_failures, 2u);
  EXPECT_EQ(s().stats().replies_unmatched, 0u);
  s().RequestFinished("r3", kT0 + 6ms);
  s().OnTimeout(kT0 + 1s);
  EXPECT_TRUE(ReleasesIn(s().TakeMessages()).empty());
  EXPECT_EQ(s().stats().releases_dropped, 1u);
}

TEST_F(DecodeSessionTest, UnreadableIdErrorToTheOnlyReleaseMarksTheEngineWithoutReleases) {
  Make();
  s().OnLookup(Engine("p"), kT0);
  s().OnNewRequest("r1", Source("x1"), kT0);
  s().OnNewRequest("r2", Source("x2"), kT0);
  s().RequestFinished("r1", kT0);
  s().OnTimeout(kT0 + 2ms);
  std::vector<Transmit> out = ReleasesIn(s().TakeMessages());
  ASSERT_EQ(out.size(), 1u);
  s().OnPullResponse(out[0].endpoint, UnreadableIdError(), kT0 + 3ms);  // id 0
  std::vector<DecodeEvent> events = s().TakeEvents();
  ASSERT_EQ(events.size(), 1u);
  ASSERT_TRUE(std::holds_alternative<Warning>(events[0]));
  EXPECT_EQ(std::get<Warning>(events[0]).kind, Warning::Kind::kNoRelease);
  s().RequestFinished("r2", kT0 + 4ms);
  s().OnTimeout(kT0 + 1s);
  EXPECT_TRUE(s().TakeMessages().empty());
  EXPECT_EQ(s().stats().releases_dropped, 1u);
}

// An engine that does not advertise releases (a P built before them) gets none: it could only
// answer with an ERROR that carries no id.
TEST_F(DecodeSessionTest, ReleasesGoOnlyToEnginesThatAdvertiseThem) {
  Make();
  PeerEngine old = Engine("p");
  old.features = 0;
  s().OnLookup(old, kT0);
  s().OnNewRequest("r1", Source("x1"), kT0);
  s().RequestFinished("r1", kT0);
  s().OnTimeout(kT0 + 1s);
  EXPECT_TRUE(ReleasesIn(s().TakeMessages()).empty());
  EXPECT_EQ(s().stats().releases_dropped, 1u);
  EXPECT_EQ(s().stats().release_messages, 0u);
}

// "unknown message type N" answers a message P could not dispatch, never a pull: it settles no
// pull even when the pull is the only message outstanding, or when it names the pull's id.
TEST_F(DecodeSessionTest, UnknownTypeErrorNeverSettlesAPull) {
  Make();
  s().OnLookup(Engine("p"), kT0);
  ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {1, 2}, kT0).ok());
  std::vector<wire::Pull> pulls = Pulls();
  ASSERT_EQ(pulls.size(), 1u);
  wire::PullResponse error;
  error.status = wire::PullStatus::kError;
  error.code = ErrorCode::kProtocol;
  error.message = "unknown message type 5";
  s().OnPullResponse(last_endpoints_[0], error, kT0 + 1ms);  // id 0, one pull outstanding
  error.id = pulls[0].id;
  s().OnPullResponse(last_endpoints_[0], error, kT0 + 2ms);
  EXPECT_TRUE(Done().empty()) << "a refusal of another message settled the pull";
  EXPECT_EQ(s().stats().replies_unmatched, 2u);
  // The pull's own answer still settles it.
  s().OnPullResponse(last_endpoints_[0], Finish(pulls[0].id, {"r1"}), kT0 + 3ms);
  std::vector<ReceiveDone> done = Done();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_TRUE(done[0].ok);
}

// With P TP2 -> D TP1 the request pulls from two P ranks: a notice from one of them releases it
// on the other, which may still hold its KV.
TEST_F(DecodeSessionTest, NoticeFromOnePrefillRankReleasesItOnTheOthers) {
  Make(Options(30s));
  s().OnNewRequest("r1", Source("x1"), kT0);
  s().OnLookup(Engine("p", 2), kT0);
  s().OnTimeout(kT0);
  EndpointId rank0 = 0;
  bool found = false;
  for (const Transmit& t : s().TakeMessages()) {
    if (t.address == "p/0") {
      rank0 = t.endpoint;
      found = true;
    }
  }
  ASSERT_TRUE(found);
  s().OnAbortNotice(rank0, Notice("x1"), kT0 + 1s);
  ASSERT_EQ(AbortedIn(s().TakeEvents()).size(), 1u);
  s().OnTimeout(kT0 + 1s + 2ms);
  std::vector<std::string> to;
  for (const Transmit& t : ReleasesIn(s().TakeMessages())) to.push_back(t.address);
  std::sort(to.begin(), to.end());
  EXPECT_EQ(to, (std::vector<std::string>{"p/0", "p/1"}));
}

// Two requests naming one transfer (a router that sent it twice): the transfer is still wanted
// while either is tracked, so neither its renewals nor a release stop at the first one's end.
TEST_F(DecodeSessionTest, FinishingOneOfTwoRequestsOfATransferReleasesNothing) {
  Make(Options(30s));
  s().OnLookup(Engine("p"), kT0);
  s().OnNewRequest("r1", Source("x1"), kT0);
  s().OnNewRequest("r2", Source("x1"), kT0);
  s().RequestFinished("r1", kT0);
  s().OnTimeout(kT0 + 1s);
  std::vector<Transmit> out = s().TakeMessages();
  EXPECT_TRUE(ReleasesIn(out).empty());
  EXPECT_EQ(s().stats().tracked, 1u) << "x1 is still renewed for r2";
  s().RequestFinished("r2", kT0 + 2s);
  s().OnTimeout(kT0 + 3s);
  EXPECT_EQ(ReleasesIn(s().TakeMessages()).size(), 1u);
  EXPECT_EQ(s().stats().tracked, 0u) << "renewals end with the last request of the transfer";
}

// The same when only the first request registered the transfer for renewals (the second came
// through StartLoad alone): the transfer's renewals still end with its last request.
TEST_F(DecodeSessionTest, RenewalsOfASharedTransferEndWithItsLastRequest) {
  Make(Options(30s));
  s().OnLookup(Engine("p"), kT0);
  s().OnNewRequest("r1", Source("x1"), kT0);
  ASSERT_TRUE(s().StartLoad("r2", Source("x1"), {1}, kT0).ok());
  s().RequestFinished("r1", kT0);
  EXPECT_EQ(s().stats().tracked, 1u);
  for (wire::Pull& pull : Pulls()) {
    s().OnPullResponse(last_endpoints_.back(), Finish(pull.id, {"r2"}), kT0 + 1ms);
  }
  EXPECT_EQ(s().stats().tracked, 0u);
}

// A fresh D refuses a request naming an engine it never paired with: P prefilled its copy all
// the same, so the engine is looked up once and told; the lookup is shared with what else
// waits for it.
TEST_F(DecodeSessionTest, ReleaseTransferOfAnUnknownEngineLooksItUpAndReleases) {
  Make();
  s().ReleaseTransfer(Source("x1", "stranger"), kT0);
  s().ReleaseTransfer(Source("x2", "stranger"), kT0);
  s().OnTimeout(kT0 + 1s);
  std::vector<LookupRequest> lookups = s().TakeLookups();
  ASSERT_EQ(lookups.size(), 1u);
  EXPECT_EQ(lookups[0].engine_id, "stranger");
  EXPECT_EQ(lookups[0].bootstrap_address, "stranger:8998");
  EXPECT_TRUE(s().TakeMessages().empty());
  s().OnLookup(Engine("stranger"), kT0 + 1s, lookups[0].id);
  std::vector<Transmit> out = ReleasesIn(s().TakeMessages());
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(std::get<wire::Release>(out[0].message).fingerprints.size(), 2u);
  // Of a known engine it releases without a lookup.
  s().ReleaseTransfer(Source("x3", "stranger"), kT0 + 2s);
  s().OnTimeout(kT0 + 3s);
  EXPECT_TRUE(s().TakeLookups().empty());
  EXPECT_EQ(ReleasesIn(s().TakeMessages()).size(), 1u);
}

// The attacker's test: refusals cost a client nothing, so the engines they introduce are capped
// and forgotten once their lookups failed; nothing is released twice.
TEST_F(DecodeSessionTest, RefusalsNamingManyUnknownEnginesAddBoundedStateThatIsForgotten) {
  Make();
  for (int i = 0; i < 5000; ++i) {
    s().ReleaseTransfer(Source("x" + std::to_string(i), "stranger-" + std::to_string(i)), kT0);
  }
  s().OnTimeout(kT0 + 2ms);  // the release delay
  std::vector<LookupRequest> lookups = s().TakeLookups();
  EXPECT_EQ(lookups.size(), 1024u);
  EXPECT_EQ(s().stats().engines_known, 1024u);
  EXPECT_EQ(s().stats().releases_dropped, 5000u - 1024u);
  for (const LookupRequest& l : lookups) {
    s().OnLookupFailed(l.engine_id, Status(ErrorCode::kUnavailable, "refused"), kT0 + 1s, l.id);
  }
  s().OnTimeout(kT0 + 20s);
  EXPECT_EQ(s().stats().engines_known, 0u);
  EXPECT_TRUE(s().TakeMessages().empty());
}

TEST_F(DecodeSessionTest, ReleaseReplyCountsLandInTheStats) {
  Make();
  s().OnLookup(Engine("p"), kT0);
  for (int i = 0; i < 6; ++i) {
    s().OnNewRequest("r" + std::to_string(i), Source("x" + std::to_string(i)), kT0);
  }
  s().RequestFinished("r0", kT0);
  s().OnTimeout(kT0 + 2ms);
  std::vector<Transmit> out = ReleasesIn(s().TakeMessages());
  ASSERT_EQ(out.size(), 1u);
  wire::ReleaseReply reply;
  reply.id = ReleaseOf(out[0]).id;
  reply.status = wire::ReleaseStatus::kAccepted;
  reply.released = 3;
  reply.kept = 2;
  reply.unknown = 1;
  s().OnMessage(out[0].endpoint, wire::Encode(reply), kT0 + 3ms);  // through the codec
  DecodeStats stats = s().stats();
  EXPECT_EQ(stats.p_released, 3u);
  EXPECT_EQ(stats.p_kept, 2u);
  EXPECT_EQ(stats.p_unknown, 1u);
  EXPECT_EQ(stats.release_failures, 0u);
  // A second copy answers nothing outstanding.
  s().OnReleaseReply(out[0].endpoint, reply, kT0 + 4ms);
  EXPECT_EQ(s().stats().p_released, 3u);
  EXPECT_EQ(s().stats().replies_unmatched, 1u);
  // An unanswered release counts as failed at its reply deadline, once.
  s().RequestFinished("r1", kT0 + 5ms);
  s().OnTimeout(kT0 + 7ms);
  ASSERT_EQ(ReleasesIn(s().TakeMessages()).size(), 1u);
  s().OnTimeout(kT0 + 7ms + 2s);
  EXPECT_EQ(s().stats().release_failures, 1u);
  s().OnTimeout(kT0 + 10s);
  EXPECT_EQ(s().stats().release_failures, 1u);
}

TEST_F(DecodeSessionTest, AbortNoticeFailsAQueuedRequestWithPsReasonAndReleasesItOnce) {
  std::vector<Transmit> out = AfterRenewalPass();
  ASSERT_EQ(out.size(), 1u);
  const wire::Renewal& renewal = std::get<wire::Renewal>(out[0].message);
  EXPECT_TRUE(renewal.accepts_notices);
  const EndpointId endpoint = out[0].endpoint;
  s().OnMessage(endpoint,
                wire::Encode(Notice("x1", "p", ErrorCode::kCancelled, "the engine aborted it")),
                kT0 + 1s);
  std::vector<TransferAborted> aborted = AbortedIn(s().TakeEvents());
  ASSERT_EQ(aborted.size(), 1u);
  EXPECT_EQ(aborted[0].request, "r1");
  EXPECT_EQ(aborted[0].error.code(), ErrorCode::kCancelled);
  EXPECT_NE(aborted[0].error.message().find("the engine aborted it"), std::string::npos)
      << aborted[0].error.message();
  DecodeStats stats = s().stats();
  EXPECT_EQ(stats.notices_received, 1u);
  EXPECT_EQ(stats.transfers_aborted, 1u);
  EXPECT_EQ(stats.notices_ignored, 0u);
  EXPECT_EQ(stats.tracked, 0u) << "no more renewals for it";
  // Released to every P rank it pulls from (with P TP > D TP the other ranks may still hold
  // it; the rank that sent the notice ignores it), once: the engine's finish adds nothing.
  s().OnTimeout(kT0 + 1s + 2ms);
  EXPECT_EQ(ReleasesIn(s().TakeMessages()).size(), 1u);
  s().RequestFinished("r1", kT0 + 2s);
  s().OnTimeout(kT0 + 3s);
  EXPECT_TRUE(ReleasesIn(s().TakeMessages()).empty());
  EXPECT_EQ(s().stats().release_messages, 1u);
  // A repeated notice changes nothing.
  s().OnAbortNotice(endpoint, Notice("x1"), kT0 + 4s);
  EXPECT_TRUE(AbortedIn(s().TakeEvents()).empty());
  EXPECT_EQ(s().stats().notices_ignored, 1u);
}

TEST_F(DecodeSessionTest, AbortNoticeKeepsPsErrorCode) {
  std::vector<Transmit> out = AfterRenewalPass();
  ASSERT_EQ(out.size(), 1u);
  s().OnAbortNotice(out[0].endpoint,
                    Notice("x1", "p", ErrorCode::kLeaseMismatch, "decoder has 20s, P has 30s"),
                    kT0 + 1s);
  std::vector<TransferAborted> aborted = AbortedIn(s().TakeEvents());
  ASSERT_EQ(aborted.size(), 1u);
  EXPECT_EQ(aborted[0].error.code(), ErrorCode::kLeaseMismatch);
}

TEST_F(DecodeSessionTest, AbortNoticeForALoadingRequestChangesNothing) {
  std::vector<Transmit> out = AfterRenewalPass(/*with_load=*/true);
  ASSERT_EQ(out.size(), 2u);
  const wire::Pull* pull = nullptr;
  EndpointId endpoint = 0;
  for (const Transmit& t : out) {
    if (const auto* p = std::get_if<wire::Pull>(&t.message)) {
      pull = p;
      endpoint = t.endpoint;
    }
  }
  ASSERT_NE(pull, nullptr);
  s().OnAbortNotice(endpoint, Notice("x1"), kT0 + 1s);
  EXPECT_TRUE(s().TakeEvents().empty()) << "its pull's answer settles it";
  EXPECT_EQ(s().stats().transfers_aborted, 0u);
  EXPECT_EQ(s().stats().receiving, 1u);
  // The pull's answer still settles it (here: ok), and nothing is released.
  s().OnPullResponse(endpoint, Finish(pull->id, {"r1"}), kT0 + 2s);
  std::vector<ReceiveDone> done = Done();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_TRUE(done[0].ok);
  s().OnTimeout(kT0 + 3s);
  EXPECT_TRUE(ReleasesIn(s().TakeMessages()).empty());
}

TEST_F(DecodeSessionTest, AbortNoticeFromAnotherEnginesEndpointIsIgnored) {
  Make(Options(30s));
  s().OnNewRequest("r1", Source("x1", "p"), kT0);
  s().OnNewRequest("r2", Source("x2", "q"), kT0);
  s().OnLookup(Engine("p"), kT0);
  s().OnLookup(Engine("q"), kT0);
  s().OnTimeout(kT0);
  std::map<std::string, EndpointId> endpoint;
  for (const Transmit& t : s().TakeMessages()) endpoint[t.address] = t.endpoint;
  ASSERT_EQ(endpoint.size(), 2u);
  // Engine q's socket names r1's transfer, as q and as p: neither may fail r1.
  s().OnAbortNotice(endpoint.at("q/0"), Notice("x1", "q"), kT0 + 1s);
  s().OnAbortNotice(endpoint.at("q/0"), Notice("x1", "p"), kT0 + 1s);
  // p's own socket under another engine's name: ignored too.
  s().OnAbortNotice(endpoint.at("p/0"), Notice("x1", "q"), kT0 + 1s);
  // An endpoint the session never made, and a transfer nobody tracks.
  s().OnAbortNotice(999, Notice("x1", "p"), kT0 + 1s);
  s().OnAbortNotice(endpoint.at("p/0"), Notice("x-unknown", "p"), kT0 + 1s);
  EXPECT_TRUE(s().TakeEvents().empty());
  DecodeStats stats = s().stats();
  EXPECT_EQ(stats.notices_received, 5u);
  EXPECT_EQ(stats.notices_ignored, 5u);
  EXPECT_EQ(stats.transfers_aborted, 0u);
  EXPECT_EQ(stats.tracked, 2u);
  // The real one still works.
  s().OnAbortNotice(endpoint.at("p/0"), Notice("x1", "p"), kT0 + 2s);
  std::vector<TransferAborted> aborted = AbortedIn(s().TakeEvents());
  ASSERT_EQ(aborted.size(), 1u);
  EXPECT_EQ(aborted[0].request, "r1");
}

TEST_F(DecodeSessionTest, UndecodableOrUnexpectedMessagesAreCountedAndChangeNothing) {
  std::vector<Transmit> out = AfterRenewalPass(/*with_load=*/true);
  ASSERT_EQ(out.size(), 2u);
  const EndpointId endpoint = out[0].endpoint;
  const std::vector<std::uint8_t> garbage = {0xc1, 0x00, 0xff};
  s().OnMessage(endpoint, garbage, kT0 + 1ms);
  s().OnMessage(endpoint, {}, kT0 + 1ms);
  // A D -> P message type arriving at D.
  s().OnMessage(endpoint, wire::Encode(std::get<wire::Renewal>(out[1].message)), kT0 + 1ms);
  // An AbortNotice without entries is a decode error.
  wire::AbortNotice empty = Notice("x1");
  empty.aborted.clear();
  s().OnMessage(endpoint, wire::Encode(empty), kT0 + 1ms);
  EXPECT_EQ(s().stats().undecodable, 4u);
  EXPECT_EQ(s().stats().notices_received, 0u);
  EXPECT_TRUE(s().TakeEvents().empty());
  EXPECT_EQ(s().stats().receiving, 1u);
  EXPECT_EQ(s().stats().tracked, 1u);
}

TEST_F(DecodeSessionTest, ReleaseTransferOfATransferATrackedRequestUsesSendsNothing) {
  Make();
  s().OnLookup(Engine("p"), kT0);
  s().OnNewRequest("r1", Source("x1"), kT0);
  s().ReleaseTransfer(Source("x1"), kT0);
  s().OnTimeout(kT0 + 10ms);
  EXPECT_TRUE(s().TakeMessages().empty()) << "r1 still needs x1";
  // A transfer the engine refused and nothing tracks is released.
  s().ReleaseTransfer(Source("x2"), kT0 + 10ms);
  s().OnTimeout(kT0 + 20ms);
  std::vector<Transmit> out = ReleasesIn(s().TakeMessages());
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(ReleaseOf(out[0]).fingerprints,
            std::vector<core::Fingerprint>{core::FingerprintOf("x2")});
  // And r1's own release still goes when it finishes.
  s().RequestFinished("r1", kT0 + 30ms);
  s().OnTimeout(kT0 + 40ms);
  out = ReleasesIn(s().TakeMessages());
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(ReleaseOf(out[0]).fingerprints,
            std::vector<core::Fingerprint>{core::FingerprintOf("x1")});
}

// End to end: D's release reaches P's session, which frees the KV and answers; P's notice
// reaches D's session, which fails the queued request.
TEST(DecodeSessionWithPrefill, ReleaseFreesPsKvAndANoticeFailsAQueuedRequest) {
  DecodeSessionOptions o = Options(30s);
  DecodeSession d(o);
  PrefillSessionOptions po;
  po.engine_id = "p";
  po.hold.lease = 30s;
  po.block_len = o.block_len;
  po.num_blocks = 1024;
  PrefillSession p(po);
  ASSERT_TRUE(p.Admit("x1", 1, kT0).ok());
  ASSERT_TRUE(p.PrefillDone("x1", {0, 1, 2, 3}, kT0).ok());
  ASSERT_TRUE(p.Admit("x2", 2, kT0).ok());
  d.OnNewRequest("r1", Source("x1"), kT0);
  d.OnNewRequest("r2", Source("x2"), kT0);
  d.OnLookup(Engine("p"), kT0);
  auto deliver = [&](core::TimePoint now) {
    for (Transmit& t : d.TakeMessages()) {
      std::vector<std::uint8_t> bytes =
          std::visit([](const auto& m) { return wire::Encode(m); }, t.message);
      p.OnMessage("d-socket", bytes, now);
      for (Outgoing& back : p.TakeOutgoing()) {
        std::vector<std::uint8_t> reply =
            std::visit([](const auto& m) { return wire::Encode(m); }, back.message);
        d.OnMessage(t.endpoint, reply, now);
      }
    }
  };
  d.OnTimeout(kT0);  // the renewal pass: P remembers the socket for notices
  deliver(kT0);
  EXPECT_EQ(d.stats().renewals_accepted, 1u);
  d.RequestFinished("r1", kT0 + 1s);
  d.OnTimeout(kT0 + 1s + 2ms);
  deliver(kT0 + 1s + 2ms);
  EXPECT_FALSE(p.hold().Contains("x1"));
  std::vector<core::HoldEvent> freed = p.TakeEngineEvents();
  ASSERT_EQ(freed.size(), 1u);
  EXPECT_EQ(freed[0].reason, core::ReleaseReason::kReleasedByDecoder);
  EXPECT_EQ(d.stats().p_released, 1u);
  // P's engine aborts x2 while D still queues r2.
  p.EngineFinished("x2", kT0 + 2s);
  std::vector<Outgoing> notices = p.TakeOutgoing();
  ASSERT_EQ(notices.size(), 1u);
  EXPECT_EQ(notices[0].peer, "d-socket");
  d.OnMessage(0, wire::Encode(std::get<wire::AbortNotice>(notices[0].message)), kT0 + 2s);
  std::vector<TransferAborted> aborted = AbortedIn(d.TakeEvents());
  ASSERT_EQ(aborted.size(), 1u);
  EXPECT_EQ(aborted[0].request, "r2");
  EXPECT_EQ(aborted[0].error.code(), ErrorCode::kCancelled);
  EXPECT_EQ(d.stats().tracked, 0u);
}

TEST(DecodeSessionOptionsTest, PullTimeoutMustOutlastWhatPMayTakeToAnswer) {
  DecodeSessionOptions o = Options();
  o.pull_timeout = 120s;  // kvferry serve's old default, below abort_request_timeout
  Status s = DecodeSession::ValidateOptions(o);
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("480"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("120"), std::string::npos) << s.message();
  o.pull_timeout = 516s;
  EXPECT_TRUE(DecodeSession::ValidateOptions(o).ok());
  o.lease = 30s;
  o.renewal_reply_timeout = 3s;  // > lease/12
  EXPECT_EQ(DecodeSession::ValidateOptions(o).code(), ErrorCode::kInvalidArgument);
  o.tp_size = core::kMaxTpSize + 1;
  o.renewal_reply_timeout = 0s;
  EXPECT_EQ(DecodeSession::ValidateOptions(o).code(), ErrorCode::kInvalidArgument);
}

// Hole 5, end to end in virtual time: a live D renews on time with a live P while 20 other P
// engines are silent (10 whose bootstrap never answers, 10 whose workers never reply), so P
// keeps the live transfer's KV for 10 minutes; before, each dead endpoint cost the serial pass
// a fixed 1 s and each dead bootstrap 5 s, and ~20 of them made P expire a live D's KV.
TEST(DecodeSessionWithPrefill, TwentySilentEnginesCannotCostALiveDecoderItsKv) {
  const core::Duration lease = 30s;
  DecodeSessionOptions o = Options(lease);
  DecodeSession d(o);
  PrefillSessionOptions po;
  po.hold.lease = lease;
  po.block_len = o.block_len;
  po.num_blocks = 1024;
  PrefillSession p(po);
  ASSERT_TRUE(p.Admit("x-live", 1, kT0).ok());
  ASSERT_TRUE(p.PrefillDone("x-live", {0, 1, 2, 3}, kT0).ok());
  d.OnNewRequest("r-live", {"x-live", "live", "live:1"}, kT0);
  for (int i = 0; i < 20; ++i) {
    const std::string name = "silent-" + std::to_string(i);
    d.OnNewRequest("r-" + name, {"x-" + name, name, name + ":1"}, kT0);
  }
  TimePoint now = kT0;
  const TimePoint end = kT0 + 10min;
  std::uint64_t live_renewals = 0;
  while (now < end) {
    for (const LookupRequest& l : d.TakeLookups()) {
      if (l.engine_id == "live") {
        d.OnLookup(Engine("live"), now);
      } else if (std::stoi(l.engine_id.substr(7)) >= 10) {
        d.OnLookup(Engine(l.engine_id), now);  // silent-10..19: workers that never reply
      }  // silent-0..9: bootstraps that never answer (the lookup deadline decides)
    }
    for (Transmit& t : d.TakeMessages()) {
      if (t.address != "live/0") continue;
      ++live_renewals;
      p.OnMessage("d", wire::Encode(std::get<wire::Renewal>(t.message)), now);
      for (Outgoing& out : p.TakeOutgoing()) {
        d.OnRenewalReply(t.endpoint, std::get<wire::RenewalReply>(out.message), now);
      }
    }
    ASSERT_TRUE(p.hold().Contains("x-live"))
        << "P expired a live decoder's KV at t=" << core::ToSeconds(now - kT0) << " s";
    const TimePoint next = std::min(d.NextDeadline(), p.NextDeadline());
    ASSERT_NE(next, core::kNever);
    now = std::max(now, next);
    d.OnTimeout(now);
    p.OnTimeout(now);
  }
  EXPECT_TRUE(p.hold().Contains("x-live"));
  EXPECT_GE(live_renewals, 10u * 60 / 5 - 1);  // every lease/6 = 5 s
  EXPECT_GT(d.stats().renewal_failures, 0u);
}

}  // namespace
// A liveness source (etcd) says P is down: the request of its pull in flight fails now, its block
// stays quarantined (P may be alive behind a partition), and P's late answer — even after the
// pull's deadline — still releases it.
TEST_F(DecodeSessionTest, EngineDownFailsPullsInFlightAndTheirLateAnswerStillReleases) {
  Make();
  s().OnLookup(Engine("p"), kT0);
  ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {1}, kT0).ok());
  auto pulls = Pulls();
  ASSERT_EQ(pulls.size(), 1u);
  const EndpointId ep = last_endpoints_[0];
  s().OnEngineDown("p", Status(ErrorCode::kUnavailable, "left etcd"), kT0 + 1s);
  bool failed = false;
  for (auto& e : s().TakeEvents()) {
    if (auto* d = std::get_if<ReceiveDone>(&e)) {
      EXPECT_EQ(d->request, "r1");
      EXPECT_FALSE(d->ok);
      EXPECT_TRUE(d->quarantined);
      EXPECT_NE(d->error.message().find("left etcd"), std::string::npos) << d->error.ToString();
      failed = true;
    }
    EXPECT_FALSE(std::holds_alternative<BlocksReleased>(e)) << "released on etcd's word alone";
  }
  EXPECT_TRUE(failed) << "the request waited for its pull deadline";
  for (auto& f : s().TakeFences()) {
    s().OnFenceDone(f.id, Status(ErrorCode::kRejected, "cannot fence"), kT0 + 1s);
  }
  EXPECT_EQ(s().stats().quarantined_blocks, 1u);
  s().OnTimeout(kT0 + 601s);  // the pull's deadline passes: it must stay known
  EXPECT_EQ(s().stats().quarantined_blocks, 1u);
  s().OnPullResponse(ep, Finish(pulls[0].id, {"r1"}), kT0 + 602s);
  EXPECT_EQ(s().stats().quarantined_blocks, 0u) << "P's late FINISH releases the quarantine";
}

// P back with the same incarnation after being declared down: pulls sent since are a new epoch,
// which the fence asked at the down does not cover.
TEST_F(DecodeSessionTest, AFenceAskedAtEngineDownDoesNotCoverPullsSentAfter) {
  Make();
  s().OnLookup(Engine("p"), kT0);
  ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {1}, kT0).ok());
  (void)Pulls();
  s().OnEngineDown("p", Status(ErrorCode::kUnavailable, "left etcd"), kT0 + 1s);
  auto fences = s().TakeFences();
  ASSERT_EQ(fences.size(), 1u);
  (void)s().TakeEvents();
  s().OnLookup(Engine("p"), kT0 + 100s);
  ASSERT_TRUE(s().StartLoad("r2", Source("x2"), {2}, kT0 + 100s).ok());
  ASSERT_EQ(Pulls().size(), 1u);
  s().OnFenceDone(fences[0].id, Status::Ok(), kT0 + 101s);
  for (auto& e : s().TakeEvents()) {
    if (auto* d = std::get_if<ReceiveDone>(&e)) {
      EXPECT_NE(d->request, "r2");
    }
    if (auto* r = std::get_if<BlocksReleased>(&e)) {
      EXPECT_NE(r->request, "r2");
    }
  }
  EXPECT_EQ(s().stats().receiving, 1u);
  EXPECT_EQ(s().stats().quarantined_blocks, 0u);
}

// A lookup asked before an engine was declared down may come back with the dead process (a
// registry read before its lease lapsed). Believing it would send new loads to that process to
// wait out their pull deadlines; the answer is counted stale instead, and the next load gets a
// fresh lookup. Found by hosts_xpyd_host_loss_and_partition: 3 requests left to the client's
// 90 s timeout on a D that learnt of a killed P while cut off.
TEST_F(DecodeSessionTest, ALookupAskedBeforeAnEngineDownCannotBringTheDeadProcessBack) {
  Make();
  ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {1}, kT0).ok());
  std::vector<LookupRequest> before = s().TakeLookups();
  ASSERT_EQ(before.size(), 1u);
  EXPECT_NE(before[0].id, 0u);
  s().OnEngineDown("p", Status(ErrorCode::kUnavailable, "left etcd"), kT0 + 1s);
  std::vector<ReceiveDone> done = Done();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_FALSE(done[0].ok);
  s().OnLookup(Engine("p"), kT0 + 1500ms, before[0].id);  // the read from before the down
  EXPECT_EQ(s().stats().lookups_stale, 1u);
  // Past lookup_failure_ttl a new load asks again instead of pulling from the dead process.
  ASSERT_TRUE(s().StartLoad("r2", Source("x2"), {2}, kT0 + 4s).ok());
  EXPECT_TRUE(Pulls().empty()) << "a load went to the process declared down";
  std::vector<LookupRequest> after = s().TakeLookups();
  ASSERT_EQ(after.size(), 1u);
  EXPECT_GT(after[0].id, before[0].id);
  s().OnLookupFailed("p", Status(ErrorCode::kNotFound, "not in etcd"), kT0 + 4s, after[0].id);
  done = Done();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].request, "r2");
  EXPECT_FALSE(done[0].ok);
  EXPECT_FALSE(done[0].quarantined) << "nothing was sent: nothing can be written";
}

// A stale answer that arrives while loads wait asks the fresh lookup they need.
TEST_F(DecodeSessionTest, AStaleLookupAnswerLeavesWaitingLoadsToAFreshLookup) {
  Make();
  ASSERT_TRUE(s().StartLoad("r1", Source("x1"), {1}, kT0).ok());
  const std::uint64_t stale = s().TakeLookups().at(0).id;
  s().OnEngineDown("p", Status(ErrorCode::kUnavailable, "left etcd"), kT0 + 1s);
  (void)Done();
  ASSERT_TRUE(s().StartLoad("r2", Source("x2"), {2}, kT0 + 4s).ok());
  const std::uint64_t fresh = s().TakeLookups().at(0).id;
  s().OnLookupFailed("p", Status(ErrorCode::kTimeout, "no answer"), kT0 + 5s, stale);
  EXPECT_TRUE(Done().empty()) << "a stale failure decided a load waiting for a fresh lookup";
  s().OnLookup(Engine("p", 1, "2"), kT0 + 5s, fresh);
  EXPECT_EQ(Pulls().size(), 1u);
  EXPECT_EQ(s().stats().lookups_stale, 1u);
}

// Clients name the engines D pulls from: one naming a new engine per request (lookups that
// fail) must not grow D's state, and an id beyond the wire's bound keeps none at all. Engines
// D reached stay known.
TEST_F(DecodeSessionTest, EnginesNeverReachedAreForgottenOnceNoRequestNamesThem) {
  Make();
  s().OnLookup(Engine("p"), kT0);
  for (int i = 0; i < 1000; ++i) {
    const std::string engine = "stranger-" + std::to_string(i);
    const RemoteSource source{"x" + std::to_string(i), engine, engine + ":1"};
    ASSERT_TRUE(s().StartLoad("r" + std::to_string(i), source, {1}, kT0).ok());
  }
  for (const LookupRequest& l : s().TakeLookups()) {
    s().OnLookupFailed(l.engine_id, Status(ErrorCode::kUnavailable, "refused"), kT0, l.id);
  }
  EXPECT_EQ(Done().size(), 1000u);
  for (int i = 0; i < 1000; ++i) s().RequestFinished("r" + std::to_string(i), kT0);
  EXPECT_EQ(s().stats().engines_known, 1001u);
  s().OnTimeout(kT0 + 1s);  // their releases are dropped: the failed lookups are believed
  EXPECT_EQ(s().stats().engines_known, 1001u) << "forgotten while a failure is believed";
  s().OnTimeout(kT0 + 12s);  // nothing names them, nothing reached them, the next sweep
  EXPECT_EQ(s().stats().engines_known, 1u) << "only the engine D reached";
  EXPECT_EQ(s().stats().engines_forgotten, 1000u);
  const std::string huge(100000, 'e');
  EXPECT_EQ(s().StartLoad("big", RemoteSource{"x", huge, "h:1"}, {1}, kT0 + 12s).code(),
            ErrorCode::kInvalidArgument);
  s().OnNewRequest("big", RemoteSource{"x", huge, "h:1"}, kT0 + 12s);
  EXPECT_EQ(s().stats().engines_known, 1u) << "state kept for an id P would refuse";
  EXPECT_TRUE(s().TakeLookups().empty());
}

}  // namespace kvferry::protocol
