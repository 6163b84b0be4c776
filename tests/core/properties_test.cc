// Properties of the core state machines over arbitrary interleavings (rapidcheck).
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
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
// HoldTable: for any sequence of admissions, prefill completions, renewals, pulls, sends and
// time steps, no entry is released by expiry before its deadline, none survives its deadline
// past one expiry pass, and a pull for a released id fails at once.

enum class Op {
  kAdmit,
  kPrefillDone,
  kRenew,
  kPull,
  kBeginSend,
  kEndSendOk,
  kEndSendFail,
  kEngineFinished,
  kAdvance
};

struct HoldStep {
  Op op;
  int id;
  int rank;
  int advance_ms;
};

RC_GTEST_PROP(HoldTableProperties, ExpiryIsNeverEarlyNorLateAndLatePullsFailAtOnce, ()) {
  HoldConfig config;
  config.lease = *rc::gen::element<Duration>(Duration{0}, seconds(6), seconds(30));
  config.abort_request_timeout = *rc::gen::element<Duration>(seconds(20), seconds(60));
  HoldTable table(config);

  const auto steps = *rc::gen::container<std::vector<HoldStep>>(rc::gen::build<HoldStep>(
      rc::gen::set(&HoldStep::op,
                   rc::gen::element(Op::kAdmit, Op::kPrefillDone, Op::kRenew, Op::kPull,
                                    Op::kBeginSend, Op::kEndSendOk, Op::kEndSendFail,
                                    Op::kEngineFinished, Op::kAdvance, Op::kAdvance)),
      rc::gen::set(&HoldStep::id, rc::gen::inRange(0, 6)),
      rc::gen::set(&HoldStep::rank, rc::gen::inRange(0, 2)),
      rc::gen::set(&HoldStep::advance_ms, rc::gen::inRange(0, 40000))));

  TimePoint now = TimePoint{} + seconds(10);
  std::set<TransferId> released;  // released and still within the tombstone lifetime
  std::map<TransferId, TimePoint> released_at;
  for (const HoldStep& s : steps) {
    const TransferId id = "xfer-" + std::to_string(s.id);
    const auto rank = static_cast<std::uint32_t>(s.rank);
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
        (void)table.BeginSend(id, rank, now);
        break;
      case Op::kEndSendOk:
        (void)table.EndSend(id, rank, true, now);
        break;
      case Op::kEndSendFail:
        (void)table.EndSend(id, rank, false, now);
        break;
      case Op::kEngineFinished:
        table.EngineFinished(id, now);
        break;
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
    // Track what was released (by any path) for the late-pull check.
    for (const HoldEvent& e : table.TakeEvents()) (void)e;
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
