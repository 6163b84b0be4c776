#include "bench_baselines.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <thread>

namespace kvferry::transport::bench {

using namespace std::chrono_literals;

std::string RunCommand(const std::string& cmd) {
  std::string out;
  FILE* f = popen(cmd.c_str(), "r");
  if (f == nullptr) return out;
  char buf[4096];
  std::size_t n;
  while ((n = fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
  pclose(f);
  return out;
}

bool HaveProgram(const std::string& name) {
  return std::system(("command -v " + name + " >/dev/null 2>&1").c_str()) == 0;
}

namespace {

int NextPort() {
  static int port = 20000 + static_cast<int>(getpid() % 20000);
  return port++;
}

}  // namespace

double Perftest(const std::string& tls, const std::string& test, std::size_t size,
                std::size_t iters) {
  std::size_t warmup = std::max<std::size_t>(2, iters / 10);
  for (int attempt = 0; attempt < 3; ++attempt) {
    int port = NextPort();
    std::string env = fmt::format("UCX_TLS={} UCX_NET_DEVICES=lo", tls);
    // The server serves one test and exits; `timeout` bounds it if the client never comes.
    std::system(
        fmt::format("{} timeout 30 ucx_perftest -p {} >/dev/null 2>&1 &", env, port).c_str());
    std::this_thread::sleep_for(300ms);
    std::string out =
        RunCommand(fmt::format("{} timeout 30 ucx_perftest 127.0.0.1 -p {} -t {} -s {} "
                        "-n {} -w {} 2>&1",
                        env, port, test, size, iters, warmup));
    auto pos = out.find("Final:");
    if (pos == std::string::npos) continue;
    std::istringstream in(out.substr(pos));
    std::string label;
    double n_iters, p50, avg, overall, bw_avg, bw_overall;
    if (in >> label >> n_iters >> p50 >> avg >> overall >> bw_avg >> bw_overall) {
      return bw_overall * 1048576.0 / 1e9;  // perftest's MB/s are MiB/s
    }
  }
  return -1;
}

double Iperf(double seconds, const std::string& len, int streams) {
  int port = NextPort();
  std::system(
      fmt::format("timeout 30 iperf3 -s -1 -B 127.0.0.1 -p {} >/dev/null 2>&1 &", port).c_str());
  std::this_thread::sleep_for(300ms);
  std::string out =
      RunCommand(fmt::format("timeout 30 iperf3 -c 127.0.0.1 -p {} -t {} -P {} -J {} 2>&1", port,
                             seconds, streams, len.empty() ? "" : "-l " + len));
  auto pos = out.find("\"sum_received\"");
  if (pos == std::string::npos) return -1;
  pos = out.find("\"bits_per_second\"", pos);
  if (pos == std::string::npos) return -1;
  pos = out.find(':', pos);
  return std::strtod(out.c_str() + pos + 1, nullptr) / 8 / 1e9;
}

}  // namespace kvferry::transport::bench
