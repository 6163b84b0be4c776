// PrefillAdapter: the glue between a P engine and its ranks' PrefillSessions, written once and
// sans-IO — the twin of DecodeAdapter (decode_adapter.h; docs/design.md, "The engine adapter").
//
// An engine prefills one request; each of its ranks holds that rank's share of the KV in its
// hold table. What lies between:
//   - admission on every rank, with rollback: a transfer is admitted only if every rank admits
//     it; otherwise the ranks that did are told the engine finished it, and the request is
//     refused with the first rank's reason;
//   - the hand-off: PrefillDone on every rank; a rank that cannot hold it (released by D, its
//     lease lapsed meanwhile) means nobody can complete the transfer (D needs every rank), so
//     the others are told to let go too and the engine hears HandOffFailed;
//   - frees: the blocks go back to the engine only once no rank holds them (each rank's
//     kFreeBlocks, which its hold table sends once no write reads them);
//   - what a rank's kAbortPrefill (dead decoder, nobody pulled in time) does: the engine stops
//     the request once (AbortPrefill); after the hand-off, every rank lets go instead.
//
// The decisions:
//  - Duplicate transfer id: Admit of a transfer the adapter still knows answers kAlreadyExists
//    and changes nothing (the ranks would refuse it too; the first request keeps its transfer).
//  - Refusal: a request the engine drops before admitting it (aborted or finished while it
//    queued, or refused outright) is Dropped: every rank tombstones the transfer, so D's pull
//    fails at once instead of parking for abort_request_timeout.
//  - A refused admission: the engine may still prefill the request (vLLM cannot skip it); its
//    PrefillDone then frees the blocks at once (FreeBlocks) and touches no rank.
//  - Finish before the hand-off (the engine aborted or failed the request): every admitted rank
//    is told; the engine frees its blocks itself. After the hand-off the hold tables own them:
//    Finish then lets every rank go (the blocks come back through FreeBlocks).
//  - Stop: forgets everything, reporting what was still held.
//
// Rank calls that answer (Admit, PrefillDone) must be answered with OnAdmitted / OnPrefillDone,
// synchronously or later, and a rank's PrefillDone answer before that rank's later hold
// events; events come out of TakeEvents, each once per transfer. An engine that will not
// prefill a request whose admission was refused calls Finish (vLLM prefills it anyway and
// calls PrefillDone, which frees at once).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <variant>
#include <vector>

#include "kvferry/core/hold_table.h"
#include "kvferry/core/ids.h"
#include "kvferry/status.h"

namespace kvferry::protocol {

struct PrefillAdapterOptions {
  std::uint32_t ranks = 1;
  // Transfers known at once; Admit beyond it answers kResourceExhausted.
  std::size_t max_transfers = 1 << 20;
};

// A call the engine makes on one rank's worker (or session).
struct PrefillRankCall {
  enum class Kind : std::uint8_t {
    kAdmit,           // Admit(transfer, handle); answer with OnAdmitted
    kPrefillDone,     // PrefillDone(transfer, blocks); answer with OnPrefillDone
    kEngineFinished,  // EngineFinished(transfer)
    kRefuse,          // Refuse(transfer, why): tombstone a transfer nobody here will prefill
    kLayersReady,     // LayersReady(transfer, blocks, planes): a hint, not answered
  };
  std::uint32_t rank = 0;
  Kind kind = Kind::kAdmit;
  core::TransferId transfer;
  std::uint64_t handle = 0;
  std::vector<core::BlockId> blocks;  // kPrefillDone, kLayersReady
  Status why;                         // kRefuse
  std::vector<std::uint32_t> planes;  // kLayersReady
};

struct Admitted {  // every rank admitted the transfer
  core::TransferId transfer;
  std::uint64_t handle = 0;
};
struct AdmitRefused {  // some rank refused it: nothing is held (the others were rolled back)
  core::TransferId transfer;
  std::uint64_t handle = 0;
  Status why;
};
struct AbortPrefill {  // a rank gave up on it before the hand-off: stop the request (once)
  core::TransferId transfer;
  std::uint64_t handle = 0;
  core::ReleaseReason reason = core::ReleaseReason::kDeadDecoder;
};
struct HandOffFailed {  // some rank could not hold it at PrefillDone: no D can complete it
  core::TransferId transfer;
  std::uint64_t handle = 0;
  Status why;
};
struct FreeBlocks {  // no rank holds the transfer's blocks any more: the engine frees them
  core::TransferId transfer;
  std::uint64_t handle = 0;
  // The last holding rank's reason (kSent, kExpired, kReleasedByDecoder, ...); kAbortedByEngine
  // when no rank held them (refused at admission, or every rank let go before the hand-off).
  core::ReleaseReason reason = core::ReleaseReason::kAbortedByEngine;
};
using PrefillAdapterEvent =
    std::variant<Admitted, AdmitRefused, AbortPrefill, HandOffFailed, FreeBlocks>;

struct PrefillAdapterStats {
  std::size_t transfers = 0;  // known (admitting, admitted, held, refused awaiting PrefillDone)
  std::size_t held = 0;       // handed off, some rank still holding
  std::uint64_t stray_results = 0;  // rank answers or events for nothing of that rank
};

class PrefillAdapter {
 public:
  explicit PrefillAdapter(PrefillAdapterOptions options);

  // ---- The engine ----
  // The engine will prefill the request: every rank admits `transfer`. kInvalidArgument for an
  // empty id, kAlreadyExists for a transfer still known, kResourceExhausted at max_transfers.
  [[nodiscard]] Status Admit(const core::TransferId& transfer, std::uint64_t handle);
  // Its KV sits in `blocks`: every rank holds it for the decoder (or, refused at admission,
  // FreeBlocks at once). kNotFound for a transfer not admitted (the engine frees its blocks).
  [[nodiscard]] Status PrefillDone(const core::TransferId& transfer,
                                   std::vector<core::BlockId> blocks);
  // Layers `planes` of the request's KV are final in `blocks` before its prefill ends (vLLM's
  // save_kv_layer in the step that completes the prompt): every rank writes them to the pulls
  // already waiting (PrefillSession::LayersReady). Passed on only while every rank admitted
  // `transfer` for `handle` and the engine neither finished nor handed it off; otherwise
  // (refused, being admitted, another request's transfer id) it does nothing and returns false:
  // a hint changes no outcome, so it is never an error.
  bool LayersReady(const core::TransferId& transfer, std::uint64_t handle,
                   const std::vector<core::BlockId>& blocks,
                   const std::vector<std::uint32_t>& planes);
  // The engine is done with the request (see the file comment). Idempotent.
  void Finish(const core::TransferId& transfer);
  // The engine drops a request it never admitted: every rank tombstones the transfer. A
  // transfer the adapter knows is left alone (Finish is for those).
  void Drop(const core::TransferId& transfer, const Status& why);

  // ---- What the ranks report ----
  void OnAdmitted(std::uint32_t rank, const core::TransferId& transfer, const Status& result);
  void OnPrefillDone(std::uint32_t rank, const core::TransferId& transfer, const Status& result);
  // A rank's hold event (kFreeBlocks and kAbortPrefill matter; others are ignored).
  void OnHoldEvent(std::uint32_t rank, const core::HoldEvent& event);

  // Forgets everything; returns how many transfers some rank still held.
  std::size_t Stop();

  std::vector<PrefillRankCall> TakeCommands();
  std::vector<PrefillAdapterEvent> TakeEvents();
  PrefillAdapterStats stats() const;
  // The handle `transfer` was admitted with, while the adapter knows it.
  std::optional<std::uint64_t> handle_of(const core::TransferId& transfer) const;
  // Whether the adapter told the engine to stop `transfer` (AbortPrefill), while it knows it:
  // for an engine that can learn of a request after the adapter did (`kvferry serve` admits on
  // its HTTP thread, and a hold event may reach its engine thread before the request does).
  bool abort_told(const core::TransferId& transfer) const;

 private:
  enum class Phase : std::uint8_t {
    kAdmitting,  // kAdmit sent, answers pending
    kAdmitted,   // every rank admitted; prefilling
    kRefused,    // admission refused: PrefillDone frees at once
    kHandingOff, // kPrefillDone sent, answers pending
    kHeld,       // some rank holds it
  };
  enum class RankState : std::uint8_t { kNone, kPending, kAdmitted, kHolding };
  struct Entry {
    std::uint64_t handle = 0;
    Phase phase = Phase::kAdmitting;
    std::vector<RankState> ranks;
    std::uint32_t pending = 0;  // answers still due
    std::uint32_t holding = 0;  // ranks holding (kHeld)
    Status first_error;
    bool finished = false;       // the engine called Finish
    bool abort_told = false;     // AbortPrefill emitted
    core::ReleaseReason last_free = core::ReleaseReason::kAbortedByEngine;
  };

  void Call(PrefillRankCall::Kind kind, const core::TransferId& transfer, const Entry& entry,
            RankState only, const std::vector<core::BlockId>* blocks);
  Entry* Expecting(std::uint32_t rank, const core::TransferId& transfer, Phase phase);
  void AdmissionDone(const core::TransferId& transfer, Entry& entry);
  void HandOffDone(const core::TransferId& transfer, Entry& entry);
  // Emits FreeBlocks and forgets the entry once no rank holds it.
  void MaybeFree(const core::TransferId& transfer);

  PrefillAdapterOptions options_;
  std::unordered_map<core::TransferId, Entry> entries_;
  std::vector<PrefillRankCall> commands_;
  std::vector<PrefillAdapterEvent> events_;
  std::uint64_t stray_results_ = 0;
};

}  // namespace kvferry::protocol
