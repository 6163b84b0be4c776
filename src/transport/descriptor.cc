#include "descriptor.h"

#include <cstring>
#include <random>

namespace kvferry::transport::internal {
namespace {

constexpr char kMagic[4] = {'K', 'V', 'F', 'D'};
// 2: the UCX backend's write headers carry a write key (transport::WriteKey). Engines of
// version 1 cannot read them and would leave every write unacknowledged until its timeout, so
// their descriptors are refused at Connect instead, saying why (found by review).
constexpr std::uint8_t kVersion = 2;

std::uint8_t BackendCode(const std::string& name) {
  if (name == "ucx") return 1;
  if (name == "inprocess") return 2;
  return 0;
}

class Writer {
 public:
  void Bytes(const void* p, std::size_t n) {
    const auto* b = static_cast<const std::byte*>(p);
    out_.insert(out_.end(), b, b + n);
  }
  template <typename T>
  void Int(T v) {  // little-endian regardless of host order
    for (std::size_t i = 0; i < sizeof(T); ++i) {
      out_.push_back(static_cast<std::byte>((static_cast<std::uint64_t>(v) >> (8 * i)) & 0xff));
    }
  }
  std::vector<std::byte> Take() { return std::move(out_); }

 private:
  std::vector<std::byte> out_;
};

class Reader {
 public:
  explicit Reader(std::span<const std::byte> in) : in_(in) {}
  bool Bytes(void* p, std::size_t n) {
    if (in_.size() - pos_ < n) return false;
    std::memcpy(p, in_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  template <typename T>
  bool Int(T* v) {
    if (in_.size() - pos_ < sizeof(T)) return false;
    std::uint64_t x = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i) {
      x |= static_cast<std::uint64_t>(in_[pos_ + i]) << (8 * i);
    }
    pos_ += sizeof(T);
    *v = static_cast<T>(x);
    return true;
  }
  // Reads a u32 length-prefixed blob of at most `max` bytes.
  bool Blob(std::vector<std::byte>* out, std::size_t max) {
    std::uint32_t n = 0;
    if (!Int(&n) || n > max || in_.size() - pos_ < n) return false;
    out->assign(in_.begin() + static_cast<std::ptrdiff_t>(pos_),
                in_.begin() + static_cast<std::ptrdiff_t>(pos_ + n));
    pos_ += n;
    return true;
  }
  bool AtEnd() const { return pos_ == in_.size(); }

 private:
  std::span<const std::byte> in_;
  std::size_t pos_ = 0;
};

}  // namespace

const DescriptorRegion* Descriptor::Find(RegionId id) const {
  for (const auto& r : regions) {
    if (r.info.id == id) return &r;
  }
  return nullptr;
}

std::vector<std::byte> EncodeDescriptor(const Descriptor& d) {
  Writer w;
  w.Bytes(kMagic, sizeof(kMagic));
  w.Int<std::uint8_t>(kVersion);
  w.Int<std::uint8_t>(BackendCode(d.backend));
  w.Int<std::uint16_t>(0);
  w.Int<std::uint64_t>(d.engine_uid);
  w.Int<std::uint32_t>(static_cast<std::uint32_t>(d.address.size()));
  w.Bytes(d.address.data(), d.address.size());
  w.Int<std::uint32_t>(static_cast<std::uint32_t>(d.regions.size()));
  for (const auto& r : d.regions) {
    w.Int<std::uint32_t>(r.info.id);
    w.Int<std::uint8_t>(static_cast<std::uint8_t>(r.info.kind));
    w.Int<std::uint8_t>(0);
    w.Int<std::uint16_t>(0);
    w.Int<std::uint64_t>(r.info.base);
    w.Int<std::uint64_t>(r.info.length);
    w.Int<std::uint32_t>(static_cast<std::uint32_t>(r.rkey.size()));
    w.Bytes(r.rkey.data(), r.rkey.size());
  }
  return w.Take();
}

Result<Descriptor> DecodeDescriptor(std::span<const std::byte> bytes) {
  Reader r(bytes);
  char magic[4];
  std::uint8_t version = 0, backend = 0, pad8 = 0;
  std::uint16_t pad16 = 0;
  if (!r.Bytes(magic, 4) || std::memcmp(magic, kMagic, 4) != 0) {
    return Err(ErrorCode::kProtocol, "descriptor: bad magic");
  }
  if (!r.Int(&version)) return Err(ErrorCode::kProtocol, "descriptor: truncated");
  if (version != kVersion) {
    return Err(ErrorCode::kProtocol,
               "descriptor: version " + std::to_string(version) + ", this build reads version " +
                   std::to_string(kVersion) + " (a peer of another kvferry release: upgrade both)");
  }
  Descriptor d;
  if (!r.Int(&backend) || !r.Int(&pad16)) return Err(ErrorCode::kProtocol, "descriptor: truncated");
  if (backend == 1) {
    d.backend = "ucx";
  } else if (backend == 2) {
    d.backend = "inprocess";
  } else {
    return Err(ErrorCode::kProtocol, "descriptor: unknown backend");
  }
  std::uint32_t count = 0;
  if (!r.Int(&d.engine_uid) || !r.Blob(&d.address, kMaxAddressBytes) || !r.Int(&count)) {
    return Err(ErrorCode::kProtocol, "descriptor: truncated header or address too long");
  }
  if (count > kMaxRegions) return Err(ErrorCode::kProtocol, "descriptor: too many regions");
  d.regions.reserve(count);
  for (std::uint32_t i = 0; i < count; ++i) {
    DescriptorRegion reg;
    std::uint8_t kind = 0;
    if (!r.Int(&reg.info.id) || !r.Int(&kind) || !r.Int(&pad8) || !r.Int(&pad16) ||
        !r.Int(&reg.info.base) || !r.Int(&reg.info.length) || !r.Blob(&reg.rkey, kMaxRkeyBytes)) {
      return Err(ErrorCode::kProtocol, "descriptor: truncated region");
    }
    if (kind > static_cast<std::uint8_t>(MemoryKind::kCuda)) {
      return Err(ErrorCode::kProtocol, "descriptor: unknown memory kind");
    }
    reg.info.kind = static_cast<MemoryKind>(kind);
    if (d.Find(reg.info.id) != nullptr) {
      return Err(ErrorCode::kProtocol, "descriptor: duplicate region id");
    }
    d.regions.push_back(std::move(reg));
  }
  if (!r.AtEnd()) return Err(ErrorCode::kProtocol, "descriptor: trailing bytes");
  return d;
}

std::uint64_t RandomUid() {
  std::random_device rd;
  return (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
}

}  // namespace kvferry::transport::internal

namespace kvferry::transport {

Result<DescriptorInfo> ParseDescriptor(std::span<const std::byte> descriptor) {
  auto d = internal::DecodeDescriptor(descriptor);
  if (!d) return tl::unexpected(d.error());
  DescriptorInfo info;
  info.backend = d->backend;
  info.engine_uid = d->engine_uid;
  for (const auto& r : d->regions) info.regions.push_back(r.info);
  return info;
}

CompletionFn BatchWaiter::Callback() const {
  return [state = state_](BatchId, Status status) {
    std::lock_guard<std::mutex> lock(state->mu);
    state->status = std::move(status);
    state->cv.notify_all();
  };
}

Status BatchWaiter::Wait(TimePoint deadline) const {
  std::unique_lock<std::mutex> lock(state_->mu);
  if (!state_->cv.wait_until(lock, deadline, [&] { return state_->status.has_value(); })) {
    return Status(ErrorCode::kTimeout, "batch did not complete before the deadline");
  }
  return *state_->status;
}

bool BatchWaiter::done() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->status.has_value();
}

}  // namespace kvferry::transport
