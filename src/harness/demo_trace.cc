#include "demo_trace.h"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

namespace kvferry::harness {

void ParseTraceLines(const std::string& text, ParsedTraces& out) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    ++out.lines;
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("t_ns") || !j.contains("event")) {
      ++out.bad_lines;
      continue;
    }
    try {
      const std::string event = j.at("event").get<std::string>();
      const std::string role = j.value("role", "");
      if (event == "alloc" || event == "free") {
        TraceBlockEvent e;
        e.t_ns = j.at("t_ns").get<std::int64_t>();
        e.block = j.at("block").get<std::int64_t>();
        e.generation = j.value("generation", std::uint64_t{0});
        e.alloc = event == "alloc";
        e.request = j.value("request", "");
        (role == "prefill" ? out.p_blocks : out.d_blocks).push_back(std::move(e));
      } else if (event == "write_start" || event == "write_end") {
        TraceWriteEvent w;
        w.t_ns = j.at("t_ns").get<std::int64_t>();
        w.start = event == "write_start";
        w.transfer_id = j.value("transfer_id", "");
        w.d_req_id = j.value("d_req_id", "");
        w.p_rank = j.value("p_rank", 0);
        if (j.contains("dst_blocks"))
          w.blocks = j.at("dst_blocks").get<std::vector<std::int64_t>>();
        out.writes.push_back(std::move(w));
      }
    } catch (const nlohmann::json::exception&) {
      ++out.bad_lines;
    }
  }
}

bool ParseTraceFile(const std::string& path, ParsedTraces& out) {
  std::ifstream in(path);
  if (!in) return false;
  std::stringstream ss;
  ss << in.rdbuf();
  ParseTraceLines(ss.str(), out);
  return true;
}

WriteAfterFree CountWritesAfterFree(const ParsedTraces& traces, int rank) {
  // Each block's D events in time order.
  std::unordered_map<std::int64_t, std::vector<const TraceBlockEvent*>> by_block;
  for (const auto& e : traces.d_blocks) by_block[e.block].push_back(&e);
  for (auto& [block, events] : by_block) {
    std::stable_sort(events.begin(), events.end(),
                     [](const auto* a, const auto* b) { return a->t_ns < b->t_ns; });
  }
  WriteAfterFree out;
  for (const auto& w : traces.writes) {
    if (!w.start || w.p_rank != rank) continue;
    ++out.write_starts;
    bool freed = false, realloc = false, matched = true;
    for (const std::int64_t b : w.blocks) {
      const auto it = by_block.find(b);
      if (it == by_block.end()) {
        matched = false;
        continue;
      }
      const auto& events = it->second;
      // The latest allocation of b to this request at or before the WRITE began.
      std::ptrdiff_t alloc_idx = -1;
      for (std::size_t i = 0; i < events.size() && events[i]->t_ns <= w.t_ns; ++i) {
        if (events[i]->alloc && events[i]->request == w.d_req_id) {
          alloc_idx = static_cast<std::ptrdiff_t>(i);
        }
      }
      if (alloc_idx < 0) {
        matched = false;
        continue;
      }
      bool block_freed = false;
      for (std::size_t i = static_cast<std::size_t>(alloc_idx) + 1;
           i < events.size() && events[i]->t_ns <= w.t_ns; ++i) {
        if (!events[i]->alloc) block_freed = true;
        if (events[i]->alloc && block_freed) realloc = true;
      }
      freed = freed || block_freed;
    }
    if (!matched) ++out.unmatched;
    if (freed) {
      ++out.after_free;
      out.requests_after_free.insert(w.d_req_id);
    }
    if (realloc) {
      ++out.after_realloc;
      out.requests_after_realloc.insert(w.d_req_id);
    }
  }
  return out;
}

FreeOrder CheckFreeAfterWrites(const ParsedTraces& traces) {
  std::map<std::string, std::int64_t> last_end;
  for (const auto& w : traces.writes) {
    if (w.start) continue;
    auto [it, inserted] = last_end.emplace(w.d_req_id, w.t_ns);
    if (!inserted) it->second = std::max(it->second, w.t_ns);
  }
  std::map<std::string, std::int64_t> first_free;
  for (const auto& e : traces.d_blocks) {
    if (e.alloc || last_end.count(e.request) == 0) continue;
    auto [it, inserted] = first_free.emplace(e.request, e.t_ns);
    if (!inserted) it->second = std::min(it->second, e.t_ns);
  }
  FreeOrder out;
  for (const auto& [req, t_free] : first_free) {
    ++out.requests;
    const double margin_ms = static_cast<double>(t_free - last_end.at(req)) / 1e6;
    out.min_margin_ms = out.requests == 1 ? margin_ms : std::min(out.min_margin_ms, margin_ms);
    if (t_free < last_end.at(req)) {
      ++out.freed_too_early;
      out.early.insert(req);
    }
  }
  return out;
}

HeldRelease ReleaseOfBlocksHeldAt(const std::vector<TraceBlockEvent>& events, std::int64_t t_ns) {
  std::vector<const TraceBlockEvent*> sorted;
  sorted.reserve(events.size());
  for (const auto& e : events) sorted.push_back(&e);
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const auto* a, const auto* b) { return a->t_ns < b->t_ns; });
  std::map<std::int64_t, bool> allocated;  // state of each block at t_ns
  std::size_t i = 0;
  for (; i < sorted.size() && sorted[i]->t_ns <= t_ns; ++i)
    allocated[sorted[i]->block] = sorted[i]->alloc;
  std::set<std::int64_t> held;
  for (const auto& [block, on] : allocated) {
    if (on) held.insert(block);
  }
  HeldRelease out;
  out.held = held.size();
  for (; i < sorted.size() && !held.empty(); ++i) {
    if (!sorted[i]->alloc && held.erase(sorted[i]->block) != 0) out.last_free_ns = sorted[i]->t_ns;
  }
  out.never_freed = held.size();
  return out;
}

std::set<std::string> RequestsWrittenByAll(const ParsedTraces& traces,
                                           const std::vector<int>& ranks) {
  std::map<std::string, std::set<int>> seen;
  for (const auto& w : traces.writes) {
    if (w.start) seen[w.d_req_id].insert(w.p_rank);
  }
  std::set<std::string> out;
  for (const auto& [req, rs] : seen) {
    if (std::all_of(ranks.begin(), ranks.end(), [&](int r) { return rs.count(r) != 0; })) {
      out.insert(req);
    }
  }
  return out;
}

}  // namespace kvferry::harness
