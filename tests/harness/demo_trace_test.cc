// Scenario C's trace analysis on hand-made traces.
#include "demo_trace.h"

#include <gtest/gtest.h>

namespace kvferry::harness {
namespace {

ParsedTraces Parse(const std::string& text) {
  ParsedTraces t;
  ParseTraceLines(text, t);
  return t;
}

TEST(DemoTrace, CountsWritesAfterFreeAndRealloc) {
  const ParsedTraces t = Parse(R"(
{"t_ns":100,"role":"decode","block":7,"generation":1,"event":"alloc","request":"req-1"}
{"t_ns":100,"role":"decode","block":8,"generation":1,"event":"alloc","request":"req-1"}
{"t_ns":110,"role":"prefill","event":"write_start","transfer_id":"x1","d_req_id":"req-1","p_rank":0,"dst_blocks":[7,8]}
{"t_ns":120,"role":"prefill","event":"write_end","transfer_id":"x1","d_req_id":"req-1","p_rank":0,"dst_blocks":[7,8]}
{"t_ns":130,"role":"decode","block":7,"generation":2,"event":"free","request":"req-1"}
{"t_ns":130,"role":"decode","block":8,"generation":2,"event":"free","request":"req-1"}
{"t_ns":135,"role":"prefill","event":"write_start","transfer_id":"x1","d_req_id":"req-1","p_rank":1,"dst_blocks":[7,8]}
{"t_ns":140,"role":"decode","block":8,"generation":3,"event":"alloc","request":"req-2"}
{"t_ns":150,"role":"prefill","event":"write_start","transfer_id":"x1","d_req_id":"req-1","p_rank":1,"dst_blocks":[8]}
{"t_ns":150,"role":"prefill","event":"write_start","transfer_id":"x2","d_req_id":"req-2","p_rank":1,"dst_blocks":[8]}
{"t_ns":160,"role":"prefill","block":8,"generation":3,"event":"alloc","request":"req-9"}
{"t_ns":170,"role":"prefill","event":"write_start","transfer_id":"x3","d_req_id":"req-3","p_rank":1,"dst_blocks":[99]}
not json
)");
  EXPECT_EQ(t.bad_lines, 1u);
  EXPECT_EQ(t.d_blocks.size(), 5u);  // P's own block events are not D's
  EXPECT_EQ(t.p_blocks.size(), 1u);
  const WriteAfterFree p1 = CountWritesAfterFree(t, 1);
  EXPECT_EQ(p1.write_starts, 4u);
  EXPECT_EQ(p1.after_free, 2u);  // t=135 (freed) and t=150 for req-1 (freed, reallocated)
  EXPECT_EQ(p1.after_realloc, 1u);
  EXPECT_EQ(p1.unmatched, 1u);  // block 99 never allocated on D
  EXPECT_EQ(p1.requests_after_free, std::set<std::string>{"req-1"});
  const WriteAfterFree p0 = CountWritesAfterFree(t, 0);
  EXPECT_EQ(p0.write_starts, 1u);
  EXPECT_EQ(p0.after_free, 0u);
  EXPECT_EQ(RequestsWrittenByAll(t, {0, 1}), std::set<std::string>{"req-1"});
}

}  // namespace
}  // namespace kvferry::harness

namespace kvferry::harness {
namespace {

TEST(DemoTrace, FreeOrderFlagsFreesBeforeTheLastWriteEnded) {
  const ParsedTraces t = Parse(R"(
{"t_ns":100,"role":"decode","block":1,"generation":1,"event":"alloc","request":"req-1"}
{"t_ns":100,"role":"decode","block":2,"generation":1,"event":"alloc","request":"req-2"}
{"t_ns":110,"role":"prefill","event":"write_start","d_req_id":"req-1","p_rank":0,"dst_blocks":[1]}
{"t_ns":2000120,"role":"prefill","event":"write_end","d_req_id":"req-1","p_rank":0,"dst_blocks":[1]}
{"t_ns":110,"role":"prefill","event":"write_start","d_req_id":"req-2","p_rank":1,"dst_blocks":[2]}
{"t_ns":500,"role":"prefill","event":"write_end","d_req_id":"req-2","p_rank":1,"dst_blocks":[2]}
{"t_ns":400,"role":"decode","block":2,"generation":2,"event":"free","request":"req-2"}
{"t_ns":3000120,"role":"decode","block":1,"generation":2,"event":"free","request":"req-1"}
)");
  const FreeOrder f = CheckFreeAfterWrites(t);
  EXPECT_EQ(f.requests, 2u);
  EXPECT_EQ(f.freed_too_early, 1u);
  EXPECT_EQ(f.early, std::set<std::string>{"req-2"});
  EXPECT_LT(f.min_margin_ms, 0);
}

}  // namespace
}  // namespace kvferry::harness

namespace kvferry::harness {
namespace {

TEST(DemoTrace, ReleaseOfBlocksHeldAt) {
  const ParsedTraces t = Parse(R"(
{"t_ns":10,"role":"prefill","block":1,"generation":1,"event":"alloc","request":"req-1"}
{"t_ns":20,"role":"prefill","block":2,"generation":1,"event":"alloc","request":"req-2"}
{"t_ns":30,"role":"prefill","block":2,"generation":2,"event":"free","request":"req-2"}
{"t_ns":40,"role":"prefill","block":3,"generation":1,"event":"alloc","request":"req-3"}
{"t_ns":70,"role":"prefill","block":1,"generation":2,"event":"free","request":"req-1"}
{"t_ns":90,"role":"prefill","block":3,"generation":2,"event":"free","request":"req-3"}
)");
  HeldRelease r = ReleaseOfBlocksHeldAt(t.p_blocks, 25);  // blocks 1 and 2 held
  EXPECT_EQ(r.held, 2u);
  EXPECT_EQ(r.never_freed, 0u);
  EXPECT_EQ(r.last_free_ns, 70);
  r = ReleaseOfBlocksHeldAt(t.p_blocks, 45);  // blocks 1 and 3
  EXPECT_EQ(r.last_free_ns, 90);
  r = ReleaseOfBlocksHeldAt(std::vector<TraceBlockEvent>(t.p_blocks.begin(), t.p_blocks.end() - 1),
                            45);
  EXPECT_EQ(r.never_freed, 1u);
  EXPECT_EQ(ReleaseOfBlocksHeldAt(t.p_blocks, 5).held, 0u);
}

}  // namespace
}  // namespace kvferry::harness
