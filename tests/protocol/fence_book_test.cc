// FenceBook (protocol/fence_book.h): one peer per (endpoint, incarnation, epoch), never reused; at
// most one fence of a peer in flight and none once it is proved stopped; retries back off from
// the first wait to the last; closing an endpoint forgets its peers.
#include "protocol/fence_book.h"

#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <chrono>
#include <map>
#include <set>
#include <vector>

namespace kvferry::protocol {
namespace {

using std::chrono::seconds;

constexpr core::TimePoint kT0{};

TEST(FenceBook, APeerIsOneEpochOfOneProcessBehindOneEndpointAndIsNeverReused) {
  FenceBook book(seconds(1), seconds(60));
  const core::PeerId a = book.PeerFor({1, "p-1", 0});
  EXPECT_EQ(book.PeerFor({1, "p-1", 0}), a);
  const core::PeerId next_epoch = book.PeerFor({1, "p-1", 1});
  const core::PeerId other_process = book.PeerFor({1, "p-2", 0});
  const core::PeerId other_endpoint = book.PeerFor({2, "p-1", 0});
  EXPECT_EQ((std::set<core::PeerId>{a, next_epoch, other_process, other_endpoint}).size(), 4u);

  book.ForgetEndpoint(1);
  EXPECT_EQ(book.Find(a), nullptr);
  EXPECT_EQ(book.Find(next_epoch), nullptr);
  EXPECT_EQ(book.Find(other_process), nullptr);
  ASSERT_NE(book.Find(other_endpoint), nullptr);
  EXPECT_EQ(book.At(other_endpoint).endpoint, 2u);
  // The same key after the endpoint closed is a new writer: a new id.
  const core::PeerId again = book.PeerFor({1, "p-1", 0});
  EXPECT_NE(again, a);
  EXPECT_NE(again, other_endpoint);
}

TEST(FenceBook, APeerIsFencedOnceAtATimeAndNeverAgainOnceProvedStopped) {
  FenceBook book(seconds(1), seconds(60));
  const core::PeerId peer = book.PeerFor({3, "p", 0});
  const auto first = book.Start(peer);
  ASSERT_TRUE(first.has_value());
  EXPECT_FALSE(book.Start(peer).has_value()) << "a second fence while one is in flight";
  EXPECT_EQ(book.fences_in_flight(), 1u);

  const auto done = book.Finish(*first);
  ASSERT_TRUE(done.has_value());
  EXPECT_EQ(done->peer, peer);
  EXPECT_EQ(done->endpoint, 3u);
  EXPECT_FALSE(book.Finish(*first).has_value()) << "a fence ends once";

  const auto second = book.Start(peer);  // the first failed: may be asked again
  ASSERT_TRUE(second.has_value());
  EXPECT_NE(*second, *first);
  ASSERT_TRUE(book.Finish(*second).has_value());
  book.MarkQuiesced(peer);
  EXPECT_TRUE(book.Quiesced(peer));
  EXPECT_FALSE(book.Start(peer).has_value()) << "proved stopped: nothing more to prove";
}

TEST(FenceBook, RetriesBackOffFromTheFirstWaitToTheLastAndProofClearsTheBackOff) {
  FenceBook book(seconds(1), seconds(5));
  const core::PeerId peer = book.PeerFor({1, "p", 0});
  EXPECT_EQ(book.NextRetry(), core::kNever);
  core::TimePoint now = kT0;
  std::vector<core::Duration> waits;
  for (int i = 0; i < 5; ++i) {
    book.ScheduleRetry(peer, now);
    const core::TimePoint due = book.NextRetry();
    waits.push_back(due - now);
    EXPECT_TRUE(book.TakeDueRetries(due - std::chrono::nanoseconds(1)).empty());
    EXPECT_EQ(book.TakeDueRetries(due), std::vector<core::PeerId>{peer});
    now = due;
  }
  EXPECT_EQ(waits, (std::vector<core::Duration>{seconds(1), seconds(2), seconds(4), seconds(5),
                                                seconds(5)}));
  book.MarkQuiesced(peer);
  book.ScheduleRetry(peer, now);  // the back-off starts over
  EXPECT_EQ(book.NextRetry() - now, seconds(1));
}

// Under any sequence of operations: Start never hands out a fence for a peer with one in flight
// or one proved stopped, every fence finishes at most once, and ids are unique.
RC_GTEST_PROP(FenceBookProperties, NeverTwoFencesOfOnePeerAndNoneOfAStoppedOne, ()) {
  FenceBook book(seconds(1), seconds(60));
  std::vector<core::PeerId> peers;
  for (EndpointId ep = 0; ep < 3; ++ep) {
    for (std::uint32_t epoch = 0; epoch < 2; ++epoch)
      peers.push_back(book.PeerFor({ep, "p", epoch}));
  }
  std::map<std::uint64_t, core::PeerId> in_flight;
  std::set<core::PeerId> stopped;
  std::set<std::uint64_t> ever;
  const auto steps = *rc::gen::container<std::vector<std::pair<int, int>>>(
      rc::gen::pair(rc::gen::inRange(0, 3), rc::gen::inRange(0, 64)));
  for (const auto& [kind, pick] : steps) {
    const core::PeerId peer = peers[static_cast<std::size_t>(pick) % peers.size()];
    if (kind == 0) {
      bool busy = false;
      for (const auto& [id, p] : in_flight) busy = busy || p == peer;
      const auto id = book.Start(peer);
      RC_ASSERT(id.has_value() == (!busy && stopped.count(peer) == 0));
      if (id) {
        RC_ASSERT(ever.insert(*id).second);
        in_flight[*id] = peer;
      }
    } else if (!in_flight.empty()) {
      auto it = in_flight.begin();
      std::advance(it, pick % static_cast<int>(in_flight.size()));
      const auto done = book.Finish(it->first);
      RC_ASSERT(done.has_value());
      RC_ASSERT(done->peer == it->second);
      RC_ASSERT(!book.Finish(it->first).has_value());
      if (kind == 2) {
        book.MarkQuiesced(it->second);
        stopped.insert(it->second);
      }
      in_flight.erase(it);
    }
    RC_ASSERT(book.fences_in_flight() == in_flight.size());
  }
}

}  // namespace
}  // namespace kvferry::protocol
