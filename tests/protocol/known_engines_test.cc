// KnownEngines (protocol/known_engines.h): one lookup per engine and address, at most four at
// once; answers asked before a down or a process gone are stale; a failed lookup is believed for
// its address only, for the ttl; a failed refresh hands everything back for the known view; a
// new incarnation is a restart only at the bootstrap the old one came from; engines never
// reached are forgotten; parked work is handed back exactly once.
#include "protocol/known_engines.h"

#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <chrono>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace kvferry::protocol {
namespace {

using std::chrono::seconds;

constexpr core::TimePoint kT0{};
const core::Duration kTimeout = seconds(5);
const core::Duration kTtl = seconds(2);

PeerEngine View(const std::string& incarnation) {
  return PeerEngine{"p", incarnation, 1, {"tcp://p:1"}, 0};
}

ParkedLoad LoadAt(const std::string& request, const std::string& address) {
  return ParkedLoad{request, RemoteSource{"x-" + request, "p", address}, {1, 2}};
}

// The one lookup asked since the last call, at `address`: its id.
std::uint64_t OnlyLookup(KnownEngines& engines, const std::string& address) {
  std::vector<LookupRequest> asked = engines.TakeLookups();
  EXPECT_EQ(asked.size(), 1u);
  if (asked.size() != 1) return 0;
  EXPECT_EQ(asked[0].bootstrap_address, address);
  return asked[0].id;
}

TEST(KnownEngines, OneLookupPerAddressAndAtMostFourAddressesAtOnce) {
  KnownEngines engines(kTimeout, kTtl);
  KnownEngine& p = engines.Note("p", "http://b0");
  engines.Ask("p", p, kT0);
  engines.Ask("p", p, kT0);  // in flight there already
  EXPECT_EQ(engines.TakeLookups().size(), 1u);
  const std::vector<std::string> others = {"http://b1", "http://b2", "http://b3", "http://b4"};
  for (const std::string& address : others) engines.Ask("p", p, kT0, &address);
  const std::vector<LookupRequest> asked = engines.TakeLookups();
  ASSERT_EQ(asked.size(), 3u);  // four in flight: b4 waits
  EXPECT_LT(asked[0].id, asked[1].id);
  EXPECT_LT(asked[1].id, asked[2].id);
  EXPECT_EQ(engines.stats().lookups, 4u);
}

TEST(KnownEngines, ALookupNotAnsweredByItsDeadlineIsExpiredAndItsFailureFailsItsLoads) {
  KnownEngines engines(kTimeout, kTtl);
  KnownEngine& p = engines.Note("p", "http://b0");
  p.parked.loads.push_back(LoadAt("r1", ""));
  engines.Ask("p", p, kT0);
  const std::uint64_t id = OnlyLookup(engines, "http://b0");
  EXPECT_EQ(engines.NextDeadline(), kT0 + kTimeout);
  EXPECT_TRUE(engines.Expired(kT0 + kTimeout - seconds(1)).empty());
  const auto expired = engines.Expired(kT0 + kTimeout);
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].first, "p");
  EXPECT_EQ(expired[0].second, id);

  const auto failed =
      engines.OnFailure("p", Status(ErrorCode::kTimeout, "no answer"), kT0 + kTimeout, id);
  ASSERT_TRUE(failed.has_value());
  EXPECT_FALSE(failed->refreshed);
  ASSERT_EQ(failed->parked.loads.size(), 1u);
  EXPECT_EQ(failed->entry->failure().code(), ErrorCode::kTimeout);
  EXPECT_EQ(engines.NextDeadline(), core::kNever);
  // A second report of the same lookup says nothing new.
  EXPECT_FALSE(engines.OnFailure("p", Status(ErrorCode::kTimeout, "again"), kT0 + kTimeout, id));
}

TEST(KnownEngines, AFailedLookupFailsOnlyTheLoadsThatNamedItsAddressAndIsBelievedForTheTtl) {
  KnownEngines engines(kTimeout, kTtl);
  KnownEngine& p = engines.Note("p", "http://a");
  p.parked.loads.push_back(LoadAt("r-a", "http://a"));
  p.parked.loads.push_back(LoadAt("r-b", "http://b"));
  engines.AskForParked("p", p, kT0);
  std::map<std::string, std::uint64_t> by_address;
  for (const LookupRequest& l : engines.TakeLookups()) by_address[l.bootstrap_address] = l.id;
  ASSERT_EQ(by_address.size(), 2u);

  const auto failed = engines.OnFailure("p", Status(ErrorCode::kUnavailable, "refused"), kT0,
                                        by_address["http://a"]);
  ASSERT_TRUE(failed.has_value());
  ASSERT_EQ(failed->parked.loads.size(), 1u);
  EXPECT_EQ(failed->parked.loads[0].request, "r-a");
  ASSERT_EQ(p.parked.loads.size(), 1u);  // r-b waits for its own lookup
  EXPECT_EQ(p.parked.loads[0].request, "r-b");
  EXPECT_TRUE(p.FailureCovers("http://a", kT0 + kTtl - seconds(1)));
  EXPECT_FALSE(p.FailureCovers("http://b", kT0));
  EXPECT_FALSE(p.FailureCovers("http://a", kT0 + kTtl));
  EXPECT_NE(p.failure().message().find("bootstrap lookup of p"), std::string::npos);
}

TEST(KnownEngines, AFailedRefreshHandsEverythingBackForTheKnownView) {
  KnownEngines engines(kTimeout, kTtl);
  KnownEngine& p = engines.Note("p", "http://a");
  engines.Ask("p", p, kT0);
  ASSERT_TRUE(engines.OnAnswer(View("i1"), kT0, OnlyLookup(engines, "http://a")));
  engines.MarkViewsStale("tcp://p:1");
  EXPECT_TRUE(p.view_stale());
  p.parked.loads.push_back(LoadAt("r1", ""));
  p.parked.releases.push_back(7);
  engines.AskForParked("p", p, kT0);
  const auto failed = engines.OnFailure("p", Status(ErrorCode::kUnavailable, "down"), kT0,
                                        OnlyLookup(engines, "http://a"));
  ASSERT_TRUE(failed.has_value());
  EXPECT_TRUE(failed->refreshed);
  EXPECT_EQ(failed->parked.loads.size(), 1u);
  EXPECT_EQ(failed->parked.releases.size(), 1u);
  EXPECT_TRUE(p.parked.empty());
  EXPECT_FALSE(p.FailureBelieved(kT0));
  ASSERT_NE(p.view(), nullptr);
  EXPECT_EQ(p.view()->incarnation, "i1");
}

TEST(KnownEngines, ANewIncarnationIsARestartOnlyAtTheBootstrapTheOldOneCameFrom) {
  KnownEngines engines(kTimeout, kTtl);
  KnownEngine& p = engines.Note("p", "http://a");
  engines.Ask("p", p, kT0);
  ASSERT_TRUE(engines.OnAnswer(View("i1"), kT0, OnlyLookup(engines, "http://a")));

  const std::string b = "http://b";
  engines.Ask("p", p, kT0, &b);
  auto elsewhere = engines.OnAnswer(View("i2"), kT0, OnlyLookup(engines, b));
  ASSERT_TRUE(elsewhere.has_value());
  EXPECT_EQ(elsewhere->previous, "i1");
  EXPECT_FALSE(elsewhere->replaced);  // another service says nothing of i1

  engines.Ask("p", p, kT0, &b);  // i2 was learned at b
  auto same = engines.OnAnswer(View("i3"), kT0, OnlyLookup(engines, b));
  ASSERT_TRUE(same.has_value());
  EXPECT_EQ(same->previous, "i2");
  EXPECT_TRUE(same->replaced);

  engines.Ask("p", p, kT0, &b);
  auto unchanged = engines.OnAnswer(View("i3"), kT0, OnlyLookup(engines, b));
  ASSERT_TRUE(unchanged.has_value());
  EXPECT_FALSE(unchanged->previous.has_value());
}

TEST(KnownEngines, AnAnswerAskedBeforeADownIsStaleAndWhatWaitsIsAskedForAgain) {
  KnownEngines engines(kTimeout, kTtl);
  KnownEngine& p = engines.Note("p", "http://a");
  engines.Ask("p", p, kT0);
  const std::uint64_t before = OnlyLookup(engines, "http://a");
  const auto down = engines.OnEngineDown("p", Status(ErrorCode::kUnavailable, "lease lapsed"), kT0);
  ASSERT_TRUE(down.has_value());
  EXPECT_FALSE(down->view.has_value());
  EXPECT_TRUE(p.FailureCovers("http://anywhere", kT0));
  EXPECT_EQ(engines.NextDeadline(), core::kNever);  // the lookup in flight is dropped

  p.parked.renewals.push_back({1, 2});
  EXPECT_FALSE(engines.OnAnswer(View("dead"), kT0 + seconds(1), before).has_value());
  EXPECT_EQ(engines.stats().lookups_stale, 1u);
  EXPECT_EQ(p.view(), nullptr);
  EXPECT_EQ(p.parked.renewals.size(), 1u);  // still waiting, for the fresh lookup asked
  const std::uint64_t fresh = OnlyLookup(engines, "http://a");
  EXPECT_GT(fresh, before);
  EXPECT_TRUE(engines.OnAnswer(View("alive"), kT0 + seconds(1), fresh).has_value());
}

TEST(KnownEngines, ADownKeepsTheViewAsDeclaredDownUntilTheNextAnswer) {
  KnownEngines engines(kTimeout, kTtl);
  KnownEngine& p = engines.Note("p", "http://a");
  engines.Ask("p", p, kT0);
  ASSERT_TRUE(engines.OnAnswer(View("i1"), kT0, OnlyLookup(engines, "http://a")));
  p.parked.loads.push_back(LoadAt("r1", ""));
  p.pending_releases.push_back(9);
  auto down = engines.OnEngineDown("p", Status(ErrorCode::kUnavailable, "gone"), kT0);
  ASSERT_TRUE(down.has_value());
  ASSERT_TRUE(down->view.has_value());
  EXPECT_EQ(down->parked.loads.size(), 1u);
  EXPECT_EQ(down->parked.releases, std::vector<core::Fingerprint>{9});
  EXPECT_TRUE(p.pending_releases.empty());
  EXPECT_EQ(p.view(), nullptr);
  engines.DeclareDown(*down->entry, *down->view);
  ASSERT_NE(p.declared_down(), nullptr);
  EXPECT_EQ(p.declared_down()->incarnation, "i1");

  engines.Ask("p", p, kT0 + kTtl);
  ASSERT_TRUE(engines.OnAnswer(View("i1"), kT0 + kTtl, OnlyLookup(engines, "http://a")));
  EXPECT_EQ(p.declared_down(), nullptr);
  ASSERT_NE(p.view(), nullptr);
}

TEST(KnownEngines, AProcessGoneDropsOnlyAViewOfThatProcessAndMakesEarlierAnswersStale) {
  KnownEngines engines(kTimeout, kTtl);
  KnownEngine& p = engines.Note("p", "http://a");
  engines.Ask("p", p, kT0);
  ASSERT_TRUE(engines.OnAnswer(View("i2"), kT0, OnlyLookup(engines, "http://a")));
  ASSERT_NE(engines.OnProcessGone("p", "i1", kT0), nullptr);
  ASSERT_NE(p.view(), nullptr);  // another process

  p.parked.loads.push_back(LoadAt("r1", ""));
  engines.Ask("p", p, kT0);
  const std::uint64_t before = OnlyLookup(engines, "http://a");
  ASSERT_NE(engines.OnProcessGone("p", "i2", kT0), nullptr);
  EXPECT_EQ(p.view(), nullptr);
  const std::uint64_t again = OnlyLookup(engines, "http://a");  // for the parked load
  EXPECT_FALSE(engines.OnAnswer(View("i2"), kT0, before).has_value());
  auto answered = engines.OnAnswer(View("i3"), kT0, again);
  ASSERT_TRUE(answered.has_value());
  EXPECT_EQ(answered->parked.loads.size(), 1u);
  EXPECT_EQ(engines.OnProcessGone("unknown", "i1", kT0), nullptr);
}

TEST(KnownEngines, EnginesNeverReachedAndNoLongerNamedAreForgotten) {
  KnownEngines engines(kTimeout, kTtl);
  engines.Note("never", "http://x");
  engines.Note("named", "http://y");
  KnownEngine& asking = engines.Note("asking", "http://z");
  engines.Ask("asking", asking, kT0);
  KnownEngine& reached = engines.Note("reached", "http://r");
  engines.Ask("reached", reached, kT0);
  for (const LookupRequest& l : engines.TakeLookups()) {
    if (l.engine_id == "reached") {
      ASSERT_TRUE(engines.OnAnswer(PeerEngine{"reached", "i", 1, {"tcp://r:1"}, 0}, kT0, l.id));
    }
  }
  ASSERT_TRUE(engines.SweepDue(kT0));
  engines.Sweep(kT0, {"named"});
  EXPECT_EQ(engines.Find("never"), nullptr);
  EXPECT_NE(engines.Find("named"), nullptr);
  EXPECT_NE(engines.Find("asking"), nullptr);
  EXPECT_NE(engines.Find("reached"), nullptr);
  EXPECT_EQ(engines.stats().engines_forgotten, 1u);
  EXPECT_FALSE(engines.SweepDue(kT0 + seconds(9)));
  EXPECT_TRUE(engines.SweepDue(kT0 + seconds(10)));
}

// Whatever the order of asks, answers, failures, deadlines, downs and processes gone: lookup ids
// increase; an engine has at most one lookup in flight per address and four in all; every load,
// renewal batch and release parked is handed back at most once, and is either handed back or
// still parked.
RC_GTEST_PROP(KnownEngines, LookupsStayBoundedAndParkedWorkIsHandedBackExactlyOnce, ()) {
  KnownEngines engines(kTimeout, kTtl);
  const std::vector<std::string> names = {"p", "q"};
  const std::vector<std::string> addresses = {"",         "http://a", "http://b",
                                              "http://c", "http://d", "http://e"};
  std::map<std::uint64_t, LookupRequest> asked;  // every lookup ever asked, by id
  // What was parked and not yet handed back, and what was: loads by request, renewal batches
  // and releases by fingerprint (each made once).
  std::set<std::string> parked;
  std::set<std::string> handed_back;
  std::uint64_t last_id = 0;
  int next_request = 0;
  core::Fingerprint next_fingerprint = 1;
  core::TimePoint now = kT0;
  auto hand_back = [&](const std::string& what) {
    RC_ASSERT(parked.erase(what) == 1u);
    RC_ASSERT(handed_back.insert(what).second);
  };
  auto take = [&](const ParkedWork& work) {
    for (const ParkedLoad& load : work.loads) hand_back("load " + load.request);
    for (const auto& batch : work.renewals) hand_back("renewal " + std::to_string(batch.at(0)));
    for (core::Fingerprint f : work.releases) hand_back("release " + std::to_string(f));
  };
  const int steps = *rc::gen::inRange(1, 80);
  for (int step = 0; step < steps; ++step) {
    const std::string& engine = names[*rc::gen::inRange<std::size_t>(0, names.size())];
    const std::string& address = addresses[*rc::gen::inRange<std::size_t>(0, addresses.size())];
    std::vector<std::uint64_t> ids;
    for (const auto& [id, l] : asked) ids.push_back(id);
    const std::uint64_t some_id =
        ids.empty() ? 0 : ids[*rc::gen::inRange<std::size_t>(0, ids.size())];
    switch (*rc::gen::inRange(0, 8)) {
      case 0: {  // a load, a renewal batch or a release parks and asks
        KnownEngine& e = engines.Note(engine, address);
        switch (*rc::gen::inRange(0, 3)) {
          case 0: {
            const std::string request = "r" + std::to_string(next_request++);
            e.parked.loads.push_back(
                ParkedLoad{request, RemoteSource{"x" + request, engine, address}, {1}});
            parked.insert("load " + request);
            break;
          }
          case 1:
            e.parked.renewals.push_back({next_fingerprint});
            parked.insert("renewal " + std::to_string(next_fingerprint++));
            break;
          default:
            e.parked.releases.push_back(next_fingerprint);
            parked.insert("release " + std::to_string(next_fingerprint++));
            break;
        }
        engines.AskForParked(engine, e, now);
        break;
      }
      case 1: {
        auto answered = engines.OnAnswer(
            PeerEngine{engine, *rc::gen::element<std::string>("i1", "i2"), 1, {"tcp://s"}, 0}, now,
            some_id);
        if (answered) take(answered->parked);
        break;
      }
      case 2: {
        auto failed =
            engines.OnFailure(engine, Status(ErrorCode::kUnavailable, "no"), now, some_id);
        if (failed) take(failed->parked);
        break;
      }
      case 3:
        for (const auto& [e, id] : engines.Expired(now)) {
          auto failed = engines.OnFailure(e, Status(ErrorCode::kTimeout, "late"), now, id);
          if (failed) take(failed->parked);
        }
        break;
      case 4: {
        auto down = engines.OnEngineDown(engine, Status(ErrorCode::kUnavailable, "down"), now);
        if (down) {
          take(down->parked);
          if (down->view) engines.DeclareDown(*down->entry, *down->view);
        }
        break;
      }
      case 5:
        (void)engines.OnProcessGone(engine, *rc::gen::element<std::string>("i1", "i2"), now);
        break;
      case 6:
        engines.MarkViewsStale("tcp://s");
        break;
      case 7:
        now += std::chrono::milliseconds(*rc::gen::inRange(0, 7000));
        if (engines.SweepDue(now)) engines.Sweep(now, {});
        break;
    }
    for (const LookupRequest& l : engines.TakeLookups()) {
      RC_ASSERT(l.id > last_id);
      last_id = l.id;
      asked.emplace(l.id, l);
    }
    // In flight: every lookup whose deadline has not been reported (Expired at the far future).
    std::map<std::string, std::set<std::string>> in_flight;
    for (const auto& [e, id] : engines.Expired(core::TimePoint::max())) {
      RC_ASSERT(asked.count(id) == 1u);
      RC_ASSERT(asked.at(id).engine_id == e);
      RC_ASSERT(in_flight[e].insert(asked.at(id).bootstrap_address).second);
    }
    for (const auto& [e, where] : in_flight) {
      RC_ASSERT(where.size() <= KnownEngines::kMaxLookupsPerEngine);
    }
  }
  // What is not handed back is still parked where it was put.
  std::set<std::string> still;
  for (const std::string& name : names) {
    if (const KnownEngine* e = engines.Find(name)) {
      for (const ParkedLoad& load : e->parked.loads) {
        RC_ASSERT(still.insert("load " + load.request).second);
      }
      for (const auto& batch : e->parked.renewals) {
        RC_ASSERT(still.insert("renewal " + std::to_string(batch.at(0))).second);
      }
      for (core::Fingerprint f : e->parked.releases) {
        RC_ASSERT(still.insert("release " + std::to_string(f)).second);
      }
    }
  }
  RC_ASSERT(still == parked);
}

}  // namespace
}  // namespace kvferry::protocol
