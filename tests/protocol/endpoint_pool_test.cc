// EndpointPool (protocol/endpoint_pool.h): D's side channels stay within their two caps under any
// sequence of acquires, endings and idle passes, a busy endpoint never closes, ids are never
// reused, and closed ones keep their address for late reports.
#include "protocol/endpoint_pool.h"

#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

namespace kvferry::protocol {
namespace {

struct State {
  std::string address;
  int in_flight = 0;  // what makes an endpoint busy in this test
};

struct Step {
  int kind;     // 0: acquire and send on it; 1: something on it ends; 2: an idle pass
  int address;  // acquire: which of a few addresses
  int pick;     // ends: which open endpoint (modulo their count)
};

RC_GTEST_PROP(EndpointPoolProperties, StaysWithinItsCapsAndNeverClosesABusyEndpoint, ()) {
  const auto max_open = *rc::gen::inRange<std::size_t>(1, 6);
  const auto max_idle = *rc::gen::inRange<std::size_t>(0, max_open + 1);
  const auto steps = *rc::gen::container<std::vector<Step>>(rc::gen::build<Step>(
      rc::gen::set(&Step::kind, rc::gen::inRange(0, 3)),
      rc::gen::set(&Step::address, rc::gen::inRange(0, 9)),
      rc::gen::set(&Step::pick, rc::gen::inRange(0, 64))));

  EndpointPool<State> pool(max_open, max_idle);
  std::set<EndpointId> ever;    // every id handed out
  std::set<EndpointId> closed;  // every id closed (by on_close and TakeClosed alike)
  std::map<EndpointId, std::string> address_of;
  std::set<EndpointId> noted;  // noted maybe idle since the last idle pass
  auto on_close = [&](EndpointId id) {
    const State* state = pool.Find(id);
    RC_ASSERT(state != nullptr);
    RC_ASSERT(state->in_flight == 0);  // never a busy one
    RC_ASSERT(closed.insert(id).second);
  };
  auto busy = [](const State& s) { return s.in_flight > 0; };

  for (const Step& step : steps) {
    if (step.kind == 0) {
      const std::string address = "tcp://p" + std::to_string(step.address);
      const std::optional<EndpointId> id = pool.Acquire(address, on_close);
      if (!id) {
        // Refused only when every open one is busy, or has not been through an idle pass
        // since it ended what it carried.
        RC_ASSERT(pool.size() == max_open);
        for (const auto& [open_id, state] : pool) {
          RC_ASSERT(state.in_flight > 0 || noted.count(open_id) == 1);
        }
        continue;
      }
      RC_ASSERT(closed.count(*id) == 0);  // never a closed id again
      if (ever.insert(*id).second) address_of[*id] = address;
      RC_ASSERT(address_of[*id] == address);
      pool.At(*id).in_flight++;
    } else if (step.kind == 1 && pool.size() > 0) {
      std::vector<EndpointId> busy_ids;
      for (const auto& [id, state] : pool) {
        if (state.in_flight > 0) busy_ids.push_back(id);
      }
      if (busy_ids.empty()) continue;
      const EndpointId id = busy_ids[static_cast<std::size_t>(step.pick) % busy_ids.size()];
      pool.At(id).in_flight--;
      pool.NoteMaybeIdle(id);
      noted.insert(id);
    } else if (step.kind == 2) {
      pool.CloseIdle(busy, on_close);
      noted.clear();
      std::size_t idle = 0;
      for (const auto& [id, state] : pool) idle += state.in_flight == 0 ? 1 : 0;
      RC_ASSERT(idle <= max_idle);
    }
    RC_ASSERT(pool.size() <= max_open);
    for (EndpointId id : pool.TakeClosed()) {
      RC_ASSERT(closed.count(id) == 1);
      RC_ASSERT(pool.Find(id) == nullptr);
      RC_ASSERT(*pool.AddressOf(id) == address_of[id]);  // remembered after closing
    }
  }
}

TEST(EndpointPoolTest, TheLeastRecentlyIdleEndpointClosesFirstAndAnIdleOneReusedIsNotClosed) {
  EndpointPool<State> pool(/*max_open=*/2, /*max_idle=*/2);
  std::vector<EndpointId> closed;
  auto on_close = [&](EndpointId id) { closed.push_back(id); };
  auto busy = [](const State& s) { return s.in_flight > 0; };
  const EndpointId a = *pool.Acquire("a", on_close);
  const EndpointId b = *pool.Acquire("b", on_close);
  pool.NoteMaybeIdle(a);
  pool.NoteMaybeIdle(b);
  pool.CloseIdle(busy, on_close);
  EXPECT_EQ(*pool.Acquire("a", on_close), a);  // idle, in use again: not closed for "c"
  const EndpointId c = *pool.Acquire("c", on_close);
  EXPECT_EQ(closed, std::vector<EndpointId>{b});
  EXPECT_NE(c, b);
  EXPECT_EQ(pool.TakeClosed(), std::vector<EndpointId>{b});
  EXPECT_EQ(*pool.AddressOf(b), "b");
  EXPECT_EQ(pool.IdOf("b"), std::nullopt);
  // "b" again is a new endpoint: nothing meant for the old socket reaches the new one.
  pool.NoteMaybeIdle(c);
  pool.CloseIdle(busy, on_close);
  const EndpointId b2 = *pool.Acquire("b", on_close);
  EXPECT_NE(b2, b);
}

}  // namespace
}  // namespace kvferry::protocol
