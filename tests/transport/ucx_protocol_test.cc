// The UCX engine's active-message protocol (ucx_am_protocol.h) against a peer written here with
// raw UCX calls: what a real engine would never send (a QUERY for a batch it never wrote, a
// header of the wrong length), and what a real engine cannot be made to do on demand (lose an
// ACK).
#include <gtest/gtest.h>
#include <ucp/api/ucp.h>

#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "descriptor.h"
#include "inbound_tally.h"
#include "kvferry/transport/ucx.h"
#include "ucx_am_protocol.h"

namespace kvferry::transport {
namespace {

using namespace std::chrono_literals;
using namespace ucx_am;

TimePoint In(Duration d) { return Clock::now() + d; }

// One UCX worker speaking the engine's protocol by hand, progressed by the test's own thread.
// Every active message it receives is kept (id, header bytes); `on_message` sees it inside UCX's
// callback, and answers it through Defer.
class RawUcxPeer {
 public:
  struct Message {
    unsigned id;
    std::vector<std::byte> header;
    std::vector<std::byte> data;  // eager data, or the sender's address of a HELLO
  };

  RawUcxPeer() {
    ucp_config_t* config = nullptr;
    EXPECT_EQ(ucp_config_read(nullptr, nullptr, &config), UCS_OK);
    (void)ucp_config_modify(config, "TLS", "tcp");
    (void)ucp_config_modify(config, "NET_DEVICES", "lo");
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_AM;
    EXPECT_EQ(ucp_init(&params, config, &context_), UCS_OK);
    ucp_config_release(config);
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    EXPECT_EQ(ucp_worker_create(context_, &wp, &worker_), UCS_OK);
    ucp_address_t* address = nullptr;
    size_t address_length = 0;
    EXPECT_EQ(ucp_worker_get_address(worker_, &address, &address_length), UCS_OK);
    const auto* a = reinterpret_cast<const std::byte*>(address);
    address_.assign(a, a + address_length);
    ucp_worker_release_address(worker_, address);
    for (unsigned id : {kHello, kHelloAck, kWrite, kWriteV, kAck, kBye, kQuery}) {
      ucp_am_handler_param_t hp{};
      hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
      hp.id = id;
      hp.flags = UCP_AM_FLAG_WHOLE_MSG;
      hp.arg = new Handler{this, id};
      handlers_.push_back(static_cast<Handler*>(hp.arg));
      hp.cb = [](void* arg, const void* header, size_t header_length, void* data, size_t length,
                 const ucp_am_recv_param_t* param) {
        auto* h = static_cast<Handler*>(arg);
        Message m{h->id, {}, {}};
        const auto* hb = static_cast<const std::byte*>(header);
        m.header.assign(hb, hb + header_length);
        if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) == 0 && data != nullptr) {
          const auto* db = static_cast<const std::byte*>(data);
          m.data.assign(db, db + length);
        }
        h->peer->received_.push_back(m);
        if (h->peer->on_message) h->peer->on_message(h->peer->received_.back());
        return UCS_OK;  // a rendezvous message's data is dropped
      };
      EXPECT_EQ(ucp_worker_set_am_recv_handler(worker_, &hp), UCS_OK);
    }
  }

  ~RawUcxPeer() {
    for (ucp_ep_h ep : eps_) {
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
      ucs_status_ptr_t sp = ucp_ep_close_nbx(ep, &rp);
      while (sp != nullptr && !UCS_PTR_IS_ERR(sp) && ucp_request_check_status(sp) == UCS_INPROGRESS) {
        ucp_worker_progress(worker_);
      }
      if (sp != nullptr && !UCS_PTR_IS_ERR(sp)) ucp_request_free(sp);
    }
    ucp_worker_destroy(worker_);
    ucp_cleanup(context_);
    for (Handler* h : handlers_) delete h;
  }

  const std::vector<std::byte>& address() const { return address_; }

  ucp_ep_h Connect(std::span<const std::byte> address) {
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    ep.address = reinterpret_cast<const ucp_address_t*>(address.data());
    ucp_ep_h h = nullptr;
    EXPECT_EQ(ucp_ep_create(worker_, &ep, &h), UCS_OK);
    eps_.push_back(h);
    return h;
  }

  // Sends one message and progresses until UCX is done with it.
  void Send(ucp_ep_h ep, unsigned id, const void* header, std::size_t header_length,
            const void* data = nullptr, std::size_t length = 0, std::uint32_t flags = 0) {
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_AM_SEND_FLAG_EAGER | flags;
    ucs_status_ptr_t sp = ucp_am_send_nbx(ep, id, header, header_length, data, length, &rp);
    ASSERT_FALSE(UCS_PTR_IS_ERR(sp));
    while (sp != nullptr && ucp_request_check_status(sp) == UCS_INPROGRESS) {
      ucp_worker_progress(worker_);
    }
    if (sp != nullptr) ucp_request_free(sp);
  }
  template <typename H>
  void Send(ucp_ep_h ep, unsigned id, const H& header, const void* data = nullptr,
            std::size_t length = 0) {
    Send(ep, id, &header, sizeof(H), data, length);
  }

  // Runs `fn` from ProgressUntil, outside UCX's callbacks (which must not progress the worker,
  // as Send does).
  void Defer(std::function<void()> fn) { deferred_.push_back(std::move(fn)); }

  // Progresses until `done` or the deadline; says which.
  bool ProgressUntil(const std::function<bool()>& done, TimePoint deadline) {
    while (!done()) {
      if (Clock::now() > deadline) return false;
      const unsigned progressed = ucp_worker_progress(worker_);
      std::vector<std::function<void()>> run;
      run.swap(deferred_);
      for (auto& fn : run) fn();
      if (progressed == 0 && run.empty()) std::this_thread::sleep_for(100us);
    }
    return true;
  }

  // The received messages with `id`, each header read as T (wrong lengths skipped).
  template <typename T>
  std::vector<T> Headers(unsigned id) const {
    std::vector<T> out;
    for (const Message& m : received_) {
      T h;
      if (m.id == id && ReadHeader(m.header.data(), m.header.size(), &h)) out.push_back(h);
    }
    return out;
  }

  std::function<void(const Message&)> on_message;

 private:
  struct Handler {
    RawUcxPeer* peer;
    unsigned id;
  };
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::vector<std::byte> address_;
  std::vector<ucp_ep_h> eps_;
  std::vector<Handler*> handlers_;
  std::vector<Message> received_;
  std::vector<std::function<void()>> deferred_;
};

UcxOptions TcpOptions() {
  UcxOptions options;
  options.config = {{"TLS", "tcp"}, {"NET_DEVICES", "lo"}};
  return options;
}

// A receiving engine over tcp with one 1 MiB region, and a raw peer connected to its worker
// (`ep`): what the tests of the receiver's side start from. Hello says hello as sender `uid`
// and waits for the answer.
struct RawSenderAndReceiver {
  ::testing::AssertionResult Start() {
    if (!engine) return ::testing::AssertionFailure() << engine.error().ToString();
    auto r = (*engine)->AllocateRegion(1 << 20);
    if (!r) return ::testing::AssertionFailure() << r.error().ToString();
    region = *r;
    auto bytes = (*engine)->ExportDescriptor({});
    if (!bytes) return ::testing::AssertionFailure() << bytes.error().ToString();
    auto desc = internal::DecodeDescriptor(*bytes);
    if (!desc) return ::testing::AssertionFailure() << desc.error().ToString();
    ep = raw.Connect(desc->address);
    return ::testing::AssertionSuccess();
  }
  ::testing::AssertionResult Hello(std::uint64_t uid) {
    raw.Send(ep, kHello, HelloHeader{uid, 1}, raw.address().data(), raw.address().size());
    if (raw.ProgressUntil([&] { return raw.Headers<HelloAckHeader>(kHelloAck).size() == 1; },
                          In(10s))) {
      return ::testing::AssertionSuccess();
    }
    return ::testing::AssertionFailure() << "no HELLO_ACK within 10 s";
  }
  std::vector<AckHeader> acks() const { return raw.Headers<AckHeader>(kAck); }

  Result<std::unique_ptr<Engine>> engine = MakeUcxEngine(TcpOptions());
  Region region{};
  RawUcxPeer raw;
  ucp_ep_h ep = nullptr;
};

TEST(UcxProtocol, AReceiverAnswersAQueryWithTheVerdictItSentAndIgnoresTheRest) {
  RawSenderAndReceiver t;
  ASSERT_TRUE(t.Start());
  RawUcxPeer& raw = t.raw;
  const Region* region = &t.region;
  constexpr std::uint64_t kUid = 0x5eed;
  ucp_ep_h ep = t.ep;
  ASSERT_TRUE(t.Hello(kUid));
  auto acks = [&] { return t.acks(); };
  std::vector<std::byte> page(4096, std::byte{7});
  auto write = [&](std::uint64_t batch, std::uint64_t offset) {
    raw.Send(ep, kWrite,
             WriteHeader{kUid, batch, kNoWriteKey, offset, page.size(),
                         static_cast<std::uint32_t>(region->id), 1},
             page.data(), page.size());
  };
  write(7, 0);
  ASSERT_TRUE(raw.ProgressUntil([&] { return acks().size() == 1; }, In(10s)));
  write(8, (1 << 20) - 100);  // past the region's end: refused
  ASSERT_TRUE(raw.ProgressUntil([&] { return acks().size() == 2; }, In(10s)));
  EXPECT_EQ(static_cast<ErrorCode>(acks()[1].code), ErrorCode::kOutOfRange);

  // Asked again, the same verdicts.
  raw.Send(ep, kQuery, QueryHeader{kUid, 7, 1, 0});
  raw.Send(ep, kQuery, QueryHeader{kUid, 8, 1, 0});
  ASSERT_TRUE(raw.ProgressUntil([&] { return acks().size() == 4; }, In(10s)));
  EXPECT_EQ(acks()[2].batch_id, 7u);
  EXPECT_EQ(static_cast<ErrorCode>(acks()[2].code), ErrorCode::kOk);
  EXPECT_EQ(acks()[3].batch_id, 8u);
  EXPECT_EQ(static_cast<ErrorCode>(acks()[3].code), ErrorCode::kOutOfRange);

  // A batch never written, another sender's batch, a header of the wrong length, a flood:
  // no answer, and the receiver goes on acknowledging.
  raw.Send(ep, kQuery, QueryHeader{kUid, 99, 1, 0});
  raw.Send(ep, kQuery, QueryHeader{kUid + 1, 7, 1, 0});
  const std::byte junk[5]{};
  raw.Send(ep, kQuery, junk, sizeof(junk));
  for (std::uint32_t i = 0; i < 200; ++i) raw.Send(ep, kQuery, QueryHeader{~0ull, i, i, 0});
  write(9, 4096);
  ASSERT_TRUE(raw.ProgressUntil([&] { return acks().size() == 5; }, In(10s)));
  EXPECT_EQ(acks()[4].batch_id, 9u);
  EXPECT_EQ(static_cast<ErrorCode>(acks()[4].code), ErrorCode::kOk);
  raw.ProgressUntil([] { return false; }, In(300ms));
  EXPECT_EQ(acks().size(), 5u) << "an ACK for a batch the receiver never acknowledged";
  EXPECT_EQ(std::memcmp(region->base + 4096, page.data(), page.size()), 0);
}

// A sender that opens batches and never finishes them (each write claims one more op to come)
// cannot grow the receiver without bound: past InboundTally's bound the longest-open batch is
// forgotten, so finishing it later earns no ACK (its sender times it out, unsettled), and the
// receiver goes on acknowledging whole batches.
TEST(UcxProtocol, BatchesLeftOpenWithoutEndAreForgottenOldestFirstAndWholeOnesStillAcked) {
  RawSenderAndReceiver t;
  ASSERT_TRUE(t.Start());
  RawUcxPeer& raw = t.raw;
  const Region* region = &t.region;
  constexpr std::uint64_t kUid = 0xf100d;
  ucp_ep_h ep = t.ep;
  ASSERT_TRUE(t.Hello(kUid));
  const std::uint64_t word = 0x1122334455667788ull;
  auto write = [&](std::uint64_t batch, std::uint32_t op_count) {
    raw.Send(ep, kWrite,
             WriteHeader{kUid, batch, kNoWriteKey, 0, sizeof(word),
                         static_cast<std::uint32_t>(region->id), op_count},
             &word, sizeof(word));
  };
  write(1, 2);  // the first half of batch 1
  const std::uint64_t flood = internal::InboundTally::kDefaultMaxOpen;
  for (std::uint64_t b = 2; b < 2 + flood; ++b) write(b, 2);  // halves, never finished
  write(1, 2);  // batch 1's second half: batch 1 was forgotten, so this opens it again
  write(flood + 10, 1);  // a whole batch
  auto acks = [&] { return t.acks(); };
  ASSERT_TRUE(raw.ProgressUntil([&] { return !acks().empty(); }, In(30s)));
  raw.ProgressUntil([] { return false; }, In(300ms));
  ASSERT_EQ(acks().size(), 1u) << "batch " << acks()[0].batch_id << " acknowledged";
  EXPECT_EQ(acks()[0].batch_id, flood + 10);
  EXPECT_EQ(static_cast<ErrorCode>(acks()[0].code), ErrorCode::kOk);
}

// A receiver with no endpoint back to a sender (it failed, or, as here, the sender never said
// hello) still answers the sender's QUERY, on the endpoint the query came with (REPLY): so a
// sender whose endpoint back was lost gets its verdicts in seconds, not at its write bound.
TEST(UcxProtocol, AQueryIsAnsweredOnItsReplyEndpointWhenNoEndpointBackIsLeft) {
  RawSenderAndReceiver t;
  ASSERT_TRUE(t.Start());
  RawUcxPeer& raw = t.raw;
  const Region* region = &t.region;
  constexpr std::uint64_t kUid = 0xbac;
  ucp_ep_h ep = t.ep;  // no HELLO: no endpoint back to this sender
  std::vector<std::byte> page(4096, std::byte{5});
  raw.Send(ep, kWrite,
           WriteHeader{kUid, 3, kNoWriteKey, 0, page.size(), static_cast<std::uint32_t>(region->id),
                       1},
           page.data(), page.size());
  auto acks = [&] { return t.acks(); };
  raw.ProgressUntil([] { return false; }, In(300ms));
  ASSERT_TRUE(acks().empty()) << "acknowledged with no endpoint back";
  // Without REPLY, nothing to answer on; with it, the verdict.
  const QueryHeader q{kUid, 3, 1, 0};
  raw.Send(ep, kQuery, &q, sizeof(q));
  raw.ProgressUntil([] { return false; }, In(300ms));
  ASSERT_TRUE(acks().empty());
  raw.Send(ep, kQuery, &q, sizeof(q), nullptr, 0, UCP_AM_SEND_FLAG_REPLY);
  ASSERT_TRUE(raw.ProgressUntil([&] { return !acks().empty(); }, In(10s)))
      << "the query's reply endpoint was not used";
  EXPECT_EQ(acks()[0].batch_id, 3u);
  EXPECT_EQ(static_cast<ErrorCode>(acks()[0].code), ErrorCode::kOk);
  EXPECT_EQ(std::memcmp(region->base, page.data(), page.size()), 0);
  // A batch it never acknowledged gets no answer there either.
  const QueryHeader unknown{kUid, 4, 1, 0};
  raw.Send(ep, kQuery, &unknown, sizeof(unknown), nullptr, 0, UCP_AM_SEND_FLAG_REPLY);
  raw.ProgressUntil([] { return false; }, In(300ms));
  EXPECT_EQ(acks().size(), 1u);
}

TEST(UcxProtocol, ASenderWhoseAckWasLostAsksAndCompletesTheBatchWithinSeconds) {
  // The raw peer plays the receiver: it answers HELLO, swallows the WRITE's ACK (as a lost
  // message would), and answers the sender's QUERY with the ACK.
  RawUcxPeer raw;
  constexpr std::uint64_t kRawUid = 0xacc;
  internal::Descriptor d;
  d.backend = "ucx";
  d.engine_uid = kRawUid;
  d.address = raw.address();
  d.regions.push_back({RemoteRegion{1, 0x1000, 1 << 20, MemoryKind::kHost}, {}});
  const std::vector<std::byte> descriptor = internal::EncodeDescriptor(d);
  ucp_ep_h back = nullptr;
  raw.on_message = [&](const RawUcxPeer::Message& m) {
    if (m.id == kHello) {
      HelloHeader h;
      ASSERT_TRUE(ReadHeader(m.header.data(), m.header.size(), &h));
      raw.Defer([&raw, &back, h, address = m.data] {
        back = raw.Connect(address);
        raw.Send(back, kHelloAck, HelloAckHeader{h.nonce, kRawUid});
      });
    } else if (m.id == kQuery) {
      QueryHeader q;
      ASSERT_TRUE(ReadHeader(m.header.data(), m.header.size(), &q));
      raw.Defer([&raw, &back, q] { raw.Send(back, kAck, AckHeader{q.batch_id, 0, 0}); });
    }
  };

  auto engine = MakeUcxEngine(TcpOptions());
  ASSERT_TRUE(engine) << engine.error().ToString();
  auto src = (*engine)->AllocateRegion(1 << 20);
  ASSERT_TRUE(src);
  std::optional<Result<ConnectionId>> peer;
  std::thread connect([&] { peer = (*engine)->Connect(descriptor, In(10s)); });
  ASSERT_TRUE(raw.ProgressUntil([&] { return peer.has_value(); }, In(15s)));
  connect.join();
  ASSERT_TRUE(*peer) << peer->error().ToString();

  const WriteOp op{src->id, 1, 0, 0, 4096};
  BatchWaiter w;
  const TimePoint start = Clock::now();
  ASSERT_TRUE((*engine)->SubmitWrites(**peer, std::span(&op, 1), kNoWriteKey, w.Callback()));
  ASSERT_TRUE(raw.ProgressUntil([&] { return !raw.Headers<QueryHeader>(kQuery).empty(); },
                                In(10s)))
      << "the sender never asked for its ACK";
  const Status status = w.Wait(In(5s));
  const Duration took = Clock::now() - start;
  EXPECT_TRUE(status.ok()) << status.ToString();
  EXPECT_EQ(raw.Headers<WriteHeader>(kWrite).size(), 1u);
  // Asked after its bound (2 s: kAckQueryAfter), long before a write bound of 30 s.
  EXPECT_GE(took, 1900ms);
  EXPECT_LT(took, 6s);
  EXPECT_EQ(raw.Headers<QueryHeader>(kQuery).front().attempt, 1u);
}

}  // namespace
}  // namespace kvferry::transport
