// RunServe: the process behind `kvferry serve` — one P or D instance of the synthetic model
// (engine.h) behind its HTTP front (http_front.h); P also embeds the bootstrap service.
//
// Startup order: signals blocked (before any thread starts), --kv-transfer-config parsed (a bad
// one is an error here, not later), P's bootstrap service, the engine and its ranks (P ranks
// register), the HTTP server, then the ready file. Shutdown on SIGINT/SIGTERM: stop HTTP (new
// requests refused), answer every open request, stop the ranks (P drains in-flight writes before
// its memory is deregistered), stop the bootstrap service, exit 0.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "harness/engine.h"

namespace kvferry::harness {

struct ServeOptions {
  Role role = Role::kPrefill;
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: any free port (the ready file says which)
  std::string kv_transfer_config = "{}";
  std::uint32_t tp = 1;
  std::uint32_t kv_heads = 4;
  std::uint32_t block_tokens = 16;
  std::uint32_t kv_bytes_per_token = 64;  // all KV heads of one token (a TP1 rank's bytes/token)
  std::uint32_t num_blocks = 4096;
  EngineCosts costs;
  std::uint32_t max_model_len = 8192;
  std::uint32_t max_waiting = 4096;
  std::size_t http_threads = 512;
  double request_timeout_s = 3600;
  // D: seconds a pull may take before its blocks are quarantined. 0: abort_request_timeout +
  // the write bound (70 s: P's 30 s connect and 30 s write timeouts, then closing and fencing)
  // + 5 s. Must exceed the first
  // two (P answers every pull within that), or serve refuses to start.
  double pull_timeout_s = 0;
  // Faults on P (SPEC §8 C), applied to fault_ranks only; fault_err_ranks / fault_delay_ranks,
  // when given, pick the ranks of each fault separately (case C: errors on P0, delays on P1).
  double fault_err_after_write = 0;
  std::uint32_t fault_write_delay_ms = 0;
  std::vector<std::uint32_t> fault_ranks;
  std::vector<std::uint32_t> fault_err_ranks;
  std::vector<std::uint32_t> fault_delay_ranks;
  std::uint64_t fault_seed = 1;
  std::string trace_file;  // empty: no trace
  std::string ready_file;  // written once serving: {"port", "bootstrap_port", "engine_id", ...}
  std::string served_model = "kvferry-synthetic";
  // Bound on the whole shutdown after SIGINT/SIGTERM. P's ranks drain their writes within it
  // (PrefillListener: 5 s + 1 s grace); D's pulls in flight cannot be cancelled by the runtime
  // (they end at --pull-timeout), so past this bound the process logs what it abandons and
  // exits 0 without waiting: D's memory dies with it, so no write can land anywhere after.
  double shutdown_timeout_s = 10;
};

// Runs until SIGINT or SIGTERM. Returns the process exit code (0 after a clean shutdown, 1 when
// it could not start; the reason goes to stderr). Call it from the main thread before any other
// thread exists: it blocks both signals process-wide and sigwait()s for them.
int RunServe(const ServeOptions& options);

}  // namespace kvferry::harness
