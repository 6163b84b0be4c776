#include "control/bootstrap_json.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "control/json_limits.h"

namespace kvferry::control {
namespace {

using nlohmann::json;

// Dumps never throw: strings are validated printable ASCII, and `replace` covers any slip.
std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// Field readers. Each returns false and sets `error` (naming the field) when the field is
// missing or has the wrong JSON type.
class Reader {
 public:
  Reader(const json& object, std::string_view what) : object_(object), what_(what) {}

  bool String(const char* field, std::string& out) {
    const json* v = Find(field);
    if (v == nullptr) return false;
    if (!v->is_string()) return Fail(field, "a string");
    const auto& s = v->get_ref<const std::string&>();
    if (s.size() > kMaxStringBytes) {
      error_ = fmt::format("{}: {} is {} bytes, limit {}", what_, field, s.size(), kMaxStringBytes);
      return false;
    }
    out = s;
    return true;
  }

  bool Uint(const char* field, std::uint32_t& out) {
    const json* v = Find(field);
    if (v == nullptr) return false;
    // number_unsigned only: 1.0, -1, "1", true are all wrong types, not ranks.
    if (!v->is_number_unsigned()) return Fail(field, "a non-negative integer");
    const auto n = v->get<std::uint64_t>();
    if (n > std::numeric_limits<std::uint32_t>::max()) {
      error_ = fmt::format("{}: {} {} is out of range", what_, field, n);
      return false;
    }
    out = static_cast<std::uint32_t>(n);
    return true;
  }

  bool Number(const char* field, double& out) {
    const json* v = Find(field);
    if (v == nullptr) return false;
    if (!v->is_number()) return Fail(field, "a number");
    out = v->get<double>();
    return true;
  }

  // An optional field: absent leaves `out` as it is (a peer that predates the field).
  bool OptionalUint(const char* field, std::uint32_t& out) {
    return object_.find(field) == object_.end() || Uint(field, out);
  }

  bool Bool(const char* field, bool& out) {
    const json* v = Find(field);
    if (v == nullptr) return false;
    if (!v->is_boolean()) return Fail(field, "a boolean");
    out = v->get<bool>();
    return true;
  }

  const json* Array(const char* field) {
    const json* v = Find(field);
    if (v == nullptr) return nullptr;
    if (!v->is_array()) {
      Fail(field, "an array");
      return nullptr;
    }
    return v;
  }

  const std::string& error() const { return error_; }

 private:
  const json* Find(const char* field) {
    auto it = object_.find(field);
    if (it == object_.end()) {
      error_ = fmt::format("{}: missing field {}", what_, field);
      return nullptr;
    }
    return &*it;
  }
  bool Fail(const char* field, const char* expected) {
    error_ = fmt::format("{}: {} must be {}", what_, field, expected);
    return false;
  }

  const json& object_;
  std::string_view what_;
  std::string error_;
};

// Parses `body` into an object, or explains why not.
Result<json> ParseObject(std::string_view body, ErrorCode code, std::string_view what) {
  if (body.size() > kMaxBodyBytes) {
    return Err(code,
               fmt::format("{}: body is {} bytes, limit {}", what, body.size(), kMaxBodyBytes));
  }
  if (JsonDepth(body) > kMaxJsonDepth) {
    return Err(code, fmt::format("{}: JSON nested deeper than {} levels", what, kMaxJsonDepth));
  }
  json j = json::parse(body, /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Err(code, fmt::format("{}: body is not valid JSON", what));
  if (!j.is_object()) return Err(code, fmt::format("{}: body must be a JSON object", what));
  return j;
}

json EngineToJson(const EngineInfo& info) {
  json workers = json::array();
  for (const WorkerAddress& w : info.workers) {
    workers.push_back({{"dp_rank", w.dp_rank},
                       {"tp_rank", w.tp_rank},
                       {"pp_rank", w.pp_rank},
                       {"side_channel", w.side_channel},
                       {"data_plane", w.data_plane}});
  }
  return {{"engine_id", info.engine_id},
          {"incarnation", info.incarnation},
          {"dp_rank", info.dp_rank},
          {"tp_size", info.tp_size},
          {"pp_size", info.pp_size},
          {"kv_lease_duration", info.kv_lease_duration},
          {"protocol_version", info.protocol_version},
          {"protocol_features", info.protocol_features},
          {"complete", info.complete},
          {"workers", std::move(workers)}};
}

// A listing entry: the engine object plus Mooncake's worker_addr map (tp_rank -> pp_rank ->
// side channel), so that a router written for vLLM's Mooncake bootstrap reads it too.
json EngineToListEntry(const EngineInfo& info) {
  json entry = EngineToJson(info);
  json addresses = json::object();
  for (const WorkerAddress& w : info.workers) {
    addresses[std::to_string(w.tp_rank)][std::to_string(w.pp_rank)] = w.side_channel;
  }
  entry["worker_addr"] = std::move(addresses);
  return entry;
}

// At most 32 printable bytes of text from the network, for an error message.
std::string Excerpt(std::string_view text) {
  std::string out;
  for (char c : text.substr(0, 32)) out.push_back(c >= 0x20 && c <= 0x7e ? c : '?');
  if (text.size() > 32) out += "...";
  return out;
}

// A listing's key: the decimal dp rank, as Python writes an int key ("0", "17"; no sign, no
// leading zero), below kMaxRank.
bool ParseDpKey(std::string_view key, std::uint32_t& out) {
  if (key.empty() || key.size() > 4 || (key.size() > 1 && key[0] == '0')) return false;
  std::uint32_t value = 0;
  for (char c : key) {
    if (c < '0' || c > '9') return false;
    value = value * 10 + static_cast<std::uint32_t>(c - '0');
  }
  if (value >= kMaxRank) return false;
  out = value;
  return true;
}

// The outer object of a listing, bounded before the parser sees it.
Result<json> ParseListing(std::string_view body) {
  constexpr ErrorCode kBad = ErrorCode::kProtocol;
  if (body.size() > kMaxListAnswerBytes) {
    return Err(
        kBad, fmt::format("listing: body is {} bytes, limit {}", body.size(), kMaxListAnswerBytes));
  }
  if (JsonDepth(body) > kMaxJsonDepth) {
    return Err(kBad, fmt::format("listing: JSON nested deeper than {} levels", kMaxJsonDepth));
  }
  if (JsonValues(body) > kMaxJsonValues) {
    return Err(kBad, fmt::format("listing: more than {} JSON values", kMaxJsonValues));
  }
  json j = json::parse(body, /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Err(kBad, "listing: body is not valid JSON");
  if (!j.is_object()) return Err(kBad, "listing: body must be a JSON object keyed by dp rank");
  if (j.size() > kMaxRank) {
    return Err(kBad,
               fmt::format("listing: {} entries, limit {} (one per dp rank)", j.size(), kMaxRank));
  }
  return j;
}

Result<EngineInfo> EngineFromJson(const json& j) {
  constexpr ErrorCode kBad = ErrorCode::kProtocol;
  if (!j.is_object()) return Err(kBad, "query answer: an engine must be a JSON object");
  EngineInfo info;
  Reader in(j, "query answer");
  const json* workers = nullptr;
  bool ok = in.String("engine_id", info.engine_id) && in.String("incarnation", info.incarnation) &&
            in.Uint("dp_rank", info.dp_rank) && in.Uint("tp_size", info.tp_size) &&
            in.Uint("pp_size", info.pp_size) &&
            in.Number("kv_lease_duration", info.kv_lease_duration) &&
            in.Uint("protocol_version", info.protocol_version) &&
            in.OptionalUint("protocol_features", info.protocol_features) &&
            in.Bool("complete", info.complete) && (workers = in.Array("workers")) != nullptr;
  if (!ok) return Err(kBad, in.error());
  // Bound the loop before trusting the array (ValidateEngineInfo repeats the check).
  if (workers->size() > kMaxWorkersPerEngine) {
    return Err(kBad, fmt::format("query answer: {} workers, limit {}", workers->size(),
                                 kMaxWorkersPerEngine));
  }
  info.workers.reserve(workers->size());
  for (const json& wj : *workers) {
    if (!wj.is_object()) return Err(kBad, "query answer: a worker must be a JSON object");
    WorkerAddress w;
    Reader win(wj, "query answer worker");
    if (!(win.Uint("dp_rank", w.dp_rank) && win.Uint("tp_rank", w.tp_rank) &&
          win.Uint("pp_rank", w.pp_rank) && win.String("side_channel", w.side_channel) &&
          win.String("data_plane", w.data_plane))) {
      return Err(kBad, win.error());
    }
    info.workers.push_back(std::move(w));
  }
  if (Status s = ValidateEngineInfo(info); !s.ok()) return tl::unexpected(std::move(s));
  return info;
}

}  // namespace

std::string EncodeRegistration(const WorkerRegistration& r) {
  return Dump({{"engine_id", r.engine_id},
               {"dp_rank", r.dp_rank},
               {"tp_rank", r.tp_rank},
               {"pp_rank", r.pp_rank},
               {"tp_size", r.tp_size},
               {"pp_size", r.pp_size},
               {"side_channel", r.side_channel},
               {"data_plane", r.data_plane},
               {"kv_lease_duration", r.kv_lease_duration},
               {"protocol_version", r.protocol_version},
               {"protocol_features", r.protocol_features},
               {"incarnation", r.incarnation}});
}

Result<WorkerRegistration> DecodeRegistration(std::string_view body) {
  constexpr ErrorCode kBad = ErrorCode::kInvalidArgument;
  auto j = ParseObject(body, kBad, "registration");
  if (!j) return tl::unexpected(j.error());
  WorkerRegistration r;
  Reader in(*j, "registration");
  bool ok = in.String("engine_id", r.engine_id) && in.Uint("dp_rank", r.dp_rank) &&
            in.Uint("tp_rank", r.tp_rank) && in.Uint("pp_rank", r.pp_rank) &&
            in.Uint("tp_size", r.tp_size) && in.Uint("pp_size", r.pp_size) &&
            in.String("side_channel", r.side_channel) && in.String("data_plane", r.data_plane) &&
            in.Number("kv_lease_duration", r.kv_lease_duration) &&
            in.Uint("protocol_version", r.protocol_version) &&
            in.OptionalUint("protocol_features", r.protocol_features) &&
            in.String("incarnation", r.incarnation);
  if (!ok) return Err(kBad, in.error());
  if (Status s = Validate(r); !s.ok()) {
    return Err(kBad, "registration: " + s.message());
  }
  return r;
}

std::string EncodeEngine(const EngineInfo& info) { return Dump(EngineToJson(info)); }

std::string EncodeEngines(const std::vector<EngineInfo>& engines) {
  json listing = json::object();
  for (const EngineInfo& e : engines) listing[std::to_string(e.dp_rank)] = EngineToListEntry(e);
  return Dump(listing);
}

Result<EngineInfo> DecodeEngine(std::string_view body) {
  auto j = ParseObject(body, ErrorCode::kProtocol, "query answer");
  if (!j) return tl::unexpected(j.error());
  return EngineFromJson(*j);
}

Result<std::vector<EngineInfo>> DecodeEngines(std::string_view body) {
  constexpr ErrorCode kBad = ErrorCode::kProtocol;
  auto j = ParseListing(body);
  if (!j) return tl::unexpected(j.error());
  std::vector<EngineInfo> out;
  out.reserve(j->size());
  for (const auto& [key, value] : j->items()) {
    std::uint32_t dp_rank = 0;
    if (!ParseDpKey(key, dp_rank)) {
      return Err(
          kBad, fmt::format("listing: key '{}' is not a dp rank below {}", Excerpt(key), kMaxRank));
    }
    auto info = EngineFromJson(value);
    if (!info) return tl::unexpected(info.error());
    if (info->dp_rank != dp_rank) {
      return Err(kBad, fmt::format("listing: the entry of dp rank {} is engine {} of dp rank {}",
                                   dp_rank, info->engine_id, info->dp_rank));
    }
    out.push_back(std::move(*info));
  }
  std::sort(out.begin(), out.end(),
            [](const EngineInfo& a, const EngineInfo& b) { return a.dp_rank < b.dp_rank; });
  return out;
}

Result<std::vector<DpEngine>> DecodeDpEngines(std::string_view body) {
  constexpr ErrorCode kBad = ErrorCode::kProtocol;
  auto j = ParseListing(body);
  if (!j) return tl::unexpected(j.error());
  std::vector<DpEngine> out;
  out.reserve(j->size());
  std::set<std::string> seen;
  for (const auto& [key, value] : j->items()) {
    DpEngine e;
    if (!ParseDpKey(key, e.dp_rank)) {
      return Err(
          kBad, fmt::format("listing: key '{}' is not a dp rank below {}", Excerpt(key), kMaxRank));
    }
    if (!value.is_object()) {
      return Err(kBad,
                 fmt::format("listing: the entry of dp rank {} must be a JSON object", e.dp_rank));
    }
    const std::string what = fmt::format("listing: dp rank {}", e.dp_rank);
    Reader in(value, what);
    if (!in.String("engine_id", e.engine_id)) return Err(kBad, in.error());
    if (e.engine_id.empty() || !std::all_of(e.engine_id.begin(), e.engine_id.end(),
                                            [](char c) { return c >= 0x20 && c <= 0x7e; })) {
      return Err(kBad, fmt::format("{}: engine_id must be 1 to {} bytes of printable ASCII", what,
                                   kMaxStringBytes));
    }
    if (value.contains("complete") && !in.Bool("complete", e.complete)) {
      return Err(kBad, in.error());
    }
    if (value.contains("dp_rank")) {
      std::uint32_t stated = 0;
      if (!in.Uint("dp_rank", stated)) return Err(kBad, in.error());
      if (stated != e.dp_rank) {
        return Err(kBad, fmt::format("{}: the entry says dp_rank {}", what, stated));
      }
    }
    if (!seen.insert(e.engine_id).second) {
      return Err(kBad, fmt::format("{}: engine {} is listed on two dp ranks", what, e.engine_id));
    }
    out.push_back(std::move(e));
  }
  std::sort(out.begin(), out.end(),
            [](const DpEngine& a, const DpEngine& b) { return a.dp_rank < b.dp_rank; });
  return out;
}

std::string EncodeError(std::string_view reason) { return Dump({{"error", std::string(reason)}}); }

std::string DecodeError(std::string_view body) {
  json j = json::parse(body, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return "";
  auto it = j.find("error");
  if (it == j.end() || !it->is_string()) return "";
  return it->get<std::string>();
}

std::string EncodeObject(const std::vector<std::pair<std::string, std::string>>& fields) {
  json j = json::object();
  for (const auto& [key, value] : fields) j[key] = value;
  return Dump(j);
}

}  // namespace kvferry::control
