// Side channel over real ZeroMQ sockets on 127.0.0.1: a PrefillListener (P worker) and
// DecodeChannels (D's blocking client). Every test bounds its waits with deadlines; the fixture
// stops the listener (joining its threads) in TearDown.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>

#include "control/side_channel_client.h"
#include "control/side_channel_listener.h"
#include "support/raw_socket.h"
#include "kvferry/core/ids.h"
#include "wire/messages.h"
#include "wire/raw_msgpack.h"

namespace kvferry::control {
namespace {

using namespace std::chrono_literals;
using core::Clock;
using core::FingerprintOf;
using wire::testing::Raw;

// A KvWriter whose writes block while its gate is closed (CancelWrites opens it).
class GateWriter : public KvWriter {
 public:
  protocol::WriteOutcome Write(const protocol::PullContext& context,
                               const protocol::WriteJob& job) override {
    std::unique_lock<std::mutex> lock(mu_);
    ++running_;
    jobs_.push_back(job);
    contexts_.push_back(context);
    cv_.notify_all();
    cv_.wait(lock, [this] { return open_; });
    --running_;
    if (fail_) {
      return protocol::WriteOutcome::Failed(
          Status(ErrorCode::kUnavailable, "injected write failure"));
    }
    return protocol::WriteOutcome::Landed();
  }
  void CancelWrites() override {
    cancelled_ = true;
    SetOpen(true);
  }
  void SetOpen(bool open) {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = open;
    cv_.notify_all();
  }
  void SetFail(bool fail) {
    std::lock_guard<std::mutex> lock(mu_);
    fail_ = fail;
  }
  bool WaitRunning(int n, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return running_ >= n; });
  }
  std::vector<protocol::WriteJob> jobs() {
    std::lock_guard<std::mutex> lock(mu_);
    return jobs_;
  }
  std::vector<protocol::PullContext> contexts() {
    std::lock_guard<std::mutex> lock(mu_);
    return contexts_;
  }
  std::atomic<bool> cancelled_{false};

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = true;
  bool fail_ = false;
  int running_ = 0;
  std::vector<protocol::WriteJob> jobs_;
  std::vector<protocol::PullContext> contexts_;
};

class EventLog {
 public:
  void Add(const core::HoldEvent& event) {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(event);
    cv_.notify_all();
  }
  std::optional<core::HoldEvent> WaitFor(core::HoldEvent::Kind kind, const core::TransferId& id,
                                         std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    std::optional<core::HoldEvent> found;
    cv_.wait_for(lock, timeout, [&] {
      for (const core::HoldEvent& e : events_) {
        if (e.kind == kind && e.id == id) {
          found = e;
          return true;
        }
      }
      return false;
    });
    return found;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<core::HoldEvent> events_;
};

Status Get(std::future<Status> future) {
  if (future.wait_for(2s) != std::future_status::ready) {
    return Status(ErrorCode::kTimeout, "engine call not answered");
  }
  return future.get();
}

wire::Pull MakePull(std::vector<std::pair<std::string, std::string>> requests,
                    std::optional<std::uint64_t> d_lease_ms, bool with_descriptor = true) {
  wire::Pull pull;
  pull.d_engine_id = "d-engine";
  pull.d_tp_size = 1;
  pull.d_tp_rank = 0;
  pull.d_lease_ms = d_lease_ms;
  if (with_descriptor) pull.region_descriptor = std::vector<std::uint8_t>{1, 2, 3, 4};
  pull.block_len = 4096;
  pull.num_blocks = 64;
  std::uint32_t next_block = 0;
  for (auto& [req, xfer] : requests) {
    wire::PullRequest r;
    r.d_req_id = req;
    r.transfer_id = xfer;
    r.block_ids = {next_block, next_block + 1};
    next_block += 2;
    pull.requests.push_back(std::move(r));
  }
  return pull;
}

// The outcome of one pull: every response, and the channel's status.
struct PullOutcome {
  Status status;
  std::vector<wire::PullResponse> responses;

  // Per request: "ok" or the error code's name.
  std::map<std::string, std::string> Verdicts() const {
    std::map<std::string, std::string> out;
    for (const auto& r : responses) {
      for (const auto& id : r.ok) out[id] = "ok";
      for (const auto& e : r.err) out[e.d_req_id] = std::string(ToString(e.code));
    }
    return out;
  }
  const wire::RequestError* FindErr(const std::string& id) const {
    for (const auto& r : responses) {
      for (const auto& e : r.err) {
        if (e.d_req_id == id) return &e;
      }
    }
    return nullptr;
  }
};

class SideChannelTest : public ::testing::Test {
 protected:
  void StartP(core::Duration lease, std::size_t senders = 2, std::uint32_t p_tp = 1,
              std::uint32_t p_rank = 0) {
    ListenerOptions options;
    options.session.hold.lease = lease;
    options.num_senders = senders;
    options.session.p_tp_size = p_tp;
    options.session.p_tp_rank = p_rank;
    options.session.block_len = 4096;  // as MakePull says
    options.session.num_blocks = 1024;
    options.drain_timeout = 300ms;
    options.cancel_grace = 300ms;
    options.linger = 200ms;
    options.cluster_secret = p_secret_;
    auto listener = PrefillListener::Start(options, writer_,
                                           [this](const core::HoldEvent& e) { events_.Add(e); });
    ASSERT_TRUE(listener.has_value()) << listener.error().ToString();
    listener_ = std::move(*listener);
  }

  void TearDown() override {
    if (listener_) {
      writer_->SetOpen(true);
      EXPECT_TRUE(listener_->Stop().ok());
      listener_.reset();
    }
  }

  std::unique_ptr<DecodeChannel> Channel(const std::string& endpoint = "") {
    ChannelOptions options;
    options.cluster_secret = d_secret_;
    auto channel =
        DecodeChannel::Connect(ctx_, endpoint.empty() ? listener_->endpoint() : endpoint, options);
    EXPECT_TRUE(channel.has_value());
    return std::move(*channel);
  }

  void Ready(const std::string& id, std::uint64_t handle = 7, std::uint32_t blocks = 2) {
    ASSERT_TRUE(Get(listener_->Admit(id, handle)).ok());
    std::vector<core::BlockId> source(blocks);
    for (std::uint32_t i = 0; i < blocks; ++i) source[i] = i;
    ASSERT_TRUE(Get(listener_->PrefillDone(id, std::move(source))).ok());
  }

  PullOutcome DoPull(DecodeChannel& channel, const wire::Pull& pull,
                     std::chrono::milliseconds timeout = 3000ms) {
    PullOutcome out;
    out.status = channel.Pull(pull, Clock::now() + timeout,
                              [&](const wire::PullResponse& r) { out.responses.push_back(r); });
    return out;
  }

  // Runs a pull on its own channel and thread.
  std::future<PullOutcome> AsyncPull(wire::Pull pull) {
    return std::async(std::launch::async, [this, pull = std::move(pull)] {
      auto channel = Channel();
      return DoPull(*channel, pull);
    });
  }

  bool WaitParked(std::uint64_t n) {
    const auto deadline = Clock::now() + 2s;
    while (Clock::now() < deadline) {
      if (listener_->Stats().requests_parked == n) return true;
      std::this_thread::sleep_for(5ms);
    }
    return false;
  }

  wire::Renewal MakeRenewal(std::vector<std::string> ids, std::uint64_t d_lease_ms = 30000) {
    wire::Renewal renewal;
    renewal.d_engine_id = "d-engine";
    renewal.d_lease_ms = d_lease_ms;
    for (const auto& id : ids) renewal.fingerprints.push_back(FingerprintOf(id));
    return renewal;
  }

  std::shared_ptr<SideChannelContext> ctx_ = std::make_shared<SideChannelContext>();
  // Cluster secrets of the listener and of the channels; null: open (most tests).
  std::shared_ptr<const ClusterSecret> p_secret_;
  std::shared_ptr<const ClusterSecret> d_secret_;
  std::shared_ptr<GateWriter> writer_ = std::make_shared<GateWriter>();
  EventLog events_;
  std::unique_ptr<PrefillListener> listener_;
};

TEST_F(SideChannelTest, RenewalAndPullOnOneChannel) {
  StartP(30s);
  Ready("xfer-1", /*handle=*/42);
  auto channel = Channel();

  auto reply = channel->Renew(MakeRenewal({"xfer-1", "xfer-unknown"}), Clock::now() + 2s);
  ASSERT_TRUE(reply.has_value()) << reply.error().ToString();
  EXPECT_EQ(reply->status, wire::RenewalStatus::kAccepted);
  EXPECT_EQ(reply->extended, 1u);
  EXPECT_EQ(reply->unknown, 1u);
  EXPECT_EQ(reply->p_lease_ms, 30000u);

  PullOutcome out = DoPull(*channel, MakePull({{"d-1", "xfer-1"}}, 30000));
  ASSERT_TRUE(out.status.ok()) << out.status.ToString();
  ASSERT_EQ(out.responses.size(), 1u);
  EXPECT_EQ(out.responses[0].status, wire::PullStatus::kFinish);
  EXPECT_EQ(out.responses[0].ok, std::vector<core::RequestId>{"d-1"});
  ASSERT_EQ(writer_->jobs().size(), 1u);
  EXPECT_EQ(writer_->jobs()[0].writes, (std::vector<core::BlockWrite>{{0, 0, 8192}}));
  EXPECT_EQ(writer_->jobs()[0].dst_block_ids, (std::vector<core::BlockId>{0, 1}));
  EXPECT_EQ(writer_->contexts()[0].d_engine_id, "d-engine");
  ASSERT_NE(writer_->contexts()[0].region_descriptor, nullptr);
  EXPECT_EQ(*writer_->contexts()[0].region_descriptor, (std::vector<std::uint8_t>{1, 2, 3, 4}));

  // Every paired D rank pulled: P frees the blocks and tells the engine.
  auto freed = events_.WaitFor(core::HoldEvent::Kind::kFreeBlocks, "xfer-1", 1s);
  ASSERT_TRUE(freed.has_value());
  EXPECT_EQ(freed->reason, core::ReleaseReason::kSent);
  EXPECT_EQ(freed->handle, 42u);

  // The same channel keeps working; the freed transfer is no longer known.
  reply = channel->Renew(MakeRenewal({"xfer-1"}), Clock::now() + 2s);
  ASSERT_TRUE(reply.has_value());
  EXPECT_EQ(reply->extended, 0u);
  EXPECT_EQ(reply->unknown, 1u);

  // A later pull without the descriptor reuses the cached one.
  Ready("xfer-2");
  out = DoPull(*channel, MakePull({{"d-2", "xfer-2"}}, 30000, /*with_descriptor=*/false));
  EXPECT_EQ(out.Verdicts(), (std::map<std::string, std::string>{{"d-2", "ok"}}));
  const ListenerStats stats = listener_->Stats();
  EXPECT_EQ(stats.renewals_accepted, 2u);
  EXPECT_EQ(stats.pulls_received, 2u);
  EXPECT_EQ(stats.requests_ok, 2u);
  EXPECT_EQ(stats.pulls_in_progress, 0u);
}

TEST_F(SideChannelTest, RenewalsAnsweredWhileEverySenderIsBlocked) {
  StartP(30s, /*senders=*/2);
  writer_->SetOpen(false);
  Ready("xfer-a");
  Ready("xfer-b");
  auto pull_a = AsyncPull(MakePull({{"d-a", "xfer-a"}}, 30000));
  auto pull_b = AsyncPull(MakePull({{"d-b", "xfer-b"}}, 30000));
  auto pull_c = AsyncPull(MakePull({{"d-c", "xfer-c"}}, 30000));  // not admitted: parks
  ASSERT_TRUE(writer_->WaitRunning(2, 2s));
  ASSERT_TRUE(WaitParked(1));

  auto channel = Channel();
  // Connect first, so the measurement is of the listener, not of the TCP handshake.
  ASSERT_TRUE(channel->Renew(MakeRenewal({}), Clock::now() + 2s).has_value());
  const auto start = Clock::now();
  auto reply = channel->Renew(MakeRenewal({"xfer-a", "xfer-b", "xfer-c"}), Clock::now() + 2s);
  const auto elapsed = Clock::now() - start;
  ASSERT_TRUE(reply.has_value()) << reply.error().ToString();
  EXPECT_EQ(reply->status, wire::RenewalStatus::kAccepted);
  EXPECT_EQ(reply->extended, 3u);
  EXPECT_LT(elapsed, 200ms);

  writer_->SetOpen(true);
  ASSERT_TRUE(Get(listener_->Admit("xfer-c", 3)).ok());
  ASSERT_TRUE(Get(listener_->PrefillDone("xfer-c", {0, 1})).ok());
  for (auto* f : {&pull_a, &pull_b, &pull_c}) {
    ASSERT_EQ(f->wait_for(3s), std::future_status::ready);
    PullOutcome out = f->get();
    ASSERT_TRUE(out.status.ok()) << out.status.ToString();
    ASSERT_EQ(out.Verdicts().size(), 1u);
    EXPECT_EQ(out.Verdicts().begin()->second, "ok");
    EXPECT_EQ(out.responses.back().status, wire::PullStatus::kFinish);
  }
}

TEST_F(SideChannelTest, LatePullForTombstonedTransferFailsInMilliseconds) {
  StartP(core::Duration{0});
  Ready("xfer-1");
  ASSERT_TRUE(Get(listener_->EngineFinished("xfer-1")).ok());
  auto channel = Channel();
  ASSERT_TRUE(channel->Renew(MakeRenewal({}, 0), Clock::now() + 2s).has_value());  // connected

  const auto start = Clock::now();
  PullOutcome out = DoPull(*channel, MakePull({{"d-1", "xfer-1"}}, 0));
  const auto elapsed = Clock::now() - start;
  ASSERT_TRUE(out.status.ok()) << out.status.ToString();
  EXPECT_LT(elapsed, 100ms);
  ASSERT_EQ(out.responses.size(), 1u);
  EXPECT_EQ(out.responses[0].status, wire::PullStatus::kFinish);
  const wire::RequestError* err = out.FindErr("d-1");
  ASSERT_NE(err, nullptr);
  EXPECT_EQ(err->code, ErrorCode::kTombstoned);
  EXPECT_EQ(listener_->Stats().late_pulls_rejected, 1u);
}

TEST_F(SideChannelTest, UnrenewedTransferExpiresOnTimeAndLatePullFails) {
  StartP(100ms);
  const auto start = Clock::now();
  Ready("xfer-1", 9);
  auto freed = events_.WaitFor(core::HoldEvent::Kind::kFreeBlocks, "xfer-1", 2s);
  const auto elapsed = Clock::now() - start;
  ASSERT_TRUE(freed.has_value());
  EXPECT_EQ(freed->reason, core::ReleaseReason::kExpired);
  EXPECT_EQ(freed->handle, 9u);
  EXPECT_GE(elapsed, 100ms);
  EXPECT_LT(elapsed, 600ms);  // the listener wakes at NextDeadline, not at some poll period

  auto channel = Channel();
  PullOutcome out = DoPull(*channel, MakePull({{"d-1", "xfer-1"}}, 100));
  const wire::RequestError* err = out.FindErr("d-1");
  ASSERT_NE(err, nullptr);
  EXPECT_EQ(err->code, ErrorCode::kTombstoned);
}

TEST_F(SideChannelTest, PullBeforeAdmitWaitsAndIsServedAfterPrefillDone) {
  StartP(30s);
  auto pull = AsyncPull(MakePull({{"d-1", "xfer-1"}, {"d-2", "xfer-2"}}, 30000));
  ASSERT_TRUE(WaitParked(2));
  EXPECT_EQ(pull.wait_for(20ms), std::future_status::timeout);  // nothing answered yet

  Ready("xfer-1");
  ASSERT_TRUE(WaitParked(1));
  Ready("xfer-2");
  ASSERT_EQ(pull.wait_for(3s), std::future_status::ready);
  PullOutcome out = pull.get();
  ASSERT_TRUE(out.status.ok()) << out.status.ToString();
  EXPECT_EQ(out.Verdicts(), (std::map<std::string, std::string>{{"d-1", "ok"}, {"d-2", "ok"}}));
  // One readiness wave per PrefillDone: CONTINUE, then FINISH.
  ASSERT_EQ(out.responses.size(), 2u);
  EXPECT_EQ(out.responses[0].status, wire::PullStatus::kContinue);
  EXPECT_EQ(out.responses[1].status, wire::PullStatus::kFinish);
}

TEST_F(SideChannelTest, WriteFailureAndBadBlockIdsAreListedInErr) {
  StartP(30s);
  Ready("xfer-1");
  Ready("xfer-2");
  writer_->SetFail(true);
  wire::Pull pull = MakePull({{"d-1", "xfer-1"}, {"d-2", "xfer-2"}}, 30000);
  pull.requests[1].block_ids = {63, 64};  // 64 is outside D's 64 blocks
  auto channel = Channel();
  PullOutcome out = DoPull(*channel, pull);
  EXPECT_EQ(out.Verdicts(),
            (std::map<std::string, std::string>{{"d-1", "UNAVAILABLE"}, {"d-2", "OUT_OF_RANGE"}}));
  EXPECT_NE(out.FindErr("d-1")->reason.find("injected write failure"), std::string::npos);
  EXPECT_EQ(listener_->Stats().writes_failed, 1u);
}

TEST_F(SideChannelTest, MalformedMessagesGetAnErrorReplyAndChangeNothing) {
  StartP(30s);
  Ready("xfer-1");
  ASSERT_TRUE(WaitParked(0));
  auto channel = Channel();
  const ListenerStats before = listener_->Stats();

  wire::Pull pull = MakePull({{"d-1", "xfer-1"}}, 30000);
  pull.id = 41;
  const std::vector<std::uint8_t> pull_bytes = wire::Encode(pull);
  wire::Renewal renewal = MakeRenewal({"xfer-1"});
  renewal.id = 42;
  const std::vector<std::uint8_t> renewal_bytes = wire::Encode(renewal);
  wire::RenewalReply stray;
  stray.id = 43;
  std::vector<std::uint8_t> oversized = pull_bytes;
  oversized.resize(wire::kMaxFrameBytes + 1, 0);
  struct Case {
    std::string name;
    std::vector<std::uint8_t> bytes;
    bool renewal_error;  // answered with RenewalReply kError instead of PullResponse ERROR
    std::uint64_t id = 0;  // the id the answer carries: the message's, where it is readable
  };
  std::vector<Case> cases = {
      {"truncated pull", {pull_bytes.begin(), pull_bytes.begin() + pull_bytes.size() / 2}, false,
       41},
      {"truncated renewal",
       {renewal_bytes.begin(), renewal_bytes.begin() + renewal_bytes.size() - 3},
       true, 42},
      {"pull with a wrong type", Raw().Head(3, 1).Str("e").Uint(5), false},
      {"renewal with a wrong type",
       Raw().Head(5, 2).Str("e").Str("d").Str("l").Uint(0).Str("fp").Str("x"), true},
      {"unknown version", Raw().Head(2, 1, 99), false},
      {"unknown type", Raw().Head(2, 77), false},
      {"garbage", {0xde, 0xad, 0xbe, 0xef, 0x00, 0x01}, false},
      {"empty", {}, false},
      {"oversized frame", std::vector<std::uint8_t>(wire::kMaxFrameBytes + 1, 0x81), false},
      {"oversized pull", oversized, false, 41},
      {"reply sent to P", wire::Encode(stray), false, 43},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    auto reply = channel->RoundTrip(c.bytes, Clock::now() + 2s);
    ASSERT_TRUE(reply.has_value()) << reply.error().ToString();
    if (c.renewal_error) {
      auto decoded = wire::DecodeRenewalReply(*reply);
      ASSERT_TRUE(decoded.has_value());
      EXPECT_EQ(decoded->status, wire::RenewalStatus::kError);
      EXPECT_FALSE(decoded->message.empty());
      EXPECT_EQ(decoded->p_lease_ms, 30000u);
      EXPECT_EQ(decoded->id, c.id);
    } else {
      auto decoded = wire::DecodePullResponse(*reply);
      ASSERT_TRUE(decoded.has_value());
      EXPECT_EQ(decoded->status, wire::PullStatus::kError);
      EXPECT_NE(decoded->code, ErrorCode::kOk);
      EXPECT_FALSE(decoded->message.empty());
      EXPECT_EQ(decoded->id, c.id);
    }
  }
  // A message of more than one frame (docs/protocol.md §1) is refused, not served.
  {
    zmq::context_t zctx;
    zmq::socket_t dealer(zctx, zmq::socket_type::dealer);
    dealer.set(zmq::sockopt::linger, 0);
    dealer.set(zmq::sockopt::rcvtimeo, 2000);
    dealer.connect(listener_->endpoint());
    dealer.send(zmq::buffer(pull_bytes), zmq::send_flags::sndmore);
    dealer.send(zmq::str_buffer("extra"));
    zmq::message_t reply;
    ASSERT_TRUE(dealer.recv(reply));
    EXPECT_FALSE(reply.more());
    auto decoded = wire::DecodePullResponse(reply.data<std::uint8_t>(), reply.size());
    ASSERT_TRUE(decoded.has_value());
    EXPECT_EQ(decoded->status, wire::PullStatus::kError);
    EXPECT_EQ(decoded->code, ErrorCode::kProtocol);
    EXPECT_EQ(decoded->id, 41u) << "the payload frame's id";
  }
  // Whole-message refusals of well-formed pulls.
  wire::Pull duplicate = MakePull({{"d-1", "xfer-1"}, {"d-1", "xfer-2"}}, 30000);
  PullOutcome out = DoPull(*channel, duplicate);
  ASSERT_EQ(out.responses.size(), 1u);
  EXPECT_EQ(out.responses[0].status, wire::PullStatus::kError);
  wire::Pull no_descriptor = MakePull({{"d-1", "xfer-1"}}, 30000, /*with_descriptor=*/false);
  no_descriptor.d_engine_id = "never-seen";
  out = DoPull(*channel, no_descriptor);
  ASSERT_EQ(out.responses.size(), 1u);
  EXPECT_EQ(out.responses[0].status, wire::PullStatus::kError);
  EXPECT_EQ(out.responses[0].code, ErrorCode::kNotFound);
  // Renewing ids P does not know only counts them.
  auto unknown = channel->Renew(MakeRenewal({"nope-1", "nope-2"}), Clock::now() + 2s);
  ASSERT_TRUE(unknown.has_value());
  EXPECT_EQ(unknown->unknown, 2u);

  const ListenerStats after = listener_->Stats();
  EXPECT_EQ(after.messages_malformed, before.messages_malformed + cases.size() + 1);
  EXPECT_EQ(after.hold_entries, before.hold_entries);
  EXPECT_EQ(after.hold.entries, before.hold.entries);
  EXPECT_EQ(after.hold.tombstones, before.hold.tombstones);
  EXPECT_EQ(after.hold.renewals_extended, before.hold.renewals_extended);
  EXPECT_EQ(after.hold.released, before.hold.released);
  EXPECT_EQ(after.requests_parked, 0u);
  EXPECT_EQ(after.writes_started, before.writes_started);

  // P is unharmed: the transfer is still served.
  out = DoPull(*channel, MakePull({{"d-1", "xfer-1"}}, 30000));
  EXPECT_EQ(out.Verdicts(), (std::map<std::string, std::string>{{"d-1", "ok"}}));
}

TEST_F(SideChannelTest, UnpairedDecoderRankIsAWholeMessageError) {
  StartP(30s, 2, /*p_tp=*/2, /*p_rank=*/0);
  Ready("xfer-1");
  auto channel = Channel();
  wire::Pull pull = MakePull({{"d-1", "xfer-1"}}, 30000);
  pull.d_tp_size = 4;
  pull.d_tp_rank = 3;  // pulls from P rank 1, not 0
  pull.block_len = 2048;  // one of the four heads; P's 4096-byte blocks hold two
  PullOutcome out = DoPull(*channel, pull);
  ASSERT_EQ(out.responses.size(), 1u);
  EXPECT_EQ(out.responses[0].status, wire::PullStatus::kError);
  EXPECT_EQ(out.responses[0].code, ErrorCode::kInvalidArgument);
  pull.d_tp_size = 3;  // does not divide
  pull.d_tp_rank = 0;
  out = DoPull(*channel, pull);
  ASSERT_EQ(out.responses.size(), 1u);
  EXPECT_EQ(out.responses[0].status, wire::PullStatus::kError);
  // A paired rank of D TP 4 (ranks 0, 1 pull from P rank 0): need_send 2.
  pull.d_tp_size = 4;
  pull.d_tp_rank = 1;
  out = DoPull(*channel, pull);
  EXPECT_EQ(out.Verdicts(), (std::map<std::string, std::string>{{"d-1", "ok"}}));
  EXPECT_FALSE(events_.WaitFor(core::HoldEvent::Kind::kFreeBlocks, "xfer-1", 20ms).has_value());
  pull.d_tp_rank = 0;
  out = DoPull(*channel, pull);
  EXPECT_EQ(out.Verdicts(), (std::map<std::string, std::string>{{"d-1", "ok"}}));
  EXPECT_TRUE(events_.WaitFor(core::HoldEvent::Kind::kFreeBlocks, "xfer-1", 1s).has_value());
}

struct MismatchCase {
  std::uint64_t d_lease_ms;
  core::Duration p_lease;
  std::string d_text;
  std::string p_text;
};

class LeaseMismatchTest : public SideChannelTest,
                          public ::testing::WithParamInterface<MismatchCase> {};

TEST_P(LeaseMismatchTest, FailsTheRequestNamingBothValues) {
  const MismatchCase& c = GetParam();
  StartP(c.p_lease);
  Ready("xfer-1");
  auto channel = Channel();
  PullOutcome out = DoPull(*channel, MakePull({{"d-1", "xfer-1"}}, c.d_lease_ms));
  ASSERT_TRUE(out.status.ok());
  const wire::RequestError* err = out.FindErr("d-1");
  ASSERT_NE(err, nullptr);
  EXPECT_EQ(err->code, ErrorCode::kLeaseMismatch);
  EXPECT_NE(err->reason.find("decoder has " + c.d_text), std::string::npos) << err->reason;
  EXPECT_NE(err->reason.find("prefiller has " + c.p_text), std::string::npos) << err->reason;
  EXPECT_EQ(listener_->Stats().lease_mismatches, 1u);
  // D fails the request and will not pull it again: P frees it now.
  auto freed = events_.WaitFor(core::HoldEvent::Kind::kFreeBlocks, "xfer-1", 1s);
  ASSERT_TRUE(freed.has_value());
  EXPECT_EQ(freed->reason, core::ReleaseReason::kLeaseMismatch);
}

INSTANTIATE_TEST_SUITE_P(Leases, LeaseMismatchTest,
                         ::testing::Values(MismatchCase{30000, core::Duration{0}, "30s", "off"},
                                           MismatchCase{0, std::chrono::seconds(30), "off", "30s"},
                                           MismatchCase{20000, std::chrono::seconds(30), "20s",
                                                        "30s"}),
                         [](const ::testing::TestParamInfo<MismatchCase>& param_info) {
                           return "Decoder" + param_info.param.d_text + "Prefiller" +
                                  param_info.param.p_text;
                         });

TEST_F(SideChannelTest, ShutdownAnswersParkedPullsWithCancelled) {
  StartP(30s);
  auto pull = AsyncPull(MakePull({{"d-1", "xfer-1"}}, 30000));
  ASSERT_TRUE(WaitParked(1));
  const auto start = Clock::now();
  EXPECT_TRUE(listener_->Stop().ok());
  EXPECT_LT(Clock::now() - start, 1s);
  ASSERT_EQ(pull.wait_for(2s), std::future_status::ready);
  PullOutcome out = pull.get();
  ASSERT_TRUE(out.status.ok()) << out.status.ToString();
  EXPECT_EQ(out.Verdicts(), (std::map<std::string, std::string>{{"d-1", "CANCELLED"}}));
  EXPECT_EQ(out.responses.back().status, wire::PullStatus::kFinish);
  // Engine calls after Stop are refused, not lost.
  EXPECT_EQ(Get(listener_->Admit("xfer-2", 1)).code(), ErrorCode::kCancelled);
  listener_.reset();
}

TEST_F(SideChannelTest, ShutdownCancelsWritesThatOutlastTheDrain) {
  StartP(30s, 1);
  writer_->SetOpen(false);
  Ready("xfer-1");
  Ready("xfer-2");
  auto pull = AsyncPull(MakePull({{"d-1", "xfer-1"}, {"d-2", "xfer-2"}}, 30000));
  ASSERT_TRUE(writer_->WaitRunning(1, 2s));  // d-1 writes; d-2 queued behind it
  const auto start = Clock::now();
  EXPECT_TRUE(listener_->Stop().ok());  // drain 300 ms, then CancelWrites opens the gate
  EXPECT_LT(Clock::now() - start, 1s);
  EXPECT_TRUE(writer_->cancelled_);
  ASSERT_EQ(pull.wait_for(2s), std::future_status::ready);
  PullOutcome out = pull.get();
  EXPECT_EQ(out.Verdicts(),
            (std::map<std::string, std::string>{{"d-1", "ok"}, {"d-2", "CANCELLED"}}));
  listener_.reset();
}

TEST_F(SideChannelTest, EngineCallsReportHoldTableRefusals) {
  StartP(30s);
  ASSERT_TRUE(Get(listener_->Admit("xfer-1", 1)).ok());
  EXPECT_EQ(Get(listener_->Admit("xfer-1", 1)).code(), ErrorCode::kAlreadyExists);
  EXPECT_EQ(Get(listener_->PrefillDone("xfer-unknown", {0})).code(), ErrorCode::kNotFound);
  ASSERT_TRUE(Get(listener_->EngineFinished("xfer-1")).ok());
  EXPECT_EQ(Get(listener_->Admit("xfer-1", 1)).code(), ErrorCode::kTombstoned);
}

// ---- Cluster authentication: P's ROUTER is a CURVE server behind a ZAP handler ----

std::shared_ptr<const ClusterSecret> TestSecret(char fill) {
  auto secret = ClusterSecret::FromBytes(std::string(48, fill));
  EXPECT_TRUE(secret.has_value());
  return std::make_shared<const ClusterSecret>(std::move(*secret));
}

class AuthenticatedSideChannelTest : public SideChannelTest {
 protected:
  void SetUp() override { p_secret_ = TestSecret('s'); }

  // The handshakes counted so far: refused ones, plus abandoned ones if `with_abandoned`.
  std::uint64_t FailedHandshakes(bool with_abandoned) {
    const ListenerStats stats = listener_->Stats();
    return stats.auth_refusals + (with_abandoned ? stats.handshakes_abandoned : 0);
  }

  // Waits until the listener counted more than `n` failed handshakes.
  std::uint64_t WaitRefusalsAbove(std::uint64_t n, bool with_abandoned) {
    const auto deadline = Clock::now() + 3s;
    std::uint64_t seen = FailedHandshakes(with_abandoned);
    while (seen <= n && Clock::now() < deadline) {
      std::this_thread::sleep_for(10ms);
      seen = FailedHandshakes(with_abandoned);
    }
    return seen;
  }

  // A channel of someone who is not (or not fully) a cluster member, the first to connect to a
  // fresh listener, gets no answer at all, and its handshake is counted: as refused, or with
  // `may_abandon` (a libzmq NULL client that may hang up first on reading P's CURVE greeting)
  // as refused or abandoned. Counted from the listener's start, not from this call: the
  // handshake may fail as soon as the channel connects, and a client that failed one on a
  // protocol error does not reconnect.
  void ExpectShutOut(DecodeChannel& outsider, bool may_abandon = false) {
    const std::uint64_t before = 0;
    auto reply = outsider.Renew(MakeRenewal({"xfer-1"}), Clock::now() + 500ms);
    ASSERT_FALSE(reply.has_value());
    EXPECT_EQ(reply.error().code(), ErrorCode::kTimeout);
    PullOutcome out = DoPull(outsider, MakePull({{"d-x", "xfer-1"}}, 30000), 300ms);
    EXPECT_EQ(out.status.code(), ErrorCode::kTimeout);
    EXPECT_TRUE(out.responses.empty());
    EXPECT_GT(WaitRefusalsAbove(before, may_abandon), before);
    const ListenerStats stats = listener_->Stats();
    EXPECT_EQ(stats.renewals_accepted, 0u);
    EXPECT_EQ(stats.pulls_received, 0u);
    EXPECT_EQ(stats.responses_sent, 0u);
    EXPECT_TRUE(writer_->jobs().empty());
  }
};

TEST_F(AuthenticatedSideChannelTest, MemberChannelGetsItsRenewalAnsweredAndItsPullServed) {
  d_secret_ = p_secret_;
  StartP(30s);
  Ready("xfer-1");
  auto channel = Channel();
  auto reply = channel->Renew(MakeRenewal({"xfer-1"}), Clock::now() + 2s);
  ASSERT_TRUE(reply.has_value()) << reply.error().ToString();
  EXPECT_EQ(reply->status, wire::RenewalStatus::kAccepted);
  EXPECT_EQ(reply->extended, 1u);
  PullOutcome out = DoPull(*channel, MakePull({{"d-1", "xfer-1"}}, 30000));
  ASSERT_TRUE(out.status.ok()) << out.status.ToString();
  EXPECT_EQ(out.Verdicts(), (std::map<std::string, std::string>{{"d-1", "ok"}}));
  EXPECT_EQ(listener_->Stats().auth_refusals, 0u);
}

TEST_F(AuthenticatedSideChannelTest, ChannelWithoutCurveGetsNoAnswerAndIsCounted) {
  StartP(30s);
  Ready("xfer-1");
  auto open = Channel();  // d_secret_ null: the NULL mechanism
  ASSERT_NO_FATAL_FAILURE(ExpectShutOut(*open, /*may_abandon=*/true));
  // The listener keeps serving members meanwhile.
  d_secret_ = p_secret_;
  auto member = Channel();
  auto reply = member->Renew(MakeRenewal({"xfer-1"}), Clock::now() + 2s);
  ASSERT_TRUE(reply.has_value()) << reply.error().ToString();
  EXPECT_EQ(reply->extended, 1u);
}

TEST_F(AuthenticatedSideChannelTest, ChannelWithAnotherSecretGetsNoAnswerAndIsCounted) {
  StartP(30s);
  Ready("xfer-1");
  d_secret_ = TestSecret('x');
  auto stranger = Channel();
  ASSERT_NO_FATAL_FAILURE(ExpectShutOut(*stranger));
}

// Someone who learnt P's public server key but not the cluster's client key completes the
// CURVE key exchange; the ZAP handler refuses it before a single message gets through.
TEST_F(AuthenticatedSideChannelTest, ServerKeyWithoutTheClientKeyIsRefusedByZap) {
  StartP(30s);
  Ready("xfer-1");
  zmq::context_t context(1);
  zmq::socket_t dealer(context, zmq::socket_type::dealer);
  char public_key[41] = {};
  char secret_key[41] = {};
  ASSERT_EQ(zmq_curve_keypair(public_key, secret_key), 0);
  dealer.set(zmq::sockopt::linger, 0);
  dealer.set(zmq::sockopt::curve_serverkey, p_secret_->curve_server().public_z85);
  dealer.set(zmq::sockopt::curve_publickey, std::string(public_key));
  dealer.set(zmq::sockopt::curve_secretkey, std::string(secret_key));
  dealer.connect(listener_->endpoint());
  wire::Renewal renewal = MakeRenewal({"xfer-1"});
  renewal.id = 1;
  const std::vector<std::uint8_t> payload = wire::Encode(renewal);
  ASSERT_TRUE(dealer.send(zmq::buffer(payload), zmq::send_flags::dontwait));
  zmq::pollitem_t item = {dealer.handle(), 0, ZMQ_POLLIN, 0};
  zmq::poll(&item, 1, 500ms);
  EXPECT_EQ(item.revents & ZMQ_POLLIN, 0);
  EXPECT_GT(WaitRefusalsAbove(0, false), 0u);
  EXPECT_EQ(listener_->Stats().renewals_accepted, 0u);
}

// A connection that closes before sending a greeting (a port probe, or the race a libzmq NULL
// client may win) is counted as abandoned, not as a refusal: P cannot tell it lacked the secret.
TEST_F(AuthenticatedSideChannelTest, AConnectionClosedMidHandshakeIsCountedAsAbandoned) {
  StartP(30s);
  const std::string endpoint = listener_->endpoint();
  {
    testing::RawSocket probe(std::stoi(endpoint.substr(endpoint.rfind(':') + 1)));
    ASSERT_TRUE(probe.ok()) << endpoint;
    ASSERT_TRUE(probe.Send(std::string("\xff", 1)));  // the first byte of a greeting, no more
  }
  const auto deadline = Clock::now() + 3s;
  while (listener_->Stats().handshakes_abandoned == 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
  }
  const ListenerStats stats = listener_->Stats();
  EXPECT_EQ(stats.handshakes_abandoned, 1u);
  EXPECT_EQ(stats.auth_refusals, 0u);
}

}  // namespace
}  // namespace kvferry::control
