// MUOND_SKIP_WITHOUT_GPU() << "why": where a GPU test finds no usable GPU it is skipped, saying why —
// unless MUOND_REQUIRE_GPU=1 (set by scripts/gpu-check.sh on the GPU machine), where the same
// condition fails the test, so a broken GPU path can never pass there as "skipped". Use it only for
// "there is no GPU"; a test that needs more than the machine has (two devices) skips plainly.
// Header-only; reads the environment.
#pragma once

#include <cstdlib>
#include <cstring>

#include "gtest/gtest.h"

namespace muond::testing {

inline bool GpuRequired() {
  const char* required = std::getenv("MUOND_REQUIRE_GPU");
  return required != nullptr && std::strcmp(required, "1") == 0;
}

}  // namespace muond::testing

#define MUOND_SKIP_WITHOUT_GPU()                                                                   \
  return GTEST_MESSAGE_(                                                                           \
      ::muond::testing::GpuRequired() ? "MUOND_REQUIRE_GPU=1 and the GPU path failed" : "Skipped", \
      ::muond::testing::GpuRequired() ? ::testing::TestPartResult::kFatalFailure : ::testing::TestPartResult::kSkip)
