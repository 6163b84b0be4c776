#include "control/side_channel_client.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <mutex>
#include <optional>
#include <utility>
#include <zmq.hpp>

namespace kvferry::control {
namespace {

using core::Clock;
using core::TimePoint;

std::chrono::milliseconds Remaining(TimePoint deadline) {
  const TimePoint now = Clock::now();
  if (deadline <= now) return std::chrono::milliseconds(0);
  return std::chrono::ceil<std::chrono::milliseconds>(deadline - now);
}

}  // namespace

// ---- SideChannelContext ----

struct SideChannelContext::Impl {
  explicit Impl(int io_threads) : context(io_threads) {}
  zmq::context_t context;
};

SideChannelContext::SideChannelContext(int io_threads)
    : impl_(std::make_unique<Impl>(std::max(1, io_threads))) {}
SideChannelContext::~SideChannelContext() = default;
void* SideChannelContext::raw() { return &impl_->context; }

// ---- DecodeChannel ----

class DecodeChannel::Impl {
 public:
  Impl(std::shared_ptr<SideChannelContext> context, const ChannelOptions& options)
      : context_(std::move(context)),
        socket_(*static_cast<zmq::context_t*>(context_->raw()), zmq::socket_type::dealer) {
    socket_.set(zmq::sockopt::linger, static_cast<int>(options.linger.count()));
    socket_.set(zmq::sockopt::sndhwm, options.send_hwm);
    socket_.set(zmq::sockopt::rcvhwm, options.receive_hwm);
    // A reply can never be larger than the protocol's limit; a bigger frame is hostile.
    socket_.set(zmq::sockopt::maxmsgsize, static_cast<std::int64_t>(wire::kMaxFrameBytes));
    if (options.cluster_secret) {
      const ClusterSecret& secret = *options.cluster_secret;
      socket_.set(zmq::sockopt::curve_serverkey, secret.curve_server().public_z85);
      socket_.set(zmq::sockopt::curve_publickey, secret.curve_client().public_z85);
      socket_.set(zmq::sockopt::curve_secretkey, secret.curve_client().secret_z85);
    }
  }

  Status Connect(const std::string& endpoint) {
    try {
      socket_.connect(endpoint);
    } catch (const zmq::error_t& e) {
      return Status(ErrorCode::kInvalidArgument,
                    fmt::format("cannot connect to {}: {}", endpoint, e.what()));
    }
    return Status::Ok();
  }

  // A fresh request number (never 0: 0 is the wire id P uses when it could not read one).
  // Called with mu_ held.
  std::uint64_t NextSeq() { return ++next_seq_; }

  // Sends one request (its wire id already set to `seq`). Called with mu_ held.
  Status SendRequest(std::span<const std::uint8_t> payload, TimePoint deadline) {
    for (;;) {
      try {
        if (socket_.send(zmq::buffer(payload.data(), payload.size()), zmq::send_flags::dontwait)) {
          ++stats_.requests;
          return Status::Ok();
        }
      } catch (const zmq::error_t& e) {
        return Status(ErrorCode::kUnavailable, fmt::format("send failed: {}", e.what()));
      }
      // The queue to P is full (P is not reading): wait for room until the deadline.
      const auto left = Remaining(deadline);
      if (left.count() == 0) {
        ++stats_.timeouts;
        return Status(ErrorCode::kTimeout,
                      "side channel send queue stayed full until the deadline");
      }
      zmq::pollitem_t item = {socket_.handle(), 0, ZMQ_POLLOUT, 0};
      PollOnce(item, left);
    }
  }

  // Waits for the reply to the request `seq` (the only one outstanding on this socket, since
  // calls are serialized). A reply whose wire id is another non-zero number answers a request
  // that timed out earlier: discarded. Id 0 (P could not read ours) or an undecodable reply is
  // taken as ours (docs/protocol.md §1); `seq` 0 accepts any reply (raw probes).
  Result<std::vector<std::uint8_t>> AwaitReply(std::uint64_t seq, TimePoint deadline) {
    for (;;) {
      zmq::message_t frame;
      if (!ReceiveOne(frame)) {
        const auto left = Remaining(deadline);
        if (left.count() == 0) {
          ++stats_.timeouts;
          return Err(ErrorCode::kTimeout, "no reply from the prefill worker before the deadline");
        }
        zmq::pollitem_t item = {socket_.handle(), 0, ZMQ_POLLIN, 0};
        PollOnce(item, left);
        continue;
      }
      const auto* data = frame.data<std::uint8_t>();
      std::vector<std::uint8_t> bytes(data, data + frame.size());
      const std::uint64_t id = ReplyId(bytes);
      if (seq != 0 && id != 0 && id != seq) {
        ++stats_.stale_replies;
        continue;
      }
      ++stats_.replies;
      return bytes;
    }
  }

  std::mutex mu_;  // serializes calls (and the socket's use) across threads
  ChannelStats stats_;

 private:
  static void PollOnce(zmq::pollitem_t& item, std::chrono::milliseconds left) {
    try {
      zmq::poll(&item, 1, std::min(left, std::chrono::milliseconds(1000)));
    } catch (const zmq::error_t&) {
      // EINTR, or the context is shutting down: the caller's deadline still bounds the wait.
    }
  }

  // The wire id of a reply; 0 when it has none or does not decode.
  static std::uint64_t ReplyId(std::span<const std::uint8_t> bytes) {
    Result<wire::MessageType> type = wire::PeekType(bytes);
    if (!type) return 0;
    if (*type == wire::MessageType::kPullResponse) {
      Result<wire::PullResponse> r = wire::DecodePullResponse(bytes);
      return r ? r->id : 0;
    }
    if (*type == wire::MessageType::kRenewalReply) {
      Result<wire::RenewalReply> r = wire::DecodeRenewalReply(bytes);
      return r ? r->id : 0;
    }
    return 0;
  }

  // One message; a peer that sends more than one frame (not P) has the extra frames dropped.
  bool ReceiveOne(zmq::message_t& frame) {
    try {
      if (!socket_.recv(frame, zmq::recv_flags::dontwait)) return false;
      bool more = frame.more();
      while (more) {
        zmq::message_t extra;
        (void)socket_.recv(extra);
        more = extra.more();
      }
    } catch (const zmq::error_t&) {
      return false;
    }
    return true;
  }

  std::shared_ptr<SideChannelContext> context_;  // outlives socket_ (declared first)
  zmq::socket_t socket_;
  std::uint64_t next_seq_ = 0;
};

Result<std::unique_ptr<DecodeChannel>> DecodeChannel::Connect(
    std::shared_ptr<SideChannelContext> context, std::string endpoint, ChannelOptions options) {
  if (context == nullptr) return Err(ErrorCode::kInvalidArgument, "SideChannelContext is null");
  if (options.cluster_secret && !CurveAvailable()) {
    return Err(ErrorCode::kInvalidArgument,
               "a cluster secret needs CURVE, and this libzmq was built without it");
  }
  auto impl = std::make_unique<Impl>(std::move(context), options);
  Status status = impl->Connect(endpoint);
  if (!status.ok()) return tl::unexpected<Status>(std::move(status));
  return std::unique_ptr<DecodeChannel>(new DecodeChannel(std::move(endpoint), std::move(impl)));
}

DecodeChannel::DecodeChannel(std::string endpoint, std::unique_ptr<Impl> impl)
    : endpoint_(std::move(endpoint)), impl_(std::move(impl)) {}
DecodeChannel::~DecodeChannel() = default;

ChannelStats DecodeChannel::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  return impl_->stats_;
}

Result<std::vector<std::uint8_t>> DecodeChannel::RoundTrip(std::span<const std::uint8_t> payload,
                                                           TimePoint deadline) {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  Status sent = impl_->SendRequest(payload, deadline);
  if (!sent.ok()) return tl::unexpected<Status>(std::move(sent));
  return impl_->AwaitReply(/*seq=*/0, deadline);
}

Result<wire::RenewalReply> DecodeChannel::Renew(const wire::Renewal& renewal, TimePoint deadline) {
  Status valid = wire::Validate(renewal);
  if (!valid.ok()) return tl::unexpected<Status>(std::move(valid));
  Result<std::vector<std::uint8_t>> reply;
  {
    std::lock_guard<std::mutex> lock(impl_->mu_);
    const std::uint64_t seq = impl_->NextSeq();
    wire::Renewal numbered = renewal;
    numbered.id = seq;  // P copies it into the reply
    Status sent = impl_->SendRequest(wire::Encode(numbered), deadline);
    if (!sent.ok()) return tl::unexpected<Status>(std::move(sent));
    reply = impl_->AwaitReply(seq, deadline);
  }
  if (!reply) return tl::unexpected<Status>(reply.error());
  Result<wire::MessageType> type = wire::PeekType(*reply);
  if (type && *type == wire::MessageType::kPullResponse) {
    Result<wire::PullResponse> response = wire::DecodePullResponse(*reply);
    if (response && response->status == wire::PullStatus::kError) {
      // A P without lease support tried to read the renewal as a pull.
      wire::RenewalReply rejected;
      rejected.status = wire::RenewalStatus::kRejected;
      rejected.message = "prefill worker answered the renewal with ERROR: " + response->message;
      rejected.message.resize(std::min(rejected.message.size(), wire::kMaxTextBytes));
      return rejected;
    }
  }
  Result<wire::RenewalReply> decoded = wire::DecodeRenewalReply(*reply);
  if (!decoded) {
    std::lock_guard<std::mutex> lock(impl_->mu_);
    ++impl_->stats_.bad_replies;
    return Err(ErrorCode::kProtocol,
               fmt::format("bad reply to a renewal: {}", decoded.error().ToString()));
  }
  return decoded;
}

Status DecodeChannel::Pull(const wire::Pull& pull, TimePoint deadline,
                           const ResponseCallback& on_response) {
  Status valid = wire::Validate(pull);
  if (!valid.ok()) return valid;
  std::lock_guard<std::mutex> lock(impl_->mu_);
  const std::uint64_t seq = impl_->NextSeq();
  wire::Pull numbered = pull;  // a copy: the caller's pull stays untouched
  numbered.id = seq;
  Status sent = impl_->SendRequest(wire::Encode(numbered), deadline);
  if (!sent.ok()) return sent;
  for (;;) {
    Result<std::vector<std::uint8_t>> reply = impl_->AwaitReply(seq, deadline);
    if (!reply) return reply.error();
    Result<wire::PullResponse> response = wire::DecodePullResponse(*reply);
    if (!response) {
      ++impl_->stats_.bad_replies;
      return Status(ErrorCode::kProtocol,
                    fmt::format("bad reply to a pull: {}", response.error().ToString()));
    }
    if (on_response) on_response(*response);
    if (response->status != wire::PullStatus::kContinue) return Status::Ok();
  }
}

}  // namespace kvferry::control
