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
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/optim/options.h"

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
  const lapack_int info = LAPACKE_dgesvd(LAPACK_ROW_MAJOR, 'S', 'S', a.rows, a.cols, work.data(),
                                         a.cols, out.s.data(), out.u.v.data(), k, out.vt.v.data(),
                                         a.cols, superb.data());
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
inline Mat MatWithSingularValues(std::mt19937& rng, int64_t rows, int64_t cols,
                                 const std::vector<double>& sigma) {
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

// The scalar map σ ↦ p_T(…p_1(σ)) of `steps` iterations: NS acts on each singular value alone.
inline double ScalarNs(double sigma, const optim::NsSchedule& schedule, int steps) {
  for (int t = 0; t < steps; ++t) {
    const optim::NsCoefficient co = schedule.At(t);
    sigma = co.a * sigma + co.b * sigma * sigma * sigma + co.c * std::pow(sigma, 5);
  }
  return sigma;
}

// Backend round trips.
inline std::unique_ptr<kernels::DeviceBuffer> Upload(kernels::Backend& backend,
                                                     const std::vector<float>& host) {
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

}  // namespace muond::testing
