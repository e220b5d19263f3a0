// Newton–Schulz in fp64 through cblas_dgemm, docs/algorithms.md, Muon step 2 (transpose to wide,
// normalize, iterate with the default set, transpose back), the relative error of a result against
// it, and inputs with a gradient's decaying spectrum: what the bf16 accuracy tests of every backend
// compare with (a 1024×2752 reference takes a second rather than minutes). Header-only; needs
// cblas.h and a BLAS.
#pragma once

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/optim/options.h"
#include "tests/kernels/reference.h"

namespace muond::testing {

inline std::vector<double> Fp64ReferenceNs(const std::vector<float>& g, int64_t rows, int64_t cols, int steps) {
  const bool tall = rows > cols;
  const int64_t m = std::min(rows, cols), n = std::max(rows, cols);
  std::vector<double> x(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) x[tall ? j * rows + i : i * cols + j] = g[i * cols + j];
  }
  double norm = 0;
  for (double v : x) norm += v * v;
  const double denom = std::sqrt(norm) + 1e-7;
  for (double& v : x) v /= denom;
  const optim::NsSchedule schedule;
  std::vector<double> a(static_cast<size_t>(m * m)), b(a.size()), next(x.size());
  for (int t = 0; t < steps; ++t) {
    const optim::NsCoefficient co = schedule.At(t);
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, m, n, 1.0, x.data(), n, x.data(), n, 0.0, a.data(), m);
    b = a;
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, m, m, co.c, a.data(), m, a.data(), m, co.b, b.data(), m);
    next = x;
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, m, 1.0, b.data(), m, x.data(), n, co.a, next.data(),
                n);
    x.swap(next);
  }
  if (!tall) return x;
  std::vector<double> out(x.size());
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) out[i * cols + j] = x[j * rows + i];
  }
  return out;
}

// A rows×cols matrix whose singular values decay from 1 to 1e-2 evenly in log scale (like a
// gradient's), with random singular vectors.
inline std::vector<float> DecayingSpectrum(std::mt19937& rng, int64_t rows, int64_t cols) {
  const int64_t k = std::min(rows, cols);
  std::vector<double> sigma(k);
  for (int64_t i = 0; i < k; ++i) sigma[i] = std::pow(10.0, -2.0 * static_cast<double>(i) / static_cast<double>(k - 1));
  std::mt19937 svd_rng(rng());
  std::vector<float> g;
  for (double v : MatWithSingularValues(svd_rng, rows, cols, sigma).v) g.push_back(static_cast<float>(v));
  return g;
}

// ‖got − want‖_F / ‖want‖_F and max |got − want|, in fp64.
struct NsErrors {
  double relative = 0, max_abs = 0;
};
inline NsErrors CompareNs(const std::vector<float>& got, const std::vector<double>& want) {
  double diff = 0, norm = 0;
  NsErrors e;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = got[i] - want[i];
    diff += d * d;
    norm += want[i] * want[i];
    e.max_abs = std::max(e.max_abs, std::abs(d));
  }
  e.relative = std::sqrt(diff / norm);
  return e;
}

}  // namespace muond::testing
