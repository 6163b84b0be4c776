// `kvferry serve`: one prefill (P) or decode (D) instance of the synthetic serving engine
// (src/harness/serve.h), with vLLM's --kv-transfer-config.
//
//   kvferry serve --role prefill --port 8010 --tp 2
//       --kv-transfer-config '{"kv_role":"kv_producer","kv_connector_extra_config":
//                              {"kv_lease_duration":30,"bootstrap_port":8998}}'
//   kvferry serve --role decode --port 8020
//       --kv-transfer-config '{"kv_role":"kv_consumer","kv_connector_extra_config":
//                              {"kv_lease_duration":30}}'
#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>

#include "commands.h"
#include "harness/serve.h"

namespace kvferry::tools {

void AddServeCommand(CLI::App& app, int& exit_code) {
  auto options = std::make_shared<harness::ServeOptions>();
  auto role = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand(
      "serve", "Run one P or D instance of the synthetic model (HTTP /v1/completions, /metrics)");
  harness::ServeOptions& o = *options;
  cmd->add_option("--role", *role, "prefill or decode")
      ->required()
      ->check(CLI::IsMember({"prefill", "decode"}));
  cmd->add_option("--host", o.host, "HTTP bind address")->capture_default_str();
  cmd->add_option("--port", o.port, "HTTP port (0: any free port)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--kv-transfer-config", o.kv_transfer_config,
                  "vLLM-style JSON: kv_role, engine_id, kv_load_failure_policy, "
                  "kv_connector_extra_config.{kv_lease_duration,abort_request_timeout,"
                  "bootstrap_port,kv_release,cluster_secret_file}")
      ->capture_default_str();
  cmd->add_option("--tp", o.tp, "tensor-parallel ranks (threads)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  cmd->add_option("--kv-heads", o.kv_heads, "KV heads of the model (same on P and D)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--block-tokens", o.block_tokens, "tokens per KV block")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--kv-bytes-per-token", o.kv_bytes_per_token,
                  "KV bytes of one token over all heads (= per rank at TP1; a rank holds its "
                  "share of the heads)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--num-blocks", o.num_blocks, "KV blocks in the pool")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1u << 24));
  cmd->add_option("--prefill-us-per-token", o.costs.prefill_us_per_token)->capture_default_str();
  cmd->add_option("--prefill-us-per-batch", o.costs.prefill_us_per_batch)->capture_default_str();
  cmd->add_option("--decode-us-per-step", o.costs.decode_us_per_step)->capture_default_str();
  cmd->add_option("--max-batch-tokens", o.costs.max_batch_tokens, "token budget of one step")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1u << 24));
  cmd->add_option("--max-running", o.costs.max_running, "requests running at once")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1u << 20));
  cmd->add_option("--max-model-len", o.max_model_len, "prompt + max_tokens limit")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1u << 24));
  cmd->add_option("--max-waiting", o.max_waiting, "open requests beyond this get 503")
      ->capture_default_str();
  cmd->add_option("--http-threads", o.http_threads,
                  "HTTP worker threads (each open connection holds one)")
      ->capture_default_str()
      ->check(CLI::Range(4, 8192));
  cmd->add_option("--request-timeout", o.request_timeout_s,
                  "seconds before an open request is "
                  "aborted (504)")
      ->capture_default_str()
      ->check(CLI::Range(1.0, 86400.0));
  cmd->add_option("--pull-timeout", o.pull_timeout_s,
                  "D: seconds a pull may take before its blocks are quarantined; must exceed "
                  "abort_request_timeout + 70 s (P's write bound). 0: that + 5 s")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 86400.0));
  cmd->add_option("--fault-err-after-write", o.fault_err_after_write,
                  "P: fraction of writes reported failed after they landed")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--fault-write-delay-ms", o.fault_write_delay_ms,
                  "P: each write starts after a uniform 0..X ms delay")
      ->capture_default_str();
  cmd->add_option("--fault-ranks", o.fault_ranks, "P ranks the faults apply to")->delimiter(',');
  cmd->add_option("--fault-err-ranks", o.fault_err_ranks,
                  "P ranks --fault-err-after-write applies to (default: --fault-ranks)")
      ->delimiter(',');
  cmd->add_option("--fault-delay-ranks", o.fault_delay_ranks,
                  "P ranks --fault-write-delay-ms applies to (default: --fault-ranks)")
      ->delimiter(',');
  cmd->add_option("--fault-seed", o.fault_seed)->capture_default_str();
  cmd->add_option("--trace-file", o.trace_file,
                  "append JSON lines: block alloc/free (both roles), WRITE start/end (P)");
  cmd->add_option("--ready-file", o.ready_file,
                  "write {port, bootstrap_port, engine_id, ...} here once serving");
  cmd->add_option("--served-model-name", o.served_model)->capture_default_str();
  cmd->add_option("--shutdown-timeout", o.shutdown_timeout_s,
                  "seconds the shutdown may take; then the process exits without waiting for "
                  "pulls still in flight")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 3600.0));
  cmd->callback([options, role, &exit_code] {
    auto parsed = harness::ParseRole(*role);
    if (!parsed) {
      std::fprintf(stderr, "%s\n", parsed.error().ToString().c_str());
      exit_code = 2;
      return;
    }
    options->role = *parsed;
    exit_code = harness::RunServe(*options);
  });
}

}  // namespace kvferry::tools
