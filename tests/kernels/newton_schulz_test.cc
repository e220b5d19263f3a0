#include "kernels/optim/newton_schulz.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/kernels/forwarding_backend.h"
#include "tests/kernels/reference.h"
#include "tests/testing/error_bounds.h"
#include "tests/testing/status_matchers.h"

namespace muond::optim {
namespace {

using ::muond::testing::ComputeSvd;
using ::muond::testing::Mat;
using ::muond::testing::MatWithSingularValues;
using ::muond::testing::MaxAbsDiff;
using ::muond::testing::NsBound;
using ::muond::testing::ReferenceNs;
using ::muond::testing::WithinBound;

class NewtonSchulzTest : public ::testing::Test {
 protected:
  // Runs `ns` (a NewtonSchulz-like call on device data, in place) over a batch of same-shape
  // matrices uploaded to the backend.
  using NsCall = std::function<absl::Status(float* data, int64_t rows, int64_t cols, int64_t batch)>;
  std::vector<Mat> RunWith(const std::vector<Mat>& in, const NsCall& ns) {
    const int64_t rows = in[0].rows, cols = in[0].cols, mat = rows * cols;
    std::vector<float> host;
    for (const Mat& m : in) host.insert(host.end(), m.v.begin(), m.v.end());
    auto buf = testing::Upload(*backend_, host);
    EXPECT_OK(ns(buf->data(), rows, cols, static_cast<int64_t>(in.size())));
    const std::vector<float> out = testing::Download(*backend_, buf->data(), host.size());
    std::vector<Mat> result;
    for (size_t b = 0; b < in.size(); ++b) {
      Mat m(rows, cols);
      for (int64_t i = 0; i < mat; ++i) m.v[i] = out[b * mat + i];
      result.push_back(m);
    }
    return result;
  }
  // Runs the backend's NewtonSchulz over a batch of same-shape matrices.
  std::vector<Mat> Run(const std::vector<Mat>& in, const NsSchedule& schedule, int steps, double eps = 1e-7,
                       double safety = 1.0) {
    return RunWith(in, [&](float* data, int64_t rows, int64_t cols, int64_t batch) {
      return NewtonSchulz(*backend_, schedule, steps, eps, safety, kernels::MatmulPrecision::kFp32, data, data, rows,
                          cols, batch, ws_);
    });
  }
  // The same through GramNewtonSchulz.
  std::vector<Mat> RunGram(const std::vector<Mat>& in, const NsSchedule& schedule, int steps,
                           const std::vector<int>& restarts, double eps = 1e-7, double safety = 1.0) {
    return RunWith(in, [&](float* data, int64_t rows, int64_t cols, int64_t batch) {
      return GramNewtonSchulz(*backend_, schedule, steps, restarts, eps, safety, kernels::MatmulPrecision::kFp32, data,
                              data, rows, cols, batch, ws_);
    });
  }
  // The same with Turbo-Muon's AOL preconditioning.
  // `stored_transposed`: each matrix holds the transpose of the one AOL scales (a column block).
  std::vector<Mat> RunAol(const std::vector<Mat>& in, const NsSchedule& schedule, int steps,
                          bool stored_transposed = false) {
    return RunWith(in, [&](float* data, int64_t rows, int64_t cols, int64_t batch) {
      return NewtonSchulz(*backend_, schedule, steps, 1e-7, 1.0, kernels::MatmulPrecision::kFp32, data, data, rows,
                          cols, batch, ws_, nullptr, NsPreconditioner::kAol, stored_transposed);
    });
  }
  Mat RunOne(const Mat& in, const NsSchedule& schedule, int steps, double eps = 1e-7) {
    return Run({in}, schedule, steps, eps)[0];
  }
  static NsSchedule Named(const std::string& name) { return *NamedSchedule(name); }

  std::unique_ptr<kernels::Backend> backend_ = kernels::NewCpuBackend(1);
  NsWorkspace ws_;
  std::mt19937 rng_{1234};
};

// Singular values spread over a decade: σ/‖G‖_F stays within [0.01, 1] for these sizes, the range in
// which muon-anchors computes Jordan ×5 to map into [0.6818, 1.1344].
std::vector<double> Decade(int64_t k) {
  std::vector<double> s(k);
  for (int64_t i = 0; i < k; ++i) s[i] = std::pow(10.0, -static_cast<double>(i) / std::max<int64_t>(k - 1, 1));
  return s;
}

struct Shape {
  int64_t rows, cols;
};
// Readable test names in ctest instead of a byte dump.
void PrintTo(const Shape& s, std::ostream* os) { *os << s.rows << "x" << s.cols; }

class NewtonSchulzShapeTest : public NewtonSchulzTest, public ::testing::WithParamInterface<Shape> {};

TEST_P(NewtonSchulzShapeTest, SimpleFiveStepsApproximatesPolarFactor) {
  const auto [rows, cols] = GetParam();
  const int64_t k = std::min(rows, cols);
  const Mat g = MatWithSingularValues(rng_, rows, cols, Decade(k));
  const Mat o = RunOne(g, Named("simple"), 5);

  const testing::Svd in_svd = ComputeSvd(g);
  const testing::Svd out_svd = ComputeSvd(o);
  for (double s : out_svd.s) {
    EXPECT_GE(s, 0.68);
    EXPECT_LE(s, 1.14);
  }
  // NS is a matrix polynomial, so exactly O = U·p₅(Σ/‖G‖)·Vᵀ (fp64 SVD: exact to ~1e-14). fp32
  // GEMMs perturb it by at most NsRoundingBound (reference.h: each step's rounding, ≈ √n·u of its
  // terms, times the divided-difference gain of the later steps; 4e-5 to 2e-4 for these shapes). A
  // wrong coefficient, a missing transpose or a wrong normalization moves entries by ≥ 1e-2.
  // NsBound: that bound, capped at 1e-3 to keep 10× under the smallest bug.
  const double norm = testing::FrobeniusNorm(g);
  const NsSchedule simple = Named("simple");
  const Mat expected =
      testing::Reassemble(in_svd, [&](double s) { return testing::ScalarNs(s / (norm + 1e-7), simple, 5); });
  const double bound = NsBound(g, simple, 5);
  EXPECT_TRUE(WithinBound("ns.simple5_vs_svd", MaxAbsDiff(o, expected), bound));

  // Against the polar factor itself the singular values may be off by up to 0.3182 (the band above,
  // in exact arithmetic), so ‖O − UVᵀ‖₂ ≤ 0.3182 plus the rounding (‖·‖₂ ≤ ‖·‖_F ≤ the bound); a
  // wrong sign or transposed factor gives ≥ 1.
  const Mat polar = testing::Reassemble(in_svd, [](double) { return 1.0; });
  Mat diff = o;
  for (size_t i = 0; i < diff.v.size(); ++i) diff.v[i] -= polar.v[i];
  EXPECT_LE(ComputeSvd(diff).s[0], 0.3182 + bound);
}

TEST_P(NewtonSchulzShapeTest, PolarExpressEightStepsIsOrthogonal) {
  const auto [rows, cols] = GetParam();
  const int64_t k = std::min(rows, cols);
  const Mat g = MatWithSingularValues(rng_, rows, cols, Decade(k));
  const Mat o = RunOne(g, Named("polar_express"), 8);
  // Rows (wide) or columns (tall) orthonormal: the smaller Gram matrix is the identity.
  const Mat gram =
      rows <= cols ? testing::MatMul(o, testing::Transposed(o)) : testing::MatMul(testing::Transposed(o), o);
  Mat eye(k, k);
  for (int64_t i = 0; i < k; ++i) eye(i, i) = 1.0;
  // The scalar map after 8 steps is within 2e-3 of 1 over σ/‖G‖ ∈ [0.01, 1] (ScalarMapBounds), so
  // |σ² − 1| ≤ 4e-3 in exact arithmetic; fp32 rounding adds ≤ 2·‖O‖₂·NsBound ≤ 2.1e-3 to the
  // Gram matrix's entries. 1e-2 covers both and still fails any set that has not converged (an
  // unconverged σ ≈ 0.7 gives |σ² − 1| ≈ 0.5).
  const double bound = 4e-3 + 2 * 1.002 * NsBound(g, Named("polar_express"), 8);
  EXPECT_LE(bound, 1e-2);
  EXPECT_TRUE(WithinBound("ns.polar_express8_gram", MaxAbsDiff(gram, eye), 1e-2));
}

INSTANTIATE_TEST_SUITE_P(Shapes, NewtonSchulzShapeTest,
                         ::testing::Values(Shape{32, 32}, Shape{24, 64}, Shape{64, 24}, Shape{1, 40}, Shape{40, 1}),
                         [](const auto& param_info) {
                           return std::to_string(param_info.param.rows) + "x" + std::to_string(param_info.param.cols);
                         });

// The premise of the two tests above, checked on the scalar map in fp64.
TEST(NewtonSchulzScalarTest, ScalarMapBounds) {
  const NsSchedule simple = *NamedSchedule("simple");
  const NsSchedule pe = *NamedSchedule("polar_express");
  double lo = 10, hi = 0, pe_err = 0;
  for (double x = 0.01; x <= 1.0; x *= 1.001) {
    const double y = testing::ScalarNs(x, simple, 5);
    lo = std::min(lo, y);
    hi = std::max(hi, y);
    pe_err = std::max(pe_err, std::abs(testing::ScalarNs(x, pe, 8) - 1.0));
  }
  EXPECT_NEAR(lo, 0.6818, 1e-3);
  EXPECT_NEAR(hi, 1.1344, 1e-3);
  EXPECT_LT(pe_err, 2e-3);
}

TEST_F(NewtonSchulzTest, ZeroMatrixGivesZeros) {
  for (double eps : {1e-7, 0.0}) {
    const Mat o = RunOne(Mat(8, 12), Named("simple"), 5, eps);
    for (double x : o.v) ASSERT_EQ(x, 0.0) << "eps=" << eps;
  }
}

TEST_F(NewtonSchulzTest, TinyNormInputStaysFinite) {
  for (const std::string& name : NamedScheduleNames()) {
    for (double scale : {1e-12, 1e-30, 1e-40 /* subnormal in fp32 */}) {
      Mat g = testing::RandomMat(rng_, 6, 10, scale);
      for (double& x : g.v) x = static_cast<float>(x);
      const Mat o = RunOne(g, Named(name), 5);
      for (double x : o.v) ASSERT_TRUE(std::isfinite(x)) << name << " scale " << scale;
    }
  }
}

TEST_F(NewtonSchulzTest, BatchedEqualsOneAtATime) {
  for (const Shape shape : {Shape{16, 48}, Shape{48, 16}, Shape{20, 20}}) {
    std::vector<Mat> in;
    for (int i = 0; i < 4; ++i) in.push_back(testing::RandomMat(rng_, shape.rows, shape.cols));
    for (Mat& m : in)
      for (double& x : m.v) x = static_cast<float>(x);
    const std::vector<Mat> batched = Run(in, Named("quintic"), 5);
    for (size_t i = 0; i < in.size(); ++i) {
      // The same GEMMs on the same data, but a BLAS may block a batch element at another address
      // differently: each result is within NsRoundingBound of the exact one, so the two within twice
      // that. A batch element reading another's data (a wrong stride) is off by O(1).
      EXPECT_TRUE(WithinBound("ns.batched_vs_one", MaxAbsDiff(batched[i], RunOne(in[i], Named("quintic"), 5)),
                              2 * NsBound(in[i], Named("quintic"), 5)));
    }
  }
}

// Every named set, and custom lists in both "after" modes, against the fp64 reference loop, with
// more steps than the lists are long so cycling and repeating are both exercised.
TEST_F(NewtonSchulzTest, MatchesFp64ReferenceForEverySchedule) {
  std::vector<NsSchedule> schedules;
  for (const std::string& name : NamedScheduleNames()) schedules.push_back(Named(name));
  const std::vector<NsCoefficient> custom = {{1.875, -1.25, 0.375}, {3.4445, -4.775, 2.0315}};
  schedules.push_back({"custom", custom, CoefficientsAfter::kCycle});
  schedules.push_back({"custom", custom, CoefficientsAfter::kRepeatLast});
  for (const Shape shape : {Shape{24, 40}, Shape{40, 24}}) {
    Mat g = testing::RandomMat(rng_, shape.rows, shape.cols);
    for (double& x : g.v) x = static_cast<float>(x);
    for (const NsSchedule& s : schedules) {
      for (int steps : {1, 5, 10}) {
        // fp32 GEMM rounding (≈ √n·u per entry) grows by at most the step's divided-difference
        // gain (|p'| and kin) per step: NsRoundingBound. A wrong tuple, a wrong cycle/repeat_last
        // mode (≥ 1e-2 apart, checked below) or a missed transpose fails by orders of magnitude.
        EXPECT_TRUE(WithinBound("ns.every_schedule_vs_fp64", MaxAbsDiff(RunOne(g, s, steps), ReferenceNs(g, s, steps)),
                                NsBound(g, s, steps)))
            << s.name << (s.after == CoefficientsAfter::kCycle ? " cycle " : " repeat_last ") << steps << " steps "
            << shape.rows << "x" << shape.cols;
      }
    }
  }
  Mat g = testing::RandomMat(rng_, 24, 40);
  EXPECT_GT(MaxAbsDiff(ReferenceNs(g, schedules[schedules.size() - 2], 10), ReferenceNs(g, schedules.back(), 10)),
            1e-2);
}

TEST_F(NewtonSchulzTest, NormSafetyAndEpsEnterTheNormalization) {
  Mat g = testing::RandomMat(rng_, 12, 20);
  for (double& x : g.v) x = static_cast<float>(x);
  const NsSchedule s = Named("simple");
  // fp32 against fp64: NsRoundingBound; leaving out eps = 0.5 or safety = 1.02 moves entries by ≥ 1e-2.
  EXPECT_TRUE(WithinBound("ns.safety_eps_vs_fp64",
                          MaxAbsDiff(Run({g}, s, 3, 0.5, 1.02)[0], ReferenceNs(g, s, 3, 0.5, 1.02)),
                          NsBound(g, s, 3, 3, 0.5, 1.02)));
}

// The rounding the growth check allows for (NsRoundingOf, docs/algorithms.md, Finite steps), on the
// real fp32 iteration of rank-1 inputs, whose largest singular value the normalization puts exactly
// at the top of the range: within the range cans stays under the fp32 bound, but an input 2⁻¹⁰ above
// it (what tf32 operands can leave) runs away, as the bound for tf32 says it may.
TEST_F(NewtonSchulzTest, CansRunsAwayJustAboveItsRangeAsItsBoundSays) {
  const NsSchedule cans = Named("cans");
  const double fp32_bound = NsSingularValueBound(cans, 5, 1.0, NsRoundingOf(kernels::MatmulPrecision::kFp32));
  const double tf32_bound = NsSingularValueBound(cans, 5, 1.0, NsRoundingOf(kernels::MatmulPrecision::kTf32));
  ASSERT_LT(fp32_bound, kMaxNsGrowth);
  ASSERT_GT(tf32_bound, kMaxNsGrowth);
  std::normal_distribution<double> normal;
  for (const Shape shape : {Shape{16, 256}, Shape{256, 16}, Shape{1, 64}, Shape{48, 48}}) {
    Mat g(shape.rows, shape.cols);
    std::vector<double> u(shape.rows), v(shape.cols);
    for (double& x : u) x = normal(rng_);
    for (double& x : v) x = normal(rng_);
    for (int64_t i = 0; i < shape.rows; ++i)
      for (int64_t j = 0; j < shape.cols; ++j) g.v[i * shape.cols + j] = static_cast<float>(u[i] * v[j]);
    const double within = ComputeSvd(Run({g}, cans, 5, 0.0, 1.0)[0]).s[0];
    EXPECT_GT(within, 0.5) << shape.rows << "x" << shape.cols;
    EXPECT_LT(within, fp32_bound) << shape.rows << "x" << shape.cols;
    const Mat above = Run({g}, cans, 5, 0.0, 1.0 / (1.0 + 0x1p-10))[0];
    const bool finite = std::all_of(above.v.begin(), above.v.end(), [](double x) { return std::isfinite(x); });
    if (finite) {
      EXPECT_GT(ComputeSvd(above).s[0], kMaxNsGrowth) << shape.rows << "x" << shape.cols;
    }
  }
}

TEST_F(NewtonSchulzTest, RejectsBadArguments) {
  float dummy = 0;
  EXPECT_FALSE(NewtonSchulz(*backend_, Named("simple"), 5, 1e-7, 1.0, kernels::MatmulPrecision::kFp32, &dummy, &dummy,
                            -1, 2, 1, ws_)
                   .ok());
  EXPECT_FALSE(NewtonSchulz(*backend_, NsSchedule{"custom", {}, CoefficientsAfter::kCycle}, 5, 1e-7, 1.0,
                            kernels::MatmulPrecision::kFp32, &dummy, &dummy, 1, 1, 1, ws_)
                   .ok());
}

TEST_F(NewtonSchulzTest, WorkspaceGrowsAndIsReused) {
  ASSERT_OK_AND_ASSIGN(float* a, ws_.Get(*backend_, 5, 100));
  ASSERT_OK_AND_ASSIGN(float* b, ws_.Get(*backend_, 5, 50));
  EXPECT_EQ(a, b);
  EXPECT_GE(ws_.held(), 100u);
  ws_.Release();
  EXPECT_EQ(ws_.held(), 0u);
}

// ---- GramNewtonSchulz ----

// The Polar Express paper's first five tuples with the 1.05 safety factor folded in as
// (a/1.05, b/1.05³, c/1.05⁵), as used with Gram Newton–Schulz and a restart at step 2.
NsSchedule GramPolarExpress() {
  return {"custom",
          {{8.28721201814563, -23.595886519098837, 17.300387312530933},
           {4.107059111542203, -2.9478499167379106, 0.5448431082926601},
           {3.9486908534822946, -2.908902115962949, 0.5518191394370137},
           {3.3184196573706015, -2.488488024314874, 0.51004894012372},
           {2.300652019954817, -1.6689039845747493, 0.4188073119525673}},
          CoefficientsAfter::kRepeatLast};
}

// alpha·x + beta·y.
Mat Lin(double alpha, const Mat& x, double beta, const Mat& y) {
  Mat out = y;
  for (size_t i = 0; i < out.v.size(); ++i) out.v[i] = alpha * x.v[i] + beta * y.v[i];
  return out;
}

// The Gram Newton–Schulz loop of newton_schulz.h, in fp64, written from the header's formula
// independently of the Backend code: wide orientation, normalize, iterate on R = X·Xᵀ, Q·X.
Mat ReferenceGramNs(const Mat& g, const NsSchedule& schedule, int steps, const std::vector<int>& restarts,
                    double eps = 1e-7, double safety = 1.0) {
  const bool tall = g.rows > g.cols;
  Mat x = tall ? testing::Transposed(g) : g;
  const double denom = safety * testing::FrobeniusNorm(x) + eps;
  for (double& e : x.v) e = denom > 0 ? e / denom : 0.0;
  const auto restarts_at = [&](int t) { return std::find(restarts.begin(), restarts.end(), t) != restarts.end(); };
  Mat r = testing::MatMul(x, testing::Transposed(x));
  std::optional<Mat> q;
  for (int t = 0; t < steps; ++t) {
    const NsCoefficient co = schedule.At(t);
    if (t != 0 && restarts_at(t)) {
      x = testing::MatMul(*q, x);
      r = testing::MatMul(x, testing::Transposed(x));
      q.reset();
    }
    const Mat z = Lin(co.b, r, co.c, testing::MatMul(r, r));
    if (!q) {
      q = z;
      for (int64_t i = 0; i < z.rows; ++i) (*q)(i, i) += co.a;
    } else {
      q = Lin(co.a, *q, 1.0, testing::MatMul(*q, z));
    }
    if (t < steps - 1 && !restarts_at(t + 1)) {
      const Mat rz = Lin(co.a, r, 1.0, testing::MatMul(r, z));
      r = Lin(co.a, rz, 1.0, testing::MatMul(z, rz));
    }
  }
  const Mat out = q ? testing::MatMul(*q, x) : x;
  return tall ? testing::Transposed(out) : out;
}

Mat RoundedRandom(std::mt19937& rng, int64_t rows, int64_t cols) {
  Mat g = testing::RandomMat(rng, rows, cols);
  for (double& x : g.v) x = static_cast<float>(x);  // the device sees exactly this matrix
  return g;
}

// The reference itself: in fp64 the Gram loop is the standard iteration, whatever the restarts.
TEST(GramNewtonSchulzReferenceTest, Fp64GramLoopIsTheStandardIteration) {
  std::mt19937 rng(99);
  for (const Shape shape : {Shape{24, 64}, Shape{64, 24}}) {
    const Mat g = testing::RandomMat(rng, shape.rows, shape.cols);
    for (const std::vector<int>& restarts : {std::vector<int>{}, std::vector<int>{2}}) {
      for (const NsSchedule& s : {GramPolarExpress(), *NamedSchedule("simple"), *NamedSchedule("cubic5")}) {
        // Only fp64 rounding separates them: the fp32 rounding of these maps (NsBound, ≤ 1e-3)
        // scaled by fp64's u = 2⁻⁵³ over fp32's 2⁻²⁴, ≤ 2⁻²⁹·1e-3 ≈ 2e-12 for each; 1e-10 has room
        // for the Gram loop's extra products, while a wrong R update or Q product is off by ≥ 1e-2.
        EXPECT_LT(MaxAbsDiff(ReferenceGramNs(g, s, 5, restarts), ReferenceNs(g, s, 5)), 1e-10)
            << s.name << " restarts " << restarts.size() << " " << shape.rows << "x" << shape.cols;
      }
    }
  }
}

// Tolerances: fp32 rounding amplified by the slope of the composite map, NsBound (reference.h: the
// derived NsRoundingBound, capped at 1e-3, a tenth of the smallest bug) with 5 GEMMs a step (R·R, Q·Z and the two of
// the R update besides Q·X). The Gram Polar Express set is far steeper (p'(σ) ≈ 24 at σ = 1 for its first tuple, and
// its composition swings σ widely), which the bound's gain follows. A wrong coefficient, Q product, R update or restart
// (X ← Q·X, Q reset) moves entries by ≥ 1e-2. Whether a restart runs at all changes nothing in exact arithmetic;
// GramGemmCountAndCubicSkipsRSquared checks that.
TEST_F(NewtonSchulzTest, GramMatchesFp64GramReference) {
  struct Case {
    NsSchedule schedule;
    std::vector<int> restarts;
  };
  const std::vector<Case> cases = {
      {GramPolarExpress(), {}}, {GramPolarExpress(), {2}}, {Named("simple"), {}}, {Named("quintic"), {3}}};
  for (const Shape shape : {Shape{24, 64}, Shape{64, 24}}) {
    const Mat g = RoundedRandom(rng_, shape.rows, shape.cols);
    for (const Case& c : cases) {
      EXPECT_TRUE(WithinBound(
          "ns.gram_vs_fp64",
          MaxAbsDiff(RunGram({g}, c.schedule, 5, c.restarts)[0], ReferenceGramNs(g, c.schedule, 5, c.restarts)),
          NsBound(g, c.schedule, 5, 5)))
          << c.schedule.name << " restarts " << c.restarts.size() << " " << shape.rows << "x" << shape.cols;
    }
  }
  // Rank one (m = 1): σ/‖X‖_F = 1 exactly, where the Polar Express set's first tuple is steepest
  // (fp32 NewtonSchulz itself is up to 2.5e-3 off there), so only the flatter sets.
  for (const Shape shape : {Shape{1, 40}, Shape{40, 1}}) {
    const Mat g = RoundedRandom(rng_, shape.rows, shape.cols);
    for (const Case& c : {cases[2], cases[3]}) {
      EXPECT_TRUE(WithinBound(
          "ns.gram_vs_fp64",
          MaxAbsDiff(RunGram({g}, c.schedule, 5, c.restarts)[0], ReferenceGramNs(g, c.schedule, 5, c.restarts)),
          NsBound(g, c.schedule, 5, 5)))
          << c.schedule.name << " " << shape.rows << "x" << shape.cols;
    }
  }
  // Batched: every matrix of the batch against its own reference.
  for (const Shape shape : {Shape{16, 40}, Shape{40, 16}}) {
    std::vector<Mat> in;
    for (int i = 0; i < 3; ++i) in.push_back(RoundedRandom(rng_, shape.rows, shape.cols));
    for (const std::vector<int>& restarts : {std::vector<int>{}, std::vector<int>{2}}) {
      const std::vector<Mat> out = RunGram(in, GramPolarExpress(), 5, restarts);
      for (size_t i = 0; i < in.size(); ++i) {
        EXPECT_TRUE(WithinBound("ns.gram_batched_vs_fp64",
                                MaxAbsDiff(out[i], ReferenceGramNs(in[i], GramPolarExpress(), 5, restarts)),
                                NsBound(in[i], GramPolarExpress(), 5, 5)))
            << "batch element " << i << " restarts " << restarts.size() << " " << shape.rows << "x" << shape.cols;
      }
    }
  }
}

TEST_F(NewtonSchulzTest, GramAgreesWithStandardNewtonSchulz) {
  for (const Shape shape : {Shape{64, 256}, Shape{256, 64}}) {
    const Mat g = RoundedRandom(rng_, shape.rows, shape.cols);
    // Both are fp32 evaluations of one polynomial map, rounded differently: each within its
    // NsRoundingBound (5 GEMMs a step for Gram, 3 for the standard loop) of the exact map, so the
    // two within the sum. Any wrong step moves entries by ≥ 1e-2.
    for (const NsSchedule& s : {Named("simple"), GramPolarExpress()}) {
      const std::vector<int> restarts = s.name == "simple" ? std::vector<int>{} : std::vector<int>{2};
      EXPECT_TRUE(WithinBound("ns.gram_vs_standard", MaxAbsDiff(RunGram({g}, s, 5, restarts)[0], RunOne(g, s, 5)),
                              NsBound(g, s, 5, 5) + NsBound(g, s, 5, 3)))
          << s.name << " " << shape.rows << "x" << shape.cols;
    }
  }
}

TEST_F(NewtonSchulzTest, GramSquareFallsBackToNewtonSchulz) {
  const Mat g = RoundedRandom(rng_, 20, 20);
  const Mat gram = RunGram({g}, GramPolarExpress(), 5, {2})[0];
  const Mat standard = RunOne(g, GramPolarExpress(), 5);
  for (size_t i = 0; i < g.v.size(); ++i) ASSERT_EQ(gram.v[i], standard.v[i]) << "entry " << i;
}

TEST_F(NewtonSchulzTest, GramZeroMatrixGivesZeros) {
  for (const Shape shape : {Shape{8, 12}, Shape{12, 8}}) {
    for (double eps : {1e-7, 0.0}) {
      const Mat o = RunGram({Mat(shape.rows, shape.cols)}, GramPolarExpress(), 5, {2}, eps)[0];
      for (double x : o.v) {
        ASSERT_EQ(x, 0.0) << "eps=" << eps << " " << shape.rows << "x" << shape.cols;
      }
    }
  }
}

// No step: the normalized input, exactly as NewtonSchulz gives it. Restart entries at 0 or past the
// last step change nothing.
TEST_F(NewtonSchulzTest, GramZeroStepsAndIgnoredRestarts) {
  const Mat g = RoundedRandom(rng_, 12, 30);
  const Mat zero_steps = RunGram({g}, Named("simple"), 0, {})[0];
  const Mat standard = RunOne(g, Named("simple"), 0);
  for (size_t i = 0; i < g.v.size(); ++i) ASSERT_EQ(zero_steps.v[i], standard.v[i]);
  const Mat plain = RunGram({g}, GramPolarExpress(), 5, {})[0];
  const Mat ignored = RunGram({g}, GramPolarExpress(), 5, {0, 5, 9})[0];
  for (size_t i = 0; i < g.v.size(); ++i) ASSERT_EQ(plain.v[i], ignored.v[i]);
}

TEST_F(NewtonSchulzTest, GramCubicTupleMatchesReference) {
  const NsSchedule cubic = Named("cubic5");
  for (const Shape shape : {Shape{24, 64}, Shape{64, 24}}) {
    const Mat g = RoundedRandom(rng_, shape.rows, shape.cols);
    for (const std::vector<int>& restarts : {std::vector<int>{}, std::vector<int>{2}}) {
      const Mat o = RunGram({g}, cubic, 5, restarts)[0];
      // The same bounds as the quintic sets above.
      EXPECT_TRUE(WithinBound("ns.gram_cubic_vs_fp64", MaxAbsDiff(o, ReferenceGramNs(g, cubic, 5, restarts)),
                              NsBound(g, cubic, 5, 5)));
      EXPECT_TRUE(WithinBound("ns.gram_cubic_vs_standard", MaxAbsDiff(o, RunOne(g, cubic, 5)),
                              NsBound(g, cubic, 5, 5) + NsBound(g, cubic, 5, 3)));
    }
  }
}

// Counts the GEMMs a wrapped backend runs, forwarding every primitive.
class GemmCountingBackend final : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  int gemms = 0;
  // Multiply-adds as NsWork splits them: products over the long side (k or n > m) and m³ ones; the
  // k = 1 products that write a·I are left out.
  double wide_macs = 0, square_macs = 0;

  absl::Status Gemm(const kernels::GemmShape& shape, float alpha, const float* a, const float* b, float beta, float* c,
                    kernels::MatmulPrecision precision) override {
    ++gemms;
    const double macs = static_cast<double>(shape.m * shape.n * shape.k);
    if (shape.k > 1) (shape.m == shape.n && shape.n == shape.k ? square_macs : wide_macs) += macs;
    return ForwardingBackend::Gemm(shape, alpha, a, b, beta, c, precision);
  }
};

// The GEMM schedule: X·Xᵀ and Q·X once each (plus two per restart), a·I once per anchor, then per
// step R·R (quintic tuples only) and Q·Z (from the second step of an anchor on), and the two GEMMs
// of the R update except after the last step and before a restart.
TEST_F(NewtonSchulzTest, GramGemmCountAndCubicSkipsRSquared) {
  GemmCountingBackend counting(*backend_);
  NsWorkspace ws;
  const auto count = [&](const NsSchedule& s, const std::vector<int>& restarts) {
    const Mat g = RoundedRandom(rng_, 16, 48);
    std::vector<float> host(g.v.begin(), g.v.end());
    auto buf = testing::Upload(counting, host);
    counting.gemms = 0;
    EXPECT_OK(GramNewtonSchulz(counting, s, 5, restarts, 1e-7, 1.0, kernels::MatmulPrecision::kFp32, buf->data(),
                               buf->data(), 16, 48, 1, ws));
    return counting.gemms;
  };
  // 1 (R) + 1 (a·I) + 5 (R·R) + 4 (Q·Z) + 2·4 (R updates) + 1 (Q·X).
  EXPECT_EQ(count(GramPolarExpress(), {}), 20);
  // A restart at 2 adds Q·X, X·Xᵀ and a·I but drops Q·Z at step 2 and the R update after step 1.
  EXPECT_EQ(count(GramPolarExpress(), {2}), 20 + 3 - 1 - 2);
  EXPECT_EQ(count(Named("cubic5"), {}), 20 - 5);
}

// StandardNsWork and GramNsWork (the cost rule of ns_algorithm auto) count exactly the
// multiply-adds the two iterations issue, wide and tall, quintic and cubic, with a restart.
TEST_F(NewtonSchulzTest, NsWorkCountsTheGemmsIssued) {
  GemmCountingBackend counting(*backend_);
  NsWorkspace ws;
  for (const auto& [set, restarts] :
       {std::pair<const char*, std::vector<int>>{"simple", {}}, {"gram_polar_express", {2}}, {"cubic5", {}}}) {
    for (const Shape shape : {Shape{16, 48}, Shape{40, 24}}) {
      SCOPED_TRACE(::testing::Message() << set << " " << shape.rows << "x" << shape.cols);
      const NsSchedule s = Named(set);
      const Mat g = RoundedRandom(rng_, shape.rows, shape.cols);
      std::vector<float> host(g.v.begin(), g.v.end());
      auto buf = testing::Upload(counting, host);
      for (const bool gram : {false, true}) {
        counting.wide_macs = counting.square_macs = 0;
        if (gram) {
          ASSERT_OK(GramNewtonSchulz(counting, s, 5, restarts, 1e-7, 1.0, kernels::MatmulPrecision::kFp32, buf->data(),
                                     buf->data(), shape.rows, shape.cols, 1, ws));
        } else {
          ASSERT_OK(NewtonSchulz(counting, s, 5, 1e-7, 1.0, kernels::MatmulPrecision::kFp32, buf->data(), buf->data(),
                                 shape.rows, shape.cols, 1, ws));
        }
        const NsWork work =
            gram ? GramNsWork(shape.rows, shape.cols, s, 5, restarts) : StandardNsWork(shape.rows, shape.cols, s, 5);
        EXPECT_EQ(counting.wide_macs, work.wide) << "gram " << gram;
        EXPECT_EQ(counting.square_macs, work.square) << "gram " << gram;
      }
    }
  }
}

TEST_F(NewtonSchulzTest, GramReserveCoversTheCallAndRejectsBadArguments) {
  ASSERT_OK(ws_.ReserveFor(*backend_, 24, 64, 3, NsUse{.gram = true}));
  const size_t held = ws_.held();
  std::vector<Mat> in;
  for (int i = 0; i < 3; ++i) in.push_back(RoundedRandom(rng_, 24, 64));
  RunGram(in, GramPolarExpress(), 5, {2});
  EXPECT_EQ(ws_.held(), held);  // nothing allocated past the reservation

  float dummy = 0;
  EXPECT_FALSE(GramNewtonSchulz(*backend_, Named("simple"), 5, {}, 1e-7, 1.0, kernels::MatmulPrecision::kFp32, &dummy,
                                &dummy, -1, 2, 1, ws_)
                   .ok());
  const NsSchedule empty{"custom", {}, CoefficientsAfter::kCycle};
  EXPECT_FALSE(GramNewtonSchulz(*backend_, empty, 5, {}, 1e-7, 1.0, kernels::MatmulPrecision::kFp32, &dummy, &dummy, 1,
                                2, 1, ws_)
                   .ok());
}

// Turbo-Muon's AOL Newton–Schulz (4 steps of the aol set) against its fp64 reference on wide, tall,
// square and batched matrices; no singular value leaves the iteration's range. The tolerance: AOL's
// scaled X has spectral norm ≤ 1 like the Frobenius-scaled one, so its fp32 rounding follows the
// same bound; 2e-4 is NsBound's cap range for these sizes (SimpleFiveStepsApproximatesPolarFactor),
// while a scale on the wrong side, a missed reuse of A or a wrong tuple moves entries by ≥ 1e-2.
TEST_F(NewtonSchulzTest, AolMatchesItsReferenceAndOrthogonalizesInFourSteps) {
  const NsSchedule aol = Named("aol");
  for (const auto& [rows, cols, batch] :
       std::vector<std::tuple<int64_t, int64_t, int64_t>>{{24, 64, 1}, {64, 24, 1}, {32, 32, 1}, {16, 40, 3}}) {
    std::vector<Mat> in;
    for (int64_t b = 0; b < batch; ++b)
      in.push_back(MatWithSingularValues(rng_, rows, cols, Decade(std::min(rows, cols))));
    const std::vector<Mat> out = RunAol(in, aol, 4);
    for (int64_t b = 0; b < batch; ++b) {
      const Mat expected = testing::ReferenceAolNs(in[b], aol, 4);
      EXPECT_TRUE(testing::WithinBound("ns.aol_vs_fp64", testing::MaxAbsDiff(out[b], expected), 2e-4))
          << rows << "x" << cols << " #" << b;
      for (double s : ComputeSvd(out[b]).s) EXPECT_LT(s, 1.3) << rows << "x" << cols;
    }
  }
  // A zero matrix stays zero (the eps floor keeps the scale finite).
  const std::vector<Mat> zero = RunAol({Mat(8, 12)}, aol, 4);
  for (double v : zero[0].v) EXPECT_EQ(v, 0.0);
}

// AOL scales a rank-one matrix, and a single row or column, to spectral norm exactly 1, and brings a
// dominant singular value close to it: the aol set must keep those directions' sign (a set that maps
// σ = 1 below zero reverses the update). Singular values do not show a sign, so the check is the
// output's alignment with the input's top singular pair: u·O·v near p(1) ≈ 0.99 for rank one.
TEST_F(NewtonSchulzTest, AolKeepsTheSignOfSingularValuesNearOne) {
  const NsSchedule aol = Named("aol");
  for (const auto& [rows, cols, noise] : std::vector<std::tuple<int64_t, int64_t, double>>{
           {1, 16, 0.0}, {16, 1, 0.0}, {8, 12, 0.0}, {12, 8, 0.0}, {16, 24, 0.01}, {24, 16, 0.01}}) {
    const Mat u = testing::RandomMat(rng_, rows, 1), v = testing::RandomMat(rng_, cols, 1);
    Mat g = testing::RandomMat(rng_, rows, cols, noise);
    double u_norm = 0, v_norm = 0;
    for (double x : u.v) u_norm += x * x;
    for (double x : v.v) v_norm += x * x;
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) g(i, j) += u(i, 0) * v(j, 0) / std::sqrt(u_norm * v_norm);
    const Mat out = RunAol({g}, aol, 4)[0];
    double along = 0;  // uᵀ·O·v with unit u, v
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) along += u(i, 0) * out(i, j) * v(j, 0);
    along /= std::sqrt(u_norm * v_norm);
    EXPECT_GT(along, 0.9) << rows << "x" << cols << " noise " << noise;
    EXPECT_LT(along, 1.2) << rows << "x" << cols << " noise " << noise;
  }
}

// AOL's scales depend on the orientation: a square matrix stored as its transpose (a tensor-parallel
// column block) is scaled by its own rows, so the result is the transpose of the reference's on the
// matrix itself, not the reference's on the stored transpose.
TEST_F(NewtonSchulzTest, AolScalesTheRowsOfASquareMatrixStoredTransposed) {
  const NsSchedule aol = Named("aol");
  const Mat g = MatWithSingularValues(rng_, 12, 12, Decade(12));
  const Mat stored = testing::Transposed(g);
  const Mat out = RunAol({stored}, aol, 4, /*stored_transposed=*/true)[0];
  const Mat expected = testing::Transposed(testing::ReferenceAolNs(g, aol, 4));
  EXPECT_TRUE(testing::WithinBound("ns.aol_transposed_vs_fp64", testing::MaxAbsDiff(out, expected), 2e-4));
  const Mat of_stored = testing::ReferenceAolNs(stored, aol, 4);
  EXPECT_GT(testing::MaxAbsDiff(out, of_stored), 1e-2) << "the case must tell the orientations apart";
}

}  // namespace
}  // namespace muond::optim
