// JSON bodies of the bootstrap HTTP API (docs/bootstrap.md). Internal to kvferry_bootstrap:
// this header keeps nlohmann-json out of its includers; only the .cc files use it.
//
// Decoders never throw and never trust their input: a body that is not JSON, lacks a field, has
// a field of the wrong JSON type (a rank must be a non-negative integer, not 1.0 or "1") or
// breaks a limit of bootstrap_types.h yields an error with a reason. Unknown fields are ignored
// so that a newer peer can add fields.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "control/bootstrap_types.h"
#include "kvferry/status.h"

namespace kvferry::control {

// POST /register body. Errors: kInvalidArgument.
[[nodiscard]] std::string EncodeRegistration(const WorkerRegistration& r);
[[nodiscard]] Result<WorkerRegistration> DecodeRegistration(std::string_view body);

// GET /query?engine_id=X answers one engine object. GET /query answers the engines keyed by
// dp rank, the shape vLLM's Mooncake bootstrap answers:
//   {"<dp_rank>": {<the engine object>, "worker_addr": {"<tp_rank>": {"<pp_rank>": side_channel}}}}
// EncodeEngines expects at most one engine per dp_rank (BootstrapRegistry's rule); a later
// engine on the same dp_rank would replace an earlier one.
// Decoding errors: kProtocol (the answer came from a broken or hostile server).
[[nodiscard]] std::string EncodeEngine(const EngineInfo& info);
[[nodiscard]] std::string EncodeEngines(const std::vector<EngineInfo>& engines);
[[nodiscard]] Result<EngineInfo> DecodeEngine(std::string_view body);
// kvferry's listing, every engine checked as DecodeEngine checks one (and its dp_rank equal to
// its key); sorted by dp_rank.
[[nodiscard]] Result<std::vector<EngineInfo>> DecodeEngines(std::string_view body);
// What a router reads from a listing, kvferry's or a Mooncake bootstrap's: per entry the dp
// rank (its key: decimal, no leading zero, < kMaxRank), `engine_id` (1..kMaxStringBytes of
// printable ASCII, distinct across entries), `complete` when present (a boolean) and
// `dp_rank` when present (equal to the key). Other fields are ignored, as everywhere. The text
// is bounded before it is parsed: at most kMaxListAnswerBytes, kMaxJsonDepth levels,
// kMaxJsonValues values. Sorted by dp_rank; empty when the service has no engine yet.
[[nodiscard]] Result<std::vector<DpEngine>> DecodeDpEngines(std::string_view body);

// The largest listing a client reads (GET /query without a parameter).
inline constexpr std::size_t kMaxListAnswerBytes = std::size_t{16} << 20;

// {"error": reason} (every 4xx/5xx answer) and its reader; DecodeError returns "" when `body`
// is not such an object.
[[nodiscard]] std::string EncodeError(std::string_view reason);
[[nodiscard]] std::string DecodeError(std::string_view body);

// A small JSON object of string fields, e.g. {"status": "ok"}.
[[nodiscard]] std::string EncodeObject(
    const std::vector<std::pair<std::string, std::string>>& fields);

}  // namespace kvferry::control
