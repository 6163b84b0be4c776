#include "control/cluster_auth.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sodium.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

namespace kvferry::control {
namespace {

using Key = std::array<unsigned char, 32>;

// Labels of the derived keys: each use gets its own, so no two share key material.
constexpr std::string_view kLabelHmac = "kvferry hmac-sha256 v1";
constexpr std::string_view kLabelCurveServer = "kvferry curve server v1";
constexpr std::string_view kLabelCurveClient = "kvferry curve client v1";
constexpr std::string_view kLabelFingerprint = "kvferry fingerprint v1";
// Canonical-string prefixes: a request's signature is never a valid answer's, nor the reverse.
constexpr std::string_view kRequestPrefix = "kvferry-request-v1";
constexpr std::string_view kResponsePrefix = "kvferry-response-v1";
constexpr std::string_view kRecordPrefix = "kvferry-record-v1";

// A header longer than this is not ours ("kvferry-hmac t=" + 12 digits + ",sig=" + 64 hex).
constexpr std::size_t kMaxHeaderBytes = 128;
constexpr std::size_t kMaxTimestampDigits = 12;

bool SodiumReady() {
  static const bool ready = sodium_init() >= 0;
  return ready;
}

// BLAKE2b-256 keyed by `master` over `label`: the key for one use.
Key Derive(const Key& master, std::string_view label) {
  Key out{};
  crypto_generichash(out.data(), out.size(), reinterpret_cast<const unsigned char*>(label.data()),
                     label.size(), master.data(), master.size());
  return out;
}

std::string Z85(const unsigned char* key) {
  char text[41] = {};
  zmq_z85_encode(text, key, 32);
  return std::string(text, 40);
}

CurveKeyPair CurvePair(const Key& master, std::string_view label) {
  Key seed = Derive(master, label);
  unsigned char pk[crypto_box_PUBLICKEYBYTES];
  unsigned char sk[crypto_box_SECRETKEYBYTES];
  crypto_box_seed_keypair(pk, sk, seed.data());
  CurveKeyPair pair{Z85(pk), Z85(sk)};
  sodium_memzero(sk, sizeof(sk));
  sodium_memzero(seed.data(), seed.size());
  return pair;
}

void WipeString(std::string& s) {
  if (!s.empty()) sodium_memzero(s.data(), s.size());
  s.clear();
}

std::string Hex(const unsigned char* data, std::size_t n) {
  std::string out(2 * n + 1, '\0');
  sodium_bin2hex(out.data(), out.size(), data, n);
  out.pop_back();
  return out;
}

std::string BodyDigest(std::string_view body) {
  unsigned char digest[crypto_hash_sha256_BYTES];
  crypto_hash_sha256(digest, reinterpret_cast<const unsigned char*>(body.data()), body.size());
  return Hex(digest, sizeof(digest));
}

std::string Canonical(std::string_view prefix, std::string_view first, std::string_view path,
                      std::int64_t t, std::string_view body) {
  return fmt::format("{}\n{}\n{}\n{}\n{}", prefix, first, path, t, BodyDigest(body));
}

std::array<unsigned char, crypto_auth_hmacsha256_BYTES> Mac(const ClusterSecret& secret,
                                                            const std::string& message) {
  std::array<unsigned char, crypto_auth_hmacsha256_BYTES> mac{};
  crypto_auth_hmacsha256(mac.data(), reinterpret_cast<const unsigned char*>(message.data()),
                         message.size(), secret.hmac_key().data());
  return mac;
}

std::string HeaderValue(std::int64_t t, const std::array<unsigned char, 32>& mac) {
  return fmt::format("{} t={},sig={}", kAuthScheme, t, Hex(mac.data(), mac.size()));
}

struct ParsedHeader {
  std::int64_t t = 0;
  std::array<unsigned char, crypto_auth_hmacsha256_BYTES> sig{};
};

// "kvferry-hmac t=<1..12 digits>,sig=<64 lowercase hex>", nothing else.
bool ParseHeader(std::string_view v, ParsedHeader& out) {
  if (v.size() > kMaxHeaderBytes) return false;
  const std::string prefix = fmt::format("{} t=", kAuthScheme);
  if (v.substr(0, prefix.size()) != prefix) return false;
  v.remove_prefix(prefix.size());
  const std::size_t comma = v.find(',');
  if (comma == std::string_view::npos || comma == 0 || comma > kMaxTimestampDigits) return false;
  std::int64_t t = 0;
  for (char c : v.substr(0, comma)) {
    if (c < '0' || c > '9') return false;
    t = t * 10 + (c - '0');
  }
  v.remove_prefix(comma + 1);
  constexpr std::string_view kSig = "sig=";
  if (v.substr(0, kSig.size()) != kSig) return false;
  v.remove_prefix(kSig.size());
  if (v.size() != 2 * out.sig.size()) return false;
  for (char c : v) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  std::size_t decoded = 0;
  if (sodium_hex2bin(out.sig.data(), out.sig.size(), v.data(), v.size(), nullptr, &decoded,
                     nullptr) != 0 ||
      decoded != out.sig.size()) {
    return false;
  }
  out.t = t;
  return true;
}

// `what` names the thing checked ("request", "answer") for the messages.
Status Verify(const ClusterSecret& secret, std::string_view header_value, std::string_view what,
              std::string_view missing, std::string_view prefix, std::string_view first,
              std::string_view path, std::string_view body, std::int64_t now_unix_s) {
  if (header_value.empty()) return Status(ErrorCode::kUnauthenticated, std::string(missing));
  ParsedHeader parsed;
  if (!ParseHeader(header_value, parsed)) {
    return Status(ErrorCode::kUnauthenticated,
                  fmt::format("malformed {} signature (expected '{} t=<unix seconds>,sig=<64 "
                              "hex>')",
                              what, kAuthScheme));
  }
  const std::string message = Canonical(prefix, first, path, parsed.t, body);
  if (crypto_auth_hmacsha256_verify(parsed.sig.data(),
                                    reinterpret_cast<const unsigned char*>(message.data()),
                                    message.size(), secret.hmac_key().data()) != 0) {
    return Status(ErrorCode::kUnauthenticated,
                  fmt::format("{} signature does not match (another cluster secret, or the {} "
                              "was altered)",
                              what, what));
  }
  const std::int64_t skew = now_unix_s - parsed.t;
  if (skew > kMaxClockSkewSeconds || skew < -kMaxClockSkewSeconds) {
    return Status(ErrorCode::kUnauthenticated,
                  fmt::format("{} signed at unix time {} is {} s {} this host's clock (limit {} "
                              "s): a replay, or clocks out of sync",
                              what, parsed.t, skew > 0 ? skew : -skew,
                              skew > 0 ? "behind" : "ahead of", kMaxClockSkewSeconds));
  }
  return Status::Ok();
}

}  // namespace

Result<ClusterSecret> ClusterSecret::FromBytes(std::string_view secret) {
  if (secret.size() < kMinSecretBytes || secret.size() > kMaxSecretBytes) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("a cluster secret must be {} to {} bytes; this one has {}",
                           kMinSecretBytes, kMaxSecretBytes, secret.size()));
  }
  if (!SodiumReady()) return Err(ErrorCode::kInternal, "libsodium failed to initialise");
  Key master{};
  crypto_generichash(master.data(), master.size(),
                     reinterpret_cast<const unsigned char*>(secret.data()), secret.size(), nullptr,
                     0);
  ClusterSecret out;
  out.hmac_key_ = Derive(master, kLabelHmac);
  out.curve_server_ = CurvePair(master, kLabelCurveServer);
  out.curve_client_ = CurvePair(master, kLabelCurveClient);
  Key fingerprint = Derive(master, kLabelFingerprint);
  out.fingerprint_ = Hex(fingerprint.data(), 8);
  sodium_memzero(master.data(), master.size());
  return out;
}

ClusterSecret::~ClusterSecret() { Wipe(); }

ClusterSecret::ClusterSecret(ClusterSecret&& other) noexcept
    : hmac_key_(other.hmac_key_),
      curve_server_(std::move(other.curve_server_)),
      curve_client_(std::move(other.curve_client_)),
      fingerprint_(std::move(other.fingerprint_)) {
  other.Wipe();
}

ClusterSecret& ClusterSecret::operator=(ClusterSecret&& other) noexcept {
  if (this != &other) {
    Wipe();
    hmac_key_ = other.hmac_key_;
    curve_server_ = std::move(other.curve_server_);
    curve_client_ = std::move(other.curve_client_);
    fingerprint_ = std::move(other.fingerprint_);
    other.Wipe();
  }
  return *this;
}

void ClusterSecret::Wipe() {
  sodium_memzero(hmac_key_.data(), hmac_key_.size());
  WipeString(curve_server_.secret_z85);
  WipeString(curve_client_.secret_z85);
  curve_server_.public_z85.clear();
  curve_client_.public_z85.clear();
}

Result<ClusterSecret> LoadClusterSecret(const std::string& path) {
  // O_NONBLOCK: a FIFO put in the file's place must not hang the process at start (it is then
  // refused below as not a regular file).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) {
      return Err(ErrorCode::kNotFound, fmt::format("cluster secret file {} does not exist", path));
    }
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("cannot read cluster secret file {}: {}", path, std::strerror(err)));
  }
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("cannot stat cluster secret file {}: {}", path, std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("cluster secret file {} is not a regular file", path));
  }
  // Another user who owns the file can rewrite it, mode 0600 or not.
  if (st.st_uid != ::geteuid()) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("cluster secret file {} belongs to uid {}, not to this process's {}; "
                           "chown it",
                           path, st.st_uid, ::geteuid()));
  }
  const unsigned mode = static_cast<unsigned>(st.st_mode) & 07777u;
  if ((mode & 077u) != 0) {
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("cluster secret file {} is accessible by group or others (mode {:04o}); "
                           "run chmod 600 {}",
                           path, mode, path));
  }
  // One byte more than the longest acceptable file ("\r\n" trimmed), so a longer file shows.
  std::string bytes(kMaxSecretBytes + 3, '\0');
  std::size_t got = 0;
  while (got < bytes.size()) {
    const ssize_t n = ::read(fd, bytes.data() + got, bytes.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      WipeString(bytes);
      return Err(ErrorCode::kInvalidArgument,
                 fmt::format("cannot read cluster secret file {}: {}", path, std::strerror(err)));
    }
    if (n == 0) break;
    got += static_cast<std::size_t>(n);
  }
  std::string_view secret(bytes.data(), got);
  if (!secret.empty() && secret.back() == '\n') {
    secret.remove_suffix(1);
    if (!secret.empty() && secret.back() == '\r') secret.remove_suffix(1);
  }
  Result<ClusterSecret> out = ClusterSecret::FromBytes(secret);
  const std::size_t length = secret.size();
  WipeString(bytes);
  if (!out) {
    if (out.error().code() != ErrorCode::kInvalidArgument) return out;
    return Err(ErrorCode::kInvalidArgument,
               fmt::format("cluster secret file {}: {} bytes{} (after trimming a trailing "
                           "newline); it must hold {} to {} bytes",
                           path, length, got == kMaxSecretBytes + 3 ? " or more" : "",
                           kMinSecretBytes, kMaxSecretBytes));
  }
  return out;
}

std::int64_t UnixNowSeconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string SignRequest(const ClusterSecret& secret, std::string_view method,
                        std::string_view path_and_query, std::string_view body,
                        std::int64_t unix_time_s) {
  return HeaderValue(unix_time_s, Mac(secret, Canonical(kRequestPrefix, method, path_and_query,
                                                        unix_time_s, body)));
}

Status VerifyRequest(const ClusterSecret& secret, std::string_view header_value,
                     std::string_view method, std::string_view path, std::string_view body,
                     std::int64_t now_unix_s) {
  return Verify(secret, header_value, "request",
                "request is not signed: the cluster requires authentication (Authorization: "
                "kvferry-hmac ...; see docs/security.md)",
                kRequestPrefix, method, path, body, now_unix_s);
}

std::string SignResponse(const ClusterSecret& secret, int status, std::string_view path,
                         std::string_view body, std::int64_t unix_time_s) {
  return HeaderValue(unix_time_s, Mac(secret, Canonical(kResponsePrefix, std::to_string(status),
                                                        path, unix_time_s, body)));
}

Status VerifyResponse(const ClusterSecret& secret, std::string_view header_value, int status,
                      std::string_view path, std::string_view body, std::int64_t now_unix_s) {
  return Verify(secret, header_value, "answer",
                "answer is not signed: the bootstrap service runs without the cluster secret",
                kResponsePrefix, std::to_string(status), path, body, now_unix_s);
}

std::string SignRecord(const ClusterSecret& secret, std::string_view key, std::string_view value,
                       std::int64_t unix_time_s) {
  return HeaderValue(unix_time_s,
                     Mac(secret, Canonical(kRecordPrefix, "PUT", key, unix_time_s, value)));
}

Status VerifyRecord(const ClusterSecret& secret, std::string_view signature, std::string_view key,
                    std::string_view value) {
  if (signature.empty()) {
    return Status(ErrorCode::kUnauthenticated,
                  "record is not signed: its publisher runs without the cluster secret");
  }
  ParsedHeader parsed;
  if (!ParseHeader(signature, parsed)) {
    return Status(ErrorCode::kUnauthenticated, "malformed record signature");
  }
  const std::string message = Canonical(kRecordPrefix, "PUT", key, parsed.t, value);
  if (crypto_auth_hmacsha256_verify(parsed.sig.data(),
                                    reinterpret_cast<const unsigned char*>(message.data()),
                                    message.size(), secret.hmac_key().data()) != 0) {
    return Status(ErrorCode::kUnauthenticated,
                  "record signature does not match (another cluster secret, or the record was "
                  "altered or moved under another key)");
  }
  return Status::Ok();
}

bool CurveAvailable() { return zmq_has("curve") == 1; }

}  // namespace kvferry::control
