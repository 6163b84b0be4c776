// Writes the wire fuzzers' seed corpus: fuzz/corpus/<target>/<name>. Run by hand after a
// protocol change and commit the result:  build-wire/tests/wire/wire_gen_corpus fuzz/corpus
// Seeds are small on purpose (libFuzzer mutates them); together they reach every field, every
// error path we know of, and the historical msgpack OOM input.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "raw_msgpack.h"
#include "wire/messages.h"

namespace {

using kvferry::ErrorCode;
using kvferry::wire::testing::Raw;
using Bytes = std::vector<std::uint8_t>;
namespace wire = kvferry::wire;

std::filesystem::path g_root;
int g_count = 0;

void Put(const std::string& target, const std::string& name, const Bytes& bytes) {
  const auto dir = g_root / target;
  std::filesystem::create_directories(dir);
  std::ofstream out(dir / name, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  ++g_count;
}

Bytes Cut(Bytes b, std::size_t keep) {
  b.resize(std::min(keep, b.size()));
  return b;
}

wire::Pull SteadyPull() {
  wire::Pull p;
  p.d_engine_id = "decode-0";
  p.d_tp_size = 2;
  p.d_tp_rank = 1;
  p.d_lease_ms = 30000;
  p.block_len = 65536;
  p.num_blocks = 4096;
  p.requests.push_back({"cmpl-1", "xfer-1", {7, 8, 9, 4095}});
  p.id = 42;
  p.write_key = 0x5eed00000007ULL;
  return p;
}

wire::Pull LayoutPull() {
  wire::Pull p = SteadyPull();
  p.region_descriptor = Bytes(48, 0xab);
  p.requests.push_back({"cmpl-2", "xfer-2", {}});
  return p;
}

Bytes Fingerprints(std::size_t n) { return Bytes(n * 7, 0x5a); }

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <fuzz/corpus dir>\n", argv[0]);
    return 2;
  }
  g_root = argv[1];

  // ---- pull ----
  const Bytes steady = wire::Encode(SteadyPull());
  const Bytes layout = wire::Encode(LayoutPull());
  wire::Pull old_d = SteadyPull();
  old_d.d_lease_ms.reset();
  wire::Pull notify = SteadyPull();
  notify.requests.clear();
  notify.d_lease_ms = 0;
  Put("pull", "valid_steady", steady);
  Put("pull", "valid_layout", layout);
  Put("pull", "valid_old_d_no_lease", wire::Encode(old_d));
  Put("pull", "valid_notify_only", wire::Encode(notify));
  Put("pull", "valid_unknown_keys_t_last",
      Raw()
          .Map(10)
          .Str("zz")
          .Array(2)
          .Uint(1)
          .Map(1)
          .Str("a")
          .Nil()
          .Str("e")
          .Str("d")
          .Str("ts")
          .Uint(1)
          .Str("tr")
          .Uint(0)
          .Str("bl")
          .Uint(4096)
          .Str("nb")
          .Uint(16)
          .Str("rq")
          .Array(1)
          .Array(4)
          .Str("r")
          .Str("x")
          .Bin({1, 0, 0, 0})
          .Nil()
          .Str("future")
          .Str("skip me")
          .Str("v")
          .Uint(1)
          .Str("t")
          .Bytes({0xcc, 0x01}));
  Put("pull", "truncated", Cut(layout, layout.size() / 2));
  Put("pull", "oom_array32", Bytes{0xdd, 0xe4, 0x6d, 0xdc, 0x5b, 0x6d});
  Raw bomb = Raw().Head(3, 1).Str("zz");
  for (int i = 0; i < 12; ++i) bomb.Array(1);
  Put("pull", "depth_bomb", bomb.Nil());
  Put("pull", "version_2", Raw().Head(2, 1, 2));
  Put("pull", "wrong_type_tp_size",
      Raw()
          .Head(8, 1)
          .Str("e")
          .Str("d")
          .Str("ts")
          .Str("2")
          .Str("tr")
          .Uint(0)
          .Str("bl")
          .Uint(1)
          .Str("nb")
          .Uint(1)
          .Str("rq")
          .Array(0));
  Put("pull", "block_bin_len_5",
      Raw()
          .Head(8, 1)
          .Str("e")
          .Str("d")
          .Str("ts")
          .Uint(1)
          .Str("tr")
          .Uint(0)
          .Str("bl")
          .Uint(1)
          .Str("nb")
          .Uint(1)
          .Str("rq")
          .Array(1)
          .Array(3)
          .Str("r")
          .Str("x")
          .Bin({1, 2, 3, 4, 5}));
  Put("pull", "huge_declared_requests",
      Raw()
          .Head(8, 1)
          .Str("e")
          .Str("d")
          .Str("ts")
          .Uint(1)
          .Str("tr")
          .Uint(0)
          .Str("bl")
          .Uint(1)
          .Str("nb")
          .Uint(1)
          .Str("rq")
          .Bytes({0xdd, 0x7f, 0xff, 0xff, 0xff}));
  Put("pull", "not_a_map", Raw().Array(2).Uint(1).Uint(1));

  // ---- renewal ----
  wire::Renewal renewal{"decode-0", 30000, {}, 7};
  for (int i = 0; i < 16; ++i)
    renewal.fingerprints.push_back(kvferry::core::FingerprintOf("xfer-" + std::to_string(i)));
  Put("renewal", "valid_16", wire::Encode(renewal));
  Put("renewal", "valid_empty", wire::Encode(wire::Renewal{"decode-0", 0, {}}));
  Put("renewal", "fp_len_8",
      Raw().Head(5, 2).Str("e").Str("d").Str("l").Uint(1).Str("fp").Bin(Bytes(8, 1)));
  Put("renewal", "fp_as_array",
      Raw().Head(5, 2).Str("e").Str("d").Str("l").Uint(1).Str("fp").Array(1).Uint(7));
  Put("renewal", "missing_lease",
      Raw().Head(4, 2).Str("e").Str("d").Str("fp").Bin(Fingerprints(2)));
  Put("renewal", "version_0", Raw().Head(2, 2, 0));
  Put("renewal", "trailing_byte", Raw().Append(wire::Encode(renewal)).Byte(0xc0));
  Put("renewal", "bin32_lie",
      Raw().Head(5, 2).Str("e").Str("d").Str("l").Uint(1).Str("fp").Bytes(
          {0xc6, 0xff, 0xff, 0xff, 0xf0}));
  Put("renewal", "pull_not_renewal", steady);
  wire::Renewal notices = renewal;
  notices.accepts_notices = true;
  Put("renewal", "valid_accepts_notices", wire::Encode(notices));
  Put("renewal", "notices_as_uint",
      Raw().Head(6, 2).Str("e").Str("d").Str("l").Uint(1).Str("fp").Bin({}).Str("n").Uint(1));

  // ---- renewal_reply ----
  Put("renewal_reply", "valid_accepted",
      wire::Encode(wire::RenewalReply{wire::RenewalStatus::kAccepted, 120, 8, 30000, ""}));
  Put("renewal_reply", "valid_rejected",
      wire::Encode(
          wire::RenewalReply{wire::RenewalStatus::kRejected, 0, 0, 0, "no lease on this P"}));
  Put("renewal_reply", "valid_error",
      wire::Encode(wire::RenewalReply{wire::RenewalStatus::kError, 0, 0, 30000, "overloaded"}));
  Put("renewal_reply", "status_3",
      Raw().Head(6, 3).Str("s").Uint(3).Str("x").Uint(0).Str("u").Uint(0).Str("l").Uint(0));
  Put("renewal_reply", "missing_x",
      Raw().Head(5, 3).Str("s").Uint(0).Str("u").Uint(0).Str("l").Uint(0));
  Put("renewal_reply", "negative_u",
      Raw().Head(6, 3).Str("s").Uint(0).Str("x").Uint(0).Str("u").Byte(0xff).Str("l").Uint(0));
  Put("renewal_reply", "valid_int8_positive",
      Raw()
          .Head(6, 3)
          .Str("s")
          .Bytes({0xd0, 0x01})
          .Str("x")
          .Uint(0)
          .Str("u")
          .Uint(0)
          .Str("l")
          .Uint(0));

  // ---- pull_response ----
  wire::PullResponse cont{wire::PullStatus::kContinue,
                          {"cmpl-1", "cmpl-2"},
                          {{"cmpl-3", ErrorCode::kTombstoned, "transfer xfer-3 was freed"}},
                          ErrorCode::kOk,
                          "",
                          42};
  wire::PullResponse fin{wire::PullStatus::kFinish,
                         {},
                         {{"cmpl-4", ErrorCode::kLeaseMismatch, "lease: P 30000 ms, D 20000 ms"}},
                         ErrorCode::kOk,
                         ""};
  wire::PullResponse error{
      wire::PullStatus::kError, {}, {}, ErrorCode::kProtocol, "unsupported version 2"};
  Put("pull_response", "valid_continue", wire::Encode(cont));
  Put("pull_response", "valid_finish", wire::Encode(fin));
  Put("pull_response", "valid_finish_empty", wire::Encode(wire::PullResponse{}));
  Put("pull_response", "valid_error", wire::Encode(error));
  Put("pull_response", "error_without_message",
      Raw().Head(4, 4).Str("s").Uint(2).Str("c").Uint(10));
  Put("pull_response", "error_code_0",
      Raw().Head(4, 4).Str("s").Uint(0).Str("err").Array(1).Array(3).Str("r").Uint(0).Str("why"));
  Put("pull_response", "error_code_99",
      Raw().Head(4, 4).Str("s").Uint(1).Str("err").Array(1).Array(3).Str("r").Uint(99).Str("why"));
  Put("pull_response", "ok_not_str", Raw().Head(4, 4).Str("s").Uint(0).Str("ok").Array(1).Uint(5));
  Put("pull_response", "err_entry_short",
      Raw().Head(4, 4).Str("s").Uint(0).Str("err").Array(1).Array(2).Str("r").Uint(4));

  // ---- release ----
  wire::Release release{"decode-0", 2, 1, {kvferry::core::FingerprintOf("xfer-1")}, 11};
  wire::Release release16{"decode-0", 8, 7, renewal.fingerprints, 12};
  const Bytes release_bytes = wire::Encode(release16);
  auto release_with = [](std::uint64_t ts, std::uint64_t tr, const Bytes& fp) {
    return Raw()
        .Head(6, 5)
        .Str("e")
        .Str("d")
        .Str("ts")
        .Uint(ts)
        .Str("tr")
        .Uint(tr)
        .Str("fp")
        .Append(fp)
        .bytes();
  };
  Put("release", "valid_one", wire::Encode(release));
  Put("release", "valid_16", release_bytes);
  Put("release", "valid_unknown_keys_t_last",
      Raw()
          .Map(7)
          .Str("future")
          .Array(2)
          .Nil()
          .Str("x")
          .Str("e")
          .Str("d")
          .Str("ts")
          .Uint(1)
          .Str("tr")
          .Uint(0)
          .Str("fp")
          .Bin(Fingerprints(1))
          .Str("v")
          .Uint(1)
          .Str("t")
          .Bytes({0xcc, 0x05}));
  Put("release", "fp_empty", release_with(1, 0, Raw().Bin({})));
  Put("release", "fp_len_8", release_with(1, 0, Raw().Bin(Bytes(8, 1))));
  Put("release", "fp_as_array", release_with(1, 0, Raw().Array(1).Uint(7)));
  Put("release", "tr_not_below_ts", release_with(2, 2, Raw().Bin(Fingerprints(1))));
  Put("release", "ts_0", release_with(0, 0, Raw().Bin(Fingerprints(1))));
  Put("release", "ts_65", release_with(65, 0, Raw().Bin(Fingerprints(1))));
  Put("release", "missing_tr",
      Raw().Head(5, 5).Str("e").Str("d").Str("ts").Uint(1).Str("fp").Bin(Fingerprints(1)));
  Put("release", "empty_engine",
      Raw().Head(6, 5).Str("e").Str("").Str("ts").Uint(1).Str("tr").Uint(0).Str("fp").Bin(
          Fingerprints(1)));
  Put("release", "id_as_str",
      Raw()
          .Head(7, 5)
          .Str("id")
          .Str("11")
          .Str("e")
          .Str("d")
          .Str("ts")
          .Uint(1)
          .Str("tr")
          .Uint(0)
          .Str("fp")
          .Bin(Fingerprints(1)));
  Put("release", "truncated", Cut(release_bytes, release_bytes.size() / 2));
  Put("release", "renewal_not_release", wire::Encode(renewal));

  // ---- release_reply ----
  const Bytes release_reply =
      wire::Encode(wire::ReleaseReply{wire::ReleaseStatus::kAccepted, 3, 1, 12, "", 11});
  Put("release_reply", "valid_accepted", release_reply);
  Put("release_reply", "valid_error",
      wire::Encode(wire::ReleaseReply{wire::ReleaseStatus::kError, 0, 0, 0,
                                      "d_tp_size 3 does not pair with p_tp_size 2", 12}));
  Put("release_reply", "valid_no_id", wire::Encode(wire::ReleaseReply{}));
  Put("release_reply", "status_2",
      Raw().Head(6, 6).Str("s").Uint(2).Str("r").Uint(0).Str("k").Uint(0).Str("u").Uint(0));
  Put("release_reply", "missing_k",
      Raw().Head(5, 6).Str("s").Uint(0).Str("r").Uint(0).Str("u").Uint(0));
  Put("release_reply", "negative_r",
      Raw().Head(6, 6).Str("s").Uint(0).Str("r").Byte(0xff).Str("k").Uint(0).Str("u").Uint(0));
  Put("release_reply", "message_not_str",
      Raw()
          .Head(7, 6)
          .Str("s")
          .Uint(1)
          .Str("r")
          .Uint(0)
          .Str("k")
          .Uint(0)
          .Str("u")
          .Uint(0)
          .Str("m")
          .Bin({1}));
  Put("release_reply", "truncated", Cut(release_reply, release_reply.size() - 1));
  Put("release_reply", "renewal_reply_not_release_reply", wire::Encode(wire::RenewalReply{}));

  // ---- abort_notice ----
  wire::AbortNotice abort_notice{
      "prefill-0",
      1,
      {{"xfer-1", ErrorCode::kCancelled, "aborted by the engine"},
       {"xfer-2", ErrorCode::kTimeout, "prefill not done within abort_request_timeout"},
       {"xfer-3", ErrorCode::kLeaseMismatch, "lease: P 30000 ms, D 20000 ms"}}};
  const Bytes notice_bytes = wire::Encode(abort_notice);
  auto notice_with = [](const Bytes& aborted) {
    return Raw().Head(5, 7).Str("e").Str("p").Str("pr").Uint(0).Str("a").Append(aborted).bytes();
  };
  Put("abort_notice", "valid_three", notice_bytes);
  Put("abort_notice", "valid_one",
      wire::Encode(wire::AbortNotice{"p", 63, {{"x", ErrorCode::kTombstoned, ""}}}));
  Put("abort_notice", "valid_extra_elements",
      notice_with(Raw().Array(1).Array(4).Str("x").Uint(12).Str("why").Str("future")));
  Put("abort_notice", "aborted_empty", notice_with(Raw().Array(0)));
  Put("abort_notice", "aborted_as_map", notice_with(Raw().Map(0)));
  Put("abort_notice", "code_0", notice_with(Raw().Array(1).Array(3).Str("x").Uint(0).Str("why")));
  Put("abort_notice", "code_14", notice_with(Raw().Array(1).Array(3).Str("x").Uint(14).Str("why")));
  Put("abort_notice", "entry_short", notice_with(Raw().Array(1).Array(2).Str("x").Uint(12)));
  Put("abort_notice", "empty_transfer_id",
      notice_with(Raw().Array(1).Array(3).Str("").Uint(12).Str("why")));
  Put("abort_notice", "pr_64",
      Raw()
          .Head(5, 7)
          .Str("e")
          .Str("p")
          .Str("pr")
          .Uint(64)
          .Str("a")
          .Array(1)
          .Array(3)
          .Str("x")
          .Uint(12)
          .Str(""));
  Put("abort_notice", "missing_e",
      Raw().Head(4, 7).Str("pr").Uint(0).Str("a").Array(1).Array(3).Str("x").Uint(12).Str(""));
  Put("abort_notice", "truncated", Cut(notice_bytes, notice_bytes.size() / 2));
  Put("abort_notice", "huge_declared_aborted",
      Raw().Head(5, 7).Str("e").Str("p").Str("pr").Uint(0).Str("a").Bytes(
          {0xdd, 0x7f, 0xff, 0xff, 0xff}));

  // ---- peek (dispatch) ----
  Put("peek", "pull", steady);
  Put("peek", "renewal", wire::Encode(renewal));
  Put("peek", "renewal_reply", wire::Encode(wire::RenewalReply{}));
  Put("peek", "pull_response", wire::Encode(cont));
  Put("peek", "release", wire::Encode(release));
  Put("peek", "release_reply", release_reply);
  Put("peek", "abort_notice", notice_bytes);
  Put("peek", "unknown_type_8", Raw().Head(3, 8).Str("id").Uint(21));
  Put("peek", "t_not_first",
      Raw().Map(3).Str("x").Array(2).Nil().Nil().Str("v").Uint(1).Str("t").Uint(2));
  Put("peek", "t_uint8", Raw().Map(2).Str("t").Bytes({0xcc, 0x04}).Str("v").Uint(1));
  Put("peek", "missing_v", Raw().Map(1).Str("t").Uint(1));
  Put("peek", "unknown_type_9", Raw().Head(2, 9));
  Put("peek", "version_7", Raw().Head(2, 1, 7));
  Put("peek", "empty", Bytes{});
  Put("peek", "fixint", Bytes{0x01});

  std::printf("wrote %d seed files under %s\n", g_count, g_root.c_str());
  return 0;
}
