#include "protocol/prefill_session.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <string_view>
#include <utility>

#include "kvferry/core/tp_plan.h"

namespace kvferry::protocol {
namespace {

using core::TimePoint;

std::string Truncated(std::string text) {
  if (text.size() > wire::kMaxTextBytes) text.resize(wire::kMaxTextBytes);
  return text;
}

std::string LeaseMsText(std::uint64_t ms) { return ms == 0 ? "off" : fmt::format("{} ms", ms); }

}  // namespace

Status PrefillSession::ValidateOptions(const PrefillSessionOptions& options) {
  if (options.p_tp_size == 0 || options.p_tp_size > core::kMaxTpSize ||
      options.p_tp_rank >= options.p_tp_size) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("p_tp_rank {} of tp {}: tp must be 1..{} and the rank below it",
                              options.p_tp_rank, options.p_tp_size, core::kMaxTpSize));
  }
  if (options.block_len == 0) {
    return Status(ErrorCode::kInvalidArgument, "block_len must be > 0 (bytes of one block)");
  }
  if (options.num_blocks == 0) {
    return Status(ErrorCode::kInvalidArgument, "num_blocks must be > 0 (blocks in the region)");
  }
  if (options.num_planes > kMaxPlanes) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("num_planes {}: at most {}", options.num_planes, kMaxPlanes));
  }
  if (options.engine_id.empty() || options.engine_id.size() > wire::kMaxIdBytes) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("engine_id must be 1..{} bytes", wire::kMaxIdBytes));
  }
  return Status::Ok();
}

PrefillSession::PrefillSession(PrefillSessionOptions options, const HoldFactory& make_hold)
    : options_(std::move(options)),
      p_lease_ms_(static_cast<std::uint64_t>(
          std::chrono::duration_cast<std::chrono::milliseconds>(options_.hold.lease).count())),
      table_(make_hold ? make_hold(options_.hold) : std::make_unique<CoreHold>(options_.hold)),
      ahead_(options_.num_planes) {}

// OnTimeout: how late a pass may find itself before it takes the lateness for a stall of this
// process, and how long it then waits for what D sent meanwhile. The threshold is far above a
// loaded listener's lateness (its polls wait at most 1 s, and the pass runs as soon as it wakes)
// and the grace far above the time ZeroMQ takes to deliver what waited in the kernel.
constexpr core::Duration kStallThreshold = std::chrono::seconds(1);
constexpr core::Duration kStallGrace = std::chrono::milliseconds(500);

// ---- input from D ----

void PrefillSession::OnMessage(const PeerAddress& peer, std::span<const std::uint8_t> payload,
                               TimePoint now) {
  ++counters_.messages_received;
  // Every ERROR below carries the message's id whenever it can be read (protocol §1): an
  // ERROR with id 0 fails every message D has outstanding on the socket (found by review: four
  // shapes of malformed message were answered with id 0 although their id was readable).
  if (payload.size() > wire::kMaxFrameBytes) {
    // The id sits in the first bytes (after "t" and "v"): read it from the frame's head.
    RejectMessage(peer, ErrorCode::kOutOfRange,
                  fmt::format("frame of {} bytes exceeds the limit of {} bytes", payload.size(),
                              wire::kMaxFrameBytes),
                  wire::PeekId(payload.first(wire::kMaxFrameBytes)));
    return;
  }
  Result<wire::MessageType> type = wire::PeekType(payload);
  if (!type) {
    // E.g. a type from a newer protocol: the id, when readable, lets D match the answer.
    RejectMessage(peer, type.error().code(), type.error().message(), wire::PeekId(payload));
    return;
  }
  switch (*type) {
    case wire::MessageType::kRenewal: {
      Result<wire::Renewal> renewal = wire::DecodeRenewal(payload);
      if (!renewal) {
        ++counters_.messages_malformed;
        wire::RenewalReply reply;
        reply.p_lease_ms = p_lease_ms_;
        reply.status = wire::RenewalStatus::kError;
        reply.message = Truncated(renewal.error().ToString());
        reply.id = wire::PeekId(payload);
        Emit(peer, std::move(reply));
        return;
      }
      OnRenewal(peer, *renewal, now);
      return;
    }
    case wire::MessageType::kPull: {
      Result<wire::Pull> pull = wire::DecodePull(payload);
      if (!pull) {
        ++counters_.pull_errors;
        RejectMessage(peer, pull.error().code(), pull.error().message(), wire::PeekId(payload));
        return;
      }
      OnPull(peer, std::move(*pull), now);
      return;
    }
    case wire::MessageType::kRelease: {
      Result<wire::Release> release = wire::DecodeRelease(payload);
      if (!release) {
        ++counters_.messages_malformed;
        ++counters_.releases_refused;
        wire::ReleaseReply reply;
        reply.status = wire::ReleaseStatus::kError;
        reply.message = Truncated(release.error().ToString());
        reply.id = wire::PeekId(payload);
        Emit(peer, std::move(reply));
        return;
      }
      OnRelease(peer, *release, now);
      return;
    }
    case wire::MessageType::kRenewalReply:
    case wire::MessageType::kPullResponse:
    case wire::MessageType::kReleaseReply:
    case wire::MessageType::kAbortNotice:
      break;
  }
  RejectMessage(
      peer, ErrorCode::kProtocol,
      fmt::format("unexpected {} message on a prefill side channel", wire::ToString(*type)),
      wire::PeekId(payload));
}

void PrefillSession::RejectMessage(const PeerAddress& peer, ErrorCode code, std::string reason,
                                   std::uint64_t id) {
  ++counters_.messages_malformed;
  ReplyPullError(peer, code, std::move(reason), id);
}

void PrefillSession::OnRenewal(const PeerAddress& peer, const wire::Renewal& renewal,
                               TimePoint now) {
  wire::RenewalReply reply;
  reply.id = renewal.id;
  reply.p_lease_ms = p_lease_ms_;
  if (shut_down_) {
    reply.status = wire::RenewalStatus::kError;
    reply.message = "prefill worker is shutting down";
    Emit(peer, std::move(reply));
    return;
  }
  Result<core::HoldTable::RenewResult> result = table_->Renew(renewal.fingerprints, now);
  if (!result) {
    ++counters_.renewals_rejected;
    reply.status = wire::RenewalStatus::kRejected;
    reply.message = Truncated(result.error().message());
  } else {
    ++counters_.renewals_accepted;
    reply.status = wire::RenewalStatus::kAccepted;
    reply.extended = result->extended;
    reply.unknown = result->unknown;
    if (renewal.accepts_notices) NoteRenewers(peer, renewal.fingerprints);
    if (renewal.d_lease_ms != p_lease_ms_) {
      reply.message = fmt::format("kv_lease_duration mismatch: decoder has {}, prefiller has {}",
                                  LeaseMsText(renewal.d_lease_ms), LeaseMsText(p_lease_ms_));
    }
  }
  Emit(peer, std::move(reply));
  DrainHoldEvents(now);
  Flush();
}

void PrefillSession::NoteRenewers(const PeerAddress& peer,
                                  std::span<const core::Fingerprint> fingerprints) {
  for (core::Fingerprint fp : fingerprints) {
    // Only held transfers: a renewal of random fingerprints must not grow anything.
    if (!table_->ContainsFingerprint(fp)) continue;
    std::vector<PeerAddress>& peers = renewers_[fp];
    if (peers.size() >= kMaxNoticePeersPerTransfer ||
        std::find(peers.begin(), peers.end(), peer) != peers.end()) {
      continue;
    }
    peers.push_back(peer);
  }
}

void PrefillSession::OnRelease(const PeerAddress& peer, const wire::Release& release,
                               TimePoint now) {
  wire::ReleaseReply reply;
  reply.id = release.id;
  auto refuse = [&](std::string why) {
    ++counters_.releases_refused;
    reply.status = wire::ReleaseStatus::kError;
    reply.message = Truncated(std::move(why));
    Emit(peer, std::move(reply));
  };
  if (shut_down_) return refuse("prefill worker is shutting down");
  // The same pairing rule as a pull: it says how many D ranks pull each transfer from this
  // worker, so one rank's release never frees what another paired rank still needs.
  Result<std::vector<std::uint32_t>> paired =
      core::PairedDecoderRanks(options_.p_tp_rank, options_.p_tp_size, release.d_tp_size);
  if (!paired || std::find(paired->begin(), paired->end(), release.d_tp_rank) == paired->end()) {
    return refuse(
        fmt::format("decoder rank {} of tp {} is not paired with prefill rank {} of tp {}",
                    release.d_tp_rank, release.d_tp_size, options_.p_tp_rank, options_.p_tp_size));
  }
  ++counters_.releases_received;
  const auto need_send = static_cast<std::uint32_t>(paired->size());
  for (core::Fingerprint fp : release.fingerprints) {
    const core::HoldTable::ReleaseOutcome outcome =
        table_->ReleaseByDecoder(fp, release.d_tp_rank, need_send, now);
    switch (outcome.verdict) {
      case core::HoldTable::ReleaseOutcome::Verdict::kReleased:
        ++reply.released;
        break;
      case core::HoldTable::ReleaseOutcome::Verdict::kKept:
        ++reply.kept;
        break;
      case core::HoldTable::ReleaseOutcome::Verdict::kTombstoned:  // nothing was held
      case core::HoldTable::ReleaseOutcome::Verdict::kIgnored:
        ++reply.unknown;
        break;
    }
    // This socket gave the transfer up: it needs no notice about it.
    if (auto it = renewers_.find(fp); it != renewers_.end()) {
      std::erase(it->second, peer);
      if (it->second.empty()) renewers_.erase(it);
    }
  }
  counters_.released_entries += reply.released;
  counters_.released_kept += reply.kept;
  counters_.released_unknown += reply.unknown;
  Emit(peer, std::move(reply));
  DrainHoldEvents(now);
  Flush();
}

std::optional<std::uint32_t> PrefillSession::CheckPull(const PeerAddress& peer,
                                                       const wire::Pull& pull) {
  auto refuse = [&](ErrorCode code, std::string why) -> std::optional<std::uint32_t> {
    ++counters_.pull_errors;
    ReplyPullError(peer, code, std::move(why), pull.id);
    return std::nullopt;
  };
  if (shut_down_) return refuse(ErrorCode::kUnavailable, "prefill worker is shutting down");
  // Pairing first, bounded: d_tp_size comes from the wire and sizes the pairing computation.
  Result<std::vector<std::uint32_t>> paired =
      core::PairedDecoderRanks(options_.p_tp_rank, options_.p_tp_size, pull.d_tp_size);
  if (!paired || std::find(paired->begin(), paired->end(), pull.d_tp_rank) == paired->end()) {
    ++counters_.pulls_unpaired;
    return refuse(ErrorCode::kInvalidArgument,
                  fmt::format("decoder rank {} of tp {} is not paired with prefill rank {} of "
                              "tp {}{}",
                              pull.d_tp_rank, pull.d_tp_size, options_.p_tp_rank,
                              options_.p_tp_size, paired ? "" : ": " + paired.error().message()));
  }
  std::unordered_set<std::string_view> seen;
  for (const wire::PullRequest& r : pull.requests) {
    if (!seen.insert(r.d_req_id).second) {
      return refuse(ErrorCode::kInvalidArgument,
                    fmt::format("d_req_id {} appears twice in one pull", r.d_req_id));
    }
  }
  if (!pull.requests.empty() && pulls_.size() >= options_.max_pulls_in_progress) {
    ++counters_.pulls_over_limit;
    return refuse(ErrorCode::kResourceExhausted,
                  fmt::format("{} pulls already in progress on this prefill worker",
                              options_.max_pulls_in_progress));
  }
  std::size_t blocks = 0;
  for (const wire::PullRequest& r : pull.requests) blocks += r.block_ids.size();
  if (retained_blocks_ + blocks > options_.max_retained_blocks) {
    ++counters_.pulls_over_limit;
    return refuse(ErrorCode::kResourceExhausted,
                  fmt::format("pulls in progress already name {} blocks (limit {})",
                              retained_blocks_, options_.max_retained_blocks));
  }
  return static_cast<std::uint32_t>(paired->size());
}

std::shared_ptr<const std::vector<std::uint8_t>> PrefillSession::Descriptor(const PeerAddress& peer,
                                                                            wire::Pull& pull) {
  // Keyed by the socket too: a pull may only use a descriptor its own socket sent, so no peer
  // can make P write into another decoder's region by naming it.
  const std::string key = fmt::format("{}\n{}\n{}", peer, pull.d_engine_id, pull.d_tp_rank);
  auto cached = descriptors_.find(key);
  if (!pull.region_descriptor) {
    if (cached != descriptors_.end()) return cached->second;
    ++counters_.pull_errors;
    ReplyPullError(peer, ErrorCode::kNotFound,
                   fmt::format("no region descriptor known for decoder {} rank {}; resend it",
                               pull.d_engine_id, pull.d_tp_rank),
                   pull.id);
    return nullptr;
  }
  auto descriptor =
      std::make_shared<const std::vector<std::uint8_t>>(std::move(*pull.region_descriptor));
  if (cached != descriptors_.end()) {
    if (*cached->second != *descriptor) ++counters_.descriptors_replaced;
    cached->second = descriptor;
    return descriptor;
  }
  if (descriptors_.size() >= options_.max_cached_descriptors && !descriptors_.empty()) {
    descriptors_.erase(descriptors_.begin());  // that D resends it (ERROR kNotFound) if needed
    ++counters_.descriptors_evicted;
  }
  descriptors_.emplace(key, descriptor);
  return descriptor;
}

void PrefillSession::OnPull(const PeerAddress& peer, wire::Pull pull, TimePoint now) {
  // A duplicate of a pull must not be answered: D cannot tell an answer to the copy ("already
  // sending": err) from the original's, and would reuse blocks the original still writes; and a
  // copy arriving after the original failed could write into blocks D already freed.
  if (pull.id != 0 && pull_ids_.count({peer, pull.id}) != 0) {
    ++counters_.pulls_duplicate;
    return;
  }
  // Whole-message checks first, so a refused message changes nothing (but its id is known).
  std::optional<std::uint32_t> need_send = CheckPull(peer, pull);
  std::shared_ptr<const std::vector<std::uint8_t>> descriptor;
  if (need_send) descriptor = Descriptor(peer, pull);
  if (descriptor == nullptr) {
    if (pull.id != 0) Remember({peer, pull.id});
    return;
  }
  ++counters_.pulls_received;
  if (pull.requests.empty()) {
    // Notify-only pull: nothing to write, just close it.
    wire::PullResponse finish;
    finish.status = wire::PullStatus::kFinish;
    finish.id = pull.id;
    Emit(peer, std::move(finish));
    if (pull.id != 0) Remember({peer, pull.id});
    return;
  }

  auto context = std::make_shared<PullContext>();
  context->d_engine_id = pull.d_engine_id;
  context->d_tp_size = pull.d_tp_size;
  context->d_tp_rank = pull.d_tp_rank;
  context->p_tp_size = options_.p_tp_size;
  context->p_tp_rank = options_.p_tp_rank;
  context->region_descriptor = std::move(descriptor);
  context->block_len = pull.block_len;
  context->num_blocks = pull.num_blocks;
  context->write_key = pull.write_key;

  const std::uint64_t key = next_pull_key_++;
  PendingPull& pending = pulls_[key];
  pending.peer = peer;
  pending.id = pull.id;
  pending.context = std::move(context);
  pending.requests = std::move(pull.requests);
  for (const wire::PullRequest& r : pending.requests) {
    pending.blocks.push_back(static_cast<std::uint32_t>(r.block_ids.size()));
    retained_blocks_ += r.block_ids.size();
  }
  pending.need_send = *need_send;
  if (pull.d_lease_ms) pending.d_lease = std::chrono::milliseconds(*pull.d_lease_ms);
  if (pending.id != 0) pull_ids_.emplace(peer, pending.id);
  touched_.push_back(key);
  const auto count = static_cast<std::uint32_t>(pending.requests.size());
  for (std::uint32_t i = 0; i < count; ++i) AdmitRequest(key, i, now);
  Flush();
}

void PrefillSession::AdmitRequest(std::uint64_t key, std::uint32_t index, TimePoint now) {
  PendingPull& pull = pulls_.at(key);
  const wire::PullRequest& request = pull.requests[index];
  Status blocks = wire::CheckBlockIds(request, pull.context->num_blocks);
  if (!blocks.ok()) {
    AddErr(key, OpenWave(pull, key), index, blocks);
    return;
  }
  // The parked cap is checked before the table is touched: a refused request changes nothing.
  const std::optional<core::HoldPhase> phase = table_->PhaseOf(request.transfer_id);
  if (parked_count_ >= options_.max_parked_requests && phase != core::HoldPhase::kReady &&
      !table_->IsTombstoned(request.transfer_id)) {
    ++counters_.requests_over_limit;
    AddErr(key, OpenWave(pull, key), index,
           Status(ErrorCode::kResourceExhausted,
                  fmt::format("{} requests already wait for prefills on this worker",
                              options_.max_parked_requests)));
    return;
  }
  core::PullAdmission admission = table_->AdmitPull(request.transfer_id, pull.context->d_tp_rank,
                                                    pull.need_send, pull.d_lease, now);
  switch (admission.verdict) {
    case core::PullAdmission::Verdict::kFail:
      AddErr(key, OpenWave(pull, key), index, admission.error);
      break;
    case core::PullAdmission::Verdict::kWait:
      parked_[request.transfer_id].push_back({key, index});
      ++parked_count_;
      break;
    case core::PullAdmission::Verdict::kReady:
      Dispatch(key, index, now);
      break;
  }
  // A lease mismatch releases the entry, which may fail other parked pulls.
  DrainHoldEvents(now);
}

void PrefillSession::Dispatch(std::uint64_t key, std::uint32_t index, TimePoint now) {
  PendingPull& pull = pulls_.at(key);
  const wire::PullRequest& request = pull.requests[index];
  Status begin = table_->BeginSend(request.transfer_id, pull.context->d_tp_rank, now);
  if (!begin.ok()) {
    AddErr(key, OpenWave(pull, key), index, begin);
    return;
  }
  if (ahead_.InFlight({key, index})) {
    // Its last write must not start before the ahead ones end: EndSend may free the source
    // blocks (kFreeBlocks) while they would still read them.
    ahead_.HoldSend({key, index});
    return;
  }
  SendRequest(key, index, now);
}

void PrefillSession::SendRequest(std::uint64_t key, std::uint32_t index, TimePoint now) {
  PendingPull& pull = pulls_.at(key);
  wire::PullRequest& request = pull.requests[index];
  std::uint32_t wave_index = 0;
  Wave& wave = OpenWave(pull, key, &wave_index);
  auto source = sources_.find(request.transfer_id);
  if (source == sources_.end()) {
    // BeginSend succeeded, so the table holds the transfer prefilled: its blocks are here.
    (void)table_->EndSend(request.transfer_id, pull.context->d_tp_rank, false, now);
    AddErr(key, wave, index,
           Status(ErrorCode::kInternal,
                  fmt::format("transfer {}: no source blocks", request.transfer_id)));
    return;
  }
  // What the ahead writes left: the planes they did not cover, all of them if they read other
  // blocks than PrefillDone named; nothing if they failed (the request fails with them).
  if (ahead_.Failure({key, index}) != nullptr) {
    (void)table_->EndSend(request.transfer_id, pull.context->d_tp_rank, false, now);
    AddErr(key, wave, index, Status::Ok(), false);  // takes the ahead writes' outcome
    return;
  }
  std::optional<std::vector<std::uint32_t>> planes =
      ahead_.PlanesLeft({key, index}, source->second);
  if (!planes) {
    // Every plane landed ahead of the prefill's end.
    (void)table_->EndSend(request.transfer_id, pull.context->d_tp_rank, true, now);
    AddOk(key, wave, index);
    return;
  }
  auto writes = PlanRequest(pull, request, source->second);
  if (!writes || writes->empty()) {
    // Nothing leaves this rank: a plan that fails wrote nothing, and replicated KV is another
    // P rank's to write (SPEC §5); either way the request is answered now.
    (void)table_->EndSend(request.transfer_id, pull.context->d_tp_rank, writes.has_value(), now);
    if (writes) {
      AddOk(key, wave, index);
    } else {
      // Counted as a write that failed before its first byte, as when the writer planned it.
      ++counters_.writes_started;
      ++counters_.writes_failed;
      AddErr(key, wave, index, writes.error());
    }
    return;
  }
  WriteJob job;
  job.ticket = next_ticket_++;
  job.pull_id = pull.id;
  job.context = pull.context;
  job.transfer_id = request.transfer_id;
  job.d_req_id = request.d_req_id;
  job.dst_block_ids = std::move(request.block_ids);  // not needed here any more
  job.writes = std::move(*writes);
  job.planes = std::move(*planes);
  ++wave.outstanding;
  ++counters_.writes_started;
  writes_.emplace(job.ticket, Ticket{{key, index}, wave_index});
  new_writes_.push_back(std::move(job));
}

Result<std::vector<core::BlockWrite>> PrefillSession::PlanRequest(
    const PendingPull& pull, const wire::PullRequest& request,
    std::span<const core::BlockId> source) const {
  const PullContext& context = *pull.context;
  std::span<const core::BlockId> src = source;
  if (src.size() < request.block_ids.size()) {
    return Err(ErrorCode::kOutOfRange,
               fmt::format("transfer {}: prefill holds {} blocks, decoder asked for {}",
                           request.transfer_id, src.size(), request.block_ids.size()));
  }
  // D may already hold a prefix (a cache hit): it asks only for the last blocks.
  src = src.subspan(src.size() - request.block_ids.size());
  const core::TpLayout p_layout{options_.p_tp_size, options_.kv_heads, options_.block_len};
  const core::TpLayout d_layout{context.d_tp_size, options_.kv_heads, context.block_len};
  auto slice = core::PlanSlice(options_.p_tp_rank, p_layout, context.d_tp_rank, d_layout);
  if (!slice) return tl::unexpected(slice.error());
  if (!slice->should_write) return std::vector<core::BlockWrite>{};
  if (!options_.head_slices && (slice->src_offset != 0 || slice->length != options_.block_len)) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("transfer {}: decoder rank {} of TP {} needs a head slice of each "
                           "block, and this prefill rank's KV layout does not keep a head's "
                           "bytes together",
                           request.transfer_id, context.d_tp_rank, context.d_tp_size));
  }
  return core::PlanWrites(src, request.block_ids, *slice, options_.block_len, context.block_len);
}

PrefillSession::Wave& PrefillSession::OpenWave(PendingPull& pull, std::uint64_t key,
                                               std::uint32_t* index) {
  if (pull.open_step != step_ || pull.waves.count(pull.open_wave) == 0) {
    pull.open_wave = pull.next_wave++;
    pull.open_step = step_;
    pull.waves[pull.open_wave];
    touched_.push_back(key);
  }
  if (index != nullptr) *index = pull.open_wave;
  return pull.waves[pull.open_wave];
}

bool PrefillSession::DeferListing(std::uint64_t key, Wave& wave, std::uint32_t index, bool ok,
                                  const Status& status, bool unsettled) {
  if (!ahead_.InFlight({key, index})) return false;
  PendingPull& pull = pulls_.at(key);
  for (auto& [number, w] : pull.waves) {
    if (&w != &wave) continue;
    ++wave.outstanding;  // the wave waits for the ahead writes, as for a write of its own
    return ahead_.Defer({key, index}, AheadWrites::Listing{number, ok, status, unsettled});
  }
  return false;  // unreachable: every wave passed in is one of the pull's
}

void PrefillSession::AddOk(std::uint64_t key, Wave& wave, std::uint32_t index) {
  if (ahead_.Failure({key, index}) != nullptr) {
    AddErr(key, wave, index, Status::Ok(), false);  // an ahead write failed: so does the request
    return;
  }
  if (DeferListing(key, wave, index, true, Status::Ok(), false)) return;
  wave.ok.push_back(pulls_.at(key).requests[index].d_req_id);
  ++counters_.requests_ok;
  Listed(key, index);
}

void PrefillSession::Listed(std::uint64_t key, std::uint32_t index) {
  PendingPull& pull = pulls_.at(key);
  // An answered request needs its block ids no more: what a pull retains is bounded by what is
  // still waiting or being written (max_retained_blocks).
  retained_blocks_ -= pull.blocks[index];
  pull.blocks[index] = 0;
  std::vector<core::BlockId>().swap(pull.requests[index].block_ids);
  ahead_.Forget({key, index});  // listed only once no ahead write of it is in flight
  touched_.push_back(key);
}

void PrefillSession::AddErr(std::uint64_t key, Wave& wave, std::uint32_t index,
                            const Status& given, bool unsettled) {
  if (DeferListing(key, wave, index, false, given, unsettled)) return;
  // An ahead write that failed is the reason when nothing else is (the call passes Ok), and
  // one that may still land makes the request unsettled whatever its reason.
  Status status = given;
  if (const WriteOutcome* failed = ahead_.Failure({key, index}); failed != nullptr) {
    if (status.ok()) status = failed->status;
    if (failed->end == WriteEnd::kUnsettled) unsettled = true;
  }
  wire::RequestError error;
  error.d_req_id = pulls_.at(key).requests[index].d_req_id;
  error.code = status.ok() ? ErrorCode::kInternal : status.code();
  error.reason = Truncated(status.message().empty() ? status.ToString() : status.message());
  error.unsettled = unsettled;
  wave.err.push_back(std::move(error));
  ++counters_.requests_err;
  if (status.code() == ErrorCode::kTombstoned) ++counters_.late_pulls_rejected;
  if (status.code() == ErrorCode::kLeaseMismatch) ++counters_.lease_mismatches;
  Listed(key, index);
}

void PrefillSession::DrainHoldEvents(TimePoint now) {
  // Handling an event can make more (a request answered while it is dispatched ends its send),
  // so drain until the table has none.
  for (std::vector<core::HoldEvent> events = table_->TakeEvents(); !events.empty();
       events = table_->TakeEvents()) {
    DrainHoldEventBatch(events, now);
  }
  NotePassDue(now);
}

void PrefillSession::DrainHoldEventBatch(std::vector<core::HoldEvent>& events, TimePoint now) {
  for (core::HoldEvent& event : events) {
    switch (event.kind) {
      case core::HoldEvent::Kind::kFreeBlocks:
      case core::HoldEvent::Kind::kAbortPrefill:
        sources_.erase(event.id);
        if (event.kind == core::HoldEvent::Kind::kFreeBlocks && ahead_.HoldFree(event)) {
          break;  // an ahead write still reads the blocks: AheadWriteDone lets it go
        }
        ++counters_.hold_events_delivered;
        engine_events_.push_back(std::move(event));
        break;
      case core::HoldEvent::Kind::kPullsReady:
      case core::HoldEvent::Kind::kPullsFailed: {
        auto it = parked_.find(event.id);
        if (it == parked_.end()) break;
        // kPullsFailed may name only some D ranks (one rank released): the others wait on.
        std::vector<RequestRef> refs = std::move(it->second);
        std::vector<RequestRef> still_parked;
        for (const RequestRef& ref : refs) {
          auto pull = pulls_.find(ref.pull_key);
          if (pull == pulls_.end()) {
            --parked_count_;
            continue;
          }
          const std::uint32_t d_rank = pull->second.context->d_tp_rank;
          if (event.kind == core::HoldEvent::Kind::kPullsFailed &&
              (d_rank >= 64 || ((event.ranks >> d_rank) & 1) == 0)) {
            still_parked.push_back(ref);
            continue;
          }
          --parked_count_;
          if (event.kind == core::HoldEvent::Kind::kPullsReady) {
            Dispatch(ref.pull_key, ref.request, now);
          } else {
            AddErr(ref.pull_key, OpenWave(pull->second, ref.pull_key), ref.request, event.status);
          }
        }
        if (still_parked.empty()) {
          parked_.erase(event.id);
        } else {
          parked_[event.id] = std::move(still_parked);
        }
        break;
      }
      case core::HoldEvent::Kind::kReleased: {
        auto node = renewers_.extract(core::FingerprintOf(event.id));
        if (node.empty() || !core::LeftDecoderWaiting(event.reason)) break;
        // An id the wire cannot carry (the engine admitted it; D renewed its fingerprint) would
        // make D refuse the whole notice: its D learns at its pull instead.
        if (event.id.empty() || event.id.size() > wire::kMaxIdBytes) break;
        // The D ranks that renewed it may still be queueing the request: tell them now.
        wire::AbortedTransfer aborted;
        aborted.transfer_id = event.id;
        aborted.code = event.status.ok() ? ErrorCode::kCancelled : event.status.code();
        aborted.reason = Truncated(event.status.message());
        for (PeerAddress& peer : node.mapped()) notices_[std::move(peer)].push_back(aborted);
        break;
      }
    }
  }
}

void PrefillSession::NotePassDue(TimePoint now) {
  const TimePoint next = table_->NextDeadline();
  if (next > now) {
    pass_due_ = next;
    return;
  }
  // Due already. The table's next deadline may lie far in the past without any pass having
  // been missed: an entry whose expiry a write put off is keyed at the deadline that passed
  // while the write ran, and falls due only when the write ends, in this call. So the pass is
  // due since this call, unless an earlier call already found it due.
  pass_due_ = std::min(pass_due_, now);
}

// ---- input from the engine ----

Status PrefillSession::Admit(const core::TransferId& id, std::uint64_t handle, TimePoint now) {
  Status status = table_->Admit(id, handle, now);
  DrainHoldEvents(now);
  Flush();
  return status;
}

Status PrefillSession::CheckSourceBlocks(const core::TransferId& id,
                                         std::span<const core::BlockId> blocks) const {
  if (blocks.size() > wire::kMaxBlocksPerRequest) {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("transfer {}: {} blocks, at most {}", id, blocks.size(),
                              wire::kMaxBlocksPerRequest));
  }
  for (core::BlockId block : blocks) {
    if (block >= options_.num_blocks) {
      return Status(ErrorCode::kOutOfRange,
                    fmt::format("transfer {}: source block {} is outside this rank's {} blocks",
                                id, block, options_.num_blocks));
    }
  }
  return Status::Ok();
}

Status PrefillSession::PrefillDone(const core::TransferId& id, std::vector<core::BlockId> blocks,
                                   TimePoint now) {
  if (Status bad = CheckSourceBlocks(id, blocks); !bad.ok()) return bad;
  const auto num_blocks = static_cast<std::uint32_t>(blocks.size());
  // Kept first: the table may make the transfer ready now, and the parked pulls it wakes are
  // planned from these blocks in this call.
  auto [kept, fresh] = sources_.try_emplace(id, std::move(blocks));
  Status status = table_->PrefillDone(id, num_blocks, now);
  if (!status.ok() && fresh) sources_.erase(kept);
  DrainHoldEvents(now);
  Flush();
  return status;
}

Status PrefillSession::LayersReady(const core::TransferId& id,
                                   std::span<const core::BlockId> blocks,
                                   std::span<const std::uint32_t> planes, TimePoint now) {
  (void)now;  // nothing here depends on time: the table is not touched
  if (options_.num_planes == 0) {
    return Status(ErrorCode::kInvalidArgument,
                  "layer writes need the number of KV planes (num_planes)");
  }
  if (Status bad = CheckSourceBlocks(id, blocks); !bad.ok()) return bad;
  for (std::uint32_t plane : planes) {
    if (plane >= options_.num_planes) {
      return Status(ErrorCode::kOutOfRange,
                    fmt::format("transfer {}: plane {} is outside this rank's {} planes", id,
                                plane, options_.num_planes));
    }
  }
  auto parked = parked_.find(id);
  if (parked == parked_.end()) return Status::Ok();
  std::shared_ptr<const std::vector<core::BlockId>> shared;
  for (const RequestRef& ref : parked->second) {
    if (pulls_.count(ref.pull_key) == 0) continue;
    // One ahead write in flight per request: the planes computed meanwhile go together in the
    // next (measured: 32 concurrent ahead writes of 4 MiB over UCX 1.13 tcp stalled its progress
    // thread for 38 s, docs/performance.md; one in flight moves the same bytes in fewer batches).
    if (ahead_.Note(ref, blocks, planes, shared)) StartAheadWrite(ref);
  }
  return Status::Ok();
}

void PrefillSession::StartAheadWrite(const RequestRef& ref) {
  const std::vector<core::BlockId>* blocks = ahead_.Blocks(ref);
  if (blocks == nullptr) return;
  const PendingPull& pull = pulls_.at(ref.pull_key);
  const wire::PullRequest& request = pull.requests[ref.request];
  // A plan that fails or writes nothing from this rank does the same at PrefillDone, whose
  // write covers these planes then and answers the request.
  auto writes = PlanRequest(pull, request, *blocks);
  if (!writes || writes->empty()) {
    ahead_.DropQueued(ref);
    return;
  }
  std::vector<std::uint32_t> planes = ahead_.Begin(ref, request.transfer_id);
  if (planes.empty()) return;  // none queued
  // The job copies the request's destination blocks (and its plan): with one job in flight per
  // request, that is at most what the pulls retain (max_retained_blocks) once more.
  WriteJob job;
  job.ticket = next_ticket_++;
  job.pull_id = pull.id;
  job.context = pull.context;
  job.transfer_id = request.transfer_id;
  job.d_req_id = request.d_req_id;
  job.dst_block_ids = request.block_ids;  // the request's own write still needs them
  job.writes = std::move(*writes);
  job.planes = std::move(planes);
  job.ahead = true;
  ++counters_.writes_started;
  ++counters_.layer_writes;
  writes_.emplace(job.ticket, Ticket{ref, 0, /*ahead=*/true});
  new_writes_.push_back(std::move(job));
}

Status PrefillSession::Refuse(const core::TransferId& id, Status why, TimePoint now) {
  Status status = table_->Refuse(id, std::move(why), now);
  DrainHoldEvents(now);
  Flush();
  return status;
}

void PrefillSession::EngineFinished(const core::TransferId& id, TimePoint now) {
  table_->EngineFinished(id, now);
  DrainHoldEvents(now);
  Flush();
}

// ---- input from the data plane ----

void PrefillSession::OnWriteDone(std::uint64_t ticket, const WriteOutcome& outcome, TimePoint now) {
  const WriteEnd end = outcome.end;
  const Status& status = outcome.status;
  auto it = writes_.find(ticket);
  if (it == writes_.end()) return;
  const Ticket t = it->second;
  writes_.erase(it);
  if (t.ahead) {
    AheadWriteDone(t, outcome, now);
    return;
  }
  PendingPull& pull = pulls_.at(t.ref.pull_key);
  const wire::PullRequest& request = pull.requests[t.ref.request];
  // The entry may have left the table while we wrote (e.g. the engine aborted it); the write's
  // outcome is still what D must hear.
  (void)table_->EndSend(request.transfer_id, pull.context->d_tp_rank, end == WriteEnd::kLanded,
                        now);
  Wave& wave = pull.waves.at(t.wave);
  --wave.outstanding;
  touched_.push_back(t.ref.pull_key);
  switch (end) {
    case WriteEnd::kLanded:
      AddOk(t.ref.pull_key, wave, t.ref.request);
      break;
    case WriteEnd::kFailed:
      ++counters_.writes_failed;
      AddErr(t.ref.pull_key, wave, t.ref.request,
             Status(status.ok() ? ErrorCode::kInternal : status.code(),
                    fmt::format("write of {} failed: {}", request.transfer_id, status.message())));
      break;
    case WriteEnd::kUnsettled:
      ++counters_.writes_failed;
      ++counters_.writes_unsettled;
      AddErr(t.ref.pull_key, wave, t.ref.request,
             Status(status.ok() ? ErrorCode::kInternal : status.code(),
                    fmt::format("write of {} failed and may still land: {}", request.transfer_id,
                                status.message())),
             /*unsettled=*/true);
      break;
  }
  DrainHoldEvents(now);
  Flush();
}

void PrefillSession::AheadWriteDone(const Ticket& t, const WriteOutcome& outcome, TimePoint now) {
  const wire::PullRequest& request = pulls_.at(t.ref.pull_key).requests[t.ref.request];
  AheadWrites::Ended ended = ahead_.End(t.ref, request.transfer_id, outcome);
  if (ended.freed) {
    ++counters_.hold_events_delivered;
    engine_events_.push_back(std::move(*ended.freed));
  }
  if (!ended.known) return;  // unreachable: a request is listed once none is in flight
  if (outcome.end != WriteEnd::kLanded) {
    ++counters_.writes_failed;
    if (outcome.end == WriteEnd::kUnsettled) ++counters_.writes_unsettled;
  }
  switch (ended.then) {
    case AheadWrites::Ended::Then::kList: {
      const AheadWrites::Listing& listing = *ended.listing;
      Wave& wave = pulls_.at(t.ref.pull_key).waves.at(listing.wave);
      --wave.outstanding;
      if (listing.ok) {
        AddOk(t.ref.pull_key, wave, t.ref.request);
      } else {
        AddErr(t.ref.pull_key, wave, t.ref.request, listing.status, listing.unsettled);
      }
      break;
    }
    case AheadWrites::Ended::Then::kSend:
      SendRequest(t.ref.pull_key, t.ref.request, now);  // its write covers the queued planes
      break;
    case AheadWrites::Ended::Then::kWriteMore:
      StartAheadWrite(t.ref);  // the layers computed while this one was written
      break;
    case AheadWrites::Ended::Then::kNothing:
      break;
  }
  DrainHoldEvents(now);
  Flush();
}

// ---- time ----

void PrefillSession::OnTimeout(TimePoint now) {
  if (stall_grace_until_ == TimePoint::min()) {
    const TimePoint due = pass_due_;
    if (due != core::kNever && now - due > kStallThreshold) {
      stall_grace_until_ = now + kStallGrace;
      ++counters_.stalls;
      return;
    }
  } else if (now < stall_grace_until_) {
    return;
  }
  stall_grace_until_ = TimePoint::min();
  table_->Expire(now);
  DrainHoldEvents(now);
  Flush();
}

TimePoint PrefillSession::NextDeadline() const {
  return stall_grace_until_ != TimePoint::min() ? stall_grace_until_ : table_->NextDeadline();
}

void PrefillSession::Shutdown(TimePoint now) {
  if (shut_down_) return;
  shut_down_ = true;
  for (auto& [transfer, refs] : parked_) {
    for (const RequestRef& ref : refs) {
      --parked_count_;
      auto pull = pulls_.find(ref.pull_key);
      if (pull == pulls_.end()) continue;
      AddErr(ref.pull_key, OpenWave(pull->second, ref.pull_key), ref.request,
             Status(ErrorCode::kCancelled,
                    fmt::format("prefill worker shut down before {} was ready", transfer)));
    }
  }
  parked_.clear();
  DrainHoldEvents(now);
  Flush();
}

// ---- output ----

void PrefillSession::ReplyPullError(const PeerAddress& peer, ErrorCode code, std::string message,
                                    std::uint64_t id) {
  wire::PullResponse response;
  response.id = id;
  response.status = wire::PullStatus::kError;
  response.code = code == ErrorCode::kOk ? ErrorCode::kInternal : code;
  response.message = Truncated(message.empty() ? std::string("error") : std::move(message));
  Emit(peer, std::move(response));
}

void PrefillSession::Emit(const PeerAddress& peer, wire::PullResponse response) {
  ++counters_.replies;
  outgoing_.push_back({peer, std::move(response)});
}

void PrefillSession::Emit(const PeerAddress& peer, wire::RenewalReply reply) {
  ++counters_.replies;
  outgoing_.push_back({peer, std::move(reply)});
}

void PrefillSession::Emit(const PeerAddress& peer, wire::ReleaseReply reply) {
  ++counters_.replies;
  outgoing_.push_back({peer, std::move(reply)});
}

void PrefillSession::Remember(PullName name) {
  pull_ids_.insert(name);
  finished_ids_.push_back(std::move(name));
  while (finished_ids_.size() > options_.remembered_pull_ids) {
    pull_ids_.erase(finished_ids_.front());
    finished_ids_.pop_front();
  }
}

void PrefillSession::Flush() {
  std::sort(touched_.begin(), touched_.end());
  touched_.erase(std::unique(touched_.begin(), touched_.end()), touched_.end());
  for (std::uint64_t key : touched_) {
    auto it = pulls_.find(key);
    if (it == pulls_.end()) continue;
    PendingPull& pull = it->second;
    const std::size_t total = pull.requests.size();
    for (auto w = pull.waves.begin(); w != pull.waves.end();) {
      Wave& wave = w->second;
      if (wave.outstanding > 0) {
        ++w;
        continue;
      }
      const std::size_t listed = wave.ok.size() + wave.err.size();
      if (listed > 0) {
        pull.listed += listed;
        wire::PullResponse response;
        response.id = pull.id;
        // FINISH: every request is listed (an unsettled one with its flag, so D keeps its
        // blocks quarantined whatever FINISH says of the rest).
        response.status =
            pull.listed == total ? wire::PullStatus::kFinish : wire::PullStatus::kContinue;
        response.ok = std::move(wave.ok);
        response.err = std::move(wave.err);
        Emit(pull.peer, std::move(response));
      }
      w = pull.waves.erase(w);
    }
    if (pull.listed == total) {
      if (pull.id != 0) Remember({pull.peer, pull.id});
      pulls_.erase(it);
    }
  }
  touched_.clear();
  for (auto& [peer, aborted] : notices_) {
    for (std::size_t at = 0; at < aborted.size(); at += wire::kMaxAbortsPerNotice) {
      wire::AbortNotice notice;
      notice.p_engine_id = options_.engine_id;
      notice.p_tp_rank = options_.p_tp_rank;
      const std::size_t end = std::min(aborted.size(), at + wire::kMaxAbortsPerNotice);
      notice.aborted.assign(std::make_move_iterator(aborted.begin() + static_cast<long>(at)),
                            std::make_move_iterator(aborted.begin() + static_cast<long>(end)));
      ++counters_.notices_sent;
      counters_.notified_transfers += notice.aborted.size();
      outgoing_.push_back({peer, std::move(notice)});
    }
  }
  notices_.clear();
  ++step_;
}

std::vector<Outgoing> PrefillSession::TakeOutgoing() { return std::exchange(outgoing_, {}); }

std::vector<WriteJob> PrefillSession::TakeWrites() { return std::exchange(new_writes_, {}); }

std::vector<core::HoldEvent> PrefillSession::TakeEngineEvents() {
  return std::exchange(engine_events_, {});
}

PrefillStats PrefillSession::stats() const {
  PrefillStats s = counters_;
  s.pulls_in_progress = pulls_.size();
  s.requests_parked = parked_count_;
  s.writes_in_flight = writes_.size();
  s.source_transfers = sources_.size();
  s.hold = table_->stats();
  s.hold_entries = table_->size();
  return s;
}

}  // namespace kvferry::protocol
