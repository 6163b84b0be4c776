// Cluster authentication primitives (control/cluster_auth.h): loading the secret file, signing
// and verifying bootstrap requests and answers, and the CURVE keys derived for the side channel.
#include "control/cluster_auth.h"

#include <gtest/gtest.h>

#include <chrono>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

namespace kvferry::control {
namespace {

namespace fs = std::filesystem;

constexpr std::int64_t kNow = 1'700'000'000;
const std::string kSecretA(40, 'a');
const std::string kSecretB(40, 'b');

ClusterSecret Secret(const std::string& bytes) {
  auto secret = ClusterSecret::FromBytes(bytes);
  EXPECT_TRUE(secret.has_value()) << secret.error().ToString();
  return std::move(*secret);
}

class SecretFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "kvferry_secret_XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Write(const std::string& content, mode_t mode, const std::string& name = "s") {
    const fs::path path = dir_ / name;
    std::ofstream(path, std::ios::binary) << content;
    EXPECT_EQ(::chmod(path.c_str(), mode), 0);
    return path.string();
  }

  fs::path dir_;
};

TEST_F(SecretFileTest, PrivateFileLoadsAndOneTrailingNewlineIsTrimmed) {
  const std::string expected = Secret(kSecretA).fingerprint();
  for (const std::string& content : {kSecretA, kSecretA + "\n", kSecretA + "\r\n"}) {
    auto loaded = LoadClusterSecret(Write(content, 0600));
    ASSERT_TRUE(loaded.has_value()) << loaded.error().ToString();
    EXPECT_EQ(loaded->fingerprint(), expected);
  }
  // Only one newline is trimmed: a second one is part of the secret.
  auto two = LoadClusterSecret(Write(kSecretA + "\n\n", 0400));
  ASSERT_TRUE(two.has_value());
  EXPECT_NE(two->fingerprint(), expected);
}

TEST_F(SecretFileTest, FileAccessibleByGroupOrOthersIsRefusedNamingItsMode) {
  for (mode_t mode : {0640, 0604, 0602, 0660, 0644}) {
    auto loaded = LoadClusterSecret(Write(kSecretA, mode));
    ASSERT_FALSE(loaded.has_value()) << std::oct << mode;
    EXPECT_EQ(loaded.error().code(), ErrorCode::kInvalidArgument);
    char octal[8];
    std::snprintf(octal, sizeof(octal), "%04o", static_cast<unsigned>(mode));
    EXPECT_NE(loaded.error().message().find(octal), std::string::npos) << loaded.error().message();
    EXPECT_NE(loaded.error().message().find("chmod 600"), std::string::npos);
  }
}

TEST_F(SecretFileTest, SecretsOutsideThirtyTwoTo4096BytesAreRefusedWithoutShowingThem) {
  const std::string short_secret = "short-secret-of-31-bytes-xxxxxx";
  ASSERT_EQ(short_secret.size(), 31u);
  for (const std::string& content : {short_secret, short_secret + "\n", std::string(),
                                     std::string(4097, 'z'), std::string(9000, 'z')}) {
    auto loaded = LoadClusterSecret(Write(content, 0600));
    ASSERT_FALSE(loaded.has_value()) << content.size();
    EXPECT_EQ(loaded.error().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(loaded.error().message().find("32 to 4096 bytes"), std::string::npos)
        << loaded.error().message();
    if (!content.empty()) {
      EXPECT_EQ(loaded.error().message().find(content.substr(0, 20)), std::string::npos);
    }
  }
  EXPECT_TRUE(LoadClusterSecret(Write(std::string(32, 'k'), 0600)).has_value());
  EXPECT_TRUE(LoadClusterSecret(Write(std::string(4096, 'k') + "\n", 0600)).has_value());
}

TEST_F(SecretFileTest, MissingFileAndDirectoryAreRefused) {
  auto missing = LoadClusterSecret((dir_ / "absent").string());
  ASSERT_FALSE(missing.has_value());
  EXPECT_EQ(missing.error().code(), ErrorCode::kNotFound);
  EXPECT_NE(missing.error().message().find("absent"), std::string::npos);
  fs::create_directory(dir_ / "sub");
  ::chmod((dir_ / "sub").c_str(), 0700);
  auto directory = LoadClusterSecret((dir_ / "sub").string());
  ASSERT_FALSE(directory.has_value());
  EXPECT_EQ(directory.error().code(), ErrorCode::kInvalidArgument);
}

// A FIFO in the secret's place must not hang the process at start (open would block until a
// writer came); it is refused at once as not a regular file.
TEST_F(SecretFileTest, AFifoIsRefusedAtOnceWithoutBlocking) {
  const fs::path fifo = dir_ / "fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const auto start = std::chrono::steady_clock::now();
  auto loaded = LoadClusterSecret(fifo.string());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
  ASSERT_FALSE(loaded.has_value());
  EXPECT_NE(loaded.error().message().find("not a regular file"), std::string::npos)
      << loaded.error().message();
}

// Another user who owns the file can rewrite it, whatever its mode.
TEST_F(SecretFileTest, AFileOwnedByAnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give the file away";
  const std::string path = Write(kSecretA, 0600);
  ASSERT_EQ(::chown(path.c_str(), 65534, 65534), 0);
  auto loaded = LoadClusterSecret(path);
  ASSERT_FALSE(loaded.has_value());
  EXPECT_NE(loaded.error().message().find("belongs to uid 65534"), std::string::npos)
      << loaded.error().message();
}

TEST(RequestSigning, SignedRequestVerifiesWithinTheClockWindow) {
  const ClusterSecret secret = Secret(kSecretA);
  const std::string header = SignRequest(secret, "POST", "/register", R"({"a":1})", kNow);
  EXPECT_EQ(header.rfind("kvferry-hmac t=1700000000,sig=", 0), 0u) << header;
  EXPECT_TRUE(VerifyRequest(secret, header, "POST", "/register", R"({"a":1})", kNow).ok());
  for (std::int64_t skew : {-60, -1, 1, 60}) {
    EXPECT_TRUE(VerifyRequest(secret, header, "POST", "/register", R"({"a":1})", kNow + skew).ok())
        << skew;
  }
}

TEST(RequestSigning, TamperedBodyMethodOrPathIsRefused) {
  const ClusterSecret secret = Secret(kSecretA);
  const std::string header = SignRequest(secret, "POST", "/register", R"({"a":1})", kNow);
  for (const Status& s : {VerifyRequest(secret, header, "POST", "/register", R"({"a":2})", kNow),
                          VerifyRequest(secret, header, "GET", "/register", R"({"a":1})", kNow),
                          VerifyRequest(secret, header, "POST", "/query", R"({"a":1})", kNow)}) {
    EXPECT_EQ(s.code(), ErrorCode::kUnauthenticated);
    EXPECT_NE(s.message().find("does not match"), std::string::npos) << s.message();
  }
}

TEST(RequestSigning, AnotherSecretsSignatureIsRefused) {
  const std::string header = SignRequest(Secret(kSecretB), "POST", "/register", R"({"a":1})", kNow);
  const Status s = VerifyRequest(Secret(kSecretA), header, "POST", "/register", R"({"a":1})", kNow);
  EXPECT_EQ(s.code(), ErrorCode::kUnauthenticated);
  EXPECT_NE(s.message().find("another cluster secret"), std::string::npos) << s.message();
}

TEST(RequestSigning, StaleOrFutureTimestampIsRefusedAsAPossibleReplay) {
  const ClusterSecret secret = Secret(kSecretA);
  const std::string header = SignRequest(secret, "POST", "/register", "{}", kNow);
  const Status stale = VerifyRequest(secret, header, "POST", "/register", "{}", kNow + 61);
  EXPECT_EQ(stale.code(), ErrorCode::kUnauthenticated);
  EXPECT_NE(stale.message().find("61 s behind"), std::string::npos) << stale.message();
  const Status future = VerifyRequest(secret, header, "POST", "/register", "{}", kNow - 3600);
  EXPECT_EQ(future.code(), ErrorCode::kUnauthenticated);
  EXPECT_NE(future.message().find("ahead of"), std::string::npos) << future.message();
}

TEST(RequestSigning, MissingOrMalformedHeaderIsRefused) {
  const ClusterSecret secret = Secret(kSecretA);
  const std::string good = SignRequest(secret, "POST", "/register", "{}", kNow);
  const Status missing = VerifyRequest(secret, "", "POST", "/register", "{}", kNow);
  EXPECT_EQ(missing.code(), ErrorCode::kUnauthenticated);
  EXPECT_NE(missing.message().find("not signed"), std::string::npos) << missing.message();
  const std::string sig = good.substr(good.find("sig=") + 4);
  for (const std::string& bad : {
           std::string("Bearer abc"),
           "kvferry-hmac t=,sig=" + sig,
           "kvferry-hmac t=-5,sig=" + sig,
           "kvferry-hmac t=1700000000 ,sig=" + sig,
           "kvferry-hmac t=1700000000,sig=" + sig.substr(1),
           "kvferry-hmac t=1700000000,sig=" + sig + "00",
           "kvferry-hmac t=1700000000,sig=" + std::string(64, 'G'),
           "KVFERRY-HMAC t=1700000000,sig=" + sig,
           "kvferry-hmac t=1234567890123,sig=" + sig,
           good + ",x=1",
       }) {
    const Status s = VerifyRequest(secret, bad, "POST", "/register", "{}", kNow);
    EXPECT_EQ(s.code(), ErrorCode::kUnauthenticated) << bad;
    EXPECT_NE(s.message().find("malformed"), std::string::npos) << bad << ": " << s.message();
  }
}

// Registry records (etcd values) are bound to their key, and carry no freshness limit: a record
// is current while etcd keeps it.
TEST(RecordSigning, ARecordVerifiesUnderItsOwnKeyOnlyAndAtAnyAge) {
  const ClusterSecret secret = Secret(std::string(32, 'a'));
  const ClusterSecret other = Secret(std::string(32, 'b'));
  const std::string sig = SignRecord(secret, "/kvferry/engines/p/0-0", "{\"x\":1}", 1000);
  EXPECT_TRUE(VerifyRecord(secret, sig, "/kvferry/engines/p/0-0", "{\"x\":1}").ok())
      << "signed at unix time 1000: records have no freshness limit";
  EXPECT_EQ(VerifyRecord(secret, sig, "/kvferry/engines/q/0-0", "{\"x\":1}").code(),
            ErrorCode::kUnauthenticated)
      << "moved under another key";
  EXPECT_EQ(VerifyRecord(secret, sig, "/kvferry/engines/p/0-0", "{\"x\":2}").code(),
            ErrorCode::kUnauthenticated)
      << "altered";
  EXPECT_EQ(VerifyRecord(other, sig, "/kvferry/engines/p/0-0", "{\"x\":1}").code(),
            ErrorCode::kUnauthenticated)
      << "another secret";
  const Status unsigned_record = VerifyRecord(secret, "", "/kvferry/engines/p/0-0", "{}");
  EXPECT_NE(unsigned_record.message().find("not signed"), std::string::npos);
  EXPECT_EQ(VerifyRecord(secret, "garbage", "/k", "{}").code(), ErrorCode::kUnauthenticated);
  const std::string request = SignRequest(secret, "PUT", "/kvferry/engines/p/0-0", "{}", 1000);
  EXPECT_FALSE(VerifyRecord(secret, request, "/kvferry/engines/p/0-0", "{}").ok())
      << "a request's signature is not a record's";
}

TEST(ResponseSigning, SignedAnswerVerifiesAndAlteredStatusOrBodyDoesNot) {
  const ClusterSecret secret = Secret(kSecretA);
  const std::string header = SignResponse(secret, 200, "/query", R"({"engine_id":"p"})", kNow);
  EXPECT_TRUE(VerifyResponse(secret, header, 200, "/query", R"({"engine_id":"p"})", kNow).ok());
  EXPECT_EQ(VerifyResponse(secret, header, 404, "/query", R"({"engine_id":"p"})", kNow).code(),
            ErrorCode::kUnauthenticated);
  EXPECT_EQ(VerifyResponse(secret, header, 200, "/query", R"({"engine_id":"q"})", kNow).code(),
            ErrorCode::kUnauthenticated);
  EXPECT_EQ(
      VerifyResponse(Secret(kSecretB), header, 200, "/query", R"({"engine_id":"p"})", kNow).code(),
      ErrorCode::kUnauthenticated);
  const Status unsigned_answer = VerifyResponse(secret, "", 200, "/query", "{}", kNow);
  EXPECT_NE(unsigned_answer.message().find("not signed"), std::string::npos);
}

TEST(ResponseSigning, ARequestSignatureIsNeverAValidAnswerSignature) {
  const ClusterSecret secret = Secret(kSecretA);
  // Same fields in both canonical strings; only the prefix tells them apart.
  const std::string request = SignRequest(secret, "200", "/query", "{}", kNow);
  EXPECT_EQ(VerifyResponse(secret, request, 200, "/query", "{}", kNow).code(),
            ErrorCode::kUnauthenticated);
}

TEST(CurveKeys, DerivationIsDeterministicAndDistinct) {
  const ClusterSecret a1 = Secret(kSecretA);
  const ClusterSecret a2 = Secret(kSecretA);
  const ClusterSecret b = Secret(kSecretB);
  EXPECT_EQ(a1.curve_server().public_z85, a2.curve_server().public_z85);
  EXPECT_EQ(a1.curve_server().secret_z85, a2.curve_server().secret_z85);
  EXPECT_EQ(a1.curve_client().public_z85, a2.curve_client().public_z85);
  EXPECT_EQ(a1.fingerprint(), a2.fingerprint());
  EXPECT_NE(a1.curve_server().public_z85, a1.curve_client().public_z85);
  EXPECT_NE(a1.curve_server().public_z85, b.curve_server().public_z85);
  EXPECT_NE(a1.curve_client().public_z85, b.curve_client().public_z85);
  EXPECT_NE(a1.fingerprint(), b.fingerprint());
  EXPECT_EQ(a1.fingerprint().size(), 16u);
  for (const CurveKeyPair* pair : {&a1.curve_server(), &a1.curve_client()}) {
    ASSERT_EQ(pair->public_z85.size(), 40u);
    ASSERT_EQ(pair->secret_z85.size(), 40u);
    // ZeroMQ computes the same public key from the secret one: a valid CURVE pair.
    char derived[41] = {};
    ASSERT_EQ(zmq_curve_public(derived, pair->secret_z85.c_str()), 0);
    EXPECT_EQ(std::string(derived), pair->public_z85);
  }
}

TEST(CurveKeys, SecretLengthIsCheckedWithoutEchoingIt) {
  auto short_secret = ClusterSecret::FromBytes("too-short");
  ASSERT_FALSE(short_secret.has_value());
  EXPECT_EQ(short_secret.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(short_secret.error().message().find("too-short"), std::string::npos);
  EXPECT_TRUE(CurveAvailable()) << "this libzmq lacks CURVE: authentication cannot work";
}

}  // namespace
}  // namespace kvferry::control
