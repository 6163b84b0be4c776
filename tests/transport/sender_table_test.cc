// SenderTable: a receiver's senders, their connections and endpoints back (sender_table.h).
#include "sender_table.h"

#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <cstdint>
#include <map>
#include <set>
#include <vector>

namespace kvferry::transport {
namespace {

using Table = SenderTable<int>;  // endpoints as ints; 0 means none
using Hello = Table::HelloResult;

TEST(SenderTable, TheFirstHelloOpensTheEndpointBackAndTheLastByeClosesIt) {
  Table t;
  EXPECT_EQ(t.Hello(7, 1), Hello::kOpenEndpoint);
  t.SetEndpoint(7, 70);
  EXPECT_EQ(t.Hello(7, 2), Hello::kKnown);
  EXPECT_EQ(t.Endpoint(7), 70);
  EXPECT_EQ(t.Bye(7, 1), std::nullopt);  // connection 2 still open
  EXPECT_EQ(t.Endpoint(7), 70);
  EXPECT_EQ(t.Bye(7, 2), std::optional<int>(70));
  EXPECT_EQ(t.Endpoint(7), 0);
  EXPECT_EQ(t.size(), 0u);
}

// The case the real-vLLM tier met (a restarted P's second write never acknowledged): the endpoint
// back failed while connection 1 was open, the sender's next connection made a new record, and
// connection 1's BYE then counted that record down to nothing.
TEST(SenderTable, AByeOfAConnectionFromADroppedRecordLeavesTheNewRecordsConnectionsAlone) {
  Table t;
  ASSERT_EQ(t.Hello(7, 1), Hello::kOpenEndpoint);
  t.SetEndpoint(7, 70);
  EXPECT_EQ(t.EndpointFailed(70), std::optional<std::uint64_t>(7));
  ASSERT_EQ(t.Hello(7, 2), Hello::kOpenEndpoint);
  t.SetEndpoint(7, 71);
  EXPECT_EQ(t.Bye(7, 1), std::nullopt);
  EXPECT_EQ(t.Endpoint(7), 71);  // connection 2's acks still have their way back
  EXPECT_EQ(t.Bye(7, 2), std::optional<int>(71));
}

TEST(SenderTable, AnEndpointNoSenderHoldsIsNotAFailureOfAnyone) {
  Table t;
  ASSERT_EQ(t.Hello(7, 1), Hello::kOpenEndpoint);
  t.SetEndpoint(7, 70);
  EXPECT_EQ(t.EndpointFailed(99), std::nullopt);
  EXPECT_EQ(t.EndpointFailed(0), std::nullopt);
  EXPECT_EQ(t.Endpoint(7), 70);
}

// The attacker's case: a peer that keeps opening connections without saying goodbye.
TEST(SenderTable, HellosBeyondTheConnectionBoundAreRefusedAndChangeNothing) {
  Table t;
  ASSERT_EQ(t.Hello(7, 0), Hello::kOpenEndpoint);
  t.SetEndpoint(7, 70);
  for (std::uint64_t n = 1; n < Table::kMaxConnections; ++n) ASSERT_EQ(t.Hello(7, n), Hello::kKnown);
  EXPECT_EQ(t.Hello(7, Table::kMaxConnections), Hello::kRefused);
  EXPECT_EQ(t.connections(7), Table::kMaxConnections);
  EXPECT_EQ(t.Hello(7, 5), Hello::kKnown);  // a HELLO of a connection it holds is no new one
  EXPECT_EQ(t.Bye(7, Table::kMaxConnections), std::nullopt);  // the refused one is unknown
  EXPECT_EQ(t.connections(7), Table::kMaxConnections);
}

// The attacker's other case: a peer claiming a new sender uid with every HELLO. Beyond the
// bound a new sender is refused (no endpoint is opened for it); known senders still connect,
// and one leaving makes room.
TEST(SenderTable, HellosOfNewSendersBeyondTheSenderBoundAreRefusedAndChangeNothing) {
  Table t(3);
  for (std::uint64_t uid = 1; uid <= 3; ++uid) {
    ASSERT_EQ(t.Hello(uid, 1), Hello::kOpenEndpoint);
    t.SetEndpoint(uid, static_cast<int>(uid * 10));
  }
  EXPECT_EQ(t.Hello(4, 1), Hello::kRefused);
  EXPECT_EQ(t.size(), 3u);
  EXPECT_EQ(t.Endpoint(4), 0);
  EXPECT_EQ(t.Hello(2, 2), Hello::kKnown);  // a known sender's new connection
  EXPECT_EQ(t.Bye(1, 1), std::optional<int>(10));
  EXPECT_EQ(t.Hello(4, 1), Hello::kOpenEndpoint);
  EXPECT_EQ(Table().size(), 0u);
  EXPECT_EQ(Table::kMaxSenders, 4096u);
}

TEST(SenderTable, ClearHandsBackEveryEndpoint) {
  Table t;
  ASSERT_EQ(t.Hello(1, 1), Hello::kOpenEndpoint);
  t.SetEndpoint(1, 10);
  ASSERT_EQ(t.Hello(2, 1), Hello::kOpenEndpoint);
  t.SetEndpoint(2, 20);
  std::vector<int> eps = t.Clear();
  EXPECT_EQ(std::set<int>(eps.begin(), eps.end()), (std::set<int>{10, 20}));
  EXPECT_EQ(t.size(), 0u);
}

struct Step {
  int kind = 0;  // 0 hello, 1 bye, 2 endpoint failed
  int sender = 0;
  int nonce = 0;
};

// Against a model: a sender's endpoint back is handed out for closing exactly when the last
// connection counted since its record was made says goodbye, or when it fails; never while a
// connection counted since then is open.
TEST(AckMemory, AVerdictIsFoundUntilCapacityNewerOnesPushItOut) {
  AckMemory m(3);
  EXPECT_FALSE(m.Find(1, 1));
  m.Remember(1, 1, 0);
  m.Remember(2, 1, 7);  // another sender's batch of the same id
  EXPECT_EQ(m.Find(1, 1), std::optional<std::uint32_t>(0));
  EXPECT_EQ(m.Find(2, 1), std::optional<std::uint32_t>(7));
  m.Remember(1, 1, 5);  // again: the verdict is replaced, nothing is added
  EXPECT_EQ(m.Find(1, 1), std::optional<std::uint32_t>(5));
  EXPECT_EQ(m.size(), 2u);
  m.Remember(1, 2, 0);
  m.Remember(1, 3, 0);  // a fourth key: the oldest goes
  EXPECT_FALSE(m.Find(1, 1));
  EXPECT_TRUE(m.Find(2, 1) && m.Find(1, 2) && m.Find(1, 3));
  for (std::uint64_t b = 0; b < 10000; ++b) m.Remember(~0ull, b, 1);  // any ids: still 3 held
  EXPECT_EQ(m.size(), 3u);
  EXPECT_TRUE(m.Find(~0ull, 9999));
}

RC_GTEST_PROP(SenderTableProperties, AnEndpointClosesOnlyWithItsRecordsLastConnection, ()) {
  const auto steps = *rc::gen::container<std::vector<Step>>(rc::gen::build<Step>(
      rc::gen::set(&Step::kind, rc::gen::inRange(0, 3)),
      rc::gen::set(&Step::sender, rc::gen::inRange(0, 3)),
      rc::gen::set(&Step::nonce, rc::gen::inRange(0, 5))));
  Table t;
  std::map<int, std::set<int>> live;  // model: connections counted in each sender's record
  std::map<int, int> ep_of;           // model: each recorded sender's endpoint
  int next_ep = 1;
  for (const Step& s : steps) {
    const auto uid = static_cast<std::uint64_t>(s.sender);
    const auto nonce = static_cast<std::uint64_t>(s.nonce);
    if (s.kind == 0) {
      const Hello h = t.Hello(uid, nonce);
      RC_ASSERT(h == (live.count(s.sender) ? Hello::kKnown : Hello::kOpenEndpoint));
      if (h == Hello::kOpenEndpoint) {
        t.SetEndpoint(uid, next_ep);
        ep_of[s.sender] = next_ep++;
      }
      live[s.sender].insert(s.nonce);
    } else if (s.kind == 1) {
      const std::optional<int> closed = t.Bye(uid, nonce);
      auto it = live.find(s.sender);
      const bool last = it != live.end() && it->second.erase(s.nonce) == 1 && it->second.empty();
      RC_ASSERT(closed.has_value() == last);
      if (last) {
        RC_ASSERT(*closed == ep_of[s.sender]);
        live.erase(it);
        ep_of.erase(s.sender);
      }
    } else if (live.count(s.sender)) {
      RC_ASSERT(t.EndpointFailed(ep_of[s.sender]) == std::optional<std::uint64_t>(uid));
      live.erase(s.sender);
      ep_of.erase(s.sender);
    }
    for (int sender = 0; sender < 3; ++sender) {
      const auto u = static_cast<std::uint64_t>(sender);
      RC_ASSERT(t.Endpoint(u) == (ep_of.count(sender) ? ep_of[sender] : 0));
      RC_ASSERT(t.connections(u) == (live.count(sender) ? live[sender].size() : 0u));
    }
  }
}

}  // namespace
}  // namespace kvferry::transport
