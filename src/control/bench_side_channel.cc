#include "control/bench_side_channel.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "control/cluster_auth.h"
#include "control/side_channel_client.h"
#include "control/side_channel_listener.h"
#include "kvferry/core/ids.h"

namespace kvferry::control {
namespace {

using core::Clock;
using namespace std::chrono_literals;

constexpr std::uint32_t kBlocksPerPull = 16;

// Block ids 0..n-1: the source blocks of a held transfer (the writer here never reads them).
std::vector<core::BlockId> SourceBlocks(std::uint32_t n) {
  std::vector<core::BlockId> blocks(n);
  for (std::uint32_t i = 0; i < n; ++i) blocks[i] = i;
  return blocks;
}
constexpr std::uint64_t kLeaseMs = 30000;

// Lands every write at once: the benchmark measures the control path, not the data plane.
class InstantWriter : public KvWriter {
 public:
  protocol::WriteOutcome Write(const protocol::PullContext&, const protocol::WriteJob&) override {
    return protocol::WriteOutcome::Landed();
  }
};

struct Mode {
  std::string name;
  std::shared_ptr<const ClusterSecret> secret;
  std::unique_ptr<PrefillListener> listener;
  std::unique_ptr<DecodeChannel> channel;
  std::uint64_t next_transfer = 0;
};

struct Samples {
  std::vector<double> us;  // microseconds

  double Percentile(double p) const {
    std::vector<double> sorted = us;
    std::sort(sorted.begin(), sorted.end());
    const auto i = static_cast<std::size_t>(p * static_cast<double>(sorted.size() - 1));
    return sorted[i];
  }
  double Mean() const {
    double sum = 0;
    for (double v : us) sum += v;
    return sum / static_cast<double>(us.size());
  }
};

double MicrosSince(Clock::time_point start) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
}

wire::Renewal MakeRenewal(Mode& mode, std::size_t ids) {
  wire::Renewal renewal;
  renewal.d_engine_id = "bench-d";
  renewal.d_lease_ms = kLeaseMs;
  for (std::size_t i = 0; i < ids; ++i) {
    renewal.fingerprints.push_back(core::FingerprintOf(fmt::format("{}-held-{}", mode.name, i)));
  }
  return renewal;
}

Status Renew(Mode& mode, const wire::Renewal& renewal) {
  auto reply = mode.channel->Renew(renewal, Clock::now() + 5s);
  if (!reply) return reply.error();
  if (reply->status != wire::RenewalStatus::kAccepted) {
    return Status(ErrorCode::kRejected, "renewal not accepted: " + reply->message);
  }
  return Status::Ok();
}

// One pull of a fresh transfer, prefilled beforehand (not timed).
Status TimedPull(Mode& mode, Samples& samples) {
  const std::string id = fmt::format("{}-xfer-{}", mode.name, mode.next_transfer++);
  if (Status s = mode.listener->Admit(id, 1).get(); !s.ok()) return s;
  if (Status s = mode.listener->PrefillDone(id, SourceBlocks(kBlocksPerPull)).get(); !s.ok()) {
    return s;
  }
  wire::Pull pull;
  pull.d_engine_id = "bench-d";
  pull.d_lease_ms = kLeaseMs;
  pull.region_descriptor = std::vector<std::uint8_t>(16, 7);
  pull.block_len = 4096;
  pull.num_blocks = 1 << 16;
  wire::PullRequest request;
  request.d_req_id = "r-" + id;
  request.transfer_id = id;
  for (std::uint32_t b = 0; b < kBlocksPerPull; ++b) request.block_ids.push_back(b);
  pull.requests.push_back(std::move(request));
  bool ok = false;
  std::string error;
  const auto start = Clock::now();
  Status status = mode.channel->Pull(pull, Clock::now() + 5s, [&](const wire::PullResponse& r) {
    ok = ok || !r.ok.empty();
    if (!r.err.empty()) error = r.err.front().reason;
  });
  const double us = MicrosSince(start);
  if (!status.ok()) return status;
  if (!ok) return Status(ErrorCode::kInternal, "pull not ok: " + error);
  samples.us.push_back(us);
  return Status::Ok();
}

Status StartMode(Mode& mode, const std::shared_ptr<SideChannelContext>& context) {
  ListenerOptions options;
  options.session.hold.lease = std::chrono::milliseconds(kLeaseMs);
  options.num_senders = 2;
  options.session.block_len = 4096;  // as the pulls say: one plane, no slicing
  options.session.num_blocks = kBlocksPerPull;
  options.session.engine_id = "bench-p-" + mode.name;
  options.cluster_secret = mode.secret;
  auto listener = PrefillListener::Start(options, std::make_shared<InstantWriter>(), nullptr);
  if (!listener) return listener.error();
  mode.listener = std::move(*listener);
  ChannelOptions channel_options;
  channel_options.cluster_secret = mode.secret;
  auto channel = DecodeChannel::Connect(context, mode.listener->endpoint(), channel_options);
  if (!channel) return channel.error();
  mode.channel = std::move(*channel);
  // 128 transfers held, so renewals extend real entries.
  for (std::size_t i = 0; i < 128; ++i) {
    const std::string id = fmt::format("{}-held-{}", mode.name, i);
    if (Status s = mode.listener->Admit(id, 1).get(); !s.ok()) return s;
    if (Status s = mode.listener->PrefillDone(id, SourceBlocks(1)).get(); !s.ok()) return s;
  }
  // Warm up: connection, handshake, caches.
  const wire::Renewal renewal = MakeRenewal(mode, 1);
  for (int i = 0; i < 200; ++i) {
    if (Status s = Renew(mode, renewal); !s.ok()) return s;
  }
  return Status::Ok();
}

void PrintRow(const std::string& what, const Samples& open, const Samples& curve) {
  const double open_p50 = open.Percentile(0.5);
  const double curve_p50 = curve.Percentile(0.5);
  std::printf("%-34s %8.1f %8.1f %8.1f   %8.1f %8.1f %8.1f   %+7.1f (%+.0f%%)\n", what.c_str(),
              open_p50, open.Percentile(0.99), open.Mean(), curve_p50, curve.Percentile(0.99),
              curve.Mean(), curve_p50 - open_p50, 100.0 * (curve_p50 - open_p50) / open_p50);
}

}  // namespace

int RunSideChannelBench(const SideChannelBenchOptions& options) {
  auto secret = ClusterSecret::FromBytes(std::string(48, 'b'));
  if (!secret) {
    std::fprintf(stderr, "bench: %s\n", secret.error().ToString().c_str());
    return 1;
  }
  auto context = std::make_shared<SideChannelContext>();
  Mode modes[2];
  modes[0].name = "open";
  modes[1].name = "curve";
  modes[1].secret = std::make_shared<const ClusterSecret>(std::move(*secret));
  for (Mode& mode : modes) {
    if (Status s = StartMode(mode, context); !s.ok()) {
      std::fprintf(stderr, "bench: %s: %s\n", mode.name.c_str(), s.ToString().c_str());
      return 1;
    }
  }

  const std::size_t batch = std::max<std::size_t>(1, options.batch);
  Samples renew1[2], renew128[2], pulls[2], first[2];
  Status failed;
  auto alternate = [&](std::size_t total, auto&& one) {
    for (std::size_t done = 0; done < total && failed.ok(); done += batch) {
      for (int m = 0; m < 2 && failed.ok(); ++m) {
        for (std::size_t i = 0; i < std::min(batch, total - done) && failed.ok(); ++i) {
          failed = one(m);
        }
      }
    }
  };
  for (auto [samples, ids] :
       {std::pair{renew1, std::size_t{1}}, std::pair{renew128, std::size_t{128}}}) {
    const wire::Renewal renewals[2] = {MakeRenewal(modes[0], ids), MakeRenewal(modes[1], ids)};
    alternate(options.round_trips, [&](int m) {
      const auto start = Clock::now();
      Status s = Renew(modes[m], renewals[m]);
      samples[m].us.push_back(MicrosSince(start));
      return s;
    });
  }
  alternate(options.round_trips, [&](int m) { return TimedPull(modes[m], pulls[m]); });
  alternate(options.new_channels, [&](int m) {
    ChannelOptions channel_options;
    channel_options.cluster_secret = modes[m].secret;
    channel_options.linger = 0ms;
    const auto start = Clock::now();
    auto channel = DecodeChannel::Connect(context, modes[m].listener->endpoint(), channel_options);
    if (!channel) return channel.error();
    auto reply = (*channel)->Renew(MakeRenewal(modes[m], 1), Clock::now() + 5s);
    first[m].us.push_back(MicrosSince(start));
    return reply ? Status::Ok() : reply.error();
  });

  const std::uint64_t refusals = modes[1].listener->Stats().auth_refusals;
  for (Mode& mode : modes) {
    mode.channel.reset();
    (void)mode.listener->Stop();
  }
  if (!failed.ok()) {
    std::fprintf(stderr, "bench: a round trip failed: %s\n", failed.ToString().c_str());
    return 1;
  }
  if (refusals != 0) {
    std::fprintf(stderr, "bench: the CURVE listener refused %llu of its own handshakes\n",
                 static_cast<unsigned long long>(refusals));
    return 1;
  }
  std::printf(
      "kvferry bench sidechannel: loopback TCP, %zu round trips per kind and mode (%zu new "
      "channels), alternating in batches of %zu. Microseconds.\n",
      options.round_trips, options.new_channels, batch);
  std::printf("%-34s %26s   %26s   %s\n", "", "open (no auth)", "CURVE + ZAP", "CURVE - open");
  std::printf("%-34s %8s %8s %8s   %8s %8s %8s   %s\n", "", "p50", "p99", "mean", "p50", "p99",
              "mean", "at p50");
  PrintRow("renewal, 1 transfer", renew1[0], renew1[1]);
  PrintRow("renewal, 128 transfers", renew128[0], renew128[1]);
  PrintRow(fmt::format("pull, 1 request x {} blocks", kBlocksPerPull), pulls[0], pulls[1]);
  PrintRow("new channel: connect + 1st renewal", first[0], first[1]);
  return 0;
}

}  // namespace kvferry::control
