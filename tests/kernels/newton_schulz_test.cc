#include "kernels/optim/newton_schulz.h"

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/kernels/reference.h"
#include "tests/testing/status_matchers.h"

namespace muond::optim {
namespace {

using ::muond::testing::ComputeSvd;
using ::muond::testing::Mat;
using ::muond::testing::MatWithSingularValues;
using ::muond::testing::MaxAbsDiff;
using ::muond::testing::ReferenceNs;

class NewtonSchulzTest : public ::testing::Test {
 protected:
  // Runs the backend's NewtonSchulz over a batch of same-shape matrices.
  std::vector<Mat> Run(const std::vector<Mat>& in, const NsSchedule& schedule, int steps,
                       double eps = 1e-7, double safety = 1.0) {
    const int64_t rows = in[0].rows, cols = in[0].cols, mat = rows * cols;
    std::vector<float> host;
    for (const Mat& m : in) host.insert(host.end(), m.v.begin(), m.v.end());
    auto buf = testing::Upload(*backend_, host);
    EXPECT_OK(NewtonSchulz(*backend_, schedule, steps, eps, safety, kernels::MatmulPrecision::kFp32,
                           buf->data(), buf->data(), rows, cols, static_cast<int64_t>(in.size()), ws_));
    const std::vector<float> out = testing::Download(*backend_, buf->data(), host.size());
    std::vector<Mat> result;
    for (size_t b = 0; b < in.size(); ++b) {
      Mat m(rows, cols);
      for (int64_t i = 0; i < mat; ++i) m.v[i] = out[b * mat + i];
      result.push_back(m);
    }
    return result;
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
  // NS is a matrix polynomial, so exactly O = U·p₅(Σ/‖G‖)·Vᵀ. fp32 GEMMs perturb this by < 1e-6
  // (measured ≤ 7.4e-7): 1e-5 leaves margin yet fails a wrong coefficient, a missing transpose or a
  // wrong normalization, which move entries by ≥ 1e-2.
  const double norm = testing::FrobeniusNorm(g);
  const NsSchedule simple = Named("simple");
  const Mat expected = testing::Reassemble(
      in_svd, [&](double s) { return testing::ScalarNs(s / (norm + 1e-7), simple, 5); });
  EXPECT_LT(MaxAbsDiff(o, expected), 1e-5);

  // Against the polar factor itself the singular values may be off by up to 0.32 (the band above),
  // so ‖O − UVᵀ‖₂ ≤ 0.32; a wrong sign or transposed factor gives ≥ 1.
  const Mat polar = testing::Reassemble(in_svd, [](double) { return 1.0; });
  Mat diff = o;
  for (size_t i = 0; i < diff.v.size(); ++i) diff.v[i] -= polar.v[i];
  EXPECT_LE(ComputeSvd(diff).s[0], 0.3182 + 1e-4);
}

TEST_P(NewtonSchulzShapeTest, PolarExpressEightStepsIsOrthogonal) {
  const auto [rows, cols] = GetParam();
  const int64_t k = std::min(rows, cols);
  const Mat o = RunOne(MatWithSingularValues(rng_, rows, cols, Decade(k)), Named("polar_express"), 8);
  // Rows (wide) or columns (tall) orthonormal: the smaller Gram matrix is the identity.
  const Mat gram = rows <= cols ? testing::MatMul(o, testing::Transposed(o))
                                : testing::MatMul(testing::Transposed(o), o);
  Mat eye(k, k);
  for (int64_t i = 0; i < k; ++i) eye(i, i) = 1.0;
  // The scalar map after 8 steps is within 2e-3 of 1 over σ/‖G‖ ∈ [0.01, 1] (ScalarMapBounds), so
  // |σ² − 1| ≤ 4e-3; 1e-2 allows fp32 rounding but fails any set that has not converged.
  EXPECT_LT(MaxAbsDiff(gram, eye), 1e-2);
}

INSTANTIATE_TEST_SUITE_P(Shapes, NewtonSchulzShapeTest,
                         ::testing::Values(Shape{32, 32}, Shape{24, 64}, Shape{64, 24}, Shape{1, 40},
                                           Shape{40, 1}),
                         [](const auto& info) {
                           return std::to_string(info.param.rows) + "x" + std::to_string(info.param.cols);
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
      // The same GEMMs on the same data: equal up to fp32 rounding of a different blocking at most.
      EXPECT_LT(MaxAbsDiff(batched[i], RunOne(in[i], Named("quintic"), 5)), 1e-6);
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
        // fp32 GEMM rounding (~1e-7 per entry) grows by at most |p'| per step; measured drift is
        // ≤ 4e-6 over 10 steps, so 2e-5 has margin while a wrong tuple, a wrong cycle/repeat_last
        // mode (≥ 1e-2 apart, checked below) or a missed transpose fails by orders of magnitude.
        EXPECT_LT(MaxAbsDiff(RunOne(g, s, steps), ReferenceNs(g, s, steps)), 2e-5)
            << s.name << (s.after == CoefficientsAfter::kCycle ? " cycle " : " repeat_last ")
            << steps << " steps " << shape.rows << "x" << shape.cols;
      }
    }
  }
  Mat g = testing::RandomMat(rng_, 24, 40);
  EXPECT_GT(MaxAbsDiff(ReferenceNs(g, schedules[schedules.size() - 2], 10),
                       ReferenceNs(g, schedules.back(), 10)),
            1e-2);
}

TEST_F(NewtonSchulzTest, NormSafetyAndEpsEnterTheNormalization) {
  Mat g = testing::RandomMat(rng_, 12, 20);
  for (double& x : g.v) x = static_cast<float>(x);
  const NsSchedule s = Named("simple");
  EXPECT_LT(MaxAbsDiff(Run({g}, s, 3, 0.5, 1.02)[0], ReferenceNs(g, s, 3, 0.5, 1.02)), 1e-5);
}

TEST_F(NewtonSchulzTest, RejectsBadArguments) {
  float dummy = 0;
  EXPECT_FALSE(NewtonSchulz(*backend_, Named("simple"), 5, 1e-7, 1.0, kernels::MatmulPrecision::kFp32,
                            &dummy, &dummy, -1, 2, 1, ws_)
                   .ok());
  EXPECT_FALSE(NewtonSchulz(*backend_, NsSchedule{"custom", {}, CoefficientsAfter::kCycle}, 5, 1e-7,
                            1.0, kernels::MatmulPrecision::kFp32, &dummy, &dummy, 1, 1, 1, ws_)
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

}  // namespace
}  // namespace muond::optim
