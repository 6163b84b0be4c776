#include "protocol/decode_session.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "kvferry/core/tp_plan.h"
#include "protocol/pull_reply.h"

namespace kvferry::protocol {
namespace {

// A bootstrap address is a URL a client may name: bounded like an id, generously.
constexpr std::size_t kMaxBootstrapAddressBytes = 2048;
// A refused request may name an engine D never paired with, to release its transfer there; it
// adds engine state (and a lookup) only while D knows fewer engines than this.
constexpr std::size_t kMaxEnginesForRefusals = 1024;
// Renewals whose reply deadline passed, remembered per endpoint until the runtime says whether
// they ever left (it reports an unsent one after its connection wait, 3 s, long after a reply
// deadline of lease/12): about 20 s of passes at the shortest lease's rate.
constexpr std::size_t kMaxUnansweredRenewals = 64;
// A fence that found writes still landing under its keys (a writer stalled mid-batch) is asked
// again after 1 s, then 2, 4, ... up to 60 s, while pulls of that epoch wait for proof: the
// writer may finish, or die, meanwhile (found by review: without it, such blocks stayed
// quarantined for good when no engine-down or later deadline came).
constexpr core::Duration kFenceRetryFirst = std::chrono::seconds(1);
constexpr core::Duration kFenceRetryMax = std::chrono::seconds(60);

bool IdFits(const std::string& id) { return !id.empty() && id.size() <= wire::kMaxIdBytes; }

bool SourceFits(const core::RequestId& request, const RemoteSource& source) {
  return IdFits(request) && IdFits(source.transfer_id) && IdFits(source.engine_id) &&
         source.bootstrap_address.size() <= kMaxBootstrapAddressBytes;
}

using core::TimePoint;

std::string Secs(core::Duration d) { return fmt::format("{}s", core::ToSeconds(d)); }

std::uint64_t Millis(core::Duration d) {
  return static_cast<std::uint64_t>(std::chrono::round<std::chrono::milliseconds>(d).count());
}

// Whether `response` settles (or, late, resolves) the one request of its pull.
bool Answers(const wire::PullResponse& response, const core::RequestId& request) {
  if (response.status != wire::PullStatus::kContinue) return true;  // FINISH or ERROR
  if (std::find(response.ok.begin(), response.ok.end(), request) != response.ok.end()) return true;
  return std::any_of(response.err.begin(), response.err.end(),
                     [&](const wire::RequestError& e) { return e.d_req_id == request; });
}

}  // namespace

Status DecodeSession::ValidateOptions(const DecodeSessionOptions& o) {
  auto bad = [](std::string why) { return Status(ErrorCode::kInvalidArgument, std::move(why)); };
  if (o.engine_id.empty() || o.engine_id.size() > wire::kMaxIdBytes) {
    return bad("engine_id must be 1.." + std::to_string(wire::kMaxIdBytes) + " bytes");
  }
  if (o.tp_size == 0 || o.tp_size > core::kMaxTpSize || o.tp_rank >= o.tp_size) {
    return bad(fmt::format("tp_rank {} of tp {}: tp must be 1..{} and the rank below it", o.tp_rank,
                           o.tp_size, core::kMaxTpSize));
  }
  if (o.block_len == 0 || o.num_blocks == 0) {
    return bad(
        fmt::format("block_len {} and num_blocks {} must be >= 1", o.block_len, o.num_blocks));
  }
  if (o.region_descriptor.size() > wire::kMaxDescriptorBytes) {
    return bad(fmt::format("region descriptor of {} bytes exceeds {}", o.region_descriptor.size(),
                           wire::kMaxDescriptorBytes));
  }
  if (o.write_key_base >= (std::uint64_t{1} << 63)) {
    return bad(fmt::format("write_key_base {:#x} must be below 2^63 (keys must not wrap to 0)",
                           o.write_key_base));
  }
  if (o.lease.count() < 0 || o.renewal_reply_timeout.count() < 0) {
    return bad("lease and renewal_reply_timeout must be >= 0");
  }
  if (o.lease.count() > 0 && o.renewal_reply_timeout > o.lease / 12) {
    return bad(
        fmt::format("renewal_reply_timeout {} exceeds lease/12 ({}): a renewal pass could "
                    "outlast the interval between passes",
                    Secs(o.renewal_reply_timeout), Secs(o.lease / 12)));
  }
  // P answers every pull within abort_request_timeout plus the write bound; a shorter deadline
  // turns a slow but healthy P into quarantined blocks.
  if (o.pull_timeout <= o.abort_request_timeout + o.write_bound) {
    return bad(
        fmt::format("pull_timeout {} must exceed abort_request_timeout {} + the write "
                    "bound {}: P answers every pull within that",
                    Secs(o.pull_timeout), Secs(o.abort_request_timeout), Secs(o.write_bound)));
  }
  if (o.lookup_timeout.count() <= 0 || o.lookup_failure_ttl.count() < 0) {
    return bad("lookup_timeout must be > 0 and lookup_failure_ttl >= 0");
  }
  if (o.max_endpoints == 0 || o.max_idle_endpoints > o.max_endpoints) {
    return bad(fmt::format("max_endpoints {} must be >= 1 and >= max_idle_endpoints {}",
                           o.max_endpoints, o.max_idle_endpoints));
  }
  if (o.release_delay.count() < 0 || o.release_reply_timeout.count() <= 0) {
    return bad("release_delay must be >= 0 and release_reply_timeout > 0");
  }
  return Status::Ok();
}

DecodeSession::DecodeSession(DecodeSessionOptions options, const LedgerFactory& make_ledger)
    : options_(std::move(options)),
      renewal_reply_timeout_(options_.renewal_reply_timeout.count() > 0
                                 ? options_.renewal_reply_timeout
                                 : options_.lease / 12),
      ledger_(make_ledger ? make_ledger() : std::make_unique<CoreLedger>()),
      renewals_(options_.lease),
      engines_(options_.lookup_timeout, options_.lookup_failure_ttl),
      endpoints_(options_.max_endpoints, options_.max_idle_endpoints),
      fences_(kFenceRetryFirst, kFenceRetryMax) {}

// ---- engine ----

void DecodeSession::OnNewRequest(const core::RequestId& request, const RemoteSource& source,
                                 TimePoint now) {
  (void)now;
  // What StartLoad would refuse is not tracked (no state for it): its load fails there.
  if (!SourceFits(request, source)) return;
  Engine(source.engine_id, source.bootstrap_address);
  if (tracked_.try_emplace(request, Tracked{source.transfer_id, source.engine_id}).second) {
    by_transfer_.emplace(source.transfer_id, request);
  }
  renewals_.Track(source.transfer_id, source.engine_id);  // idempotent; nothing without a lease
}

void DecodeSession::RequestFinished(const core::RequestId& request, TimePoint now) {
  // After a successful receive the request is no longer tracked: nothing to release.
  Untrack(request, /*release=*/true, now);
}

void DecodeSession::ReleaseAll(TimePoint now) {
  std::vector<core::RequestId> requests;
  requests.reserve(tracked_.size());
  for (const auto& [request, t] : tracked_) requests.push_back(request);
  for (const core::RequestId& request : requests) Untrack(request, /*release=*/true, now);
  FlushReleases(now);
}

void DecodeSession::ReleaseTransfer(const RemoteSource& source, TimePoint now) {
  if (!SourceFits(source.transfer_id, source) || by_transfer_.count(source.transfer_id) != 0) {
    return;
  }
  if (engines_.Find(source.engine_id) == nullptr) {
    // An engine D never paired with: P prefilled its copy all the same, so it is looked up to
    // be told (found by attacking real processes: a fresh D that refused 16 requests left P
    // holding 4,000 of its 4,096 blocks). A refusal costs the client nothing, so the engines a
    // refusal may introduce are capped; beyond the cap the release is dropped (P's lease or
    // timeout frees it), and SweepEngines forgets them once their lookup ended.
    if (engines_.size() >= kMaxEnginesForRefusals) {
      ++counters_.releases_dropped;
      return;
    }
    Engine(source.engine_id, source.bootstrap_address);
  }
  QueueRelease(source.engine_id, source.transfer_id, now);
}

void DecodeSession::Untrack(const core::RequestId& request, bool release, TimePoint now) {
  auto it = tracked_.find(request);
  if (it == tracked_.end()) return;
  Tracked t = std::move(it->second);
  tracked_.erase(it);
  for (auto [b, e] = by_transfer_.equal_range(t.transfer); b != e; ++b) {
    if (b->second == request) {
      by_transfer_.erase(b);
      break;
    }
  }
  // Another request still names this transfer (a router sent it twice): it is still wanted.
  if (by_transfer_.count(t.transfer) != 0) return;
  renewals_.Untrack(t.transfer);  // the transfer's last request (a no-op if never renewed)
  if (release) QueueRelease(t.engine, t.transfer, now);
}

void DecodeSession::QueueRelease(const core::EngineId& engine, const core::TransferId& transfer,
                                 TimePoint now) {
  if (!options_.send_releases) return;
  KnownEngine& state = Engine(engine, "");
  if (state.releases_unsupported ||
      (state.view() != nullptr && (state.view()->features & wire::kFeatureRelease) == 0)) {
    ++counters_.releases_dropped;  // an older P: its lease (or timeout) frees it
    return;
  }
  state.pending_releases.push_back(core::FingerprintOf(transfer));
  if (options_.release_delay.count() == 0) {
    FlushReleases(now);
  } else {
    release_due_ = std::min(release_due_, now + options_.release_delay);
  }
}

Status DecodeSession::StartLoad(const core::RequestId& request, const RemoteSource& source,
                                std::vector<core::BlockId> blocks, TimePoint now) {
  // What P's decoder would refuse fails here, unsent, instead of as an unreadable pull; and
  // before any state is kept for the engine it names.
  if (!SourceFits(request, source) || blocks.size() > wire::kMaxBlocksPerRequest) {
    return Status(
        ErrorCode::kInvalidArgument,
        fmt::format("request {}: ids must be 1..{} bytes, the bootstrap address at most {} and "
                    "blocks at most {}",
                    request.substr(0, 64), wire::kMaxIdBytes, kMaxBootstrapAddressBytes,
                    wire::kMaxBlocksPerRequest));
  }
  KnownEngine& state = Engine(source.engine_id, source.bootstrap_address);
  if (blocks.empty()) return Status::Ok();  // notify-only: nothing will be written
  if (loading_.count(request) != 0) {
    return Status(ErrorCode::kAlreadyExists, fmt::format("request {} is already loading", request));
  }
  if (quarantined_.count(request) != 0) {
    return Status(
        ErrorCode::kAlreadyExists,
        fmt::format("request {}: its blocks of an earlier load are still quarantined", request));
  }
  for (core::BlockId b : blocks) {
    if (b >= options_.num_blocks) {
      return Status(ErrorCode::kOutOfRange, fmt::format("request {}: block {} outside the {} "
                                                        "blocks of this rank",
                                                        request, b, options_.num_blocks));
    }
  }
  loading_.insert(request);
  if (tracked_.try_emplace(request, Tracked{source.transfer_id, source.engine_id}).second) {
    by_transfer_.emplace(source.transfer_id, request);  // to release it if the receive fails
  }
  ParkedLoad load{request, source, std::move(blocks)};
  const std::string address = state.AddressOf(load);
  if (state.view() != nullptr && !state.view_stale()) {
    SendLoad(std::move(load), *state.view(), now);
  } else if (state.view() == nullptr && state.FailureCovers(address, now)) {
    FailLoad(std::move(load), state.failure(), now);  // known unreachable there: fail at once
  } else {
    state.parked.loads.push_back(std::move(load));
    // Unpaired: a lookup where this request says the engine is, whatever others named. A
    // stale view is refreshed where the latest request names it.
    engines_.Ask(source.engine_id, state, now, state.view() != nullptr ? nullptr : &address);
  }
  return Status::Ok();
}

// ---- lookups ----

void DecodeSession::OnLookup(const PeerEngine& engine, TimePoint now, std::uint64_t lookup_id) {
  std::optional<KnownEngines::Answered> answered = engines_.OnAnswer(engine, now, lookup_id);
  // Stale (asked before a down): KnownEngines asked again for what waits.
  if (!answered) return;
  std::optional<std::string> replaced;  // an old process the answer says is gone
  if (answered->previous) {
    renewals_.ResetEngine(engine.engine_id);
    answered->entry->releases_unsupported = false;  // the new process may be a newer build
    // The service that named the old process now names another: the engine restarted, so the
    // old process's pulls will get no answer: they fail now, as with a registry's word
    // (OnProcessGone), and their blocks stay quarantined until a fence or a late answer. A
    // service D did not learn the old process from says nothing of it: that answer only adds
    // peers.
    if (answered->replaced) replaced = *answered->previous;
    events_out_.push_back(Warning{
        Warning::Kind::kIncarnation,
        fmt::format("prefill engine {} now reports incarnation {} (was {}){}", engine.engine_id,
                    engine.incarnation, *answered->previous,
                    answered->replaced ? ": the old process's pulls fail now"
                                       : " at another bootstrap; pulls to the old one end by "
                                         "their replies or a fence")});
  }
  SendParked(engine.engine_id, engine, std::move(answered->parked), now);
  if (replaced) {
    ++counters_.processes_replaced;
    GiveUpOnProcess(*replaced,
                    Status(ErrorCode::kUnavailable,
                           fmt::format("prefill engine {} restarted: its bootstrap now names "
                                       "process {} instead of {}",
                                       engine.engine_id, engine.incarnation, *replaced)));
    DrainLedger(now);
  }
}

void DecodeSession::SendParked(const core::EngineId& engine, const PeerEngine& view,
                               ParkedWork parked, TimePoint now) {
  for (ParkedLoad& load : parked.loads) SendLoad(std::move(load), view, now);
  for (const auto& ids : parked.renewals) SendRenewals(engine, view, ids, now);
  if (!parked.releases.empty()) SendReleases(engine, view, parked.releases, now);
}

void DecodeSession::OnLookupFailed(const core::EngineId& engine, const Status& why, TimePoint now,
                                   std::uint64_t lookup_id) {
  std::optional<KnownEngines::Failed> failed = engines_.OnFailure(engine, why, now, lookup_id);
  if (!failed) return;
  KnownEngine& state = *failed->entry;
  if (failed->refreshed) {
    // A refresh failed: pull with what is known (the pulls' own deadlines decide). The releases
    // go last, together with any that sending the loads parked (a load that failed at once,
    // with release_delay 0, is released while the view is still doubted).
    std::vector<core::Fingerprint> releases = std::exchange(failed->parked.releases, {});
    SendParked(engine, *state.view(), std::move(failed->parked), now);
    releases.insert(releases.end(), state.parked.releases.begin(), state.parked.releases.end());
    state.parked.releases.clear();
    if (!releases.empty()) SendReleases(engine, *state.view(), releases, now);
    return;
  }
  counters_.renewal_failures += failed->parked.renewals.size();
  counters_.releases_dropped += failed->parked.releases.size();  // the lease frees them
  for (ParkedLoad& load : failed->parked.loads) FailLoad(std::move(load), state.failure(), now);
  engines_.AskForParked(engine, state, now);  // loads that waited behind the lookup cap
}

// ---- pulls ----

std::optional<std::vector<std::uint32_t>> DecodeSession::Targets(const PeerEngine& view,
                                                                 Status* why) const {
  auto targets = core::PullTargets(options_.tp_rank, options_.tp_size, view.tp_size);
  if (!targets) {
    *why = targets.error();
    return std::nullopt;
  }
  for (std::uint32_t rank : *targets) {
    if (rank >= view.side_channels.size() || view.side_channels[rank].empty()) {
      *why = Status(ErrorCode::kUnavailable,
                    fmt::format("engine {} lacks the worker of rank {} this rank pulls from",
                                view.engine_id, rank));
      return std::nullopt;
    }
  }
  return std::move(*targets);
}

std::optional<EndpointId> DecodeSession::EndpointFor(const std::string& address) {
  return endpoints_.Acquire(address, [this](EndpointId id) { EndpointClosed(id); });
}

Status DecodeSession::TooManyEndpoints(const std::string& address) const {
  return Status(ErrorCode::kResourceExhausted,
                fmt::format("cannot reach prefill worker {}: this decoder has {} side channels "
                            "open, each with messages in flight (max_endpoints)",
                            address, endpoints_.size()));
}

void DecodeSession::NoteEndpointsExhausted(const std::string& address, std::string_view what) {
  const std::uint64_t n = ++counters_.endpoints_exhausted;
  std::uint64_t leading = n;
  while (leading % 10 == 0) leading /= 10;
  if (leading != 1) return;
  events_out_.push_back(Warning{
      Warning::Kind::kEndpointsExhausted,
      fmt::format("{} for prefill worker {} not sent: all {} side channels of this decoder have "
                  "messages in flight (max_endpoints); {} message(s) so far found none free",
                  what, address, endpoints_.size(), n)});
}

void DecodeSession::CloseIdleEndpoints() {
  endpoints_.CloseIdle(
      [](const Endpoint& ep) {
        return !ep.pulls.empty() || !ep.renewals.empty() || !ep.releases.empty() ||
               ep.fences_in_flight > 0;
      },
      [this](EndpointId id) { EndpointClosed(id); });
}

void DecodeSession::EndpointClosed(EndpointId id) {
  fences_.ForgetEndpoint(id);
  ++counters_.endpoints_closed;
}

core::PeerId DecodeSession::PeerFor(EndpointId endpoint, const std::string& incarnation) {
  return fences_.PeerFor({endpoint, incarnation, endpoints_.At(endpoint).epoch});
}

void DecodeSession::SendLoad(ParkedLoad load, const PeerEngine& view, TimePoint now) {
  if (!options_.head_slices && view.tp_size > options_.tp_size) {
    FailLoad(std::move(load),
             Status(ErrorCode::kInvalidArgument,
                    fmt::format("prefill engine {} has TP {} and this decoder TP {}: its ranks "
                                "write head slices of each block, and this rank's KV layout "
                                "does not keep a head's bytes together",
                                view.engine_id, view.tp_size, options_.tp_size)),
             now);
    return;
  }
  Status why;
  std::optional<std::vector<std::uint32_t>> targets = Targets(view, &why);
  if (!targets) {
    FailLoad(std::move(load), why, now);
    return;
  }
  std::vector<EndpointId> endpoints;
  std::vector<core::PeerId> peers;
  for (std::uint32_t rank : *targets) {
    std::optional<EndpointId> endpoint = EndpointFor(view.side_channels[rank]);
    if (!endpoint) {
      NoteEndpointsExhausted(view.side_channels[rank], "a pull (its load failed)");
      for (EndpointId opened : endpoints) NoteMaybeIdle(opened);  // nothing went out on them
      FailLoad(std::move(load), TooManyEndpoints(view.side_channels[rank]), now);
      return;
    }
    endpoints.push_back(*endpoint);
  }
  for (EndpointId endpoint : endpoints) peers.push_back(PeerFor(endpoint, view.incarnation));
  Status begun = ledger_->Begin(load.request, load.blocks, peers, Status());
  if (!begun.ok()) {
    for (EndpointId opened : endpoints) NoteMaybeIdle(opened);  // nothing went out on them
    // E.g. the same request id still quarantined from an earlier receive.
    loading_.erase(load.request);
    ++counters_.receives_failed;
    events_out_.push_back(ReceiveDone{load.request, false, begun, std::move(load.blocks), false});
    return;
  }
  for (std::size_t i = 0; i < endpoints.size(); ++i) {
    Endpoint& ep = endpoints_.At(endpoints[i]);
    wire::Pull pull;
    pull.id = ++next_wire_id_;
    pull.d_engine_id = options_.engine_id;
    pull.d_tp_size = options_.tp_size;
    pull.d_tp_rank = options_.tp_rank;
    pull.d_lease_ms = Millis(options_.lease);
    pull.region_descriptor = options_.region_descriptor;
    pull.block_len = options_.block_len;
    pull.num_blocks = options_.num_blocks;
    pull.write_key = WriteKeyOf(peers[i]);
    pull.requests.push_back({load.request, load.source.transfer_id, load.blocks});
    const TimePoint deadline = now + options_.pull_timeout;
    PullOp op{load.request, peers[i], deadline, false, false, std::nullopt};
    if (endpoints.size() == 1 && !load.retried) op.retry = load;
    ep.pulls.emplace(pull.id, std::move(op));
    pull_deadlines_.insert({deadline, endpoints[i], pull.id});
    ++counters_.pulls_sent;
    messages_out_.push_back({endpoints[i], ep.address, std::move(pull)});
  }
  DrainLedger(now);
}

void DecodeSession::FailLoad(ParkedLoad load, Status why, TimePoint now) {
  // Nothing was sent to any peer: the receive completes at once as failed (SPEC §3 rule 4).
  Status begun = ledger_->Begin(load.request, load.blocks, {}, why);
  if (!begun.ok()) {
    loading_.erase(load.request);
    ++counters_.receives_failed;
    events_out_.push_back(ReceiveDone{load.request, false, begun, std::move(load.blocks), false});
    return;
  }
  DrainLedger(now);
}

void DecodeSession::ForgetPull(EndpointId endpoint, std::map<std::uint64_t, PullOp>::iterator op) {
  pull_deadlines_.erase({op->second.deadline, endpoint, op->first});
  endpoints_.At(endpoint).pulls.erase(op);
  NoteMaybeIdle(endpoint);
}

void DecodeSession::OnPullResponse(EndpointId endpoint, const wire::PullResponse& response,
                                   TimePoint now) {
  (void)now;
  Endpoint* found = FindEndpoint(endpoint);
  if (found == nullptr) {
    ++counters_.replies_unmatched;
    return;
  }
  Endpoint& ep = *found;
  std::uint64_t id = response.id;
  // "unknown message type N" answers a message P could not dispatch — never a Pull, which every
  // P reads: such an ERROR must not settle a pull P may be writing for.
  ep.unsent_since = core::kNever;  // it answered: reachable
  const bool type_refused = response.status == wire::PullStatus::kError &&
                            response.code == ErrorCode::kProtocol &&
                            response.message.rfind("unknown message type", 0) == 0;
  if (id == 0 && ep.pulls.size() + ep.renewals.size() + ep.releases.size() == 1) {
    // P could not read the id (protocol §1): only the one message outstanding can be meant —
    // a pull, or a renewal or release an old P could not dispatch. With several outstanding
    // nothing is settled (an ERROR meant for a renewal must never settle a pull P may be
    // writing): their own deadlines decide.
    id = !ep.pulls.empty()      ? (type_refused ? 0 : ep.pulls.begin()->first)
         : !ep.renewals.empty() ? ep.renewals.begin()->first
                                : ep.releases.begin()->first;
  }
  if (type_refused && ep.pulls.count(id) != 0) id = 0;
  auto op = ep.pulls.find(id);
  if (op == ep.pulls.end() && response.status == wire::PullStatus::kError) {
    if (ReleaseRefused(endpoint, id, response)) return;
    if (ep.renewals.count(id) != 0) {
      // A P that predates renewals cannot dispatch one and answers ERROR (protocol §6): the
      // same as a rejection — warn once, stop renewing, keep pulling.
      wire::RenewalReply rejected;
      rejected.id = id;
      rejected.status = wire::RenewalStatus::kRejected;
      rejected.message = response.message;
      OnRenewalReply(endpoint, rejected, now);
      return;
    }
  }
  if (op == ep.pulls.end()) {
    ++counters_.replies_unmatched;  // unknown, or an unreadable id with several outstanding
    return;
  }
  if (op->second.timed_out) ++counters_.late_replies;
  const core::RequestId request = op->second.request;
  ApplyPullResponse(*ledger_, op->second.peer, std::span<const core::RequestId>(&request, 1),
                    response);
  const bool unsettled =
      std::any_of(response.err.begin(), response.err.end(),
                  [&](const wire::RequestError& e) { return e.unsettled && e.d_req_id == request; });
  if (unsettled) {
    // P's write failed with bytes that may still land: the receive failed just now (quarantined,
    // in ApplyPullResponse). As after a timeout, the pull stays known and the writer is fenced
    // where the data plane can; a fence, or P's quiescence, releases the blocks. A copy of this
    // answer, or one that comes after the pull's deadline, proves nothing more: it must not
    // settle the request as finished below (found by exploration with duplicated answers:
    // seeds 7000572, 7020704, 7055714, 7068476 and 7156562 released blocks a write then hit).
    if (!op->second.timed_out) {
      ++counters_.unsettled_writes;
      op->second.timed_out = true;
      AskFence(endpoint, &IncarnationOf(op->second.peer));
    }
    DrainLedger(now);
    return;
  }
  if (op->second.timed_out && response.status == wire::PullStatus::kFinish) {
    // A late FINISH that does not list the request still says P writes nothing more for it.
    (void)ledger_->Settle(request, op->second.peer, core::Settle::kFinished,
                          Status(ErrorCode::kNotFound, "late FINISH without the request"));
  }
  if (Answers(response, request)) ForgetPull(endpoint, op);
  DrainLedger(now);
}

void DecodeSession::OnSent(EndpointId endpoint, std::uint64_t wire_id, TimePoint now) {
  (void)now;
  Endpoint* ep = FindEndpoint(endpoint);
  if (ep == nullptr) return;
  ep->unsent_since = core::kNever;
  if (auto op = ep->pulls.find(wire_id); op != ep->pulls.end()) {
    op->second.sent = true;
    op->second.retry.reset();  // it left: P may be writing for it
  }
}

void DecodeSession::OnSendFailed(EndpointId endpoint, std::uint64_t wire_id, const Status& why,
                                 TimePoint now) {
  Endpoint* found = FindEndpoint(endpoint);
  if (found == nullptr) {
    // Closed since (idle): the message was a renewal or release whose wait ended first. Its
    // address still has nobody listening (found by the simulator with max_idle_endpoints 0:
    // the view stayed stale, and the next load went to the dead process).
    if (const std::string* closed = endpoints_.AddressOf(endpoint)) {
      engines_.MarkViewsStale(*closed);
    }
    return;
  }
  Endpoint& ep = *found;
  NoteMaybeIdle(endpoint);
  // Nothing took the message: no process listens at that address any more (a P restarted on
  // a new side-channel port, or gone), so whichever engine D knows there is looked up again
  // before its next load or renewal (found by attacking real processes: without it a P
  // restarted without etcd never got a pull again, since only a pull *timing out* marked the
  // view stale, and a pull to a dead address fails unsent instead).
  engines_.MarkViewsStale(ep.address);
  if (auto op = ep.pulls.find(wire_id); op != ep.pulls.end()) {
    // Never left: P cannot be writing for it. A load whose only pull this was is looked up
    // again and sent once more — the engine may live on at a new side channel (a P restarted
    // without a registry: measured, every first request after such a restart failed here) —
    // and otherwise it is a plain failure, no quarantine.
    if (op->second.retry && !op->second.sent && ledger_->Forget(op->second.request).ok()) {
      ParkedLoad load = std::move(*op->second.retry);
      load.retried = true;
      ForgetPull(endpoint, op);
      ++counters_.loads_retried;
      const core::EngineId engine = load.source.engine_id;
      KnownEngine& state = Engine(engine, load.source.bootstrap_address);
      state.parked.loads.push_back(std::move(load));
      engines_.Ask(engine, state, now);  // the view is stale now (MarkViewsStale above)
      return;
    }
    (void)ledger_->Settle(
        op->second.request, op->second.peer, core::Settle::kErr,
        Status(why.ok() ? ErrorCode::kUnavailable : why.code(),
               fmt::format("pull to {} not sent: {}", ep.address, why.message())));
    ForgetPull(endpoint, op);
    DrainLedger(now);
    return;
  }
  std::optional<TimePoint> renewal_sent;
  if (auto op = ep.renewals.find(wire_id); op != ep.renewals.end()) {
    ++counters_.renewal_failures;
    renewal_sent = op->second.deadline - renewal_reply_timeout_;
    renewal_deadlines_.erase({op->second.deadline, endpoint, wire_id});
    ep.renewals.erase(op);
  } else if (auto late = ep.unanswered_renewals.find(wire_id);
             late != ep.unanswered_renewals.end()) {
    // Its reply deadline (lease/12) passed while it waited for a connection (3 s): counted
    // failed then; that it never left is the news.
    renewal_sent = late->second;
    ep.unanswered_renewals.erase(late);
  }
  if (renewal_sent) {
    const TimePoint sent = *renewal_sent;
    // No renewal has reached this P worker since `unsent_since` (each one since failed unsent:
    // provably not delivered). Once that spans a lease, P — if it lives — has dropped every
    // transfer D tracks there (SPEC §2: an unrenewed transfer goes after one lease, prefilled
    // or not), and if it is gone its pulls get no answer: either way they fail now, their
    // blocks quarantined until a fence or a late answer (found with a P killed while a real
    // vLLM D waited on it: its load waited for the pull deadline).
    ep.unsent_since = std::min(ep.unsent_since, sent);
    if (options_.lease.count() > 0 && now - ep.unsent_since >= options_.lease) {
      GiveUpOnEndpoint(endpoint,
                       Status(ErrorCode::kUnavailable,
                              fmt::format("no renewal reached prefill worker {} for {}: it has "
                                          "dropped the transfer or is gone",
                                          ep.address, Secs(now - ep.unsent_since))));
      DrainLedger(now);
    }
  }
  if (auto op = ep.releases.find(wire_id); op != ep.releases.end()) {
    ++counters_.release_failures;
    release_deadlines_.erase({op->second.deadline, endpoint, wire_id});
    ep.releases.erase(op);
  }
}

void DecodeSession::ExpirePulls(TimePoint now) {
  while (!pull_deadlines_.empty() && std::get<0>(*pull_deadlines_.begin()) <= now) {
    const auto [deadline, endpoint, id] = *pull_deadlines_.begin();
    pull_deadlines_.erase(pull_deadlines_.begin());
    Endpoint& ep = endpoints_.At(endpoint);
    auto op = ep.pulls.find(id);
    if (op == ep.pulls.end()) continue;
    // Given up on already (its engine went down): it stays known, so P's late answer still
    // releases its quarantine; and the fence is tried again now (the engine may have died
    // since a first fence failed, and a fence of a dead peer succeeds).
    if (op->second.timed_out) {
      AskFence(endpoint, &IncarnationOf(op->second.peer));
      continue;
    }
    if (!ledger_->IsPending(op->second.request, op->second.peer)) {
      ep.pulls.erase(op);  // settled meanwhile (e.g. by a fence)
      NoteMaybeIdle(endpoint);
      continue;
    }
    ++counters_.pull_timeouts;
    GiveUpOnPull(op->second,
                 Status(ErrorCode::kTimeout, fmt::format("no answer from prefill worker {} within {}",
                                                         ep.address, Secs(options_.pull_timeout))));
    engines_.MarkViewsStale(ep.address);  // the engine may have restarted elsewhere: ask again
    AskFence(endpoint, &IncarnationOf(op->second.peer));
  }
  DrainLedger(now);
}

void DecodeSession::GiveUpOnPull(PullOp& op, const Status& why) {
  // Giving up is not proof that P stopped writing: the entry's blocks are quarantined (the
  // receive fails now), the pull stays known so a late reply still resolves it, and the peer is
  // fenced if the data plane can.
  op.timed_out = true;
  (void)ledger_->Settle(op.request, op.peer, core::Settle::kTimeout, why);
}

// ---- fences ----

void DecodeSession::AskFence(EndpointId endpoint, const std::string* incarnation) {
  // Pulls sent from now on are a new epoch of the peer: no fence asked here covers them.
  Endpoint& ep = endpoints_.At(endpoint);
  const std::uint32_t through = ep.epoch++;
  // Every epoch of this endpoint with pulls still known (given up on, or in flight) and not yet
  // proved stopped — also older ones whose fence failed — one fence each, so an epoch whose
  // writes are still landing holds up no other. An epoch whose pulls were all answered has
  // nothing quarantined: it needs no fence (and without one per timeout forever, fences stay
  // linear in the pulls given up on).
  // With `incarnation`, that process's epochs — and any epoch whose pulls were given up on
  // already, of whichever process: one that restarted on the same address got the pulls D
  // still sent under its view of the process before, so a death D hears of may be the only
  // proof those pulls will ever get (found by the simulator: with a data plane that cannot
  // fence a live writer, their blocks stayed quarantined for good). A fence only revokes write
  // keys of pulls already given up on, so asking one more never lets a block be reused early.
  std::set<core::PeerId> epochs;
  for (const auto& [id, op] : ep.pulls) {
    if (incarnation == nullptr || op.timed_out ||
        IncarnationOf(op.peer) == *incarnation) {
      epochs.insert(op.peer);
    }
  }
  for (core::PeerId peer : epochs) IssueFence(peer, through);
}

bool DecodeSession::PullsWaitFor(core::PeerId peer) const {
  const FenceBook::PeerKey* key = fences_.Find(peer);
  if (key == nullptr) return false;
  const Endpoint* ep = endpoints_.Find(key->endpoint);
  if (ep == nullptr) return false;
  return std::any_of(ep->pulls.begin(), ep->pulls.end(),
                     [&](const auto& op) { return op.second.peer == peer; });
}

void DecodeSession::IssueFence(core::PeerId peer, std::uint32_t through) {
  const std::optional<std::uint64_t> id = fences_.Start(peer);
  if (!id) return;  // proved stopped, or a fence of it is in flight
  const EndpointId endpoint = fences_.At(peer).endpoint;
  Endpoint& ep = endpoints_.At(endpoint);
  ++ep.fences_in_flight;
  ++counters_.fences_requested;
  std::vector<std::uint64_t> keys;
  if (options_.write_key_base != 0) keys.push_back(WriteKeyOf(peer));
  fences_out_.push_back({*id, endpoint, ep.address, through, std::move(keys)});
}

void DecodeSession::OnFenceDone(std::uint64_t fence_id, const Status& result, TimePoint now) {
  const std::optional<FenceBook::Fence> done = fences_.Finish(fence_id);
  if (!done) return;
  const FenceBook::Fence fence = *done;
  Endpoint& ep = endpoints_.At(fence.endpoint);  // kept while a fence of it is in flight
  --ep.fences_in_flight;
  NoteMaybeIdle(fence.endpoint);
  if (!result.ok()) {
    // Not proved: the quarantined blocks wait for the peer's late replies or a later fence.
    ++counters_.fences_failed;
    if (!warned_fence_) {
      warned_fence_ = true;
      events_out_.push_back(Warning{
          Warning::Kind::kFence,
          fmt::format("cannot fence prefill worker {} ({}); its timed-out pulls stay quarantined "
                      "until it answers or a later fence holds",
                      ep.address, result.ToString())});
    }
    // Writes were still landing (a stalled writer): ask again, backing off, while pulls of
    // that epoch still wait for proof. A data plane that cannot fence at all (kRejected) is
    // not asked again here: only a pull's deadline or the engine's death asks again.
    if (result.code() == ErrorCode::kTimeout && PullsWaitFor(fence.peer)) {
      fences_.ScheduleRetry(fence.peer, now);
    } else {
      fences_.ClearBackoff(fence.peer);
    }
    return;
  }
  // Nothing of this epoch can land any more: its unknown writers are known stopped, and its
  // pulls need no answer any more.
  fences_.MarkQuiesced(fence.peer);
  ledger_->PeerQuiesced(fence.peer);
  for (auto op = ep.pulls.begin(); op != ep.pulls.end();) {
    if (op->second.peer == fence.peer) {
      pull_deadlines_.erase({op->second.deadline, fence.endpoint, op->first});
      op = ep.pulls.erase(op);
    } else {
      ++op;
    }
  }
  DrainLedger(now);
}

void DecodeSession::OnEngineDown(const core::EngineId& engine, const Status& why, TimePoint now) {
  std::optional<KnownEngines::Down> down = engines_.OnEngineDown(engine, why, now);
  if (!down) return;
  KnownEngine& state = *down->entry;
  std::vector<core::Fingerprint>& releases = down->parked.releases;
  // Declared down before the parked loads fail: their releases (queued as they fail, and sent
  // at once with release_delay 0) go to the process D knew, as every later one does (found by
  // review: with release_delay 0 they were dropped, the view gone and none declared down yet).
  if (down->view) engines_.DeclareDown(state, *down->view);
  for (ParkedLoad& load : down->parked.loads) FailLoad(std::move(load), state.failure(), now);
  if (!down->view) {
    // Down again before any lookup: the process declared down earlier may still hold the KV.
    if (state.declared_down() != nullptr && !releases.empty()) {
      SendReleases(engine, *state.declared_down(), releases, now);
    } else {
      counters_.releases_dropped += releases.size();  // nowhere to send them: the lease frees them
    }
    return;
  }
  const PeerEngine& view = *down->view;
  // The word of a liveness source is advisory: a P cut off (or frozen) past its registry TTL
  // lives on and holds the KV of these transfers, so the releases still go to the process D
  // knew (found with the test hosts: without them a P thawed after a freeze kept the KV of
  // requests D had failed until its lease ran out, and its queued prefills waited for blocks).
  if (!releases.empty()) SendReleases(engine, view, releases, now);
  // Its pulls in flight will get no answer: their requests fail now, not at their deadlines,
  // and their blocks stay quarantined (a P cut off by a partition may still be writing) until
  // the fence asked here, or a late answer, proves it stopped.
  for (const std::string& address : view.side_channels) {
    const std::optional<EndpointId> ep = endpoints_.IdOf(address);
    if (!ep || endpoints_.At(*ep).pulls.empty()) continue;
    for (auto& [id, op] : endpoints_.At(*ep).pulls) {
      if (!op.timed_out && ledger_->IsPending(op.request, op.peer)) {
        ++counters_.pulls_abandoned;
        GiveUpOnPull(op, state.failure());
      }
    }
    AskFence(*ep);
  }
  DrainLedger(now);
}

void DecodeSession::OnProcessGone(const core::EngineId& engine, const std::string& incarnation,
                                  const Status& why, TimePoint now) {
  if (engines_.OnProcessGone(engine, incarnation, now) == nullptr) return;
  const Status failure(why.ok() ? ErrorCode::kUnavailable : why.code(),
                       fmt::format("prefill engine {} (process {}) is gone: {}", engine,
                                   incarnation, why.message()));
  GiveUpOnProcess(incarnation, failure);
  DrainLedger(now);
}

void DecodeSession::GiveUpOnEndpoint(EndpointId endpoint, const Status& failure) {
  Endpoint& ep = endpoints_.At(endpoint);
  bool any = false;
  for (auto& [id, op] : ep.pulls) {
    any = true;
    if (!op.timed_out && ledger_->IsPending(op.request, op.peer)) {
      ++counters_.pulls_abandoned;
      GiveUpOnPull(op, failure);
    }
  }
  if (any) AskFence(endpoint);
}

void DecodeSession::GiveUpOnProcess(const std::string& incarnation, const Status& failure) {
  // Its pulls in flight get no answer: their requests fail now and their blocks stay
  // quarantined until the fence asked here (of that process's epochs, and of every epoch given
  // up on before: AskFence says why) or a late answer.
  for (auto& [endpoint, ep] : endpoints_) {
    bool any = false;
    for (auto& [id, op] : ep.pulls) {
      if (IncarnationOf(op.peer) != incarnation) {
        any = any || op.timed_out;
        continue;
      }
      any = true;
      if (!op.timed_out && ledger_->IsPending(op.request, op.peer)) {
        ++counters_.pulls_abandoned;
        GiveUpOnPull(op, failure);
      }
    }
    if (any) AskFence(endpoint, &incarnation);
  }
}

// ---- renewals ----

void DecodeSession::SendRenewals(const core::EngineId& engine, const PeerEngine& view,
                                 std::span<const core::Fingerprint> ids, TimePoint now) {
  Status why;
  std::optional<std::vector<std::uint32_t>> targets = Targets(view, &why);
  if (!targets) {
    ++counters_.renewal_failures;
    return;
  }
  for (std::uint32_t rank : *targets) {
    const std::optional<EndpointId> found = EndpointFor(view.side_channels[rank]);
    if (!found) {
      ++counters_.renewal_failures;
      NoteEndpointsExhausted(view.side_channels[rank], "a renewal");
      continue;
    }
    const EndpointId endpoint = *found;
    Endpoint& ep = endpoints_.At(endpoint);
    wire::Renewal renewal;
    renewal.id = ++next_wire_id_;
    renewal.d_engine_id = options_.engine_id;
    renewal.d_lease_ms = Millis(options_.lease);
    renewal.fingerprints.assign(ids.begin(), ids.end());
    renewal.accepts_notices = true;  // OnAbortNotice reads them
    const TimePoint deadline = now + renewal_reply_timeout_;
    ep.renewals.emplace(renewal.id, ReplyOp{engine, deadline});
    renewal_deadlines_.insert({deadline, endpoint, renewal.id});
    ++counters_.renewal_messages;
    messages_out_.push_back({endpoint, ep.address, std::move(renewal)});
  }
}

void DecodeSession::RenewalPass(TimePoint now) {
  // Batches still waiting for a lookup from the last pass are superseded by this one.
  for (auto& [engine, state] : engines_) {
    counters_.renewal_failures += state.parked.renewals.size();
    state.parked.renewals.clear();
  }
  for (core::RenewalBatch& batch : renewals_.Poll(now)) {
    KnownEngine& state = Engine(batch.engine, "");
    if (state.view() != nullptr) {
      // Renewals never wait for a refresh: the transfers they keep are on the known process.
      if (state.view_stale()) engines_.Ask(batch.engine, state, now);
      SendRenewals(batch.engine, *state.view(), batch.ids, now);
    } else if (state.declared_down() != nullptr) {
      // Declared down, maybe wrongly (a P frozen or cut off past its registry TTL lives on):
      // keep its KV alive for as long as D wants it — unanswered renewals cost nothing — and,
      // once the failure is no longer believed, look for it again (found by review: these
      // stopped lookup_failure_ttl after the down, and a P back after its lease freed the KV).
      if (!state.FailureBelieved(now)) engines_.Ask(batch.engine, state, now);
      SendRenewals(batch.engine, *state.declared_down(), batch.ids, now);
    } else if (state.FailureCovers(state.bootstrap_address(), now)) {
      ++counters_.renewal_failures;  // known unreachable: one lookup per ttl, not per batch
    } else {
      state.parked.renewals.push_back(std::move(batch.ids));
      engines_.Ask(batch.engine, state, now);
    }
  }
}

std::optional<core::EngineId> DecodeSession::TakeReplyOp(
    EndpointId endpoint, std::map<std::uint64_t, ReplyOp> Endpoint::*ops,
    std::set<Deadline>& deadlines, std::uint64_t id) {
  Endpoint* ep = FindEndpoint(endpoint);
  if (ep == nullptr) {
    ++counters_.replies_unmatched;
    return std::nullopt;
  }
  ep->unsent_since = core::kNever;  // it answered: reachable
  std::map<std::uint64_t, ReplyOp>& pending = ep->*ops;
  auto op = pending.find(id);
  if (op == pending.end()) {
    ++counters_.replies_unmatched;  // unknown, or answered after its deadline
    return std::nullopt;
  }
  core::EngineId engine = std::move(op->second.engine);
  deadlines.erase({op->second.deadline, endpoint, id});
  pending.erase(op);
  NoteMaybeIdle(endpoint);
  return engine;
}

void DecodeSession::OnRenewalReply(EndpointId endpoint, const wire::RenewalReply& reply,
                                   TimePoint now) {
  (void)now;
  std::optional<core::EngineId> taken =
      TakeReplyOp(endpoint, &Endpoint::renewals, renewal_deadlines_, reply.id);
  if (!taken) return;
  const core::EngineId& engine = *taken;
  switch (reply.status) {
    case wire::RenewalStatus::kAccepted:
      ++counters_.renewals_accepted;
      if (!reply.message.empty()) {
        KnownEngine& state = Engine(engine, "");
        if (!state.warned_lease) {
          state.warned_lease = true;
          events_out_.push_back(
              Warning{Warning::Kind::kLeaseMismatch,
                      fmt::format("prefill engine {}: {}", engine, reply.message)});
        }
      }
      break;
    case wire::RenewalStatus::kRejected:
      ++counters_.renewals_rejected;
      if (renewals_.NoteRejected(engine)) {
        events_out_.push_back(Warning{
            Warning::Kind::kNoLease,
            fmt::format(
                "prefill engine {} runs without kv_lease_duration: renewals stop, pulls go on ({})",
                engine, reply.message)});
      }
      break;
    case wire::RenewalStatus::kError:
      ++counters_.renewal_failures;
      break;
  }
}

// ---- releases and notices ----

void DecodeSession::FlushReleases(TimePoint now) {
  release_due_ = core::kNever;
  for (auto& [engine, state] : engines_) {
    if (state.pending_releases.empty()) continue;
    std::vector<core::Fingerprint> ids = std::exchange(state.pending_releases, {});
    if (state.view() != nullptr && !state.view_stale()) {
      SendReleases(engine, *state.view(), ids, now);
    } else if (state.view() != nullptr) {
      // The process the view names may be gone and the KV on its successor (a P restarted on
      // a new side channel prefilled the request D gave up on): they go wherever the lookup
      // finds the engine, or to the known view if it fails (OnLookupFailed).
      state.parked.releases.insert(state.parked.releases.end(), ids.begin(), ids.end());
      engines_.Ask(engine, state, now);
    } else if (state.declared_down() != nullptr) {
      SendReleases(engine, *state.declared_down(), ids, now);  // advisory down: see OnEngineDown
    } else if (state.FailureCovers(state.bootstrap_address(), now)) {
      counters_.releases_dropped += ids.size();  // known unreachable: the lease frees them
    } else {
      state.parked.releases.insert(state.parked.releases.end(), ids.begin(), ids.end());
      engines_.Ask(engine, state, now);
    }
  }
}

void DecodeSession::SendReleases(const core::EngineId& engine, const PeerEngine& view,
                                 std::span<const core::Fingerprint> ids, TimePoint now) {
  Status why;
  std::optional<std::vector<std::uint32_t>> targets = Targets(view, &why);
  // Only to an engine that said it reads releases: an older P would answer an ERROR it cannot
  // tie to the release (id 0), which must never be mistaken for the answer to a pull.
  if (!targets || (view.features & wire::kFeatureRelease) == 0) {
    counters_.releases_dropped += ids.size();
    return;
  }
  for (std::size_t at = 0; at < ids.size(); at += wire::kMaxFingerprintsPerRelease) {
    const std::size_t n = std::min(ids.size() - at, wire::kMaxFingerprintsPerRelease);
    for (std::uint32_t rank : *targets) {
      const std::optional<EndpointId> found = EndpointFor(view.side_channels[rank]);
      if (!found) {
        counters_.releases_dropped += n;
        NoteEndpointsExhausted(view.side_channels[rank], "a release");
        continue;
      }
      const EndpointId endpoint = *found;
      Endpoint& ep = endpoints_.At(endpoint);
      wire::Release release;
      release.id = ++next_wire_id_;
      release.d_engine_id = options_.engine_id;
      release.d_tp_size = options_.tp_size;
      release.d_tp_rank = options_.tp_rank;
      release.fingerprints.assign(ids.begin() + static_cast<long>(at),
                                  ids.begin() + static_cast<long>(at + n));
      const TimePoint deadline = now + options_.release_reply_timeout;
      ep.releases.emplace(release.id, ReplyOp{engine, deadline});
      release_deadlines_.insert({deadline, endpoint, release.id});
      ++counters_.release_messages;
      counters_.releases_sent += n;
      messages_out_.push_back({endpoint, ep.address, std::move(release)});
    }
  }
}

void DecodeSession::OnReleaseReply(EndpointId endpoint, const wire::ReleaseReply& reply,
                                   TimePoint now) {
  (void)now;
  if (!TakeReplyOp(endpoint, &Endpoint::releases, release_deadlines_, reply.id)) return;
  if (reply.status != wire::ReleaseStatus::kAccepted) {
    ++counters_.release_failures;
    return;
  }
  counters_.p_released += reply.released;
  counters_.p_kept += reply.kept;
  counters_.p_unknown += reply.unknown;
}

bool DecodeSession::ReleaseRefused(EndpointId endpoint, std::uint64_t id,
                                   const wire::PullResponse& error) {
  Endpoint& ep = endpoints_.At(endpoint);
  auto op = ep.releases.find(id);
  if (op == ep.releases.end()) return false;
  NoteMaybeIdle(endpoint);
  const core::EngineId engine = op->second.engine;
  release_deadlines_.erase({op->second.deadline, endpoint, id});
  ep.releases.erase(op);
  ++counters_.release_failures;
  // Only "cannot read this message" (PROTOCOL: an unknown type) means an old P; any other
  // ERROR failed this one release.
  if (error.code != ErrorCode::kProtocol) return true;
  const std::string& message = error.message;
  // A P that predates releases cannot dispatch one (protocol §6): stop sending them to it.
  KnownEngine& state = Engine(engine, "");
  if (!state.releases_unsupported) {
    state.releases_unsupported = true;
    events_out_.push_back(Warning{
        Warning::Kind::kNoRelease,
        fmt::format("prefill engine {} cannot read releases ({}): its KV of aborted requests "
                    "is freed by its lease or timeout only",
                    engine, message)});
  }
  counters_.releases_dropped += state.pending_releases.size() + state.parked.releases.size();
  state.pending_releases.clear();
  state.parked.releases.clear();
  return true;
}

void DecodeSession::OnAbortNotice(EndpointId endpoint, const wire::AbortNotice& notice,
                                  TimePoint now) {
  ++counters_.notices_received;
  if (Endpoint* ep = FindEndpoint(endpoint)) ep->unsent_since = core::kNever;
  const Endpoint* found = FindEndpoint(endpoint);
  const std::string* address = found != nullptr ? &found->address : nullptr;
  for (const wire::AbortedTransfer& aborted : notice.aborted) {
    std::vector<core::RequestId> requests;
    for (auto [b, e] = by_transfer_.equal_range(aborted.transfer_id); b != e; ++b) {
      requests.push_back(b->second);
    }
    if (requests.empty()) ++counters_.notices_ignored;
    for (const core::RequestId& request : requests) {
      const Tracked& t = tracked_.at(request);
      // Only the engine the request pulls from can abort it, through one of its own side
      // channels: nobody else can fail D's requests by naming their transfers.
      const KnownEngine* state = engines_.Find(t.engine);
      const PeerEngine* view = state != nullptr ? state->view() : nullptr;
      const bool from_its_engine =
          address != nullptr && t.engine == notice.p_engine_id && view != nullptr &&
          std::find(view->side_channels.begin(), view->side_channels.end(), *address) !=
              view->side_channels.end();
      if (!from_its_engine) {
        ++counters_.notices_ignored;
        continue;
      }
      if (loading_.count(request) != 0) continue;  // its pull's answer settles it
      ++counters_.transfers_aborted;
      events_out_.push_back(TransferAborted{
          request, Status(aborted.code == ErrorCode::kOk ? ErrorCode::kCancelled : aborted.code,
                          fmt::format("prefill engine {} rank {} dropped transfer {}: {}",
                                      notice.p_engine_id, notice.p_tp_rank, aborted.transfer_id,
                                      aborted.reason))});
      // The rank that sent it dropped the transfer; other P ranks it pulls from may still hold
      // it (the sender ignores the release: tombstoned).
      Untrack(request, /*release=*/true, now);
    }
  }
}

void DecodeSession::OnMessage(EndpointId endpoint, std::span<const std::uint8_t> payload,
                              TimePoint now) {
  Result<wire::MessageType> type = wire::PeekType(payload);
  if (type) {
    switch (*type) {
      case wire::MessageType::kPullResponse:
        if (auto m = wire::DecodePullResponse(payload)) return OnPullResponse(endpoint, *m, now);
        break;
      case wire::MessageType::kRenewalReply:
        if (auto m = wire::DecodeRenewalReply(payload)) return OnRenewalReply(endpoint, *m, now);
        break;
      case wire::MessageType::kReleaseReply:
        if (auto m = wire::DecodeReleaseReply(payload)) return OnReleaseReply(endpoint, *m, now);
        break;
      case wire::MessageType::kAbortNotice:
        if (auto m = wire::DecodeAbortNotice(payload)) return OnAbortNotice(endpoint, *m, now);
        break;
      case wire::MessageType::kPull:
      case wire::MessageType::kRenewal:
      case wire::MessageType::kRelease:
        break;
    }
  }
  ++counters_.undecodable;  // nothing to settle with it: the deadlines decide
}

// ---- time ----

void DecodeSession::OnTimeout(TimePoint now) {
  for (const auto& [engine, id] : engines_.Expired(now)) {
    OnLookupFailed(engine,
                   Status(ErrorCode::kTimeout,
                          fmt::format("no answer within {}", Secs(options_.lookup_timeout))),
                   now, id);
  }
  while (!renewal_deadlines_.empty() && std::get<0>(*renewal_deadlines_.begin()) <= now) {
    const auto [deadline, endpoint, id] = *renewal_deadlines_.begin();
    renewal_deadlines_.erase(renewal_deadlines_.begin());
    Endpoint& ep = endpoints_.At(endpoint);
    if (ep.renewals.erase(id) != 0) {
      ++counters_.renewal_failures;
      // Kept (bounded) so that a later report that it never left still counts (OnSendFailed).
      ep.unanswered_renewals.emplace(id, deadline - renewal_reply_timeout_);
      while (ep.unanswered_renewals.size() > kMaxUnansweredRenewals) {
        ep.unanswered_renewals.erase(ep.unanswered_renewals.begin());
      }
    }
    NoteMaybeIdle(endpoint);
  }
  while (!release_deadlines_.empty() && std::get<0>(*release_deadlines_.begin()) <= now) {
    const auto [deadline, endpoint, id] = *release_deadlines_.begin();
    release_deadlines_.erase(release_deadlines_.begin());
    if (endpoints_.At(endpoint).releases.erase(id) != 0) ++counters_.release_failures;
    NoteMaybeIdle(endpoint);
  }
  if (release_due_ <= now) FlushReleases(now);
  for (core::PeerId peer : fences_.TakeDueRetries(now)) {
    if (PullsWaitFor(peer)) {
      IssueFence(peer, fences_.At(peer).epoch);
    } else {
      fences_.ClearBackoff(peer);  // answered meanwhile (late replies): nothing to prove
    }
  }
  ExpirePulls(now);
  if (renewals_.tracked() > 0 && renewals_.NextDue() <= now) RenewalPass(now);
  SweepEngines(now);
}

void DecodeSession::SweepEngines(TimePoint now) {
  if (!engines_.SweepDue(now)) return;
  std::unordered_set<core::EngineId> named;
  for (const auto& [request, tracked] : tracked_) named.insert(tracked.engine);
  engines_.Sweep(now, named);
}

TimePoint DecodeSession::NextDeadline() const {
  TimePoint next = core::kNever;
  if (!pull_deadlines_.empty()) next = std::min(next, std::get<0>(*pull_deadlines_.begin()));
  if (!renewal_deadlines_.empty()) {
    next = std::min(next, std::get<0>(*renewal_deadlines_.begin()));
  }
  if (renewals_.tracked() > 0) next = std::min(next, renewals_.NextDue());
  if (!release_deadlines_.empty()) {
    next = std::min(next, std::get<0>(*release_deadlines_.begin()));
  }
  next = std::min(next, release_due_);
  next = std::min(next, fences_.NextRetry());
  return std::min(next, engines_.NextDeadline());
}

// ---- output ----

void DecodeSession::DrainLedger(TimePoint now) {
  for (core::LedgerEvent& e : ledger_->TakeEvents()) {
    if (e.kind == core::LedgerEvent::Kind::kBlocksReleased) {
      quarantined_.erase(e.request);
      events_out_.push_back(BlocksReleased{e.request, std::move(e.blocks)});
      continue;
    }
    loading_.erase(e.request);
    if (e.quarantined) quarantined_.insert(e.request);
    ++(e.ok ? counters_.receives_ok : counters_.receives_failed);
    // The receive settled: stop renewing it (SPEC §2.1); a failed one will not be pulled
    // again, so P may free it now.
    Untrack(e.request, /*release=*/!e.ok, now);
    events_out_.push_back(
        ReceiveDone{e.request, e.ok, std::move(e.error), std::move(e.blocks), e.quarantined});
  }
}

std::vector<LookupRequest> DecodeSession::TakeLookups() { return engines_.TakeLookups(); }

std::vector<Transmit> DecodeSession::TakeMessages() { return std::exchange(messages_out_, {}); }

std::vector<FenceRequest> DecodeSession::TakeFences() { return std::exchange(fences_out_, {}); }

std::vector<EndpointId> DecodeSession::TakeClosedEndpoints() {
  CloseIdleEndpoints();
  return endpoints_.TakeClosed();
}

std::vector<DecodeEvent> DecodeSession::TakeEvents() { return std::exchange(events_out_, {}); }

DecodeStats DecodeSession::stats() const {
  DecodeStats s = counters_;
  for (const auto& [id, ep] : endpoints_) s.pulls_in_flight += ep.pulls.size();
  s.endpoints = endpoints_.size();
  s.quarantined_blocks = ledger_->quarantined_blocks();
  s.tracked = renewals_.tracked();
  s.receiving = loading_.size();
  s.engines_known = engines_.size();
  s.lookups = engines_.stats().lookups;
  s.lookup_failures = engines_.stats().lookup_failures;
  s.lookups_stale = engines_.stats().lookups_stale;
  s.engines_forgotten = engines_.stats().engines_forgotten;
  return s;
}

}  // namespace kvferry::protocol
