// Scenario C's offline analysis (SPEC §8 C): merge the JSON-lines traces of P and D
// (`kvferry serve --trace-file`) by t_ns and count P WRITEs that started after their destination
// block was freed on D, or freed and reallocated to another request.
//
// Trace lines (engine.cc: the block pool's and the writes'):
//   D: {"t_ns", "role":"decode", "block", "generation", "event":"alloc"|"free", "request"}
//   P: {"t_ns", "role":"prefill", "event":"write_start"|"write_end", "transfer_id", "d_req_id",
//       "p_rank", "dst_blocks", ...}
// t_ns is CLOCK_MONOTONIC (system-wide on Linux), so lines of different processes compare.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace kvferry::harness {

struct TraceBlockEvent {
  std::int64_t t_ns = 0;
  std::int64_t block = 0;
  std::uint64_t generation = 0;
  bool alloc = false;
  std::string request;
};

struct TraceWriteEvent {
  std::int64_t t_ns = 0;
  bool start = true;
  std::string transfer_id;
  std::string d_req_id;
  int p_rank = 0;
  std::vector<std::int64_t> blocks;
};

struct ParsedTraces {
  std::vector<TraceBlockEvent> d_blocks;  // D's block events only
  std::vector<TraceBlockEvent> p_blocks;  // P's block events (role "prefill")
  std::vector<TraceWriteEvent> writes;    // P's WRITE events
  std::size_t lines = 0, bad_lines = 0;
};

// Parses JSON lines (any number of files' contents appended). Unknown events are skipped.
void ParseTraceLines(const std::string& text, ParsedTraces& out);
bool ParseTraceFile(const std::string& path, ParsedTraces& out);

struct WriteAfterFree {
  std::uint64_t write_starts = 0;             // WRITE starts of `rank`
  std::uint64_t after_free = 0;               // ... that began after a destination block's free
  std::uint64_t after_realloc = 0;            // ... and after it was allocated again
  std::uint64_t unmatched = 0;                // no D allocation of that block for that request
  std::set<std::string> requests_after_free;  // d_req_ids
  std::set<std::string> requests_after_realloc;
};

// Counts, for P rank `rank`'s WRITE starts, those whose destination block (allocated on D to
// the WRITE's d_req_id) had been freed, or freed and reallocated, before the WRITE began.
WriteAfterFree CountWritesAfterFree(const ParsedTraces& traces, int rank);

// For every D request that P WROTE into and D later freed: did D free any of its blocks before
// the last WRITE into the request (from any P rank) had ended? A stricter form of the check
// above: the fixed ledger returns blocks only after every peer settled, i.e. after its WRITE.
struct FreeOrder {
  std::uint64_t requests = 0;         // written into and freed on D
  std::uint64_t freed_too_early = 0;  // first free before the last write_end
  std::set<std::string> early;        // their d_req_ids
  double min_margin_ms = 0;           // smallest (first free - last write_end); 0 if no requests
};
FreeOrder CheckFreeAfterWrites(const ParsedTraces& traces);

// Case A: the blocks allocated (held) at `t_ns` in `events` (one pool's alloc/free events), and
// when the last of them was freed afterwards.
struct HeldRelease {
  std::uint64_t held = 0;         // blocks allocated at t_ns
  std::uint64_t never_freed = 0;  // of those, not freed by the end of the trace
  std::int64_t last_free_ns = 0;  // when the last of them was freed (0 when none were held)
};
HeldRelease ReleaseOfBlocksHeldAt(const std::vector<TraceBlockEvent>& events, std::int64_t t_ns);

// d_req_ids that got a WRITE start from every rank in `ranks`.
std::set<std::string> RequestsWrittenByAll(const ParsedTraces& traces,
                                           const std::vector<int>& ranks);

}  // namespace kvferry::harness
