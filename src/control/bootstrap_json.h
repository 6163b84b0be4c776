// JSON bodies of the bootstrap HTTP API (docs/bootstrap.md). Internal to kvferry_bootstrap:
// this header keeps nlohmann-json out of its includers; only the .cc files use it.
//
// Decoders never throw and never trust their input: a body that is not JSON, lacks a field, has
// a field of the wrong JSON type (a rank must be a non-negative integer, not 1.0 or "1") or
// breaks a limit of bootstrap_types.h yields an error with a reason. Unknown fields are ignored
// so that a newer peer can add fields.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "control/bootstrap_types.h"
#include "kvferry/status.h"

namespace kvferry::control {

// POST /register body. Errors: kInvalidArgument.
[[nodiscard]] std::string EncodeRegistration(const WorkerRegistration& r);
[[nodiscard]] Result<WorkerRegistration> DecodeRegistration(std::string_view body);

// GET /query?engine_id=X answers one engine object; GET /query answers {"engines": [...]}.
// Decoding errors: kProtocol (the answer came from a broken or hostile server).
[[nodiscard]] std::string EncodeEngine(const EngineInfo& info);
[[nodiscard]] std::string EncodeEngines(const std::vector<EngineInfo>& engines);
[[nodiscard]] Result<EngineInfo> DecodeEngine(std::string_view body);
[[nodiscard]] Result<std::vector<EngineInfo>> DecodeEngines(std::string_view body);

// {"error": reason} (every 4xx/5xx answer) and its reader; DecodeError returns "" when `body`
// is not such an object.
[[nodiscard]] std::string EncodeError(std::string_view reason);
[[nodiscard]] std::string DecodeError(std::string_view body);

// A small JSON object of string fields, e.g. {"status": "ok"}.
[[nodiscard]] std::string EncodeObject(
    const std::vector<std::pair<std::string, std::string>>& fields);

}  // namespace kvferry::control
