#include "kernels/cpu/cpu_backend.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <vector>

#include "common/compute_pool.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/blas_kernel.h"
#include "tests/kernels/reference.h"
#include "tests/testing/status_matchers.h"

namespace muond::kernels {
namespace {

using ::muond::testing::Download;
using ::muond::testing::StatusIs;
using ::muond::testing::Upload;

size_t ComputePoolRangeForTests() { return ComputePool::kMinRangeElements; }

class CpuBackendTest : public ::testing::Test {
 protected:
  std::vector<float> Random(size_t n) {
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<float> v(n);
    for (float& x : v) x = dist(rng_);
    return v;
  }
  std::unique_ptr<Backend> backend_ = NewCpuBackend(2);
  std::mt19937 rng_{99};
};

TEST_F(CpuBackendTest, NameAndDetail) {
  EXPECT_EQ(backend_->Name(), "cpu");
  EXPECT_NE(backend_->Detail().find("OpenBLAS"), std::string::npos) << backend_->Detail();
  EXPECT_NE(backend_->Detail().find("threads"), std::string::npos) << backend_->Detail();
}

TEST(BlasKernelTest, KernelsRankByTheInstructionsTheyUse) {
  EXPECT_EQ(KernelTier("Prescott"), SimdTier::kSse);
  EXPECT_EQ(KernelTier("NEHALEM"), SimdTier::kSse);
  EXPECT_EQ(KernelTier("Sandybridge"), SimdTier::kAvx);
  EXPECT_EQ(KernelTier("Haswell"), SimdTier::kAvx2);
  EXPECT_EQ(KernelTier("Zen"), SimdTier::kAvx2);
  EXPECT_EQ(KernelTier("SkylakeX"), SimdTier::kAvx512);
  EXPECT_EQ(KernelTier("Cooperlake"), SimdTier::kAvx512);
  EXPECT_EQ(KernelTier("SapphireRapids"), SimdTier::kAvx512);
  EXPECT_EQ(KernelTier("Zen5"), std::nullopt);  // a newer OpenBLAS's: left alone
  EXPECT_EQ(KernelTier(""), std::nullopt);
}

TEST(BlasKernelTest, OnlyAKernelBelowTheCpusTierIsReplaced) {
  // The case that matters: Debian 12's OpenBLAS fell back to Prescott on an Emerald Rapids Xeon.
  EXPECT_EQ(KernelToForce("Prescott", SimdTier::kAvx512, /*cpu_has_avx512_bf16=*/true), "Cooperlake");
  EXPECT_EQ(KernelToForce("Prescott", SimdTier::kAvx512, false), "SkylakeX");
  EXPECT_EQ(KernelToForce("Haswell", SimdTier::kAvx512, true), "Cooperlake");
  EXPECT_EQ(KernelToForce("Core2", SimdTier::kAvx2, false), "Haswell");
  EXPECT_EQ(KernelToForce("Prescott", SimdTier::kAvx, false), "Sandybridge");
  // As good as the CPU, or better than it (a kernel forced by hand), or unknown: kept.
  EXPECT_EQ(KernelToForce("SkylakeX", SimdTier::kAvx512, true), std::nullopt);
  EXPECT_EQ(KernelToForce("Cooperlake", SimdTier::kAvx512, true), std::nullopt);
  EXPECT_EQ(KernelToForce("Zen", SimdTier::kAvx2, false), std::nullopt);
  EXPECT_EQ(KernelToForce("SkylakeX", SimdTier::kAvx2, false), std::nullopt);
  EXPECT_EQ(KernelToForce("Prescott", SimdTier::kSse, false), std::nullopt);
  EXPECT_EQ(KernelToForce("Zen5", SimdTier::kAvx512, true), std::nullopt);
}

TEST(BlasKernelTest, TheLoadedLibrarysChoiceIsReadAndNeverReplacedByItself) {
  const BlasKernel kernel = InspectBlasKernel();
  EXPECT_FALSE(kernel.chosen.empty());
  EXPECT_NE(kernel.config.find(kernel.chosen), std::string::npos) << kernel.config;
  if (kernel.better.has_value()) {
    EXPECT_NE(*kernel.better, kernel.chosen);
    EXPECT_GT(KernelTier(*kernel.better), KernelTier(kernel.chosen));
  }
}

TEST(BlasKernelTest, AProgramStartedAgainSaysWhatOpenBlasHadChosenOnce) {
  // StartOnTheBestBlasKernel hands the kernel OpenBLAS had chosen to the program it starts again.
  setenv("MUOND_OPENBLAS_CHOSE", "Prescott", 1);
  const BlasKernelNote note = DescribeBlasKernel(0);
  EXPECT_FALSE(note.warning);
  EXPECT_THAT(note.text, ::testing::StartsWith("OpenBLAS chose its Prescott kernels, below what this CPU runs"));
  EXPECT_THAT(note.text, ::testing::HasSubstr("its GEMMs run the " + InspectBlasKernel().chosen + " kernels"));
  EXPECT_EQ(std::getenv("MUOND_OPENBLAS_CHOSE"), nullptr) << "left for the program's children";
  EXPECT_THAT(DescribeBlasKernel(0).text, ::testing::Not(::testing::HasSubstr("started again")));
}

TEST_F(CpuBackendTest, AllocateZeroedAlignedAndCopies) {
  ASSERT_OK_AND_ASSIGN(auto buf, backend_->Allocate(37));
  EXPECT_EQ(buf->size(), 37u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buf->data()) % 64, 0u);
  for (float x : Download(*backend_, buf->data(), 37)) EXPECT_EQ(x, 0.0f);
  ASSERT_OK(backend_->Fill(buf->data(), 37, 2.5f));
  for (float x : Download(*backend_, buf->data(), 37)) EXPECT_EQ(x, 2.5f);
  ASSERT_OK_AND_ASSIGN(auto empty, backend_->Allocate(0));
  EXPECT_EQ(empty->size(), 0u);
  EXPECT_THAT(backend_->Allocate(std::numeric_limits<size_t>::max()),
              StatusIs(absl::StatusCode::kResourceExhausted, "allocate"));
  const std::vector<float> src = Random(10);
  auto a = Upload(*backend_, src);
  ASSERT_OK(backend_->CopyOnDevice(a->data(), buf->data(), 10));
  EXPECT_EQ(Download(*backend_, buf->data(), 10), src);
}

// Every transpose combination, a strided batch, alpha and beta, against a fp64 triple loop.
TEST_F(CpuBackendTest, GemmMatchesNaiveProduct) {
  const int64_t m = 5, n = 7, k = 3, batch = 3;
  for (Transpose ta : {Transpose::kNo, Transpose::kYes}) {
    for (Transpose tb : {Transpose::kNo, Transpose::kYes}) {
      GemmShape s{.trans_a = ta,
                  .trans_b = tb,
                  .m = m,
                  .n = n,
                  .k = k,
                  .lda = ta == Transpose::kNo ? k : m,
                  .ldb = tb == Transpose::kNo ? n : k,
                  .ldc = n,
                  .stride_a = m * k + 2,
                  .stride_b = k * n + 1,
                  .stride_c = m * n,
                  .batch = batch};
      const std::vector<float> a = Random(s.stride_a * batch), b = Random(s.stride_b * batch);
      const std::vector<float> c0 = Random(m * n * batch);
      auto da = Upload(*backend_, a), db = Upload(*backend_, b), dc = Upload(*backend_, c0);
      ASSERT_OK(backend_->Gemm(s, 1.5f, da->data(), db->data(), -0.5f, dc->data(), MatmulPrecision::kFp32));
      const std::vector<float> c = Download(*backend_, dc->data(), c0.size());
      for (int64_t bi = 0; bi < batch; ++bi) {
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < n; ++j) {
            double acc = 0;
            for (int64_t p = 0; p < k; ++p) {
              const double av =
                  ta == Transpose::kNo ? a[bi * s.stride_a + i * s.lda + p] : a[bi * s.stride_a + p * s.lda + i];
              const double bv =
                  tb == Transpose::kNo ? b[bi * s.stride_b + p * s.ldb + j] : b[bi * s.stride_b + j * s.ldb + p];
              acc += av * bv;
            }
            const double expected = 1.5 * acc - 0.5 * c0[bi * m * n + i * n + j];
            // fp32 products of O(1) values over k = 3: a few ulps.
            EXPECT_NEAR(c[bi * m * n + i * n + j], expected, 1e-5) << bi << " " << i << " " << j;
          }
        }
      }
    }
  }
  GemmShape bad{.m = -1, .n = 1, .k = 1};
  float x = 0;
  EXPECT_THAT(backend_->Gemm(bad, 1, &x, &x, 0, &x, MatmulPrecision::kFp32),
              StatusIs(absl::StatusCode::kInvalidArgument, "Gemm"));
}

TEST_F(CpuBackendTest, GemmWithEmptyInnerDimensionScalesC) {
  std::vector<float> c = {1, 2, 3, 4};
  auto dc = Upload(*backend_, c);
  float dummy = 0;
  GemmShape s{.m = 2, .n = 2, .k = 0, .lda = 1, .ldb = 2, .ldc = 2};
  ASSERT_OK(backend_->Gemm(s, 1, &dummy, &dummy, 2, dc->data(), MatmulPrecision::kFp32));
  EXPECT_EQ(Download(*backend_, dc->data(), 4), (std::vector<float>{2, 4, 6, 8}));
}

TEST_F(CpuBackendTest, Transpose2DBatched) {
  const int64_t rows = 37, cols = 45, batch = 2;  // not multiples of the tile size
  const std::vector<float> in = Random(rows * cols * batch);
  auto din = Upload(*backend_, in);
  ASSERT_OK_AND_ASSIGN(auto dout, backend_->Allocate(in.size()));
  ASSERT_OK(backend_->Transpose2D(din->data(), dout->data(), rows, cols, batch));
  const std::vector<float> out = Download(*backend_, dout->data(), in.size());
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        ASSERT_EQ(out[b * rows * cols + c * rows + r], in[b * rows * cols + r * cols + c]);
}

TEST_F(CpuBackendTest, ReductionsAndElementwise) {
  // 0.1f² summed 1e6 times per slice: an fp32 accumulator drifts by ~1e-3 relative here, an fp64
  // one stays within n·2⁻⁵³ ≈ 1e-10.
  std::vector<float> x(2'000'000, 0.1f);
  for (size_t i = 1'000'000; i < x.size(); ++i) x[i] = 0.3f;
  auto dx = Upload(*backend_, x);
  double sums[2];
  ASSERT_OK(backend_->SumSquares(dx->data(), 1'000'000, 2, sums));
  const double e0 = 1e6 * double{0.1f} * double{0.1f}, e1 = 1e6 * double{0.3f} * double{0.3f};
  EXPECT_NEAR(sums[0], e0, 1e-9 * e0);
  EXPECT_NEAR(sums[1], e1, 1e-9 * e1);

  ASSERT_OK_AND_ASSIGN(bool finite, backend_->AllFinite(dx->data(), x.size()));
  EXPECT_TRUE(finite);
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    x[12345] = bad;
    auto dbad = Upload(*backend_, x);
    ASSERT_OK_AND_ASSIGN(finite, backend_->AllFinite(dbad->data(), x.size()));
    EXPECT_FALSE(finite);
  }

  std::vector<float> y = {1, 2, 3, 4, 5, 6};
  auto dy = Upload(*backend_, y);
  const float scales[] = {2.0f, -1.0f};
  ASSERT_OK(backend_->ScaleBatched(dy->data(), 3, 2, scales));
  EXPECT_EQ(Download(*backend_, dy->data(), 6), (std::vector<float>{2, 4, 6, -4, -5, -6}));
  auto dz = Upload(*backend_, {1, 1, 1, 1, 1, 1});
  ASSERT_OK(backend_->Axpby(0.5f, dy->data(), 3.0f, dz->data(), 6));
  EXPECT_EQ(Download(*backend_, dz->data(), 6), (std::vector<float>{4, 5, 6, 1, 0.5f, 0}));
}

TEST_F(CpuBackendTest, MomentumMatchesDesignFormulas) {
  const std::vector<float> g = Random(64), m0 = Random(64);
  for (MomentumStyle style : {MomentumStyle::kEma, MomentumStyle::kSum}) {
    for (bool nesterov : {false, true}) {
      const MomentumArgs args{.beta = 0.9f, .style = style, .nesterov = nesterov};
      auto dm = Upload(*backend_, m0), dg = Upload(*backend_, g);
      // The update written over the gradient, as Muon does.
      ASSERT_OK(backend_->Momentum(args, dm->data(), dg->data(), dg->data(), g.size()));
      const auto m = Download(*backend_, dm->data(), g.size()), u = Download(*backend_, dg->data(), g.size());
      for (size_t i = 0; i < g.size(); ++i) {
        const double b = 0.9;
        const double em = style == MomentumStyle::kEma ? b * m0[i] + (1 - b) * g[i] : b * m0[i] + g[i];
        const double eu = !nesterov ? em : (style == MomentumStyle::kEma ? (1 - b) * g[i] + b * em : g[i] + b * em);
        EXPECT_NEAR(m[i], em, 1e-6 * (1 + std::abs(em)));
        EXPECT_NEAR(u[i], eu, 1e-6 * (1 + std::abs(eu)));
      }
    }
  }
}

// The vectorized loops, split over the compute pool, give the bits of the plain scalar loop over the
// same formulas (kernels/elementwise.h) for every element: sizes below one range, odd sizes and sizes
// that split into several ranges with a short tail.
TEST_F(CpuBackendTest, ElementwiseStepsEqualTheScalarLoopBitForBit) {
  const size_t range = ComputePoolRangeForTests();
  for (size_t n : {size_t{1}, size_t{17}, size_t{1000}, 2 * range + 5, 3 * range + 16 * 7 + 3}) {
    const std::vector<float> p0 = Random(n), g = Random(n), m0 = Random(n);
    std::vector<float> v0 = Random(n);
    for (float& x : v0) x = x * x;
    auto check = [&](const char* what, const std::vector<float>& got, const std::vector<float>& want) {
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i]))
            << what << " n=" << n << " i=" << i;
      }
    };
    {
      const AdamWArgs a{
          .lr = 1e-3f, .weight_decay = 0.01f, .bias_correction1 = 0.19f, .bias_correction2_sqrt = 0.0447f};
      auto p = Upload(*backend_, p0), gd = Upload(*backend_, g), m = Upload(*backend_, m0), v = Upload(*backend_, v0);
      ASSERT_OK(backend_->AdamW(a, p->data(), gd->data(), m->data(), v->data(), n));
      std::vector<float> rp = p0, rm = m0, rv = v0;
      for (size_t i = 0; i < n; ++i) AdamWElement(a, rp[i], g[i], rm[i], rv[i]);
      check("adamw p", Download(*backend_, p->data(), n), rp);
      check("adamw v", Download(*backend_, v->data(), n), rv);
    }
    {
      const LionArgs a{.lr = 1e-4f, .weight_decay = 0.1f};
      auto p = Upload(*backend_, p0), gd = Upload(*backend_, g), m = Upload(*backend_, m0);
      ASSERT_OK(backend_->Lion(a, p->data(), gd->data(), m->data(), n));
      std::vector<float> rp = p0, rm = m0;
      for (size_t i = 0; i < n; ++i) LionElement(a, rp[i], g[i], rm[i]);
      check("lion p", Download(*backend_, p->data(), n), rp);
      check("lion m", Download(*backend_, m->data(), n), rm);
    }
    for (const SgdArgs a :
         {SgdArgs{.lr = 0.1f, .momentum = 0.9f, .weight_decay = 0.01f, .nesterov = true, .first_step = false},
          SgdArgs{.lr = 0.1f, .momentum = 0.0f, .weight_decay = 0.0f, .nesterov = false, .first_step = true}}) {
      auto p = Upload(*backend_, p0), gd = Upload(*backend_, g), b = Upload(*backend_, m0);
      ASSERT_OK(backend_->Sgd(a, p->data(), gd->data(), b->data(), n));
      std::vector<float> rp = p0, rb = m0;
      for (size_t i = 0; i < n; ++i) SgdElement(a, rp[i], g[i], rb[i]);
      check("sgd p", Download(*backend_, p->data(), n), rp);
      check("sgd b", Download(*backend_, b->data(), n), rb);
    }
    {
      const MomentumArgs a{.beta = 0.95f, .style = MomentumStyle::kEma, .nesterov = true};
      auto m = Upload(*backend_, m0), gd = Upload(*backend_, g);
      ASSERT_OK(backend_->Momentum(a, m->data(), gd->data(), gd->data(), n));
      std::vector<float> rm = m0, ru = g;
      for (size_t i = 0; i < n; ++i) MomentumElement(a, rm[i], ru[i], ru[i]);
      check("momentum m", Download(*backend_, m->data(), n), rm);
      check("momentum u", Download(*backend_, gd->data(), n), ru);
    }
  }
}

}  // namespace
}  // namespace muond::kernels
