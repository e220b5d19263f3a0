// GoogleTest helpers for absl::Status and absl::StatusOr: ASSERT_OK / EXPECT_OK, ASSERT_OK_AND_ASSIGN,
// and the StatusIs(code, substring) matcher. Header-only; no state.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace muond::testing {

inline const absl::Status& ToStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& ToStatus(const absl::StatusOr<T>& s) {
  return s.status();
}

inline ::testing::AssertionResult IsOkFormat(const char* expression, const absl::Status& status) {
  if (status.ok()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << expression << " is " << status;
}

MATCHER_P2(StatusIs, code, substring,
           std::string("has status code ") + absl::StatusCodeToString(code) + " and a message containing \"" +
               std::string(substring) + "\"") {
  const absl::Status& status = ::muond::testing::ToStatus(arg);
  *result_listener << "status is " << status;
  return status.code() == code && status.message().find(substring) != std::string::npos;
}

}  // namespace muond::testing

#define MUOND_TESTING_CONCAT_INNER(a, b) a##b
#define MUOND_TESTING_CONCAT(a, b) MUOND_TESTING_CONCAT_INNER(a, b)

// Predicate-format assertions: `expr` (a Status or a possibly temporary StatusOr) lives until the
// assertion result is built, and extra context can be streamed with <<.
#define EXPECT_OK(expr) EXPECT_PRED_FORMAT1(::muond::testing::IsOkFormat, ::muond::testing::ToStatus(expr))
#define ASSERT_OK(expr) ASSERT_PRED_FORMAT1(::muond::testing::IsOkFormat, ::muond::testing::ToStatus(expr))

#define ASSERT_OK_AND_ASSIGN(lhs, rexpr) \
  ASSERT_OK_AND_ASSIGN_IMPL(MUOND_TESTING_CONCAT(muond_statusor_, __LINE__), lhs, rexpr)
#define ASSERT_OK_AND_ASSIGN_IMPL(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                              \
  ASSERT_TRUE(statusor.ok()) << statusor.status();      \
  lhs = std::move(statusor).value()
