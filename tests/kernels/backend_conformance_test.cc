// Backend conformance, primitives: memory, element-wise optimizer steps (bitwise), GEMM (within
// rounding bounds derived below), SumSquares, NormalizeBatched, NorMuon's scales, AllFinite and
// Transpose2D, each compared with the CPU backend. Newton–Schulz and whole optimizer steps are in
// backend_conformance_optim_test.cc.
#include "tests/kernels/backend_conformance.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "common/status_macros.h"
#include "kernels/elementwise.h"
#include "tests/kernels/reference.h"
#include "tests/testing/error_bounds.h"
#include "tests/testing/status_matchers.h"

namespace muond::kernels {
namespace {

using ::muond::testing::Download;
using ::muond::testing::Upload;

// Uploads `inputs` to `backend`, runs `op` on the device copies, downloads them all again.
using DeviceOp = std::function<absl::Status(Backend&, const std::vector<float*>&)>;
std::vector<std::vector<float>> RunOn(Backend& backend, const std::vector<std::vector<float>>& inputs,
                                      const DeviceOp& op) {
  std::vector<std::unique_ptr<DeviceBuffer>> buffers;
  std::vector<float*> ptrs;
  for (const auto& in : inputs) {
    buffers.push_back(Upload(backend, in));
    ptrs.push_back(buffers.back()->data());
  }
  EXPECT_OK(op(backend, ptrs));
  std::vector<std::vector<float>> out;
  for (size_t i = 0; i < inputs.size(); ++i) out.push_back(Download(backend, ptrs[i], inputs[i].size()));
  return out;
}

TEST_P(BackendConformanceTest, MemoryZeroesCopiesAndFills) {
  ASSERT_OK_AND_ASSIGN(auto empty, backend_->Allocate(0));
  EXPECT_EQ(empty->size(), 0u);
  {
    // A freed and reallocated buffer (the CUDA pool reuses the block) must come back zeroed too.
    ASSERT_OK_AND_ASSIGN(auto dirty, backend_->Allocate(1000));
    ASSERT_OK(backend_->Fill(dirty->data(), 1000, 7.0f));
  }
  ASSERT_OK_AND_ASSIGN(auto buf, backend_->Allocate(1000));
  EXPECT_TRUE(BitwiseEqual(Download(*backend_, buf->data(), 1000), std::vector<float>(1000, 0.0f)));

  const std::vector<float> src = Random(1000);
  auto a = Upload(*backend_, src);
  EXPECT_TRUE(BitwiseEqual(Download(*backend_, a->data(), 1000), src));
  ASSERT_OK(backend_->CopyOnDevice(a->data(), buf->data(), 1000));
  EXPECT_TRUE(BitwiseEqual(Download(*backend_, buf->data(), 1000), src));

  // Overlapping copies in both directions have memmove semantics.
  std::vector<float> want = src;
  std::memmove(want.data() + 100, want.data(), 500 * sizeof(float));
  ASSERT_OK(backend_->CopyOnDevice(a->data(), a->data() + 100, 500));
  EXPECT_TRUE(BitwiseEqual(Download(*backend_, a->data(), 1000), want));
  std::memmove(want.data(), want.data() + 300, 600 * sizeof(float));
  ASSERT_OK(backend_->CopyOnDevice(a->data() + 300, a->data(), 600));
  EXPECT_TRUE(BitwiseEqual(Download(*backend_, a->data(), 1000), want));

  ASSERT_OK(backend_->Fill(a->data() + 3, 10, 2.5f));
  std::fill(want.begin() + 3, want.begin() + 13, 2.5f);
  EXPECT_TRUE(BitwiseEqual(Download(*backend_, a->data(), 1000), want));
}

// The pipelined transfers: pieces of odd sizes, some larger than the CUDA backend's 4 MiB pinned
// slots and more than its ring holds, from a host buffer overwritten as soon as each Enqueue
// returns; both directions ordered after work enqueued before the transfer was created.
TEST_P(BackendConformanceTest, PipelinedTransfersCopyExactlyAndInOrder) {
  constexpr size_t kCount = (size_t{5} << 20) + 12345;  // 5 Mi floats: 20 MiB, five slots' worth
  const std::vector<float> values = Random(kCount);
  const std::vector<size_t> pieces = {1, 1000, 262144, 3, size_t{1} << 20, (size_t{3} << 20) + 7};
  ASSERT_OK_AND_ASSIGN(auto device, backend_->Allocate(kCount));
  ASSERT_OK(backend_->Fill(device->data(), kCount, 7.0f));  // must land before the upload
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostToDevice> upload, backend_->NewHostToDevice());
    std::vector<float> scratch;
    size_t offset = 0;
    for (size_t i = 0; offset < kCount; ++i) {
      const size_t n = std::min(pieces[i % pieces.size()], kCount - offset);
      scratch.assign(values.begin() + offset, values.begin() + offset + n);
      ASSERT_OK(upload->Enqueue(scratch.data(), device->data() + offset, n));
      std::fill(scratch.begin(), scratch.end(), -1.0f);  // reusable once Enqueue returned
      offset += n;
    }
    ASSERT_OK(upload->Wait());
  }
  EXPECT_TRUE(BitwiseEqual(Download(*backend_, device->data(), kCount), values));

  ASSERT_OK(backend_->Fill(device->data() + 10, 100, 2.5f));  // must land before the read-back
  std::vector<float> want = values;
  std::fill(want.begin() + 10, want.begin() + 110, 2.5f);
  std::vector<float> got(kCount, -3.0f);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<DeviceToHost> download, backend_->NewDeviceToHost());
  size_t offset = 0;
  for (size_t i = 0; offset < kCount; ++i) {
    const size_t n = std::min(pieces[(i + 2) % pieces.size()], kCount - offset);
    ASSERT_OK(download->Enqueue(device->data() + offset, got.data() + offset, n));
    offset += n;
  }
  ASSERT_OK(download->Wait());
  EXPECT_TRUE(BitwiseEqual(got, want));

  // A second transfer reuses what the first set up (the CUDA backend keeps its pinned rings).
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostToDevice> again, backend_->NewHostToDevice());
  ASSERT_OK(again->Enqueue(values.data(), device->data(), 5));
  ASSERT_OK(again->Wait());
  ASSERT_OK(again->Wait());  // nothing pending: returns at once
}

// Runs `op` on `backend` and on `cpu` with the same inputs; every buffer afterwards must be
// bit-identical (see BitwiseEqual for why no ulp of slack is allowed).
void ExpectSameAsCpu(const char* label, Backend& backend, Backend& cpu, const std::vector<std::vector<float>>& inputs,
                     const DeviceOp& op) {
  const auto got = RunOn(backend, inputs, op);
  const auto want = RunOn(cpu, inputs, op);
  for (size_t b = 0; b < got.size(); ++b) {
    EXPECT_TRUE(BitwiseEqual(got[b], want[b])) << label << ", buffer " << b;
  }
}

TEST_P(BackendConformanceTest, ElementwiseStepsMatchCpuBitwise) {
  const size_t n = 4099;  // not a multiple of any block size
  std::vector<float> p = Random(n), g = Random(n, 0.1f), m = Random(n, 0.05f), v = Random(n, 0.01f);
  for (float& x : v) x = x * x;                    // second moments are non-negative
  for (size_t i = 0; i < n; i += 97) g[i] = 0.0f;  // Lion's sign(0) and SGD's zero gradient
  const std::vector<std::vector<float>> pgm = {p, g, m}, pgmv = {p, g, m, v};

  for (MomentumStyle style : {MomentumStyle::kEma, MomentumStyle::kSum}) {
    for (bool nesterov : {false, true}) {
      const MomentumArgs args{.beta = 0.95f, .style = style, .nesterov = nesterov};
      ExpectSameAsCpu("momentum", *backend_, *cpu_, {m, g, p}, [&](Backend& b, const std::vector<float*>& d) {
        for (int step = 0; step < 3; ++step) {
          MUOND_RETURN_IF_ERROR(b.Momentum(args, d[0], d[1], d[2], n));
        }
        return b.Momentum(args, d[0], d[1], d[1], n);  // update over the gradient
      });
    }
  }
  ExpectSameAsCpu("adamw", *backend_, *cpu_, pgmv, [&](Backend& b, const std::vector<float*>& d) {
    for (int t = 1; t <= 3; ++t) {
      const AdamWArgs args{.lr = 1e-2f,
                           .beta1 = 0.9f,
                           .beta2 = 0.999f,
                           .eps = 1e-8f,
                           .weight_decay = 0.1f,
                           .bias_correction1 = static_cast<float>(1 - std::pow(0.9, t)),
                           .bias_correction2_sqrt = static_cast<float>(std::sqrt(1 - std::pow(0.999, t))),
                           .one_minus_beta1 = static_cast<float>(1 - 0.9),
                           .one_minus_beta2 = static_cast<float>(1 - 0.999)};
      MUOND_RETURN_IF_ERROR(b.AdamW(args, d[0], d[1], d[2], d[3], n));
    }
    return absl::OkStatus();
  });
  ExpectSameAsCpu("lion", *backend_, *cpu_, pgm, [&](Backend& b, const std::vector<float*>& d) {
    const LionArgs args{.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.99f, .weight_decay = 0.1f};
    for (int t = 0; t < 3; ++t) MUOND_RETURN_IF_ERROR(b.Lion(args, d[0], d[1], d[2], n));
    return absl::OkStatus();
  });
  for (float momentum : {0.0f, 0.9f}) {
    for (bool nesterov : {false, true}) {
      ExpectSameAsCpu("sgd", *backend_, *cpu_, pgm, [&](Backend& b, const std::vector<float*>& d) {
        for (int t = 0; t < 3; ++t) {
          const SgdArgs args{
              .lr = 1e-2f, .momentum = momentum, .weight_decay = 0.01f, .nesterov = nesterov, .first_step = t == 0};
          MUOND_RETURN_IF_ERROR(b.Sgd(args, d[0], d[1], d[2], n));
        }
        return absl::OkStatus();
      });
    }
  }
  // Adaptive Muon's second moment and cautious weight decay (element formulas shared with the CPU).
  ExpectSameAsCpu("adamuon", *backend_, *cpu_, {v, g}, [&](Backend& b, const std::vector<float*>& d) {
    const AdamuonArgs args{.scale = 1.5f, .one_minus_beta2 = static_cast<float>(1 - 0.95), .eps = 1e-8f};
    for (int t = 0; t < 3; ++t) MUOND_RETURN_IF_ERROR(b.Adamuon(args, d[0], d[1], n));
    return absl::OkStatus();
  });
  ExpectSameAsCpu("cautious", *backend_, *cpu_, pgm, [&](Backend& b, const std::vector<float*>& d) {
    const CautiousArgs args{.alpha = -0.02f, .decay = 0.01f};
    for (int t = 0; t < 3; ++t) MUOND_RETURN_IF_ERROR(b.CautiousUpdate(args, d[1], d[0], n));
    return absl::OkStatus();
  });
  ExpectSameAsCpu("axpby", *backend_, *cpu_, pgm, [&](Backend& b, const std::vector<float*>& d) {
    MUOND_RETURN_IF_ERROR(b.Axpby(-0.37f, d[1], 0.999f, d[0], n));
    return b.Axpby(1.5f, d[2], 0.0f, d[1], n);
  });
  ExpectSameAsCpu("scale_batched", *backend_, *cpu_, {Random(3 * 1001)}, [&](Backend& b, const std::vector<float*>& d) {
    const float scales[] = {0.5f, -3.25f, 1e-3f};
    return b.ScaleBatched(d[0], 1001, 3, scales);
  });
  // More scales than the CUDA backend passes in a kernel's launch parameters (64).
  ExpectSameAsCpu("scale_batched_many", *backend_, *cpu_, {Random(100 * 37)},
                  [&](Backend& b, const std::vector<float*>& d) {
                    std::vector<float> scales(100);
                    for (size_t i = 0; i < scales.size(); ++i) scales[i] = 0.25f + 0.125f * static_cast<float>(i);
                    return b.ScaleBatched(d[0], 37, scales.size(), scales.data());
                  });
}

// The bound on |computed − exact| for one entry of C = α·op(A)·op(B) + β·C, relative to
// mag = |α|·Σ|a||b| + |β|·|c|: summing k products in fp32 in any order errs by at most
// γ = (k+2)·2⁻²⁴ (Higham's γ_k, +2 for the α and β terms), doubled for headroom. tf32 rounds each
// operand to 11 significant bits first (cuBLAS may truncate: ≤ 2⁻¹⁰ each, ≤ 2⁻⁹ for a product);
// bf16 rounds each to 8 bits, to nearest in our conversion kernel (≤ 2⁻⁸ each, ≤ 2⁻⁷ a product).
double GemmTolerance(MatmulPrecision precision, int64_t k) {
  const double fp32 = 2.0 * static_cast<double>(k + 2) * std::ldexp(1.0, -24);
  switch (precision) {
    case MatmulPrecision::kFp32:
      return fp32;
    case MatmulPrecision::kTf32:
      return std::ldexp(1.0, -9) + fp32;
    case MatmulPrecision::kBf16:
      return std::ldexp(1.0, -7) + fp32;
  }
  return 0;
}

// Every transpose combination, padded leading dimensions and strides, α, β (β = 0 ignoring NaN in
// C), k = 0, and A = B (the shared bf16 conversion), against fp64 and against the CPU backend.
TEST_P(BackendConformanceTest, GemmWithinRoundingBounds) {
  struct Case {
    Transpose ta, tb;
    int64_t m, n, k, batch;
    float alpha, beta;
    bool same_ab;
  };
  std::vector<Case> cases;
  for (Transpose ta : {Transpose::kNo, Transpose::kYes}) {
    for (Transpose tb : {Transpose::kNo, Transpose::kYes}) {
      cases.push_back({ta, tb, 37, 29, 53, 3, 0.75f, -0.5f, false});
      cases.push_back({ta, tb, 8, 16, 300, 2, 1.0f, 0.0f, false});
    }
  }
  cases.push_back({Transpose::kNo, Transpose::kNo, 5, 7, 0, 2, 1.0f, 0.5f, false});     // k = 0
  cases.push_back({Transpose::kNo, Transpose::kYes, 40, 40, 72, 2, 1.0f, 0.0f, true});  // X·Xᵀ
  for (MatmulPrecision precision : {MatmulPrecision::kFp32, MatmulPrecision::kTf32, MatmulPrecision::kBf16}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(::testing::Message() << PrecisionName(precision) << " m=" << c.m << " n=" << c.n << " k=" << c.k
                                        << " ta=" << (c.ta == Transpose::kYes) << " tb=" << (c.tb == Transpose::kYes));
      // Stored shapes of A and B (row-major), each row padded by 3 and each matrix by 5.
      const int64_t a_rows = c.ta == Transpose::kNo ? c.m : c.k, a_cols = c.ta == Transpose::kNo ? c.k : c.m;
      const int64_t b_rows = c.tb == Transpose::kNo ? c.k : c.n, b_cols = c.tb == Transpose::kNo ? c.n : c.k;
      GemmShape s{.trans_a = c.ta,
                  .trans_b = c.tb,
                  .m = c.m,
                  .n = c.n,
                  .k = c.k,
                  .lda = a_cols + 3,
                  .ldb = b_cols + 3,
                  .ldc = c.n + 3};
      s.stride_a = a_rows * s.lda + 5;
      s.stride_b = b_rows * s.ldb + 5;
      s.stride_c = c.m * s.ldc + 5;
      s.batch = c.batch;
      if (c.same_ab) {  // B is A's storage
        s.ldb = s.lda;
        s.stride_b = s.stride_a;
      }
      std::vector<float> a = Random(s.stride_a * c.batch);
      std::vector<float> b = c.same_ab ? a : Random(s.stride_b * c.batch);
      std::vector<float> c0 = Random(s.stride_c * c.batch);
      if (c.beta == 0.0f) c0[0] = std::numeric_limits<float>::quiet_NaN();
      const DeviceOp op = [&](Backend& be, const std::vector<float*>& d) {
        return be.Gemm(s, c.alpha, d[0], c.same_ab ? d[0] : d[1], c.beta, d[2], precision);
      };
      const std::vector<float> got = RunOn(*backend_, {a, b, c0}, op)[2];
      const std::vector<float> cpu = RunOn(*cpu_, {a, b, c0}, op)[2];
      const double tol = GemmTolerance(precision, c.k);
      for (int64_t bi = 0; bi < c.batch; ++bi) {
        for (int64_t i = 0; i < c.m; ++i) {
          for (int64_t j = 0; j < c.n; ++j) {
            double exact = 0, mag = 0;
            for (int64_t l = 0; l < c.k; ++l) {
              const double av =
                  c.ta == Transpose::kNo ? a[bi * s.stride_a + i * s.lda + l] : a[bi * s.stride_a + l * s.lda + i];
              const double bv =
                  c.tb == Transpose::kNo ? b[bi * s.stride_b + l * s.ldb + j] : b[bi * s.stride_b + j * s.ldb + l];
              exact += av * bv;
              mag += std::abs(av * bv);
            }
            const size_t ci = bi * s.stride_c + i * s.ldc + j;
            exact *= c.alpha;
            mag *= std::abs(c.alpha);
            if (c.beta != 0.0f) {
              exact += c.beta * static_cast<double>(c0[ci]);
              mag += std::abs(c.beta * static_cast<double>(c0[ci]));
            }
            ASSERT_TRUE(
                ::muond::testing::WithinBound("gemm.vs_fp64_over_mag", std::abs(got[ci] - exact) / (mag + 1e-30), tol))
                << "C" << bi << "(" << i << "," << j << ")";
            ASSERT_LE(std::abs(got[ci] - cpu[ci]), (tol + GemmTolerance(MatmulPrecision::kFp32, c.k)) * mag + 1e-30);
          }
          // The padding after each row of C is not part of C and must be left alone.
          for (int64_t j = c.n; j < s.ldc; ++j) {
            const size_t ci = bi * s.stride_c + i * s.ldc + j;
            ASSERT_EQ(Bits(got[ci]), Bits(c0[ci])) << "padding of C" << bi << " row " << i;
          }
        }
      }
    }
  }
}

// fp64 sums of squares of floats: every square is exact in fp64, so the sums differ from the exact
// value only by summation rounding, at most count·2⁻⁵³ relative (all terms are positive).
TEST_P(BackendConformanceTest, SumSquaresMatchesCpu) {
  for (const auto& [count, batch] :
       std::vector<std::pair<size_t, size_t>>{{100003, 3}, {1, 1}, {4096, 2}, {0, 2}, {5000, 0}}) {
    const std::vector<float> x = Random(std::max<size_t>(count * batch, 1));
    std::vector<double> got(batch, -1.0), cpu(batch, -1.0);
    auto dx = Upload(*backend_, x);
    auto cx = Upload(*cpu_, x);
    ASSERT_OK(backend_->SumSquares(dx->data(), count, batch, got.data()));
    ASSERT_OK(cpu_->SumSquares(cx->data(), count, batch, cpu.data()));
    for (size_t b = 0; b < batch; ++b) {
      const double tol = 2.0 * static_cast<double>(count) * std::ldexp(1.0, -53) * cpu[b];
      EXPECT_NEAR(got[b], cpu[b], tol) << "count " << count << " item " << b;
      if (count == 0) {
        EXPECT_EQ(got[b], 0.0);
      }
    }
  }
}

// NormalizeBatched is, on every backend, bit for bit its own SumSquares, the scales
// fp32(1/(s·√Σ + ε)) in fp64 on the host, then its own ScaleBatched — whether the backend computes
// the scales on the host (CPU) or on the device (CUDA) — and writes the same sums into backend
// memory when asked. A zero slice with ε = 0 stays zero, and a slice of subnormals comes out finite
// (zero where fp32 cannot hold its 1/(s·√Σ): 7 of them; never inf, nor NaN). Against the CPU the sums
// differ only by summation order, so the results agree within the SumSquares bound carried through √
// and 1/x (a few ulp).
TEST_P(BackendConformanceTest, NormalizeBatchedIsSumSquaresThenScale) {
  for (const auto& [count, batch] :
       std::vector<std::pair<size_t, size_t>>{{4096, 3}, {100003, 2}, {7, 90}, {1, 1}, {300, 0}}) {
    for (const auto& [eps, safety] : std::vector<std::pair<double, double>>{{1e-7, 1.0}, {0.0, 1.01}}) {
      SCOPED_TRACE(::testing::Message() << count << " x " << batch << " eps " << eps);
      std::vector<float> x = Random(std::max<size_t>(count * batch, 1));
      if (batch > 1) std::fill(x.begin() + static_cast<std::ptrdiff_t>(count), x.begin() + 2 * count, 0.0f);
      if (batch > 2) {
        std::fill(x.begin() + 2 * static_cast<std::ptrdiff_t>(count), x.begin() + 3 * count, -1e-40f);
      }
      auto fused = Upload(*backend_, x);
      auto quiet = Upload(*backend_, x);
      auto manual = Upload(*backend_, x);
      std::vector<double> sums(batch, -1.0), manual_sums(batch, -1.0);
      ASSERT_OK_AND_ASSIGN(auto device_sums, backend_->Allocate(2 * batch));  // doubles in backend memory
      ASSERT_OK(backend_->NormalizeBatched(fused->data(), count, batch, eps, safety,
                                           reinterpret_cast<double*>(device_sums->data())));
      ASSERT_OK(backend_->CopyBytes(device_sums->data(), sums.data(), batch * sizeof(double)));
      ASSERT_OK(backend_->NormalizeBatched(quiet->data(), count, batch, eps, safety));
      ASSERT_OK(backend_->SumSquares(manual->data(), count, batch, manual_sums.data()));
      std::vector<float> scales(batch);
      for (size_t b = 0; b < batch; ++b) scales[b] = InverseNormScale(manual_sums[b], eps, safety);
      ASSERT_OK(backend_->ScaleBatched(manual->data(), count, batch, scales.data()));
      const std::vector<float> want = Download(*backend_, manual->data(), x.size());
      EXPECT_TRUE(BitwiseEqual(Download(*backend_, fused->data(), x.size()), want));
      EXPECT_TRUE(BitwiseEqual(Download(*backend_, quiet->data(), x.size()), want));
      for (size_t b = 0; b < batch; ++b) EXPECT_EQ(sums[b], manual_sums[b]) << "item " << b;
      if (batch > 1) {
        for (size_t i = count; i < 2 * count; ++i) ASSERT_EQ(Bits(want[i]), 0u) << i;
      }
      for (size_t i = 0; i < x.size(); ++i) ASSERT_TRUE(std::isfinite(want[i])) << i;
      auto on_cpu = Upload(*cpu_, x);
      ASSERT_OK(cpu_->NormalizeBatched(on_cpu->data(), count, batch, eps, safety));
      const std::vector<float> cpu = Download(*cpu_, on_cpu->data(), x.size());
      for (size_t i = 0; i < x.size(); ++i) {
        ASSERT_NEAR(want[i], cpu[i], 4 * std::ldexp(std::abs(cpu[i]), -23) + 1e-30) << i;
      }
    }
  }
}

TEST_P(BackendConformanceTest, AllFiniteFindsNanAndInf) {
  std::vector<float> x = Random(10000);
  auto d = Upload(*backend_, x);
  ASSERT_OK_AND_ASSIGN(bool all, backend_->AllFinite(d->data(), x.size()));
  EXPECT_TRUE(all);
  ASSERT_OK_AND_ASSIGN(bool none, backend_->AllFinite(d->data(), 0));
  EXPECT_TRUE(none);
  for (size_t at : {size_t{0}, size_t{5000}, x.size() - 1}) {
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                      -std::numeric_limits<float>::infinity()}) {
      std::vector<float> y = x;
      y[at] = bad;
      auto dy = Upload(*backend_, y);
      ASSERT_OK_AND_ASSIGN(bool finite, backend_->AllFinite(dy->data(), y.size()));
      EXPECT_FALSE(finite) << bad << " at " << at;
      // Only the given range counts: the bad value just past it is not seen.
      ASSERT_OK_AND_ASSIGN(bool prefix, backend_->AllFinite(dy->data(), at));
      EXPECT_TRUE(prefix) << bad << " at " << at;
    }
  }
}

TEST_P(BackendConformanceTest, Transpose2DIsExact) {
  struct Shape {
    int64_t rows, cols, batch;
  };
  for (const Shape& sh :
       std::vector<Shape>{{67, 45, 3}, {1, 100, 1}, {100, 1, 2}, {32, 64, 1}, {33, 31, 70}, {0, 5, 1}}) {
    const size_t total = static_cast<size_t>(sh.rows * sh.cols * sh.batch);
    const std::vector<float> x = Random(std::max<size_t>(total, 1));
    const DeviceOp op = [&](Backend& b, const std::vector<float*>& d) {
      return b.Transpose2D(d[0], d[1], sh.rows, sh.cols, sh.batch);
    };
    const std::vector<float> out0(x.size(), -1.0f);
    EXPECT_TRUE(BitwiseEqual(RunOn(*backend_, {x, out0}, op)[1], RunOn(*cpu_, {x, out0}, op)[1]))
        << sh.rows << "x" << sh.cols << " batch " << sh.batch;
  }
}

// X·Xᵀ − I without an identity uploaded: only the diagonals move, by exactly `value`'s fp32 sum.
TEST_P(BackendConformanceTest, AddToDiagonalTouchesOnlyTheDiagonals) {
  for (const auto& [m, batch] : std::vector<std::pair<int64_t, int64_t>>{{5, 3}, {1, 1}, {64, 2}, {0, 4}}) {
    const std::vector<float> x = Random(std::max<size_t>(static_cast<size_t>(m * m * batch), 1));
    const DeviceOp op = [&, m = m, batch = batch](Backend& b, const std::vector<float*>& d) {
      return b.AddToDiagonal(d[0], m, batch, -1.0f);
    };
    const std::vector<float> got = RunOn(*backend_, {x}, op)[0];
    std::vector<float> want = x;
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t j = 0; j < m; ++j) want[static_cast<size_t>((b * m + j) * m + j)] -= 1.0f;
    }
    EXPECT_TRUE(BitwiseEqual(got, want)) << m << " x " << m << " batch " << batch;
  }
}

// More scales than one kernel launch carries (64 on CUDA): the same bits as the CPU's.
TEST_P(BackendConformanceTest, ScaleBatchedWithManyScales) {
  for (const auto& [count, batch] : std::vector<std::pair<size_t, size_t>>{{3, 200}, {257, 65}, {1, 64}}) {
    const std::vector<float> x = Random(count * batch);
    std::vector<float> scales = Random(batch);
    const DeviceOp op = [&, count = count, batch = batch](Backend& b, const std::vector<float*>& d) {
      return b.ScaleBatched(d[0], count, batch, scales.data());
    };
    EXPECT_TRUE(BitwiseEqual(RunOn(*backend_, {x}, op)[0], RunOn(*cpu_, {x}, op)[0])) << count << " x " << batch;
  }
}

// CopyBytes between host and backend memory, in both directions and past one pinned staging piece
// (1 MiB on CUDA), and between two buffers of the backend: every byte lands.
TEST_P(BackendConformanceTest, CopyBytesAnyDirectionAnySize) {
  for (size_t floats : {size_t{1}, size_t{1000}, (size_t{3} << 18) + 5}) {
    const std::vector<float> x = Random(floats);
    ASSERT_OK_AND_ASSIGN(auto first, backend_->Allocate(floats));
    ASSERT_OK_AND_ASSIGN(auto second, backend_->Allocate(floats));
    ASSERT_OK(backend_->CopyBytes(x.data(), first->data(), floats * sizeof(float)));
    ASSERT_OK(backend_->CopyBytes(first->data(), second->data(), floats * sizeof(float)));
    std::vector<float> back(floats, -1.0f);
    ASSERT_OK(backend_->CopyBytes(second->data(), back.data(), floats * sizeof(float)));
    EXPECT_TRUE(BitwiseEqual(back, x)) << floats << " floats";
  }
}

TEST_P(BackendConformanceTest, WidenAndNarrowMatchCpuBitwise) {
  // Values across every exponent, midpoints of the 16-bit grids (ties), fp16 subnormals and
  // overflow, signed zeros, infinities and NaN.
  std::vector<float> x = Random(4099);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::ldexp(x[i], static_cast<int>(i % 80) - 40);
  for (float v : {0.0f, -0.0f, 1.00390625f, 1.01171875f, 65519.0f, 65520.0f, 3e-8f, -6e-5f, 1e38f,
                  std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    x.push_back(v);
  }
  const size_t n = x.size();  // odd: the last 16-bit element shares its fp32 word with the pad
  for (StorageDtype dtype : {StorageDtype::kBf16, StorageDtype::kFp16}) {
    const DeviceOp op = [&](Backend& b, const std::vector<float*>& d) -> absl::Status {
      MUOND_RETURN_IF_ERROR(b.Narrow(dtype, d[0], d[1], n));
      return b.Widen(dtype, d[1], d[2], n);
    };
    const std::vector<float> packed((n + 1) / 2, 0.0f), wide(n, -1.0f);
    const auto device = RunOn(*backend_, {x, packed, wide}, op);
    const auto cpu = RunOn(*cpu_, {x, packed, wide}, op);
    EXPECT_TRUE(BitwiseEqual(device[1], cpu[1])) << StorageDtypeName(dtype) << ": the rounded bits";
    EXPECT_TRUE(BitwiseEqual(device[2], cpu[2])) << StorageDtypeName(dtype) << ": widened back";
  }
}

// NorMuon's per-line values (NormuonScales) and the device-side SumSquaresTo and ScaleBatchedBy
// against the CPU: the moments, computed line by line with the same fp32 formula, are bit-identical
// in every storage format; the scales differ only through the order of the two fp64 sums over the
// lines (≤ 2·length·2⁻⁵³ relative, then one fp32 rounding: 1 ulp). All-zero lines give zero scales.
TEST_P(BackendConformanceTest, NormuonScalesMatchCpu) {
  const size_t length = 300, count = 37;
  const Backend::NormuonArgs args{.count = count, .weight = 0.05f, .eps = 1e-10};
  for (StorageDtype dtype : {StorageDtype::kFp32, StorageDtype::kBf16}) {
    for (bool zero : {false, true}) {
      SCOPED_TRACE(::testing::Message() << StorageDtypeName(dtype) << (zero ? " zero lines" : ""));
      std::vector<float> lines = Random(length * count);
      if (zero) std::fill(lines.begin(), lines.end(), 0.0f);
      std::vector<float> moment = Random(length, 0.01f);
      for (float& m : moment) m = std::abs(m);
      struct Result {
        std::vector<float> scales, moment, scaled;
      };
      const auto run = [&](Backend& b) {
        auto x = Upload(b, lines);
        auto wide = Upload(b, moment);
        auto packed = b.Allocate(dtype == StorageDtype::kFp32 ? length : (length + 1) / 2).value();
        EXPECT_OK(b.Narrow(dtype, wide->data(), packed->data(), length));
        auto sums = b.Allocate(2 * length).value();
        auto scales = b.Allocate(length).value();
        double* device_sums = reinterpret_cast<double*>(sums->data());
        EXPECT_OK(b.SumSquaresTo(x->data(), count, length, device_sums));
        EXPECT_OK(b.NormuonScales(args, device_sums, StoredRef(packed->data(), dtype), scales->data(), length));
        EXPECT_OK(b.ScaleBatchedBy(x->data(), count, length, scales->data()));
        EXPECT_OK(b.Widen(dtype, packed->data(), wide->data(), length));
        return Result{Download(b, scales->data(), length), Download(b, wide->data(), length),
                      Download(b, x->data(), lines.size())};
      };
      const Result got = run(*backend_), want = run(*cpu_);
      EXPECT_TRUE(BitwiseEqual(got.moment, want.moment));
      for (size_t j = 0; j < length; ++j) {
        ASSERT_NEAR(got.scales[j], want.scales[j], std::ldexp(std::abs(want.scales[j]), -23)) << j;
        if (zero) {
          ASSERT_EQ(Bits(got.scales[j]), 0u) << j;
        }
      }
      for (size_t i = 0; i < lines.size(); ++i) {
        ASSERT_NEAR(got.scaled[i], want.scaled[i], 2 * std::ldexp(std::abs(want.scaled[i]), -23) + 1e-30) << i;
      }
    }
  }
}

// AOL's row scales 1/sqrt(max(sum |row|, floor)): a row under the floor takes the floor, and a row
// with a NaN stays NaN on every backend (a max that drops NaN would turn it into the floor's scale).
TEST_P(BackendConformanceTest, AolScalesMatchCpuWithNanAndFloor) {
  const int64_t m = 6, batch = 3, rows = m * batch;
  std::vector<float> gram = Random(static_cast<size_t>(rows * m));
  gram[1 * m + 2] = std::numeric_limits<float>::quiet_NaN();
  gram[4 * m + 0] = std::numeric_limits<float>::infinity();
  std::fill(gram.begin() + 7 * m, gram.begin() + 8 * m, 1e-30f);  // far under the floor
  const double floor = 1e-12;
  const auto run = [&](Backend& b) {
    auto g = Upload(b, gram);
    auto scales = b.Allocate(rows).value();
    EXPECT_OK(b.AolScales(g->data(), m, batch, floor, scales->data()));
    return Download(b, scales->data(), rows);
  };
  const std::vector<float> got = run(*backend_), want = run(*cpu_);
  EXPECT_TRUE(std::isnan(want[1]));
  EXPECT_EQ(want[4], 0.0f);
  EXPECT_EQ(want[7], static_cast<float>(1.0 / std::sqrt(floor)));
  for (int64_t r = 0; r < rows; ++r) {
    if (std::isnan(want[r])) {
      EXPECT_TRUE(std::isnan(got[r])) << r << ": " << got[r];
    } else {
      EXPECT_NEAR(got[r], want[r], std::ldexp(std::abs(want[r]), -23)) << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, BackendConformanceTest, ::testing::Values("cpu", "cuda"),
                         [](const ::testing::TestParamInfo<std::string>& param_info) { return param_info.param; });

}  // namespace
}  // namespace muond::kernels
