#include "kernels/cpu/cpu_backend.h"

#include <cblas.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/compute_pool.h"
#include "common/half_ranges.h"
#include "common/logging.h"
#include "common/simd_clones.h"
#include "kernels/cpu/onednn_bf16_gemm.h"

namespace muond::kernels {
namespace {

// Host memory aligned for SIMD loads; zero-filled so a fresh buffer never leaks stale bytes.
// Owns what a BorrowedBuffer only refers to.
class CpuBuffer final : public BorrowedBuffer {
 public:
  // `allocated` counts the bytes of the backend's live buffers; it outlives every buffer.
  CpuBuffer(float* data, size_t count, size_t bytes, std::atomic<int64_t>* allocated)
      : BorrowedBuffer(data, count), bytes_(bytes), allocated_(allocated) {
    allocated_->fetch_add(static_cast<int64_t>(bytes_), std::memory_order_relaxed);
  }
  ~CpuBuffer() override {
    std::free(data());
    allocated_->fetch_sub(static_cast<int64_t>(bytes_), std::memory_order_relaxed);
  }
  CpuBuffer(const CpuBuffer&) = delete;
  CpuBuffer& operator=(const CpuBuffer&) = delete;

 private:
  const size_t bytes_;
  std::atomic<int64_t>* const allocated_;
};

// An update that measures itself (Backend::MeasuresUpdatesInPass): element(i) updates p[i] for i in
// [begin, end), and Σ p_before² and Σ (p_before − p_after)² are added to sums[0] and sums[1] in the
// same loop. The sums run in fp32 over pieces of kMeasuredPiece elements (vectorized: reassociated
// within a piece, so each partial holds at most a few hundred terms, within 2⁻¹⁶ relative), added up
// in fp64 piece by piece. The difference is fp32's, exact where W changed by less than half its value
// (Sterbenz). Without `sums` (null) the plain loop.
constexpr size_t kMeasuredPiece = 2048;
template <typename Element>
inline __attribute__((always_inline)) void UpdateLoop(float* __restrict p, size_t begin, size_t end, double* sums,
                                                      Element element) {
  if (sums == nullptr) {
    for (size_t i = begin; i < end; ++i) element(i);
    return;
  }
  for (size_t at = begin; at < end; at += kMeasuredPiece) {
    const size_t stop = std::min(end, at + kMeasuredPiece);
    float w = 0.0f, d = 0.0f;
#pragma omp simd reduction(+ : w, d)
    for (size_t i = at; i < stop; ++i) {
      const float before = p[i];
      element(i);
      const float delta = before - p[i];
      w += before * before;
      d += delta * delta;
    }
    sums[0] += w;
    sums[1] += d;
  }
}

// The element-wise loops over one range. Arguments by value and __restrict pointers let the compiler
// keep the coefficients in registers and vectorize without alias checks (the buffers of one call
// never overlap, except Momentum's grad and update and Axpby's x and y, which may, and are read
// before written per element). `sums`: see UpdateLoop.
MUOND_ELEMENTWISE_CLONES void AdamWRange(const AdamWArgs a, float* __restrict p, const float* __restrict g,
                                         float* __restrict m, float* __restrict v, size_t begin, size_t end,
                                         double* sums) {
  UpdateLoop(p, begin, end, sums, [&](size_t i) { AdamWElement(a, p[i], g[i], m[i], v[i]); });
}
MUOND_ELEMENTWISE_CLONES void LionRange(const LionArgs a, float* __restrict p, const float* __restrict g,
                                        float* __restrict m, size_t begin, size_t end, double* sums) {
  UpdateLoop(p, begin, end, sums, [&](size_t i) { LionElement(a, p[i], g[i], m[i]); });
}
// SGD's options are fixed for a call: one loop per combination, each with its branches folded away
// (kMomentum false means momentum is 0, which SgdElement then never reads).
template <bool kMomentum, bool kFirstStep, bool kNesterov>
inline __attribute__((always_inline)) void SgdLoop(SgdArgs a, float* __restrict p, const float* __restrict g,
                                                   float* __restrict b, size_t begin, size_t end, double* sums) {
  if (!kMomentum) a.momentum = 0.0f;
  a.first_step = kFirstStep;
  a.nesterov = kNesterov;
  UpdateLoop(p, begin, end, sums, [&](size_t i) { SgdElement(a, p[i], g[i], b[i]); });
}
MUOND_ELEMENTWISE_CLONES void SgdRange(const SgdArgs a, float* __restrict p, const float* __restrict g,
                                       float* __restrict b, size_t begin, size_t end, double* sums) {
  if (a.momentum == 0.0f) return SgdLoop<false, false, false>(a, p, g, b, begin, end, sums);
  if (a.first_step) {
    return a.nesterov ? SgdLoop<true, true, true>(a, p, g, b, begin, end, sums)
                      : SgdLoop<true, true, false>(a, p, g, b, begin, end, sums);
  }
  return a.nesterov ? SgdLoop<true, false, true>(a, p, g, b, begin, end, sums)
                    : SgdLoop<true, false, false>(a, p, g, b, begin, end, sums);
}
MUOND_ELEMENTWISE_CLONES void MomentumRange(const MomentumArgs a, float* __restrict m, const float* g, float* u,
                                            size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) MomentumElement(a, m[i], g[i], u[i]);
}
MUOND_ELEMENTWISE_CLONES void AdamuonRange(const AdamuonArgs a, float* __restrict v, float* __restrict o, size_t begin,
                                           size_t end) {
  for (size_t i = begin; i < end; ++i) AdamuonElement(a, v[i], o[i]);
}
MUOND_ELEMENTWISE_CLONES void CautiousUpdateRange(const CautiousArgs a, const float* __restrict u, float* __restrict p,
                                                  size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) CautiousUpdateElement(a, u[i], p[i]);
}
// Runs range(views, offset, n) over [begin, end) of `refs`: fp32 state in place, in one call; 16-bit
// state in blocks of kBlock elements widened into stack buffers (L1-resident), with the refs in
// `written` (a bit mask) rounded back after each block. The formulas thus read and write fp32
// whatever the storage, and 16-bit state moves 2 bytes per element to and from memory.
template <size_t N, typename Range>
void Blockwise(const std::array<StoredRef, N>& refs, unsigned written, size_t begin, size_t end, Range&& range) {
  std::array<float*, N> views;
  bool all_fp32 = true;
  for (size_t k = 0; k < N; ++k) all_fp32 = all_fp32 && refs[k].is_fp32();
  if (all_fp32) {
    for (size_t k = 0; k < N; ++k) views[k] = refs[k].fp32() + begin;
    range(views, begin, end - begin);
    return;
  }
  constexpr size_t kBlock = 1024;
  alignas(64) float scratch[N][kBlock];
  for (size_t at = begin; at < end; at += kBlock) {
    const size_t n = std::min(kBlock, end - at);
    for (size_t k = 0; k < N; ++k) {
      const StoredRef& ref = refs[k];
      if (ref.is_fp32()) {
        views[k] = ref.fp32() + at;
        continue;
      }
      views[k] = scratch[k];
      if (ref.dtype == StorageDtype::kBf16) {
        WidenBf16(ref.bits16() + at, scratch[k], n);
      } else {
        WidenFp16(ref.bits16() + at, scratch[k], n);
      }
    }
    range(views, at, n);
    for (size_t k = 0; k < N; ++k) {
      const StoredRef& ref = refs[k];
      if (ref.is_fp32() || !(written & (1u << k))) continue;
      if (ref.dtype == StorageDtype::kBf16) {
        NarrowToBf16(scratch[k], ref.bits16() + at, n);
      } else {
        NarrowToFp16(scratch[k], ref.bits16() + at, n);
      }
    }
  }
}

MUOND_ELEMENTWISE_CLONES void AxpbyRange(const float alpha, const float* x, const float beta, float* y, size_t begin,
                                         size_t end) {
  for (size_t i = begin; i < end; ++i) y[i] = alpha * x[i] + beta * y[i];
}

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

// OpenBLAS maps a work buffer of its BUFFER_SIZE (128 MiB in Debian's build) for each of its threads
// as it starts it, and one for a calling thread at that thread's first product, which later callers
// reuse (Gemm runs one product at a time, behind the pool's gate); it retries a map that fails for
// ever (blas_memory_alloc). Under an address-space limit the sessions had filled, the daemon's first
// product spun there, holding the compute pool. One product as the backend starts maps them (with
// Debian's build: one built with USE_TLS keeps a buffer per calling thread instead). It is split among all of
// OpenBLAS's threads, should a build start them only when a product needs them: OpenBLAS threads a product of m·n·k
// over 2^18 per thread and gives each thread at least its switch ratio of rows (a few dozen at most); here 2^20 and 64
// rows per thread. A few milliseconds.
void MapBlasBuffers(int threads) {
  const int n = 128, m = 64 * std::max(threads, 1);
  const std::vector<float> a(static_cast<size_t>(m) * n, 0.0f), b(static_cast<size_t>(n) * n, 0.0f);
  std::vector<float> c(static_cast<size_t>(m) * n);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
}

}  // namespace

int64_t MappedBytes() {
  long pages = 0;
  if (FILE* statm = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(statm, "%ld", &pages) != 1) pages = 0;
    std::fclose(statm);
  }
  return static_cast<int64_t>(pages) * sysconf(_SC_PAGESIZE);
}

absl::Status CheckBlasBufferRoom(int threads) {
  // Per thread: OpenBLAS's work buffer (BUFFER_SIZE, 128 MiB in Debian's build, and a page: malloc
  // maps 134225920 bytes), the malloc arena a thread's first allocation reserves (64 MiB) and a
  // thread's stack (8 MiB), with room to spare. The buffers of OpenBLAS threads started before this
  // check may not be mapped yet, so every thread's is asked for.
  constexpr size_t kPerThreadBytes = size_t{208} << 20;
  const int counted = std::max(threads > 0 ? threads : openblas_get_num_threads(), 1);
  const size_t bytes = kPerThreadBytes * static_cast<size_t>(counted);
  void* probe = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (probe != MAP_FAILED) {
    munmap(probe, bytes);
    return absl::OkStatus();
  }
  const int error = errno;
  rlimit limit{};
  const bool limited = getrlimit(RLIMIT_AS, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY;
  const int64_t used_mib = MappedBytes() >> 20;
  const int64_t needed_mib = static_cast<int64_t>(bytes >> 20);
  return absl::ResourceExhaustedError(absl::StrCat(
      "the CPU backend cannot map ", needed_mib, " MiB for its ", counted, counted == 1 ? " thread" : " threads",
      " (--threads; each takes OpenBLAS's 128 MiB work buffer, a malloc arena and a stack) (", std::strerror(error),
      "): ",
      limited ? absl::StrCat("the process's address-space limit (RLIMIT_AS: ulimit -v, prlimit --as) is ",
                             static_cast<int64_t>(limit.rlim_cur >> 20), " MiB and ", used_mib,
                             " MiB are mapped already; raise it to at least ", used_mib + needed_mib,
                             " MiB and room for the sessions, or run fewer threads")
              : absl::StrCat(used_mib, " MiB are mapped already"),
      " (OpenBLAS would retry a failed map for ever)"));
}

namespace {

// The floats a strided batch of rows×cols row-major matrices spans, [begin, end), gaps included.
struct FloatRange {
  const float* begin;
  const float* end;
};
FloatRange RangeOf(const float* p, int64_t rows, int64_t cols, int64_t ld, int64_t stride, int64_t batch) {
  if (rows <= 0 || cols <= 0 || batch <= 0) return {p, p};
  return {p, p + (batch - 1) * stride + (rows - 1) * ld + cols};
}
bool Overlap(FloatRange x, FloatRange y) {
  const auto at = [](const float* q) { return reinterpret_cast<uintptr_t>(q); };
  return at(x.begin) < at(y.end) && at(y.begin) < at(x.end);
}

class CpuBackend final : public Backend {
 public:
  CpuBackend(int threads, bool host_addressable) : pool_(InitThreads(threads)), host_addressable_(host_addressable) {
    threads_ = pool_.threads();
    MapBlasBuffers(threads_);
  }
  ~CpuBackend() override { ReleaseShared(); }

  ComputePool& pool() { return pool_; }  // CpuComputePool

  std::string Name() const override { return "cpu"; }
  bool HostAddressable() const override { return host_addressable_; }
  // oneDNN rounds bf16 operands into scratch before the product (and Gemm copies an operand C
  // overlaps should oneDNN decline a shape); the fp32 path reads them where they are.
  bool GemmMayWriteAnOperand(MatmulPrecision precision) const override {
    return precision == MatmulPrecision::kBf16 && Bf16GemmSupport().available;
  }
  bool MeasuresUpdatesInPass() const override { return true; }
  std::string Detail() const override {
    const Bf16Support& bf16 = Bf16GemmSupport();
    return absl::StrCat(
        openblas_get_config(), ", ", threads_, " threads, bf16 GEMMs: ",
        bf16.available ? absl::StrCat(bf16.library, " ", bf16.kernel) : absl::StrCat("fp32 (", bf16.reason, ")"));
  }

  MemoryUse Memory() const override {
    const int64_t bytes =
        allocated_bytes_.load(std::memory_order_relaxed) + bf16_scratch_bytes_.load(std::memory_order_relaxed);
    return {bytes, bytes};  // freed buffers go back to the system allocator at once
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
    return std::unique_ptr<DeviceBuffer>(new CpuBuffer(static_cast<float*>(p), count, bytes, &allocated_bytes_));
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
    pool_.Run(count, [&](size_t begin, size_t end) { std::fill(x + begin, x + end, value); });
    return absl::OkStatus();
  }

  absl::Status Gemm(const GemmShape& s, float alpha, const float* a, const float* b, float beta, float* c,
                    MatmulPrecision precision) override {
    if (absl::Status st = CheckGemmShape(s); !st.ok()) return st;
    if (s.m == 0 || s.n == 0) return absl::OkStatus();
    std::unique_lock<std::mutex> gate = pool_.Exclusive();  // OpenBLAS and oneDNN bring their own threads
    // bf16 through oneDNN where the CPU has bf16 dot products; tf32, and bf16 elsewhere, in fp32.
    if (precision == MatmulPrecision::kBf16 && s.k > 0 && s.batch > 0 && Bf16Gemm() != nullptr &&
        bf16_->Run(s, alpha, a, b, beta, c)) {
      bf16_scratch_bytes_.store(bf16_->scratch_bytes(), std::memory_order_relaxed);
      return absl::OkStatus();
    }
    // A C in place of an operand (GemmMayWriteAnOperand said bf16 may have one, and oneDNN declined
    // this shape): BLAS reads that operand from a copy.
    std::vector<float> a_copy, b_copy;
    if (s.k > 0) {
      const bool ta = s.trans_a == Transpose::kYes, tb = s.trans_b == Transpose::kYes;
      const FloatRange c_range = RangeOf(c, s.m, s.n, s.ldc, s.stride_c, s.batch);
      const FloatRange a_range = RangeOf(a, ta ? s.k : s.m, ta ? s.m : s.k, s.lda, s.stride_a, s.batch);
      const FloatRange b_range = RangeOf(b, tb ? s.n : s.k, tb ? s.k : s.n, s.ldb, s.stride_b, s.batch);
      const bool same = a_range.begin == b_range.begin && a_range.end == b_range.end;
      if (Overlap(c_range, a_range)) {
        a_copy.assign(a_range.begin, a_range.end);
        a = a_copy.data();
        if (same) b = a;
      }
      if (!same && Overlap(c_range, b_range)) {
        b_copy.assign(b_range.begin, b_range.end);
        b = b_copy.data();
      }
    }
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
      cblas_sgemm(CblasRowMajor, ToCblas(s.trans_a), ToCblas(s.trans_b), static_cast<int>(s.m), static_cast<int>(s.n),
                  static_cast<int>(s.k), alpha, a + i * s.stride_a, static_cast<int>(s.lda), b + i * s.stride_b,
                  static_cast<int>(s.ldb), beta, ci, static_cast<int>(s.ldc));
    }
    return absl::OkStatus();
  }

  absl::Status Transpose2D(const float* in, float* out, int64_t rows, int64_t cols, int64_t batch) override {
    if (rows < 0 || cols < 0 || batch < 0) {
      return absl::InvalidArgumentError("Transpose2D: negative size");
    }
    // Tiles keep both the reads and the writes within a few cache lines.
    constexpr int64_t kTile = 32;
    std::unique_lock<std::mutex> gate = pool_.Exclusive();
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

  // Also when the backend stands in for a device (not HostAddressable): its memory is the host's.
  absl::Status AddToDiagonal(float* a, int64_t m, int64_t batch, float value) override {
    if (m < 0 || batch < 0) return absl::InvalidArgumentError("AddToDiagonal: negative size");
    std::unique_lock<std::mutex> gate = pool_.Exclusive();
    for (int64_t b = 0; b < batch; ++b) {
      float* matrix = a + b * m * m;
      for (int64_t j = 0; j < m; ++j) matrix[j * m + j] += value;
    }
    return absl::OkStatus();
  }

  absl::Status SumSquares(const float* x, size_t count, size_t batch, double* sums) override {
    std::unique_lock<std::mutex> gate = pool_.Exclusive();  // one fp64 sum in order: the same bits every time
    for (size_t b = 0; b < batch; ++b) {
      const float* p = x + b * count;
      double acc = 0.0;
      for (size_t i = 0; i < count; ++i) acc += static_cast<double>(p[i]) * p[i];
      sums[b] = acc;
    }
    return absl::OkStatus();
  }

  absl::Status Dot(const float* x, const float* y, size_t count, double* dot) override {
    std::unique_lock<std::mutex> gate = pool_.Exclusive();  // in order, like SumSquares
    double acc = 0.0;
    for (size_t i = 0; i < count; ++i) acc += static_cast<double>(x[i]) * y[i];
    *dot = acc;
    return absl::OkStatus();
  }

  absl::StatusOr<bool> AllFinite(const float* x, size_t count) override {
    for (size_t i = 0; i < count; ++i) {
      if (!std::isfinite(x[i])) return false;
    }
    return true;
  }

  absl::Status ScaleBatched(float* x, size_t count, size_t batch, const float* scales) override {
    pool_.Run(count * batch, [&](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i) x[i] *= scales[i / count];
    });
    return absl::OkStatus();
  }

  absl::Status Widen(StorageDtype dtype, const void* packed, float* out, size_t count) override {
    if (dtype == StorageDtype::kFp32) return CopyOnDevice(static_cast<const float*>(packed), out, count);
    const auto* in = static_cast<const uint16_t*>(packed);
    if (dtype == StorageDtype::kBf16) {
      pool_.Run(count, [&](size_t begin, size_t end) { WidenBf16(in + begin, out + begin, end - begin); });
    } else {
      pool_.Run(count, [&](size_t begin, size_t end) { WidenFp16(in + begin, out + begin, end - begin); });
    }
    return absl::OkStatus();
  }

  absl::Status Narrow(StorageDtype dtype, const float* in, void* packed, size_t count) override {
    if (dtype == StorageDtype::kFp32) return CopyOnDevice(in, static_cast<float*>(packed), count);
    auto* out = static_cast<uint16_t*>(packed);
    if (dtype == StorageDtype::kBf16) {
      pool_.Run(count, [&](size_t begin, size_t end) { NarrowToBf16(in + begin, out + begin, end - begin); });
    } else {
      pool_.Run(count, [&](size_t begin, size_t end) { NarrowToFp16(in + begin, out + begin, end - begin); });
    }
    return absl::OkStatus();
  }

  absl::Status Axpby(float alpha, StoredRef x, float beta, StoredRef y, size_t count) override {
    pool_.Run(count, [&](size_t begin, size_t end) {
      Blockwise<2>({x, y}, 0b10, begin, end, [&](const std::array<float*, 2>& v, size_t, size_t n) {
        AxpbyRange(alpha, v[0], beta, v[1], 0, n);
      });
    });
    return absl::OkStatus();
  }

  absl::Status Momentum(const MomentumArgs& args, StoredRef momentum, const float* grad, float* update,
                        size_t count) override {
    // `update` may alias `grad`: the element's gradient is read before its update is written.
    pool_.Run(count, [&](size_t begin, size_t end) {
      Blockwise<1>({momentum}, 0b1, begin, end, [&](const std::array<float*, 1>& v, size_t at, size_t n) {
        MomentumRange(args, v[0], grad + at, update + at, 0, n);
      });
    });
    return absl::OkStatus();
  }
  absl::Status AdamW(const AdamWArgs& args, StoredRef param, const float* grad, StoredRef exp_avg, StoredRef exp_avg_sq,
                     size_t count) override {
    RunUpdate(count, args.measure, param, [&](size_t begin, size_t end, double* sums) {
      Blockwise<3>({param, exp_avg, exp_avg_sq}, 0b111, begin, end,
                   [&](const std::array<float*, 3>& v, size_t at, size_t n) {
                     AdamWRange(args, v[0], grad + at, v[1], v[2], 0, n, sums);
                   });
    });
    return absl::OkStatus();
  }
  absl::Status Lion(const LionArgs& args, StoredRef param, const float* grad, StoredRef exp_avg,
                    size_t count) override {
    RunUpdate(count, args.measure, param, [&](size_t begin, size_t end, double* sums) {
      Blockwise<2>({param, exp_avg}, 0b11, begin, end, [&](const std::array<float*, 2>& v, size_t at, size_t n) {
        LionRange(args, v[0], grad + at, v[1], 0, n, sums);
      });
    });
    return absl::OkStatus();
  }
  absl::Status Sgd(const SgdArgs& args, StoredRef param, const float* grad, StoredRef momentum_buffer,
                   size_t count) override {
    RunUpdate(count, args.measure, param, [&](size_t begin, size_t end, double* sums) {
      Blockwise<2>({param, momentum_buffer}, 0b11, begin, end,
                   [&](const std::array<float*, 2>& v, size_t at, size_t n) {
                     SgdRange(args, v[0], grad + at, v[1], 0, n, sums);
                   });
    });
    return absl::OkStatus();
  }
  absl::Status Adamuon(const AdamuonArgs& args, StoredRef moment2, float* update, size_t count) override {
    pool_.Run(count, [&](size_t begin, size_t end) {
      Blockwise<1>({moment2}, 0b1, begin, end, [&](const std::array<float*, 1>& v, size_t at, size_t n) {
        AdamuonRange(args, v[0], update + at, 0, n);
      });
    });
    return absl::OkStatus();
  }
  absl::Status CautiousUpdate(const CautiousArgs& args, const float* update, StoredRef param, size_t count) override {
    pool_.Run(count, [&](size_t begin, size_t end) {
      Blockwise<1>({param}, 0b1, begin, end, [&](const std::array<float*, 1>& v, size_t at, size_t n) {
        CautiousUpdateRange(args, update + at, v[0], 0, n);
      });
    });
    return absl::OkStatus();
  }

 private:
  // pool_.Run of range(begin, end, sums) over [0, count) of an update of `master`: sums null, or,
  // with `measure` and an fp32 master, two doubles the range adds its Σ W_before² and Σ ΔW² to
  // (UpdateLoop); every range's sums then written to measure[0] and measure[1], added in the order of
  // the ranges (the same bits however the threads interleave).
  template <typename Range>
  void RunUpdate(size_t count, double* measure, StoredRef master, Range&& range) {
    if (measure == nullptr || !master.is_fp32()) {
      pool_.Run(count, [&](size_t begin, size_t end) { range(begin, end, nullptr); });
      return;
    }
    std::mutex mu;
    std::map<size_t, std::array<double, 2>> by_range;
    pool_.Run(count, [&](size_t begin, size_t end) {
      std::array<double, 2> sums = {0, 0};
      range(begin, end, sums.data());
      std::lock_guard<std::mutex> lock(mu);
      by_range[begin] = sums;
    });
    measure[0] = measure[1] = 0;
    for (const auto& [begin, sums] : by_range) {
      measure[0] += sums[0];
      measure[1] += sums[1];
    }
  }

  // The bf16 GEMMs, made on the first bf16 request, or null where the CPU has no bf16 kernel; either
  // way the outcome is logged once. Called under the gate.
  OnednnBf16Gemm* Bf16Gemm() {
    std::call_once(bf16_once_, [this] {
      const Bf16Support& support = Bf16GemmSupport();
      if (support.available) {
        bf16_ = std::make_unique<OnednnBf16Gemm>(threads_);
        // libgomp reads its wait policy once, when it loads; spinning waits cost bf16 most of its gain
        // on a machine whose cores are shared (README, CPU performance).
        MUOND_LOG(info, "CPU backend: matmul_precision bf16 runs bf16 GEMMs with fp32 accumulation ({} {}){}",
                  support.library, support.kernel,
                  std::getenv("OMP_WAIT_POLICY") == nullptr
                      ? "; OMP_WAIT_POLICY is unset, so its OpenMP threads spin between products: set it to PASSIVE "
                        "if other work shares these cores"
                      : "");
      } else {
        MUOND_LOG(warn, "CPU backend: matmul_precision bf16 runs in fp32: {}", support.reason);
      }
    });
    return bf16_.get();
  }

  // Sets OpenBLAS's thread count (threads > 0) and returns the count both it and the pool use.
  static int InitThreads(int threads) {
    if (threads > 0) openblas_set_num_threads(threads);
    return openblas_get_num_threads();
  }

  ComputePool pool_;  // element-wise threads, and the gate of every compute call
  int threads_ = 0;
  const bool host_addressable_;
  std::atomic<int64_t> allocated_bytes_{0};  // of the live buffers
  std::once_flag bf16_once_;
  std::unique_ptr<OnednnBf16Gemm> bf16_;        // see Bf16Gemm()
  std::atomic<int64_t> bf16_scratch_bytes_{0};  // its bf16 operands
};

}  // namespace

std::unique_ptr<Backend> NewCpuBackend(int threads, bool host_addressable) {
  return std::make_unique<CpuBackend>(threads, host_addressable);
}

ComputePool* CpuComputePool(Backend& backend) {
  auto* cpu = dynamic_cast<CpuBackend*>(&backend);
  return cpu != nullptr ? &cpu->pool() : nullptr;
}

}  // namespace muond::kernels
