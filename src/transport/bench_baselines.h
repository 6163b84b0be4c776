// The outside yardsticks kvferry's benchmarks print beside their own numbers, in the same run:
// ucx_perftest (two processes on 127.0.0.1) and iperf3 (loopback). Each spawns the tool, reads
// its result, and bounds it with `timeout`, so a tool that hangs costs at most 30 s and a tool
// that is missing or fails reads as -1 (the tables print "-"), never as a number.
#pragma once

#include <cstddef>
#include <string>

namespace kvferry::transport::bench {

// The command's standard output (and whatever it redirects there); empty when it cannot start.
std::string RunCommand(const std::string& cmd);

bool HaveProgram(const std::string& name);

// ucx_perftest `test` (ucp_put_bw, ucp_am_bw, tag_bw) of `size` bytes over UCX transports `tls`
// on loopback, `iters` iterations; GB/s (1e9 bytes/s), or -1.
double Perftest(const std::string& tls, const std::string& test, std::size_t size,
                std::size_t iters);

// iperf3 over 127.0.0.1 for `seconds` with `streams` parallel streams (-P) and writes of `len`
// ("" for iperf3's default, e.g. "1M"); the receiver's GB/s, or -1.
double Iperf(double seconds, const std::string& len, int streams = 1);

}  // namespace kvferry::transport::bench
