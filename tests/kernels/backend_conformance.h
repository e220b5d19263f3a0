// The backend conformance suite's fixture: every viable backend (the parameter: "cpu", "cuda") runs
// the same checks against the CPU backend, the reference implementation.
//
// A backend that cannot be created here is skipped with the reason — never silently passed: the
// CUDA instance on a machine without a GPU (or in a build without the CUDA backend) shows as
// SKIPPED "no usable CUDA device: <reason>". The CPU instance compares the CPU backend with a
// second CPU backend, which keeps the checks themselves exercised on every machine.
//
// Header-only; a fixture instance is used by one test thread.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/testing/gpu_skip.h"

namespace muond::kernels {

class BackendConformanceTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    absl::StatusOr<BackendSelection> selection = CreateBackend(GetParam(), /*device=*/0, /*threads=*/1);
    if (!selection.ok()) {
      if (GetParam() == "cuda") {
        MUOND_SKIP_WITHOUT_GPU() << "no usable CUDA device: " << selection.status().message();
      }
      FAIL() << selection.status();
    }
    backend_ = std::move(selection->backend);
    ASSERT_EQ(backend_->Name(), GetParam());
    cpu_ = NewCpuBackend(1);
  }

  std::vector<float> Random(size_t n, float stddev = 1.0f) {
    std::normal_distribution<float> dist(0.0f, stddev);
    std::vector<float> v(n);
    for (float& x : v) x = dist(rng_);
    return v;
  }

  std::unique_ptr<Backend> backend_;  // under test
  std::unique_ptr<Backend> cpu_;      // the reference
  std::mt19937 rng_{20240611};
};

inline uint32_t Bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

// Element-wise results must be bit-identical: both backends evaluate the same formulas of
// kernels/elementwise.h with IEEE-rounded fp32 +, −, ×, ÷ and sqrt in the same order, the CUDA
// library is compiled with -fmad=false (no fused multiply-add contraction) and without fast-math
// (so ÷ and sqrtf stay correctly rounded and subnormals are kept), and the host compiler contracts
// nothing either (ISO C++ mode, x86-64 SSE). So not even 1 ulp of slack is needed, and any
// difference points at a changed formula or compiler flag.
inline ::testing::AssertionResult BitwiseEqual(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << "sizes differ: " << got.size() << " vs " << want.size();
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (Bits(got[i]) != Bits(want[i])) {
      const int64_t ulps = static_cast<int64_t>(Bits(got[i])) - static_cast<int64_t>(Bits(want[i]));
      return ::testing::AssertionFailure()
             << "first difference at " << i << ": " << got[i] << " vs " << want[i] << " (" << ulps << " ulp)";
    }
  }
  return ::testing::AssertionSuccess();
}

// ‖got − want‖_F / ‖want‖_F in fp64.
inline double RelativeFrobenius(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    diff += d * d;
    norm += static_cast<double>(want[i]) * want[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

// A matmul precision's name, for test parameter names and messages.
inline const char* PrecisionName(MatmulPrecision p) {
  return p == MatmulPrecision::kFp32 ? "fp32" : p == MatmulPrecision::kTf32 ? "tf32" : "bf16";
}

}  // namespace muond::kernels
