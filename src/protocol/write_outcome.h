// WriteOutcome: how one data-plane write of P's ended, as far as D's blocks are concerned. The
// writer (a pump's data plane, the simulator's) reports it to PrefillSession::OnWriteDone; the
// session lists the request in `ok` or `err` from it (docs/protocol.md §3.3).
#pragma once

#include <cstdint>
#include <utility>

#include "kvferry/status.h"

namespace kvferry::protocol {

enum class WriteEnd : std::uint8_t {
  kLanded,     // every byte landed: listed in `ok`
  kFailed,     // it failed and nothing more of it can land (or it never started): `err`
  kUnsettled,  // it failed and bytes of it may still land: listed in `err` with `unsettled`,
               // so D fails the request now and quarantines the blocks instead of reusing them.
};

struct WriteOutcome {
  WriteEnd end = WriteEnd::kLanded;
  Status status;  // why, for kFailed / kUnsettled

  static WriteOutcome Landed() { return {}; }
  static WriteOutcome Failed(Status why) { return {WriteEnd::kFailed, std::move(why)}; }
  static WriteOutcome Unsettled(Status why) { return {WriteEnd::kUnsettled, std::move(why)}; }
};

}  // namespace kvferry::protocol
