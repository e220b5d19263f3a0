// Test helpers for the kernels tests: fp64 host matrices, an SVD (LAPACKE_dgesvd), a fp64
// Newton–Schulz written from docs/algorithms.md independently of kernels/optim/newton_schulz.cc,
// random inputs, and round trips through a Backend. Header-only; not thread-safe (callers own their
// RNGs).
#pragma once

#include <lapacke.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/optim/optimizer.h"
#include "kernels/optim/options.h"
#include "tests/testing/status_matchers.h"

namespace muond::testing {

// Row-major fp64 matrix.
struct Mat {
  int64_t rows = 0, cols = 0;
  std::vector<double> v;
  Mat() = default;
  Mat(int64_t r, int64_t c) : rows(r), cols(c), v(static_cast<size_t>(r * c), 0.0) {}
  double& operator()(int64_t r, int64_t c) { return v[r * cols + c]; }
  double operator()(int64_t r, int64_t c) const { return v[r * cols + c]; }
};

inline Mat MatMul(const Mat& a, const Mat& b) {
  Mat c(a.rows, b.cols);
  for (int64_t i = 0; i < a.rows; ++i)
    for (int64_t k = 0; k < a.cols; ++k) {
      const double aik = a(i, k);
      for (int64_t j = 0; j < b.cols; ++j) c(i, j) += aik * b(k, j);
    }
  return c;
}

inline Mat Transposed(const Mat& a) {
  Mat t(a.cols, a.rows);
  for (int64_t i = 0; i < a.rows; ++i)
    for (int64_t j = 0; j < a.cols; ++j) t(j, i) = a(i, j);
  return t;
}

inline double FrobeniusNorm(const Mat& a) {
  double s = 0;
  for (double x : a.v) s += x * x;
  return std::sqrt(s);
}

inline double MaxAbsDiff(const Mat& a, const Mat& b) {
  double d = 0;
  for (size_t i = 0; i < a.v.size(); ++i) d = std::max(d, std::abs(a.v[i] - b.v[i]));
  return d;
}

// Thin SVD a = U·diag(s)·Vt with U rows×k, Vt k×cols, k = min(rows, cols).
struct Svd {
  Mat u, vt;
  std::vector<double> s;
};

inline Svd ComputeSvd(const Mat& a) {
  const int64_t k = std::min(a.rows, a.cols);
  Svd out{Mat(a.rows, k), Mat(k, a.cols), std::vector<double>(k)};
  std::vector<double> work = a.v, superb(std::max<int64_t>(k, 1));
  const lapack_int info = LAPACKE_dgesvd(LAPACK_ROW_MAJOR, 'S', 'S', a.rows, a.cols, work.data(), a.cols, out.s.data(),
                                         out.u.v.data(), k, out.vt.v.data(), a.cols, superb.data());
  EXPECT_EQ(info, 0) << "LAPACKE_dgesvd failed";
  return out;
}

// U·diag(f(s))·Vt.
template <typename F>
Mat Reassemble(const Svd& svd, F f) {
  Mat us = svd.u;
  for (int64_t i = 0; i < us.rows; ++i)
    for (int64_t j = 0; j < us.cols; ++j) us(i, j) *= f(svd.s[j]);
  return MatMul(us, svd.vt);
}

inline Mat RandomMat(std::mt19937& rng, int64_t rows, int64_t cols, double stddev = 1.0) {
  std::normal_distribution<double> dist(0.0, stddev);
  Mat m(rows, cols);
  for (double& x : m.v) x = dist(rng);
  return m;
}

// A rows×cols matrix with the given singular values (k = min(rows, cols) of them) and random
// singular vectors, rounded to fp32 so the device sees exactly this matrix.
inline Mat MatWithSingularValues(std::mt19937& rng, int64_t rows, int64_t cols, const std::vector<double>& sigma) {
  Svd basis = ComputeSvd(RandomMat(rng, rows, cols));
  basis.s = sigma;
  Mat m = Reassemble(basis, [](double s) { return s; });
  for (double& x : m.v) x = static_cast<float>(x);
  return m;
}

// docs/algorithms.md, Muon step 2, in fp64: transpose to wide, normalize, iterate, transpose back.
inline Mat ReferenceNs(const Mat& g, const optim::NsSchedule& schedule, int steps, double eps = 1e-7,
                       double safety = 1.0) {
  const bool tall = g.rows > g.cols;
  Mat x = tall ? Transposed(g) : g;
  const double denom = safety * FrobeniusNorm(x) + eps;
  for (double& e : x.v) e = denom > 0 ? e / denom : 0.0;
  for (int t = 0; t < steps; ++t) {
    const optim::NsCoefficient co = schedule.At(t);
    const Mat a = MatMul(x, Transposed(x));
    Mat b = MatMul(a, a);
    for (size_t i = 0; i < b.v.size(); ++i) b.v[i] = co.b * a.v[i] + co.c * b.v[i];
    const Mat bx = MatMul(b, x);
    for (size_t i = 0; i < x.v.size(); ++i) x.v[i] = co.a * x.v[i] + bx.v[i];
  }
  return tall ? Transposed(x) : x;
}

// Turbo-Muon's AOL Newton–Schulz in fp64 (thib-s/flash-newton-schulz, gradient-exploration/ns_variants/
// flash_ns.py at 1aa1f31, newton_schulz_triton_aol): wide X; A = X·Xᵀ; s_i = 1/√max(Σ_j |A_ij|, eps);
// X ← diag(s)·X; the first iteration with diag(s)·A·diag(s); then the usual iterations.
inline Mat ReferenceAolNs(const Mat& g, const optim::NsSchedule& schedule, int steps, double eps = 1e-7) {
  const bool tall = g.rows > g.cols;
  Mat x = tall ? Transposed(g) : g;
  Mat a = MatMul(x, Transposed(x));
  std::vector<double> s(x.rows);
  for (int64_t i = 0; i < x.rows; ++i) {
    double sum = 0;
    for (int64_t j = 0; j < x.rows; ++j) sum += std::abs(a.v[i * x.rows + j]);
    s[i] = 1 / std::sqrt(std::max(sum, eps));
  }
  for (int64_t i = 0; i < x.rows; ++i) {
    for (int64_t j = 0; j < x.cols; ++j) x.v[i * x.cols + j] *= s[i];
    for (int64_t j = 0; j < x.rows; ++j) a.v[i * x.rows + j] *= s[i] * s[j];
  }
  for (int t = 0; t < steps; ++t) {
    const optim::NsCoefficient co = schedule.At(t);
    if (t > 0) a = MatMul(x, Transposed(x));
    Mat b = MatMul(a, a);
    for (size_t i = 0; i < b.v.size(); ++i) b.v[i] = co.b * a.v[i] + co.c * b.v[i];
    const Mat bx = MatMul(b, x);
    for (size_t i = 0; i < x.v.size(); ++i) x.v[i] = co.a * x.v[i] + bx.v[i];
  }
  return tall ? Transposed(x) : x;
}

// The scalar map σ ↦ p_T(…p_1(σ)) of `steps` iterations: NS acts on each singular value alone.
inline double ScalarNs(double sigma, const optim::NsSchedule& schedule, int steps) {
  for (int t = 0; t < steps; ++t) {
    const optim::NsCoefficient co = schedule.At(t);
    sigma = co.a * sigma + co.b * sigma * sigma * sigma + co.c * std::pow(sigma, 5);
  }
  return sigma;
}

// ---- Rounding bounds ----
//
// u = 2⁻²⁴, the unit roundoff of fp32. A length-k dot product summed in fp32 in any order (any
// BLAS kernel's blocking, FMA or not) errs by at most γ_k = k·u/(1 − k·u) times Σ|x_i·y_i|
// (Higham, Accuracy and Stability of Numerical Algorithms, §3.1). The error is a sum of k
// independent-signed roundings, so it is far below that in practice: about √k·u·Σ|x_i y_i|
// (Higham & Mary 2019, "A new approach to probabilistic rounding error analysis").
inline constexpr double kFp32Unit = 0x1p-24;
inline double Gamma(int64_t k) {
  const double ku = static_cast<double>(k) * kFp32Unit;
  return ku / (1.0 - ku);
}

// A bound on the fp32 rounding error of `steps` Newton–Schulz iterations of `g` (what
// optim::NewtonSchulz computes), ‖computed − exact‖_F, hence also on every entry's error.
//
// Derivation. X₀ = G/‖G‖_F has ‖X₀‖_F = 1; every step maps each singular value σ ↦ p_t(σ). An
// error E made before step t reaches the output multiplied by the first-order gain of the
// remaining steps, the product over them of the Daleckii–Krein divided differences of p between
// two singular values, (p(σ_i) − p(σ_j))/(σ_i − σ_j) (p′(σ_i) when i = j), (p(σ_i) + p(σ_j))/(σ_i + σ_j),
// and p(σ_i)/σ_i for the directions outside the row space — taken here as the largest of them along
// each singular value's trajectory (computed in fp64 from g's SVD). For the simple set that is
// p′(0) = 3.4445 per step while σ is small and ≤ 2 once σ is in [0.68, 1.14]. Each step's own
// rounding comes from its GEMMs (3; 5 for the Gram variant's R updates): an entry of an inner
// product of length ≤ n (the longer side) errs by ≈ √n·u·Σ|terms| (the probabilistic bound above;
// the worst case k·u is √n× larger and never met by a real kernel), and the Σ|terms| of the step
// X ↦ aX + (bA + cA²)X is ≤ (|a| + |b|·s² + |c|·s⁴)·‖X‖_F with s = ‖X‖₂. The bound sums those,
// each times its gain, with a factor 4 of headroom for the ≈ 3 standard deviations a few entries
// of a large product reach. It ignores second-order terms, which are ≤ 1e-3 of the first-order
// ones at these sizes.
//
// The bound is rigorous to first order but loose: the per-step gains are maxima over all pairs of
// singular values, and their product over many steps (or the steep Polar Express tuples) grows to
// 1e-2 … 5, where it could no longer catch a bug. NsBound caps it, see there.
inline double NsRoundingBound(const Mat& g, const optim::NsSchedule& schedule, int steps, int gemms_per_step = 3,
                              double eps = 1e-7, double safety = 1.0) {
  const int64_t n = std::max(g.rows, g.cols);
  std::vector<double> sigma = ComputeSvd(g).s;
  const double denom = safety * FrobeniusNorm(g) + eps;
  if (!(denom > 0)) return 0.0;
  for (double& s : sigma) s /= denom;
  // trajectory[t]: the singular values entering step t.
  std::vector<std::vector<double>> trajectory(steps + 1, sigma);
  for (int t = 0; t < steps; ++t) {
    const optim::NsCoefficient co = schedule.At(t);
    for (double& s : trajectory[t + 1]) s = co.a * s + co.b * s * s * s + co.c * std::pow(s, 5);
  }
  auto p = [&](int t, double s) {
    const optim::NsCoefficient co = schedule.At(t);
    return co.a * s + co.b * s * s * s + co.c * std::pow(s, 5);
  };
  auto dp = [&](int t, double s) {
    const optim::NsCoefficient co = schedule.At(t);
    return co.a + 3 * co.b * s * s + 5 * co.c * std::pow(s, 4);
  };
  std::vector<double> step_gain(steps, 0.0);
  for (int t = 0; t < steps; ++t) {
    const std::vector<double>& x = trajectory[t];
    double worst = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      worst = std::max(worst, std::abs(dp(t, x[i])));
      if (x[i] > 0) worst = std::max(worst, std::abs(p(t, x[i]) / x[i]));
      for (size_t j = 0; j < i; ++j) {
        const double d = x[i] - x[j], s = x[i] + x[j];
        if (std::abs(d) > 1e-12) worst = std::max(worst, std::abs((p(t, x[i]) - p(t, x[j])) / d));
        if (s > 0) worst = std::max(worst, std::abs((p(t, x[i]) + p(t, x[j])) / s));
      }
    }
    step_gain[t] = worst;
  }
  // Normalization: ‖G‖_F and the division round each entry by ≤ 2u, ‖·‖_F ≤ 2u overall.
  double error = 2 * kFp32Unit;
  for (int t = 0; t < steps; ++t) {
    const optim::NsCoefficient co = schedule.At(t);
    double s = 0, f = 0;
    for (double x : trajectory[t]) {
      s = std::max(s, std::abs(x));
      f += x * x;
    }
    const double terms = (std::abs(co.a) + std::abs(co.b) * s * s + std::abs(co.c) * std::pow(s, 4)) * std::sqrt(f);
    error = step_gain[t] * error + gemms_per_step * std::sqrt(static_cast<double>(n)) * kFp32Unit * terms;
  }
  return 4 * error;
}

// The smallest change a wrong coefficient, step count, cycle mode, transpose, Q product, R update or
// normalization makes in these tests' Newton–Schulz results (≥ 1e-2 per entry).
inline constexpr double kNsBugSignal = 1e-2;

// The tolerance the Newton–Schulz tests assert: the derived NsRoundingBound, capped at a tenth of
// kNsBugSignal so that a bug still fails with 10× margin. Where the cap applies, the rounding actually
// seen is far under it: ≤ 2e-4 (the steep Gram Polar Express set) and ≤ 1e-5 for the others under
// every OpenBLAS kernel (Haswell, SkylakeX, Cooperlake, Zen, Sandybridge, Prescott), since a
// real kernel's rounding is the √n·u random walk, not the worst case the cap stands in for.
inline double NsBound(const Mat& g, const optim::NsSchedule& schedule, int steps, int gemms_per_step = 3,
                      double eps = 1e-7, double safety = 1.0) {
  return std::min(NsRoundingBound(g, schedule, steps, gemms_per_step, eps, safety), kNsBugSignal / 10);
}

// Backend round trips.
inline std::unique_ptr<kernels::DeviceBuffer> Upload(kernels::Backend& backend, const std::vector<float>& host) {
  auto buffer = backend.Allocate(host.size());
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_TRUE(backend.CopyToDevice(host.data(), (*buffer)->data(), host.size()).ok());
  return std::move(*buffer);
}

inline std::vector<float> Download(kernels::Backend& backend, const float* device, size_t count) {
  std::vector<float> host(count);
  EXPECT_TRUE(backend.CopyToHost(device, host.data(), count).ok());
  return host;
}

inline std::vector<float> ToFloat(const std::vector<double>& v) { return {v.begin(), v.end()}; }
inline std::vector<double> ToDouble(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// Makes `s` a parameter of `shape` holding `weights` on `backend`, with its gradient buffer and
// `opt`'s slots (the setup of an optimizer test against a host reference). Call it inside
// ASSERT_NO_FATAL_FAILURE.
inline void SetUpParameter(kernels::Backend& backend, const optim::Optimizer& opt, std::vector<int64_t> shape,
                           const std::vector<float>& weights, optim::ParamState& s) {
  s.shape = std::move(shape);
  s.numel = 1;
  for (int64_t d : s.shape) s.numel *= d;
  ASSERT_EQ(static_cast<size_t>(s.numel), weights.size());
  s.master = Upload(backend, weights);
  ASSERT_OK_AND_ASSIGN(s.grad, backend.Allocate(s.numel));
  ASSERT_OK(opt.InitState(backend, s));
}

}  // namespace muond::testing
