// Opt-in cluster authentication (docs/security.md): one shared secret file per cluster, from
// which every kvferry process derives
//  - an HMAC-SHA256 key that signs bootstrap requests (POST /register, header Authorization)
//    and bootstrap answers (GET /query, header X-Kvferry-Signature), and
//  - two ZeroMQ CURVE key pairs: P's side-channel ROUTER is the CURVE server, D's DEALERs are
//    CURVE clients that know the server's public key, and P's ZAP handler admits only the
//    cluster's client public key.
// Every key is derived with its own label (libsodium crypto_generichash), so no two uses share
// key material and the secret itself is kept nowhere after loading. Nothing here logs a key or
// the secret; fingerprint() is a one-way digest operators may compare across hosts.
//
// Without a secret (a null std::shared_ptr<const ClusterSecret> in the options) everything stays
// open, as before: a vLLM-compatible deployment keeps working unchanged.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "kvferry/status.h"

namespace kvferry::control {

// Secret file bounds, after one trailing newline ("\n" or "\r\n") is trimmed.
inline constexpr std::size_t kMinSecretBytes = 32;
inline constexpr std::size_t kMaxSecretBytes = 4096;
// A signature whose timestamp is further than this from the verifier's clock is refused: the
// window in which a captured request or answer can be replayed (docs/security.md).
inline constexpr std::int64_t kMaxClockSkewSeconds = 60;
// The Authorization scheme of a signed request: "kvferry-hmac t=<unix seconds>,sig=<64 hex>".
inline constexpr std::string_view kAuthScheme = "kvferry-hmac";
// The header that carries a signed answer's signature, in the same format.
inline constexpr std::string_view kSignatureHeader = "X-Kvferry-Signature";
// The ZAP domain P's ROUTER announces and its ZAP handler expects.
inline constexpr std::string_view kZapDomain = "kvferry";

// A CURVE key pair as ZeroMQ's socket options take it: Z85, 40 characters each.
struct CurveKeyPair {
  std::string public_z85;
  std::string secret_z85;
};

// Key material derived from the cluster secret. Move-only; wiped on destruction. Share it as
// std::shared_ptr<const ClusterSecret>: it is immutable and thread-safe.
class ClusterSecret {
 public:
  // Derives the keys from `secret` (taken as it is: no trimming). kInvalidArgument when it is
  // shorter than kMinSecretBytes or longer than kMaxSecretBytes; the message states the length,
  // never the bytes. kInternal if libsodium cannot initialise.
  [[nodiscard]] static Result<ClusterSecret> FromBytes(std::string_view secret);

  ~ClusterSecret();
  ClusterSecret(ClusterSecret&& other) noexcept;
  ClusterSecret& operator=(ClusterSecret&& other) noexcept;
  ClusterSecret(const ClusterSecret&) = delete;
  ClusterSecret& operator=(const ClusterSecret&) = delete;

  // P's ROUTER (CURVE server) and D's DEALERs (CURVE clients). Every holder of the secret
  // derives the same pairs; different secrets give unrelated pairs.
  const CurveKeyPair& curve_server() const { return curve_server_; }
  const CurveKeyPair& curve_client() const { return curve_client_; }

  // 16 hex digits of a labelled digest of the secret: equal on two hosts iff (in practice)
  // their secrets are equal. Safe to log; reveals nothing a signed request does not.
  const std::string& fingerprint() const { return fingerprint_; }

  // The HMAC-SHA256 key (for cluster_auth.cc's signing functions).
  const std::array<unsigned char, 32>& hmac_key() const { return hmac_key_; }

 private:
  ClusterSecret() = default;
  void Wipe();

  std::array<unsigned char, 32> hmac_key_{};
  CurveKeyPair curve_server_;
  CurveKeyPair curve_client_;
  std::string fingerprint_;
};

// Reads the secret from `path` (a symbolic link is followed; the file it names is checked).
// Refuses with kNotFound a file that does not exist, and with kInvalidArgument one that cannot
// be read, is not a regular file, is readable or writable by group or other (mode & 077; the
// message names the mode and the chmod that fixes it), or is shorter than kMinSecretBytes or
// longer than kMaxSecretBytes after trimming one trailing newline. Messages name the path and
// the length, never the content.
[[nodiscard]] Result<ClusterSecret> LoadClusterSecret(const std::string& path);

// Seconds since the Unix epoch by the system clock (what signatures carry).
std::int64_t UnixNowSeconds();

// ---- HTTP request signing (bootstrap POST /register) ----

// The Authorization header value for a request: "kvferry-hmac t=<unix_time_s>,sig=<hex>", the
// HMAC-SHA256 of the canonical string
//   "kvferry-request-v1\n" METHOD "\n" path_and_query "\n" t "\n" hex(sha256(body)).
// `path_and_query` is the request target as sent ("/register": kvferry signs no query).
std::string SignRequest(const ClusterSecret& secret, std::string_view method,
                        std::string_view path_and_query, std::string_view body,
                        std::int64_t unix_time_s);

// OK when `header_value` is SignRequest's value for exactly this method, path, body, signed with
// the same secret no more than kMaxClockSkewSeconds away from `now_unix_s` (either way).
// kUnauthenticated otherwise, with the reason: missing (empty), malformed, signature mismatch
// (another secret, or an altered request), or stale / from the future. The signature is
// compared in constant time (crypto_auth_hmacsha256_verify).
[[nodiscard]] Status VerifyRequest(const ClusterSecret& secret, std::string_view header_value,
                                   std::string_view method, std::string_view path,
                                   std::string_view body, std::int64_t now_unix_s);

// ---- HTTP answer signing (bootstrap GET /query) ----

// The X-Kvferry-Signature value for an answer: same format, over
//   "kvferry-response-v1\n" status "\n" path "\n" t "\n" hex(sha256(body)),
// `path` being the request's path without its query ("/query"). An answer carries the engine
// id it is about in its body, which D checks, so the query string need not be signed.
std::string SignResponse(const ClusterSecret& secret, int status, std::string_view path,
                         std::string_view body, std::int64_t unix_time_s);

// As VerifyRequest, for an answer: OK, or kUnauthenticated with the reason (an empty
// `header_value` means the answer is not signed).
[[nodiscard]] Status VerifyResponse(const ClusterSecret& secret, std::string_view header_value,
                                    int status, std::string_view path, std::string_view body,
                                    std::int64_t now_unix_s);

// ---- Registry record signing (the values P publishes in etcd) ----

// The signature of a record `value` stored under `key`, published at `unix_time_s`: same
// format, over "kvferry-record-v1\nPUT\n" key "\n" t "\n" hex(sha256(value)). It binds the
// record to its key, so a record cannot be moved under another engine's name.
std::string SignRecord(const ClusterSecret& secret, std::string_view key, std::string_view value,
                       std::int64_t unix_time_s);

// OK when `signature` is SignRecord's value for exactly this key and value with the same secret;
// kUnauthenticated with the reason otherwise (empty: not signed). No freshness check: a record
// is current while etcd keeps it (its lease), whatever its age.
[[nodiscard]] Status VerifyRecord(const ClusterSecret& secret, std::string_view signature,
                                  std::string_view key, std::string_view value);

// Whether this libzmq can do CURVE (zmq_has("curve")).
bool CurveAvailable();

}  // namespace kvferry::control
