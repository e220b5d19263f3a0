#include "kernels/cpu/cpu_backend.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"

namespace muond::kernels {
namespace {

// Host memory aligned for SIMD loads; zero-filled so a fresh buffer never leaks stale bytes.
class CpuBuffer final : public DeviceBuffer {
 public:
  CpuBuffer(float* data, size_t size) : data_(data), size_(size) {}
  ~CpuBuffer() override { std::free(data_); }
  CpuBuffer(const CpuBuffer&) = delete;
  CpuBuffer& operator=(const CpuBuffer&) = delete;

  float* data() override { return data_; }
  const float* data() const override { return data_; }
  size_t size() const override { return size_; }

 private:
  float* data_;
  size_t size_;
};

CBLAS_TRANSPOSE ToCblas(Transpose t) { return t == Transpose::kYes ? CblasTrans : CblasNoTrans; }

absl::Status CheckGemmShape(const GemmShape& s) {
  if (s.m < 0 || s.n < 0 || s.k < 0 || s.batch < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Gemm: negative size m=", s.m, " n=", s.n, " k=", s.k, " batch=", s.batch));
  }
  // cblas takes int dimensions; larger matrices would silently wrap.
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  if (s.m > kMax || s.n > kMax || s.k > kMax || s.lda > kMax || s.ldb > kMax || s.ldc > kMax) {
    return absl::InvalidArgumentError("Gemm: a dimension exceeds the BLAS int range");
  }
  return absl::OkStatus();
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int threads) {
    if (threads > 0) openblas_set_num_threads(threads);
    threads_ = openblas_get_num_threads();
  }

  std::string Name() const override { return "cpu"; }
  std::string Detail() const override {
    return absl::StrCat("OpenBLAS ", openblas_get_config(), ", ", threads_, " threads");
  }

  absl::StatusOr<std::unique_ptr<DeviceBuffer>> Allocate(size_t count) override {
    if (count > std::numeric_limits<size_t>::max() / sizeof(float)) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", count, " floats"));
    }
    const size_t bytes = std::max<size_t>(count * sizeof(float), 64);
    void* p = nullptr;
    if (posix_memalign(&p, 64, bytes) != 0 || p == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("out of host memory allocating ", bytes, " bytes"));
    }
    std::memset(p, 0, bytes);
    return std::unique_ptr<DeviceBuffer>(new CpuBuffer(static_cast<float*>(p), count));
  }

  absl::Status CopyToDevice(const float* host, float* device, size_t count) override {
    return CopyOnDevice(host, device, count);
  }
  absl::Status CopyToHost(const float* device, float* host, size_t count) override {
    return CopyOnDevice(device, host, count);
  }
  absl::Status CopyOnDevice(const float* src, float* dst, size_t count) override {
    // memmove: callers may copy between overlapping views of one buffer.
    if (count > 0 && src != dst) std::memmove(dst, src, count * sizeof(float));
    return absl::OkStatus();
  }
  absl::Status Fill(float* x, size_t count, float value) override {
    std::fill(x, x + count, value);
    return absl::OkStatus();
  }

  absl::Status Gemm(const GemmShape& s, float alpha, const float* a, const float* b, float beta,
                    float* c, MatmulPrecision /*precision: the CPU always computes in fp32*/) override {
    if (absl::Status st = CheckGemmShape(s); !st.ok()) return st;
    if (s.m == 0 || s.n == 0) return absl::OkStatus();
    for (int64_t i = 0; i < s.batch; ++i) {
      float* ci = c + i * s.stride_c;
      if (s.k == 0) {
        // BLAS may skip the beta scaling when k == 0 and the product is empty; make it explicit.
        for (int64_t r = 0; r < s.m; ++r) {
          for (int64_t col = 0; col < s.n; ++col) {
            float& v = ci[r * s.ldc + col];
            v = beta == 0.0f ? 0.0f : beta * v;
          }
        }
        continue;
      }
      cblas_sgemm(CblasRowMajor, ToCblas(s.trans_a), ToCblas(s.trans_b), static_cast<int>(s.m),
                  static_cast<int>(s.n), static_cast<int>(s.k), alpha, a + i * s.stride_a,
                  static_cast<int>(s.lda), b + i * s.stride_b, static_cast<int>(s.ldb), beta, ci,
                  static_cast<int>(s.ldc));
    }
    return absl::OkStatus();
  }

  absl::Status Transpose2D(const float* in, float* out, int64_t rows, int64_t cols,
                           int64_t batch) override {
    if (rows < 0 || cols < 0 || batch < 0) {
      return absl::InvalidArgumentError("Transpose2D: negative size");
    }
    // Tiles keep both the reads and the writes within a few cache lines.
    constexpr int64_t kTile = 32;
    for (int64_t bi = 0; bi < batch; ++bi) {
      const float* src = in + bi * rows * cols;
      float* dst = out + bi * rows * cols;
      for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
        for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
          const int64_t r1 = std::min(rows, r0 + kTile), c1 = std::min(cols, c0 + kTile);
          for (int64_t r = r0; r < r1; ++r) {
            for (int64_t col = c0; col < c1; ++col) dst[col * rows + r] = src[r * cols + col];
          }
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status SumSquares(const float* x, size_t count, size_t batch, double* sums) override {
    for (size_t b = 0; b < batch; ++b) {
      const float* p = x + b * count;
      double acc = 0.0;
      for (size_t i = 0; i < count; ++i) acc += static_cast<double>(p[i]) * p[i];
      sums[b] = acc;
    }
    return absl::OkStatus();
  }

  absl::StatusOr<bool> AllFinite(const float* x, size_t count) override {
    for (size_t i = 0; i < count; ++i) {
      if (!std::isfinite(x[i])) return false;
    }
    return true;
  }

  absl::Status ScaleBatched(float* x, size_t count, size_t batch, const float* scales) override {
    for (size_t b = 0; b < batch; ++b) {
      float* p = x + b * count;
      const float s = scales[b];
      for (size_t i = 0; i < count; ++i) p[i] *= s;
    }
    return absl::OkStatus();
  }

  absl::Status Axpby(float alpha, const float* x, float beta, float* y, size_t count) override {
    for (size_t i = 0; i < count; ++i) y[i] = alpha * x[i] + beta * y[i];
    return absl::OkStatus();
  }

  absl::Status Momentum(const MomentumArgs& args, float* momentum, const float* grad, float* update,
                        size_t count) override {
    // `update` may alias `grad`: the element's gradient is read before its update is written.
    for (size_t i = 0; i < count; ++i) MomentumElement(args, momentum[i], grad[i], update[i]);
    return absl::OkStatus();
  }
  absl::Status AdamW(const AdamWArgs& args, float* param, const float* grad, float* exp_avg,
                     float* exp_avg_sq, size_t count) override {
    for (size_t i = 0; i < count; ++i) AdamWElement(args, param[i], grad[i], exp_avg[i], exp_avg_sq[i]);
    return absl::OkStatus();
  }
  absl::Status Lion(const LionArgs& args, float* param, const float* grad, float* exp_avg,
                    size_t count) override {
    for (size_t i = 0; i < count; ++i) LionElement(args, param[i], grad[i], exp_avg[i]);
    return absl::OkStatus();
  }
  absl::Status Sgd(const SgdArgs& args, float* param, const float* grad, float* momentum_buffer,
                   size_t count) override {
    for (size_t i = 0; i < count; ++i) SgdElement(args, param[i], grad[i], momentum_buffer[i]);
    return absl::OkStatus();
  }

 private:
  int threads_ = 0;
};

}  // namespace

std::unique_ptr<Backend> NewCpuBackend(int threads) { return std::make_unique<CpuBackend>(threads); }

}  // namespace muond::kernels
