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
  // A bare token is known by its SHA-256 (sha256("tok-c") begins 1236183d37679658), not its line.
  EXPECT_EQ(*table.Authenticate("Bearer tok-c"), "token-1236183d37679658");
}

// Lines added, removed or reordered never hand one bare token's sessions to another: its identity
// is its own, wherever it stands.
TEST(TokenTableTest, ABareTokenKeepsItsIdentityWhereverItsLineIs) {
  ASSERT_OK_AND_ASSIGN(TokenTable before, TokenTable::Parse("tok-a\ntok-b\n", "tokens"));
  ASSERT_OK_AND_ASSIGN(TokenTable after, TokenTable::Parse("# tok-a revoked\ntok-b\n", "tokens"));
  EXPECT_EQ(*before.Authenticate("Bearer tok-b"), *after.Authenticate("Bearer tok-b"));
  EXPECT_NE(*before.Authenticate("Bearer tok-a"), *before.Authenticate("Bearer tok-b"));
  // A byte order mark before the first line is not part of its name.
  ASSERT_OK_AND_ASSIGN(TokenTable marked, TokenTable::Parse("\xEF\xBB\xBF"
                                                            "alice:one\nalice:two\n",
                                                            "tokens"));
  EXPECT_EQ(*marked.Authenticate("Bearer one"), "alice");
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
  // One token under two names (the first would always win), and a name that is a bare token's.
  EXPECT_THAT(TokenTable::Parse("carol:same\ndave:same\n", "f"),
              StatusIs(absl::StatusCode::kInvalidArgument, "f:2: the token of line 1 under another name"));
  EXPECT_THAT(
      TokenTable::Parse("tok-c\ntoken-1236183d37679658:other\n", "f"),
      StatusIs(absl::StatusCode::kInvalidArgument, "f:2: the name 'token-1236183d37679658' is that of the bare"));
  EXPECT_OK(TokenTable::Parse("same\nsame\nci:x\nci:x\n", "f").status()) << "a line repeated is harmless";
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
