#include "kvferry/core/hold_table.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cassert>

namespace kvferry::core {

const char* ToString(HoldPhase phase) {
  switch (phase) {
    case HoldPhase::kPlaceholder:
      return "placeholder";
    case HoldPhase::kPrefilling:
      return "prefilling";
    case HoldPhase::kReady:
      return "ready";
  }
  return "unknown";
}

const char* ToString(ReleaseReason reason) {
  switch (reason) {
    case ReleaseReason::kSent:
      return "sent";
    case ReleaseReason::kExpired:
      return "expired";
    case ReleaseReason::kDeadDecoder:
      return "dead_decoder";
    case ReleaseReason::kWaitTimeout:
      return "wait_timeout";
    case ReleaseReason::kLeaseMismatch:
      return "lease_mismatch";
    case ReleaseReason::kAbortedByEngine:
      return "aborted_by_engine";
    case ReleaseReason::kReleasedByDecoder:
      return "released_by_decoder";
  }
  return "unknown";
}

bool LeftDecoderWaiting(ReleaseReason reason) {
  return reason != ReleaseReason::kSent && reason != ReleaseReason::kReleasedByDecoder;
}

namespace {

std::string LeaseText(std::optional<Duration> lease) {
  if (!lease) return "unspecified";
  if (lease->count() == 0) return "off";
  return fmt::format("{}s", ToSeconds(*lease));
}

}  // namespace

HoldStats& HoldStats::operator+=(const HoldStats& other) {
  // The tables cover every field (hold_table.h checks the struct's size against them).
  AddStats<HoldStats>(*this, other, kHoldStatFields);
  AddFamily(*this, other, kHoldEntriesFamily);
  AddFamily(*this, other, kHoldReleasedFamily);
  return *this;
}

HoldTable::HoldTable(HoldConfig config) : config_(config) {}

HoldTable::Entry* HoldTable::Find(const TransferId& id) {
  auto it = entries_.find(FingerprintOf(id));
  if (it == entries_.end() || it->second.id != id) return nullptr;
  return &it->second;
}

const HoldTable::Entry* HoldTable::Find(const TransferId& id) const {
  return const_cast<HoldTable*>(this)->Find(id);
}

bool HoldTable::Contains(const TransferId& id) const { return Find(id) != nullptr; }

std::optional<HoldPhase> HoldTable::PhaseOf(const TransferId& id) const {
  const Entry* e = Find(id);
  if (e == nullptr) return std::nullopt;
  return e->phase;
}

std::optional<TimePoint> HoldTable::DeadlineOf(const TransferId& id) const {
  const Entry* e = Find(id);
  if (e == nullptr) return std::nullopt;
  return RealDeadline(*e);
}

bool HoldTable::IsTombstoned(const TransferId& id) const {
  return tombstones_.count(FingerprintOf(id)) != 0;
}

TimePoint HoldTable::RealDeadline(const Entry& e) const {
  if (e.phase == HoldPhase::kReady) {
    if (e.sending_mask != 0) return kNever;
    // A transfer D stopped renewing for a whole lease is dropped, also when its prefill ended
    // after the last renewal (its own expire would run a full lease from the prefill's end).
    // A live D renews every lease/6, so this never binds while D is alive.
    if (config_.lease_enabled() && e.last_renewal != kNever) {
      return std::min(e.expire, e.last_renewal + config_.lease);
    }
    return e.expire;
  }
  // Armed by the first pull that waited, and kept even if that rank released it since: a
  // placeholder would otherwise never go, and a prefill a decoder once waited for stays bounded.
  TimePoint deadline = e.wait_deadline;
  if (config_.lease_enabled() && e.last_renewal != kNever) {
    deadline = std::min(deadline, e.last_renewal + config_.lease);
  }
  return deadline;
}

Status HoldTable::Admit(const TransferId& id, std::uint64_t handle, TimePoint now) {
  const Fingerprint fp = FingerprintOf(id);
  if (tombstones_.count(fp) != 0) {
    ++stats_.tombstone_hits;
    return Status(ErrorCode::kTombstoned, fmt::format("transfer {} was already released", id));
  }
  auto [it, inserted] = entries_.try_emplace(fp);
  Entry& e = it->second;
  if (inserted) {
    e.id = id;
  } else if (e.id != id) {
    return Status(ErrorCode::kAlreadyExists,
                  fmt::format("transfer {} collides with live transfer {}", id, e.id));
  } else if (e.phase != HoldPhase::kPlaceholder) {
    return Status(ErrorCode::kAlreadyExists, fmt::format("transfer {} admitted twice", id));
  } else {
    --stats_.entries[HoldPhase::kPlaceholder];
  }
  e.phase = HoldPhase::kPrefilling;
  e.handle = handle;
  ++stats_.entries[HoldPhase::kPrefilling];
  (void)now;
  Rearm(e);
  return Status::Ok();
}

Status HoldTable::PrefillDone(const TransferId& id, std::uint32_t num_blocks, TimePoint now) {
  Entry* e = Find(id);
  if (e == nullptr) {
    if (IsTombstoned(id)) {
      ++stats_.tombstone_hits;
      return Status(ErrorCode::kTombstoned,
                    fmt::format("transfer {} was released before its prefill finished", id));
    }
    return Status(ErrorCode::kNotFound, fmt::format("transfer {} was never admitted", id));
  }
  if (e->phase != HoldPhase::kPrefilling) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("transfer {}: prefill done in the wrong phase", id));
  }
  --stats_.entries[HoldPhase::kPrefilling];
  ++stats_.entries[HoldPhase::kReady];
  e->phase = HoldPhase::kReady;
  e->num_blocks = num_blocks;
  stats_.blocks_ready += num_blocks;
  e->expire = now + (config_.lease_enabled() ? config_.lease : config_.abort_request_timeout);
  e->wait_deadline = kNever;
  if (e->waiting_mask != 0) {
    e->waiting_mask = 0;
    events_.push_back({HoldEvent::Kind::kPullsReady, e->id, e->handle, ReleaseReason::kSent, {}});
  }
  Rearm(*e);
  return Status::Ok();
}

void HoldTable::EngineFinished(const TransferId& id, TimePoint now) {
  Entry* e = Find(id);
  if (e == nullptr) return;
  ReleaseOrDoom(*e, ReleaseReason::kAbortedByEngine,
                Status(ErrorCode::kCancelled, fmt::format("transfer {} was aborted on P", id)),
                now);
}

Status HoldTable::Refuse(const TransferId& id, Status why, TimePoint now) {
  const Fingerprint fp = FingerprintOf(id);
  auto it = entries_.find(fp);
  if (it != entries_.end() &&
      (it->second.id != id || it->second.phase != HoldPhase::kPlaceholder)) {
    return Status(ErrorCode::kAlreadyExists,
                  fmt::format("transfer {} is held for another request: its refusal changes "
                              "nothing",
                              id));
  }
  if (why.ok()) why = Status(ErrorCode::kCancelled, fmt::format("P refused transfer {}", id));
  // The tombstone (with the reason) first: the placeholder's release below keeps it.
  AddTombstone(fp, now, why.message());
  // A placeholder holds no blocks and has no send: it goes at once, failing its waiting pulls.
  if (it != entries_.end()) {
    Release(it->second, ReleaseReason::kAbortedByEngine, std::move(why), now);
  }
  return Status::Ok();
}

void HoldTable::ReleaseOrDoom(Entry& e, ReleaseReason reason, Status pull_error, TimePoint now) {
  if (e.sending_mask == 0) {
    Release(e, reason, std::move(pull_error), now);
    return;
  }
  // A write is reading the blocks: release when it ends (EndSend), whatever it reports.
  e.doomed = true;
  e.doom_reason = reason;
  e.doom_status = std::move(pull_error);
}

Result<HoldTable::RenewResult> HoldTable::Renew(std::span<const Fingerprint> ids, TimePoint now) {
  if (!config_.lease_enabled()) {
    stats_.renewals_rejected += ids.size();
    return Err(ErrorCode::kRejected, "this prefill instance has no kv_lease_duration");
  }
  RenewResult result;
  const TimePoint extended = now + config_.renewal_extension();
  for (Fingerprint fp : ids) {
    auto it = entries_.find(fp);
    if (it == entries_.end()) {
      ++result.unknown;
      continue;
    }
    Entry& e = it->second;
    const bool first_renewal = e.last_renewal == kNever;
    e.last_renewal = now;
    if (e.phase == HoldPhase::kReady) {
      // Only ever later: the heap key (a lower bound of the deadline) stays valid untouched.
      e.expire = std::max(e.expire, extended);
    } else if (first_renewal) {
      // The first renewal arms the dead-decoder deadline, which may be earlier than the wait
      // deadline; later renewals only move it later.
      Rearm(e);
    }
    ++result.extended;
  }
  stats_.renewals_extended += result.extended;
  stats_.renewals_unknown += result.unknown;
  return result;
}

PullAdmission HoldTable::AdmitPull(const TransferId& id, std::uint32_t d_rank,
                                   std::uint32_t need_send, std::optional<Duration> d_lease,
                                   TimePoint now) {
  using V = PullAdmission::Verdict;
  const Fingerprint fp = FingerprintOf(id);
  if (tombstones_.count(fp) != 0) {
    ++stats_.tombstone_hits;
    ++stats_.late_pulls_rejected;
    return {V::kFail, LatePull(id, fp), {}};
  }
  if (d_rank >= 64 || need_send == 0 || need_send > 64) {
    return {V::kFail,
            Status(ErrorCode::kOutOfRange,
                   fmt::format("pull of {}: d_rank {} / need_send {} outside 0..63 / 1..64", id,
                               d_rank, need_send)),
            {}};
  }
  const auto in_ms = [](Duration d) { return std::chrono::round<std::chrono::milliseconds>(d); };
  if (d_lease && in_ms(*d_lease) != in_ms(config_.lease_enabled() ? config_.lease : Duration{0})) {
    Status error(ErrorCode::kLeaseMismatch,
                 fmt::format("kv_lease_duration mismatch for {}: decoder has {}, prefiller has {}",
                             id, LeaseText(d_lease), LeaseText(config_.lease)));
    if (Entry* e = Find(id)) {
      ReleaseOrDoom(*e, ReleaseReason::kLeaseMismatch, error, now);
    } else {
      // Usually D pulls before P admits: remember the id so P does not prefill and hold KV that
      // nobody will pull.
      AddTombstone(fp, now);
    }
    return {V::kFail, error, {}};
  }
  if (entries_.count(fp) == 0 &&
      stats_.entries[HoldPhase::kPlaceholder] >= config_.max_placeholders) {
    return {V::kFail,
            Status(ErrorCode::kResourceExhausted,
                   fmt::format("pull of {}: {} pulls already wait for transfers P has not admitted",
                               id, config_.max_placeholders)),
            {}};
  }
  auto [it, inserted] = entries_.try_emplace(fp);
  Entry& e = it->second;
  if (inserted) {
    e.id = id;
    e.phase = HoldPhase::kPlaceholder;
    ++stats_.entries[HoldPhase::kPlaceholder];
  } else if (e.id != id) {
    return {V::kFail,
            Status(ErrorCode::kAlreadyExists,
                   fmt::format("transfer {} collides with live transfer {}", id, e.id)),
            {}};
  }
  if (e.doomed) {
    return {V::kFail,
            Status(ErrorCode::kCancelled, fmt::format("transfer {} is being released", id)),
            {}};
  }
  if (e.need_send == 0) {
    e.need_send = static_cast<std::uint16_t>(need_send);
  } else if (e.need_send != need_send) {
    // Counting sends against two different totals could free blocks another rank still reads.
    return {V::kFail,
            Status(ErrorCode::kInvalidArgument,
                   fmt::format("pull of {} says {} decoder ranks pull it, an earlier pull said {}",
                               id, need_send, e.need_send)),
            {}};
  }
  if (((e.sent_mask | e.sending_mask) >> d_rank) & 1) {
    return {V::kFail,
            Status(ErrorCode::kAlreadyExists,
                   fmt::format("transfer {} already sent to decoder rank {}", id, d_rank)),
            {}};
  }
  if ((e.released_mask >> d_rank) & 1) {
    return {V::kFail,
            Status(ErrorCode::kCancelled,
                   fmt::format("decoder rank {} released transfer {}", d_rank, id)),
            {}};
  }
  if (e.phase == HoldPhase::kReady) return {V::kReady, {}, {}};
  if ((e.waiting_mask >> d_rank) & 1) {
    return {V::kFail,
            Status(ErrorCode::kAlreadyExists,
                   fmt::format("decoder rank {} already waits for transfer {}", d_rank, id)),
            {}};
  }
  if (e.wait_deadline == kNever) e.wait_deadline = now + config_.abort_request_timeout;
  e.waiting_mask |= std::uint64_t{1} << d_rank;
  Rearm(e);
  return {V::kWait, {}, e.wait_deadline};
}

Status HoldTable::BeginSend(const TransferId& id, std::uint32_t d_rank, TimePoint now) {
  (void)now;
  Entry* e = Find(id);
  if (e == nullptr) {
    return Status(IsTombstoned(id) ? ErrorCode::kTombstoned : ErrorCode::kNotFound,
                  fmt::format("transfer {} is not held", id));
  }
  if (e->phase != HoldPhase::kReady) {
    return Status(ErrorCode::kInvalidArgument, fmt::format("transfer {} is not ready", id));
  }
  if (d_rank >= 64 || (((e->sent_mask | e->sending_mask | e->released_mask) >> d_rank) & 1)) {
    return Status(ErrorCode::kAlreadyExists,
                  fmt::format("transfer {} already sent, sending or released to decoder rank {}",
                              id, d_rank));
  }
  if (e->doomed) {
    return Status(ErrorCode::kCancelled, fmt::format("transfer {} is being released", id));
  }
  e->sending_mask |= std::uint64_t{1} << d_rank;
  ++stats_.sending;
  // With a send in flight the deadline is kNever: the heap key stays a valid lower bound.
  return Status::Ok();
}

Status HoldTable::EndSend(const TransferId& id, std::uint32_t d_rank, bool ok, TimePoint now) {
  Entry* e = Find(id);
  const std::uint64_t bit = d_rank < 64 ? std::uint64_t{1} << d_rank : 0;
  if (e == nullptr || (e->sending_mask & bit) == 0) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("transfer {}: no send in flight for decoder rank {}", id, d_rank));
  }
  e->sending_mask &= ~bit;
  --stats_.sending;
  if (ok) e->sent_mask |= bit;
  // Every paired rank has its KV (or released it); still, never free under a write that reads.
  if (MaybeDone(*e, now)) return Status::Ok();  // *e may be gone
  if (e->sending_mask != 0) return Status::Ok();
  if (e->doomed) {
    Release(*e, e->doom_reason, e->doom_status, now);
    return Status::Ok();
  }
  Rearm(*e);  // expiry was deferred while sending
  return Status::Ok();
}

bool HoldTable::MaybeDone(Entry& e, TimePoint now) {
  if (e.need_send == 0 || std::popcount(e.sent_mask | e.released_mask) < e.need_send) return false;
  if (e.released_mask == 0) {
    ReleaseOrDoom(e, ReleaseReason::kSent, {}, now);
  } else {
    ReleaseOrDoom(
        e, ReleaseReason::kReleasedByDecoder,
        Status(ErrorCode::kCancelled, fmt::format("transfer {} was released by its decoder", e.id)),
        now);
  }
  return true;
}

HoldTable::ReleaseOutcome HoldTable::ReleaseByDecoder(Fingerprint fp, std::uint32_t d_rank,
                                                      std::uint32_t need_send, TimePoint now) {
  using V = ReleaseOutcome::Verdict;
  auto ignored = [&](Status why) {
    ++stats_.decoder_releases_ignored;
    return ReleaseOutcome{V::kIgnored, std::move(why)};
  };
  if (d_rank >= 64 || need_send == 0 || need_send > 64) {
    return ignored(Status(
        ErrorCode::kOutOfRange,
        fmt::format("release: d_rank {} / need_send {} outside 0..63 / 1..64", d_rank, need_send)));
  }
  if (tombstones_.count(fp) != 0) {
    ++stats_.tombstone_hits;
    return ignored({});  // already freed: the release is late or repeated
  }
  auto it = entries_.find(fp);
  if (it == entries_.end()) {
    if (need_send != 1) return ignored({});  // see the header: the lease bounds it
    // Usually D gave up before P even admitted the request: P must not prefill it.
    AddTombstone(fp, now);
    ++stats_.decoder_releases;
    return {V::kTombstoned, {}};
  }
  Entry& e = it->second;
  const std::uint64_t bit = std::uint64_t{1} << d_rank;
  if (e.need_send == 0) {
    e.need_send = static_cast<std::uint16_t>(need_send);
  } else if (e.need_send != need_send) {
    return ignored(Status(ErrorCode::kInvalidArgument,
                          fmt::format("release of {} says {} decoder ranks pull it, the first "
                                      "pull said {}",
                                      e.id, need_send, e.need_send)));
  }
  if (((e.sent_mask | e.released_mask) & bit) != 0) return ignored({});
  e.released_mask |= bit;
  ++stats_.decoder_releases;
  if ((e.waiting_mask & bit) != 0) {
    // Only this rank's waiting pull fails; the other ranks' go on waiting.
    e.waiting_mask &= ~bit;
    events_.push_back({HoldEvent::Kind::kPullsFailed, e.id, e.handle,
                       ReleaseReason::kReleasedByDecoder,
                       Status(ErrorCode::kCancelled,
                              fmt::format("decoder rank {} released transfer {}", d_rank, e.id)),
                       bit});
  }
  if (MaybeDone(e, now)) return {V::kReleased, {}};
  return {V::kKept, {}};
}

void HoldTable::Expire(TimePoint now) {
  while (!heap_.empty() && heap_.front().key <= now) {
    Entry& e = *heap_.front().entry;
    const TimePoint real = RealDeadline(e);
    if (real > now) {
      // Renewed (or sending) since it was keyed: move it to its real deadline, or out.
      if (real == kNever) {
        HeapRemove(e);
      } else {
        HeapUpdateKey(e, real);
      }
      continue;
    }
    ReleaseReason reason = ReleaseReason::kExpired;
    Status pull_error;
    if (e.phase == HoldPhase::kReady) {
      reason = ReleaseReason::kExpired;
    } else if (config_.lease_enabled() && e.last_renewal != kNever &&
               e.last_renewal + config_.lease <= now) {
      reason = ReleaseReason::kDeadDecoder;
      pull_error = Status(ErrorCode::kTimeout,
                          fmt::format("transfer {}: decoder stopped renewing its lease", e.id));
    } else {
      reason = ReleaseReason::kWaitTimeout;
      pull_error =
          Status(ErrorCode::kTimeout,
                 fmt::format("transfer {}: prefill not done within abort_request_timeout ({}s)",
                             e.id, ToSeconds(config_.abort_request_timeout)));
    }
    Release(e, reason, pull_error, now);
  }
  ExpireTombstones(now);
}

TimePoint HoldTable::NextDeadline() const {
  TimePoint next = heap_.empty() ? kNever : heap_.front().key;
  if (!tombstone_order_.empty()) next = std::min(next, tombstone_order_.front().until);
  return next;
}

std::vector<HoldEvent> HoldTable::TakeEvents() {
  std::vector<HoldEvent> out;
  out.swap(events_);
  return out;
}

void HoldTable::Rearm(Entry& e) {
  const TimePoint real = RealDeadline(e);
  if (real == kNever) return;
  if (e.heap_pos == kNotInHeap) {
    HeapPush(e, real);
  } else if (real < heap_[e.heap_pos].key) {
    HeapUpdateKey(e, real);
  }
}

void HoldTable::Release(Entry& e, ReleaseReason reason, Status pull_error, TimePoint now) {
  if (pull_error.ok() && LeftDecoderWaiting(reason)) {
    // What a decoder still waiting for it hears (wire::AbortNotice): an expired entry is what a
    // late pull would find, TOMBSTONED.
    pull_error =
        reason == ReleaseReason::kExpired
            ? Status(ErrorCode::kTombstoned,
                     fmt::format("transfer {} expired on P before it was pulled", e.id))
            : Status(ErrorCode::kCancelled,
                     fmt::format("transfer {} was released on P ({})", e.id, ToString(reason)));
  }
  if (e.waiting_mask != 0) {
    events_.push_back(
        {HoldEvent::Kind::kPullsFailed, e.id, e.handle, reason, pull_error, e.waiting_mask});
  }
  if (e.phase == HoldPhase::kReady) {
    events_.push_back({HoldEvent::Kind::kFreeBlocks, e.id, e.handle, reason, {}});
  } else if (e.phase == HoldPhase::kPrefilling && reason != ReleaseReason::kAbortedByEngine) {
    events_.push_back({HoldEvent::Kind::kAbortPrefill, e.id, e.handle, reason, {}});
  }
  events_.push_back({HoldEvent::Kind::kReleased, e.id, e.handle, reason, pull_error});
  ++stats_.released[reason];
  --stats_.entries[e.phase];
  if (e.phase == HoldPhase::kReady) stats_.blocks_ready -= e.num_blocks;
  stats_.sending -= static_cast<std::uint64_t>(std::popcount(e.sending_mask));
  if (e.heap_pos != kNotInHeap) HeapRemove(e);
  const Fingerprint fp = FingerprintOf(e.id);
  entries_.erase(fp);
  AddTombstone(fp, now);
}

Status HoldTable::LatePull(const TransferId& id, Fingerprint fp) const {
  const auto kept = reasons_.find(fp);
  if (kept == reasons_.end()) {
    return Status(ErrorCode::kTombstoned,
                  fmt::format("transfer {} was already released on P (late pull)", id));
  }
  return Status(ErrorCode::kTombstoned,
                fmt::format("transfer {} was refused on P: {} (late pull)", id, kept->second));
}

void HoldTable::AddTombstone(Fingerprint fp, TimePoint now, std::string refusal) {
  if (config_.max_tombstones == 0) return;
  if (tombstones_.count(fp) != 0) return;  // the first reason stands; its expiry too
  while (tombstone_order_.size() >= config_.max_tombstones) {
    DropTombstone(tombstone_order_.front().fp);
    tombstone_order_.pop_front();
    ++stats_.tombstones_evicted;
  }
  tombstones_.insert(fp);
  tombstone_order_.push_back({now + config_.abort_request_timeout, fp});
  stats_.tombstones = tombstones_.size();
  if (refusal.empty() || config_.max_refusal_reasons == 0) return;
  if (refusal.size() > kMaxRefusalReasonBytes) {
    // Cut on a UTF-8 character boundary: the reason reaches Python as text on D.
    std::size_t cut = kMaxRefusalReasonBytes;
    while (cut > 0 && (static_cast<unsigned char>(refusal[cut]) & 0xC0) == 0x80) --cut;
    refusal.resize(cut);
  }
  while (reasons_.size() >= config_.max_refusal_reasons) {
    reasons_.erase(reason_order_.front());
    reason_order_.pop_front();
  }
  reasons_.emplace(fp, std::move(refusal));  // fp has no tombstone yet, so no reason either
  reason_order_.push_back(fp);
  stats_.refusal_reasons = reasons_.size();
}

void HoldTable::DropTombstone(Fingerprint fp) {
  tombstones_.erase(fp);
  if (reasons_.erase(fp) != 0) {
    // Only the oldest tombstone leaves (evicted or expired), so its reason is the oldest kept.
    assert(!reason_order_.empty() && reason_order_.front() == fp);
    reason_order_.pop_front();
    stats_.refusal_reasons = reasons_.size();
  }
}

void HoldTable::ExpireTombstones(TimePoint now) {
  // Every tombstone lives for the same duration, so insertion order is expiry order.
  while (!tombstone_order_.empty() && tombstone_order_.front().until <= now) {
    DropTombstone(tombstone_order_.front().fp);
    tombstone_order_.pop_front();
  }
  stats_.tombstones = tombstones_.size();
}

// ---- Indexed binary min-heap over entries (each entry knows its position). ----

void HoldTable::HeapSet(std::uint32_t pos, HeapItem item) {
  heap_[pos] = item;
  item.entry->heap_pos = pos;
}

void HoldTable::HeapPush(Entry& e, TimePoint key) {
  assert(e.heap_pos == kNotInHeap);
  heap_.push_back({key, &e});
  e.heap_pos = static_cast<std::uint32_t>(heap_.size() - 1);
  SiftUp(e.heap_pos);
}

void HoldTable::HeapRemove(Entry& e) {
  const std::uint32_t pos = e.heap_pos;
  assert(pos != kNotInHeap && pos < heap_.size());
  const std::uint32_t last = static_cast<std::uint32_t>(heap_.size() - 1);
  e.heap_pos = kNotInHeap;
  if (pos != last) {
    HeapSet(pos, heap_[last]);
    heap_.pop_back();
    SiftDown(pos);
    SiftUp(pos);
  } else {
    heap_.pop_back();
  }
}

void HoldTable::HeapUpdateKey(Entry& e, TimePoint key) {
  const std::uint32_t pos = e.heap_pos;
  const TimePoint old = heap_[pos].key;
  heap_[pos].key = key;
  if (key < old) {
    SiftUp(pos);
  } else {
    SiftDown(pos);
  }
}

void HoldTable::SiftUp(std::uint32_t pos) {
  HeapItem item = heap_[pos];
  while (pos > 0) {
    const std::uint32_t parent = (pos - 1) / 2;
    if (!(item.key < heap_[parent].key)) break;
    HeapSet(pos, heap_[parent]);
    pos = parent;
  }
  HeapSet(pos, item);
}

void HoldTable::SiftDown(std::uint32_t pos) {
  const std::uint32_t n = static_cast<std::uint32_t>(heap_.size());
  HeapItem item = heap_[pos];
  while (true) {
    std::uint32_t child = 2 * pos + 1;
    if (child >= n) break;
    if (child + 1 < n && heap_[child + 1].key < heap_[child].key) ++child;
    if (!(heap_[child].key < item.key)) break;
    HeapSet(pos, heap_[child]);
    pos = child;
  }
  HeapSet(pos, item);
}

}  // namespace kvferry::core
