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

// The status is copied out of `expr` at once: `expr` may be a temporary StatusOr.
#define EXPECT_OK(expr)                                                 \
  do {                                                                  \
    const absl::Status muond_status_ = ::muond::testing::ToStatus(expr); \
    EXPECT_TRUE(muond_status_.ok()) << muond_status_;                   \
  } while (0)
#define ASSERT_OK(expr)                                                 \
  do {                                                                  \
    const absl::Status muond_status_ = ::muond::testing::ToStatus(expr); \
    ASSERT_TRUE(muond_status_.ok()) << muond_status_;                   \
  } while (0)

#define ASSERT_OK_AND_ASSIGN(lhs, rexpr) \
  ASSERT_OK_AND_ASSIGN_IMPL(MUOND_TESTING_CONCAT(muond_statusor_, __LINE__), lhs, rexpr)
#define ASSERT_OK_AND_ASSIGN_IMPL(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                              \
  ASSERT_TRUE(statusor.ok()) << statusor.status();      \
  lhs = std::move(statusor).value()
