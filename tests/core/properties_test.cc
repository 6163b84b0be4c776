// Properties of the core state machines over arbitrary interleavings (rapidcheck).
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <bit>
#include <map>
#include <set>

#include "kvferry/core/hold_table.h"
#include "kvferry/core/receive_ledger.h"

namespace kvferry::core {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

// ---------------------------------------------------------------------------------------------
// ReceiveLedger: for any interleaving of per-peer ok / err / ERROR / FINISH / timeout events
// (with duplicates and messages after completion) a request completes exactly once, only after
// every peer entry settled, reports the first failure, and never releases a block while a peer
// entry is pending or its writer is unknown.

struct PeerEvent {
  PeerId peer;
  Settle how;
  bool quiesce;  // instead of a settle: the peer is declared dead and quiesced
};

RC_GTEST_PROP(ReceiveLedgerProperties, CompletesOnceAfterAllSettledAndNeverReleasesEarly, ()) {
  const auto num_peers = *rc::gen::inRange<PeerId>(1, 5);
  const auto events = *rc::gen::container<std::vector<PeerEvent>>(rc::gen::build<PeerEvent>(
      rc::gen::set(&PeerEvent::peer, rc::gen::inRange<PeerId>(0, num_peers + 1)),
      rc::gen::set(&PeerEvent::how,
                   rc::gen::element(Settle::kOk, Settle::kErr, Settle::kMessageError,
                                    Settle::kFinished, Settle::kTimeout)),
      rc::gen::set(&PeerEvent::quiesce, rc::gen::weightedElement<bool>({{9, false}, {1, true}}))));

  std::vector<PeerId> peers(num_peers);
  for (PeerId p = 0; p < num_peers; ++p) peers[p] = p;
  ReceiveLedger ledger;
  RC_ASSERT(ledger.Begin("r", {1, 2, 3}, peers).ok());

  // The model: what each entry's state is, and what must have been reported.
  enum class M { kPending, kSettled, kUnknownWriter };
  std::map<PeerId, M> model;
  for (PeerId p : peers) model[p] = M::kPending;
  std::optional<std::string> first_failure;
  int completions = 0;
  bool quarantined = false;
  bool released = false;
  int n = 0;

  for (const PeerEvent& ev : events) {
    const std::string reason = "failure " + std::to_string(n++);
    const bool known = ev.peer < num_peers;
    if (ev.quiesce) {
      ledger.PeerQuiesced(ev.peer);
      if (known && model[ev.peer] == M::kPending && !first_failure && completions == 0) {
        first_failure = "";  // the ledger words this failure itself
      }
      if (known) model[ev.peer] = M::kSettled;
    } else {
      ledger.Settle("r", ev.peer, ev.how, Status(ErrorCode::kUnavailable, reason));
      if (known && model[ev.peer] == M::kPending) {
        if (ev.how != Settle::kOk && !first_failure) first_failure = reason;
        model[ev.peer] = ev.how == Settle::kTimeout ? M::kUnknownWriter : M::kSettled;
      } else if (known && model[ev.peer] == M::kUnknownWriter && ev.how != Settle::kTimeout) {
        model[ev.peer] = M::kSettled;
      }
    }
    const bool all_settled =
        std::none_of(model.begin(), model.end(), [](auto& kv) { return kv.second == M::kPending; });
    const bool writers_known = std::none_of(
        model.begin(), model.end(), [](auto& kv) { return kv.second == M::kUnknownWriter; });
    for (const LedgerEvent& out : ledger.TakeEvents()) {
      if (out.kind == LedgerEvent::Kind::kCompleted) {
        ++completions;
        RC_ASSERT(all_settled);
        RC_ASSERT(out.ok == !first_failure.has_value());
        if (first_failure && !first_failure->empty()) {
          RC_ASSERT(out.error.message() == *first_failure);
        }
        quarantined = out.quarantined;
        RC_ASSERT(out.quarantined == !writers_known);
        if (!out.quarantined) released = true;
      } else {
        RC_ASSERT(completions == 1);
        RC_ASSERT(quarantined);
        RC_ASSERT(!released);
        RC_ASSERT(writers_known);
        released = true;
      }
    }
    RC_ASSERT(completions <= 1);
    if (all_settled) RC_ASSERT(completions == 1);
  }
}

// ---------------------------------------------------------------------------------------------
// HoldTable: for any sequence of admissions, prefill completions, renewals, pulls, sends,
// decoder releases and time steps, no entry is released by expiry before its deadline, none
// survives its deadline past one expiry pass, and a pull for a released id fails at once.
// Against a model of each live entry (the D ranks that pulled it, released it, or are being
// sent it): every entry that leaves the table emits exactly one kReleased, last among its
// events; no entry leaves (and no kFreeBlocks is emitted) while a send reads its blocks; and an
// entry leaves as kSent / kReleasedByDecoder only once every paired rank pulled or released it.

enum class Op {
  kAdmit,
  kPrefillDone,
  kRenew,
  kPull,
  kBeginSend,
  kEndSendOk,
  kEndSendFail,
  kEngineFinished,
  kRelease,
  kWholePull,  // a pull that is ready at once, sent and landed in one step
  kAdvance
};

struct HoldStep {
  Op op;
  int id;
  int rank;
  int advance_ms;
  int release_need;  // need_send of a release of an id P does not hold (1 or 2)
};

// What the property test knows of one live entry: D rank bits.
struct EntryModel {
  std::uint64_t sent = 0;      // EndSend(ok) succeeded
  std::uint64_t released = 0;  // ReleaseByDecoder answered kReleased or kKept
  std::uint64_t sending = 0;   // BeginSend succeeded, EndSend not yet called
};
constexpr int kPairedRanks = 2;  // every pull of the test says need_send 2

RC_GTEST_PROP(HoldTableProperties, ExpiryIsNeverEarlyNorLateAndLatePullsFailAtOnce, ()) {
  HoldConfig config;
  config.lease = *rc::gen::element<Duration>(Duration{0}, seconds(6), seconds(30));
  config.abort_request_timeout = *rc::gen::element<Duration>(seconds(20), seconds(60));
  HoldTable table(config);

  const auto steps = *rc::gen::container<std::vector<HoldStep>>(rc::gen::build<HoldStep>(
      rc::gen::set(&HoldStep::op, rc::gen::weightedElement<Op>({{2, Op::kAdmit},
                                                                {2, Op::kPrefillDone},
                                                                {1, Op::kRenew},
                                                                {2, Op::kPull},
                                                                {2, Op::kBeginSend},
                                                                {2, Op::kEndSendOk},
                                                                {1, Op::kEndSendFail},
                                                                {1, Op::kEngineFinished},
                                                                {2, Op::kRelease},
                                                                {2, Op::kWholePull},
                                                                {3, Op::kAdvance}})),
      // Weighted towards one id, so that its entry often lives through both ranks' pulls,
      // sends and releases (a uniform pick rarely completes a send to two ranks).
      rc::gen::set(&HoldStep::id,
                   rc::gen::weightedElement<int>({{6, 0}, {2, 1}, {1, 2}, {1, 3}, {1, 4}, {1, 5}})),
      rc::gen::set(&HoldStep::rank, rc::gen::inRange(0, 2)),
      rc::gen::set(&HoldStep::advance_ms, rc::gen::inRange(0, 40000)),
      rc::gen::set(&HoldStep::release_need, rc::gen::inRange(1, 3))));

  TimePoint now = TimePoint{} + seconds(10);
  std::set<TransferId> released;  // released and still within the tombstone lifetime
  std::map<TransferId, TimePoint> released_at;
  std::map<TransferId, EntryModel> model;  // live entries only
  for (const HoldStep& s : steps) {
    const TransferId id = "xfer-" + std::to_string(s.id);
    const auto rank = static_cast<std::uint32_t>(s.rank);
    const std::uint64_t bit = std::uint64_t{1} << rank;
    std::set<TransferId> live_before;
    for (int i = 0; i < 6; ++i) {
      const TransferId other = "xfer-" + std::to_string(i);
      if (table.Contains(other)) live_before.insert(other);
    }
    switch (s.op) {
      case Op::kAdmit:
        (void)table.Admit(id, 1, now);
        break;
      case Op::kPrefillDone:
        (void)table.PrefillDone(id, 2, now);
        break;
      case Op::kRenew: {
        const Fingerprint fp = FingerprintOf(id);
        (void)table.Renew(std::span<const Fingerprint>(&fp, 1), now);
        break;
      }
      case Op::kPull: {
        const bool was_live = table.Contains(id);
        const bool tombstoned = table.IsTombstoned(id);
        PullAdmission a = table.AdmitPull(id, rank, 2, std::nullopt, now);
        if (!was_live && released.count(id) != 0) {
          // Late pull: at once, never a wait.
          RC_ASSERT(tombstoned);
          RC_ASSERT(a.verdict == PullAdmission::Verdict::kFail);
          RC_ASSERT(a.error.code() == ErrorCode::kTombstoned);
        }
        break;
      }
      case Op::kBeginSend:
        if (table.BeginSend(id, rank, now).ok()) {
          RC_ASSERT((model[id].sending & bit) == 0);
          RC_ASSERT((model[id].released & bit) == 0);  // a released rank is never sent
          model[id].sending |= bit;
        }
        break;
      case Op::kEndSendOk:
      case Op::kEndSendFail: {
        const bool ok = s.op == Op::kEndSendOk;
        if (table.EndSend(id, rank, ok, now).ok()) {
          RC_ASSERT((model[id].sending & bit) != 0);
          model[id].sending &= ~bit;
          if (ok) model[id].sent |= bit;
        }
        break;
      }
      case Op::kEngineFinished:
        table.EngineFinished(id, now);
        break;
      case Op::kWholePull: {
        // A rank that has not pulled or released it yet, if any: completes entries often.
        std::uint32_t r = rank;
        if (const auto m = model.find(id); m != model.end()) {
          const std::uint64_t done = m->second.sent | m->second.released | m->second.sending;
          for (std::uint32_t c = 0; c < kPairedRanks; ++c) {
            if (((done >> c) & 1) == 0) {
              r = c;
              break;
            }
          }
        }
        if (table.AdmitPull(id, r, kPairedRanks, std::nullopt, now).verdict !=
                PullAdmission::Verdict::kReady ||
            !table.BeginSend(id, r, now).ok()) {
          break;
        }
        RC_ASSERT(table.EndSend(id, r, true, now).ok());
        model[id].sent |= std::uint64_t{1} << r;
        break;
      }
      case Op::kRelease: {
        const bool was_live = table.Contains(id);
        const bool was_tombstoned = table.IsTombstoned(id);
        // Paired ranks agree on need_send; for ids P does not hold, try both kinds.
        const auto need = static_cast<std::uint32_t>(was_live ? kPairedRanks : s.release_need);
        const auto out = table.ReleaseByDecoder(FingerprintOf(id), rank, need, now);
        using RV = HoldTable::ReleaseOutcome::Verdict;
        if (was_live) {
          EntryModel& m = model[id];
          if (((m.sent | m.released) & bit) != 0) {
            RC_ASSERT(out.verdict == RV::kIgnored);  // repeated, or after its pull
          } else {
            m.released |= bit;
            const bool done = std::popcount(m.sent | m.released) >= kPairedRanks;
            RC_ASSERT(out.verdict == (done ? RV::kReleased : RV::kKept));
            if (!done) RC_ASSERT(table.Contains(id));
            // Released means gone, or doomed until the sends reading it end.
            if (done && table.Contains(id)) RC_ASSERT(m.sending != 0);
          }
        } else if (was_tombstoned) {
          RC_ASSERT(out.verdict == RV::kIgnored);
        } else if (need == 1) {
          RC_ASSERT(out.verdict == RV::kTombstoned);
          RC_ASSERT(table.IsTombstoned(id));
          RC_ASSERT(!table.Contains(id));
        } else {
          RC_ASSERT(out.verdict == RV::kIgnored);
          RC_ASSERT(!table.IsTombstoned(id));
          RC_ASSERT(!table.Contains(id));
        }
        break;
      }
      case Op::kAdvance: {
        // Deadlines as they stand before the pass.
        std::map<TransferId, TimePoint> deadline;
        for (int i = 0; i < 6; ++i) {
          const TransferId other = "xfer-" + std::to_string(i);
          if (auto d = table.DeadlineOf(other)) deadline[other] = *d;
        }
        now += milliseconds(s.advance_ms);
        table.Expire(now);
        for (const auto& [other, d] : deadline) {
          if (table.Contains(other)) {
            RC_ASSERT(d > now);  // not late: a passed deadline never survives a pass
          } else {
            RC_ASSERT(d <= now);  // not early: expiry removed only what was due
          }
        }
        break;
      }
    }
    // Every entry that left the table emitted exactly one kReleased, last among its events;
    // no other entry emitted one.
    const std::vector<HoldEvent> events = table.TakeEvents();
    std::map<TransferId, int> released_events;
    for (std::size_t i = 0; i < events.size(); ++i) {
      const HoldEvent& e = events[i];
      const EntryModel m = model.count(e.id) != 0 ? model.at(e.id) : EntryModel{};
      if (e.kind == HoldEvent::Kind::kFreeBlocks) {
        RC_ASSERT(m.sending == 0);  // never free blocks a write is reading
      }
      if (e.kind != HoldEvent::Kind::kReleased) continue;
      ++released_events[e.id];
      RC_ASSERT(live_before.count(e.id) != 0);
      RC_ASSERT(m.sending == 0);
      for (std::size_t j = i + 1; j < events.size(); ++j) RC_ASSERT(events[j].id != e.id);
      // "Done" reasons only once every paired rank pulled or released it.
      if (e.reason == ReleaseReason::kSent) {
        RC_ASSERT(m.released == 0);
        RC_ASSERT(std::popcount(m.sent) >= kPairedRanks);
      } else if (e.reason == ReleaseReason::kReleasedByDecoder) {
        RC_ASSERT(m.released != 0);
        RC_ASSERT(std::popcount(m.sent | m.released) >= kPairedRanks);
      } else {
        RC_ASSERT(!e.status.ok());  // what a D rank still waiting hears
      }
    }
    for (int i = 0; i < 6; ++i) {
      const TransferId other = "xfer-" + std::to_string(i);
      const bool left = live_before.count(other) != 0 && !table.Contains(other);
      RC_ASSERT(released_events[other] == (left ? 1 : 0));
      if (!table.Contains(other)) model.erase(other);  // the next entry of this id starts anew
    }
    std::uint64_t sending = 0;
    for (const auto& [other, m] : model) sending += std::popcount(m.sending);
    RC_ASSERT(table.stats().sending == sending);
    // Track what was released (by any path) for the late-pull check.
    for (int i = 0; i < 6; ++i) {
      const TransferId other = "xfer-" + std::to_string(i);
      if (table.IsTombstoned(other) && !table.Contains(other)) {
        if (released.insert(other).second) released_at[other] = now;
      }
    }
    for (auto it = released.begin(); it != released.end();) {
      if (!table.IsTombstoned(*it)) {
        RC_ASSERT(now >= released_at[*it] + config.abort_request_timeout);
        it = released.erase(it);
      } else {
        ++it;
      }
    }
  }
}

}  // namespace
}  // namespace kvferry::core
