#include "server/security/token_table.h"

#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace muond::security {
namespace {

using ::muond::testing::StatusIs;

TEST(ConstantTimeEqualsTest, ComparesWholeStrings) {
  EXPECT_TRUE(ConstantTimeEquals("secret", "secret"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_FALSE(ConstantTimeEquals("secret", "secreT"));
  EXPECT_FALSE(ConstantTimeEquals("secret", "secret2"));
  EXPECT_FALSE(ConstantTimeEquals("secret", "secre"));
  EXPECT_FALSE(ConstantTimeEquals("secret", ""));
  EXPECT_FALSE(ConstantTimeEquals(absl::string_view("a\0b", 3), absl::string_view("a\0c", 3)));
}

TEST(TokenTableTest, ParsesNamedAndBareTokensSkippingCommentsAndBlankLines) {
  ASSERT_OK_AND_ASSIGN(TokenTable table,
                       TokenTable::Parse("# tokens\nalice:tok-a\n\n  bob : tok-b  \ntok-c\r\n", "tokens"));
  EXPECT_EQ(table.size(), 3u);
  EXPECT_EQ(*table.Authenticate("Bearer tok-a"), "alice");
  EXPECT_EQ(*table.Authenticate("bearer  tok-b "), "bob");
  EXPECT_EQ(*table.Authenticate("Bearer tok-c"), "token-5");
}

TEST(TokenTableTest, SharedNameMeansSameOwner) {
  ASSERT_OK_AND_ASSIGN(TokenTable table, TokenTable::Parse("ci:old\nci:new\n", "tokens"));
  EXPECT_EQ(*table.Authenticate("Bearer old"), "ci");
  EXPECT_EQ(*table.Authenticate("Bearer new"), "ci");
}

TEST(TokenTableTest, RefusesMalformedFiles) {
  EXPECT_THAT(TokenTable::Parse("", "f"), StatusIs(absl::StatusCode::kInvalidArgument, "f: no tokens"));
  EXPECT_THAT(TokenTable::Parse("# only\n\n", "f"), StatusIs(absl::StatusCode::kInvalidArgument, "no tokens"));
  EXPECT_THAT(TokenTable::Parse("ok\n:tok\n", "f"), StatusIs(absl::StatusCode::kInvalidArgument, "f:2: empty name"));
  EXPECT_THAT(TokenTable::Parse("alice:\n", "f"), StatusIs(absl::StatusCode::kInvalidArgument, "f:1: empty token"));
  EXPECT_THAT(TokenTable::Parse("alice:a b\n", "f"), StatusIs(absl::StatusCode::kInvalidArgument, "spaces"));
  EXPECT_THAT(TokenTable::Load("/nonexistent/muond-tokens"),
              StatusIs(absl::StatusCode::kNotFound, "--auth-token-file"));
}

TEST(TokenTableTest, RefusesMissingMalformedAndWrongCredentials) {
  ASSERT_OK_AND_ASSIGN(TokenTable table, TokenTable::Parse("alice:tok-a\n", "tokens"));
  EXPECT_THAT(table.Authenticate(std::nullopt), StatusIs(absl::StatusCode::kUnauthenticated, "missing credentials"));
  EXPECT_THAT(table.Authenticate("tok-a"), StatusIs(absl::StatusCode::kUnauthenticated, "'Bearer <token>'"));
  EXPECT_THAT(table.Authenticate("Basic tok-a"), StatusIs(absl::StatusCode::kUnauthenticated, "'Bearer <token>'"));
  EXPECT_THAT(table.Authenticate("Bearer "), StatusIs(absl::StatusCode::kUnauthenticated, "'Bearer <token>'"));
  EXPECT_THAT(table.Authenticate("Bearer tok"), StatusIs(absl::StatusCode::kUnauthenticated, "not one"));
  EXPECT_THAT(table.Authenticate("Bearer tok-a2"), StatusIs(absl::StatusCode::kUnauthenticated, "not one"));
  // A refusal never repeats what was presented.
  absl::StatusOr<std::string> refused = table.Authenticate("Bearer guess-123");
  EXPECT_EQ(std::string(refused.status().message()).find("guess-123"), std::string::npos);
}

}  // namespace
}  // namespace muond::security
