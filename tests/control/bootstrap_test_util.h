// Helpers shared by the bootstrap tests.
#pragma once

#include <chrono>
#include <string>

#include "control/bootstrap_types.h"

namespace kvferry::control::testing {

// A worker of engine `engine` (TP `tp_size`, PP 1, no lease) at a made-up address derived from
// its rank, so each rank's address differs.
inline WorkerRegistration MakeWorker(const std::string& engine, std::uint32_t tp_rank,
                                     std::uint32_t tp_size = 2,
                                     const std::string& incarnation = "inc-a",
                                     std::uint32_t dp_rank = 0) {
  WorkerRegistration r;
  r.engine_id = engine;
  r.dp_rank = dp_rank;
  r.tp_rank = tp_rank;
  r.pp_rank = 0;
  r.tp_size = tp_size;
  r.pp_size = 1;
  r.side_channel = "tcp://127.0.0.1:" + std::to_string(5550 + tp_rank);
  r.data_plane = "inproc://" + engine + "/" + std::to_string(tp_rank);
  r.kv_lease_duration = 0;
  r.protocol_version = 1;
  r.incarnation = incarnation;
  return r;
}

inline std::chrono::milliseconds ElapsedSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                               start);
}

}  // namespace kvferry::control::testing
