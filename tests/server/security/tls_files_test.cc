#include "server/security/tls_files.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace muond::security {
namespace {

using ::muond::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

TEST(TlsConfigTest, LocalAddresses) {
  EXPECT_TRUE(IsLocalListenAddress("127.0.0.1:50051"));
  EXPECT_TRUE(IsLocalListenAddress("127.1.2.3:0"));
  EXPECT_TRUE(IsLocalListenAddress("localhost:50051"));
  EXPECT_TRUE(IsLocalListenAddress("[::1]:50051"));
  EXPECT_TRUE(IsLocalListenAddress("unix:/run/muond.sock"));
  EXPECT_FALSE(IsLocalListenAddress("0.0.0.0:50051"));
  EXPECT_FALSE(IsLocalListenAddress("[::]:50051"));
  EXPECT_FALSE(IsLocalListenAddress("10.0.0.5:50051"));
  EXPECT_FALSE(IsLocalListenAddress(":50051"));
  EXPECT_FALSE(IsLocalListenAddress("muond.internal:50051"));
}

TEST(TlsConfigTest, WarningsForExposedListeners) {
  EXPECT_THAT(ExposureWarnings("127.0.0.1:50051", false, false, false), IsEmpty());
  const std::vector<std::string> open = ExposureWarnings("0.0.0.0:50051", false, false, false);
  ASSERT_GE(open.size(), 2u);
  EXPECT_THAT(open[0], HasSubstr("WITHOUT AUTHENTICATION"));
  EXPECT_THAT(ExposureWarnings("0.0.0.0:50051", true, false, true), IsEmpty());
  EXPECT_THAT(ExposureWarnings("0.0.0.0:50051", true, true, false), IsEmpty());
  const std::vector<std::string> plain_tokens = ExposureWarnings("0.0.0.0:50051", false, false, true);
  ASSERT_EQ(plain_tokens.size(), 1u);
  EXPECT_THAT(plain_tokens[0], HasSubstr("plain text"));
  // /metrics has no authentication: a non-local one beside an authenticated gRPC port is named.
  EXPECT_THAT(MetricsExposureWarnings("", true), IsEmpty());
  EXPECT_THAT(MetricsExposureWarnings("127.0.0.1:9464", true), IsEmpty());
  EXPECT_THAT(MetricsExposureWarnings("0.0.0.0:9464", false), IsEmpty());  // nothing is kept to owners
  const std::vector<std::string> metrics = MetricsExposureWarnings("0.0.0.0:9464", true);
  ASSERT_EQ(metrics.size(), 2u);
  EXPECT_THAT(metrics[0], HasSubstr("/metrics on 0.0.0.0:9464 has no authentication"));
}

TEST(TlsConfigTest, FlagsThatDoNotGoTogetherAreRefused) {
  ASSERT_OK_AND_ASSIGN(TlsMaterial none, LoadTlsMaterial(TlsFiles{}));
  EXPECT_FALSE(none.enabled);
  EXPECT_THAT(LoadTlsMaterial(TlsFiles{"cert.pem", "", ""}),
              StatusIs(absl::StatusCode::kInvalidArgument, "--tls-cert and --tls-key go together"));
  EXPECT_THAT(LoadTlsMaterial(TlsFiles{"", "", "ca.pem"}),
              StatusIs(absl::StatusCode::kInvalidArgument, "--tls-client-ca needs --tls-cert"));
  EXPECT_THAT(LoadTlsMaterial(TlsFiles{"/nonexistent/cert.pem", "/nonexistent/key.pem", ""}),
              StatusIs(absl::StatusCode::kInvalidArgument, "--tls-cert: cannot read"));
}

}  // namespace
}  // namespace muond::security
