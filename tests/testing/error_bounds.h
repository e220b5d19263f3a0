// Checks of numeric results against a rounding bound, for tests that compare numbers computed in
// different summation orders (GEMM, reductions, Newton–Schulz, fp64 references).
//
// WithinBound(label, error, bound) is `error ≤ bound` as a gtest assertion with both numbers in the
// message. With MUOND_REPORT_ERRORS set in the environment it also prints one line
// "error-bound <label> <error> <bound>", so that the worst case of each check under each BLAS
// kernel (OPENBLAS_CORETYPE=Haswell, SkylakeX, Zen, …) can be read off a run and compared with its
// bound. Header-only.
#pragma once

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "gtest/gtest.h"

namespace muond::testing {

inline ::testing::AssertionResult WithinBound(std::string_view label, double error, double bound) {
  static const bool report = std::getenv("MUOND_REPORT_ERRORS") != nullptr;
  if (report) {
    std::printf("error-bound %.*s %.6g %.6g\n", static_cast<int>(label.size()), label.data(), error, bound);
  }
  if (error <= bound) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << label << ": error " << error << " exceeds the bound " << bound
                                       << (std::isnan(error) ? " (NaN)" : "");
}

}  // namespace muond::testing
