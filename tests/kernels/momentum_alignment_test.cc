// HeLoCo's correction against the momentum (kernels/optim/momentum_alignment.h): its three cases
// against the formulas of docs/algorithms.md (SGD, HeLoCo) written here in fp64, SGD steps with
// `heloco` against an fp64 reference, a bf16 momentum, the backend's Dot and the refusal.
#include "kernels/optim/momentum_alignment.h"

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/optim/optimizer.h"
#include "tests/kernels/reference.h"
#include "tests/testing/status_matchers.h"

namespace muond::optim {
namespace {

double DotOf(const std::vector<double>& x, const std::vector<double>& y) {
  double s = 0;
  for (size_t i = 0; i < x.size(); ++i) s += x[i] * y[i];
  return s;
}

// The correction in fp64, from the formulas; `kind` reports the case taken.
std::vector<double> Corrected(const GroupOptions& o, const std::vector<double>& g, const std::vector<double>& m,
                              Alignment* kind) {
  const double gn = std::sqrt(DotOf(g, g)), mn = std::sqrt(DotOf(m, m));
  *kind = Alignment::kKept;
  if (gn == 0 || mn == 0) return g;
  const double c = DotOf(g, m) / (gn * mn);
  if (c >= o.heloco_keep_cosine) return g;
  const double conf = gn / (gn + o.heloco_kappa * mn + 1e-12);
  std::vector<double> out(g.size());
  if (c < 0) {
    *kind = Alignment::kShrunk;
    const double beta = std::min(o.heloco_shrink * -c * conf, o.heloco_shrink_max);
    for (size_t i = 0; i < g.size(); ++i) out[i] = g[i] - beta * c * gn * m[i] / mn;
    return out;
  }
  *kind = Alignment::kReoriented;
  const double lambda = std::min(o.heloco_reorient * (o.heloco_keep_cosine - c) * conf, 1.0);
  std::vector<double> u(g.size());
  for (size_t i = 0; i < g.size(); ++i) u[i] = (1 - lambda) * g[i] / gn + lambda * m[i] / mn;
  const double un = std::max(std::sqrt(DotOf(u, u)), 1e-12);
  for (size_t i = 0; i < g.size(); ++i) out[i] = gn * u[i] / un;
  return out;
}

GroupOptions HelocoSgd() {
  GroupOptions o = DefaultOptions(OptimizerKind::kSgd);
  o.lr = 0.5;
  o.momentum = 0.9;
  o.nesterov = true;
  o.heloco = true;
  o.heloco_keep_cosine = 0.3;  // wide enough that random gradients land in all three cases
  o.heloco_reorient = 2.0;
  o.heloco_kappa = 0.5;
  return o;
}

std::vector<double> Applied(const AlignmentPlan& plan, const std::vector<double>& g, const std::vector<double>& m) {
  std::vector<double> out(g.size());
  for (size_t i = 0; i < g.size(); ++i) out[i] = plan.grad_scale * g[i] + plan.momentum_scale * m[i];
  return out;
}

TEST(MomentumAlignmentTest, PlansTheThreeCasesAsTheFormulasSay) {
  GroupOptions o = HelocoSgd();
  const std::vector<double> m = {1.0, 0.0, 0.0};
  struct Case {
    std::vector<double> g;
    Alignment kind;
  };
  for (const Case& c : {Case{{2.0, 0.5, 0.0}, Alignment::kKept}, Case{{0.2, 1.0, 0.3}, Alignment::kReoriented},
                        Case{{-0.5, 1.0, 0.0}, Alignment::kShrunk}, Case{{-3.0, 0.1, 0.0}, Alignment::kShrunk}}) {
    Alignment expected_kind;
    const std::vector<double> expected = Corrected(o, c.g, m, &expected_kind);
    ASSERT_EQ(expected_kind, c.kind);
    const AlignmentPlan plan = PlanAlignment(o, std::sqrt(DotOf(c.g, c.g)), 1.0, DotOf(c.g, m));
    EXPECT_EQ(plan.kind, c.kind);
    const std::vector<double> got = Applied(plan, c.g, m);
    for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], expected[i], 1e-12) << i;
    if (c.kind == Alignment::kReoriented) {  // the norm kept, the direction turned toward m
      EXPECT_NEAR(DotOf(got, got), DotOf(c.g, c.g), 1e-12);
      EXPECT_GT(got[0] / std::sqrt(DotOf(got, got)), plan.cosine);
    }
  }
  // β_max = 1 and a strong k_s remove the whole component against the momentum (PCGrad's projection).
  o.heloco_shrink = 100;
  const std::vector<double> g = {-0.5, 1.0, 0.0};
  const AlignmentPlan plan = PlanAlignment(o, std::sqrt(DotOf(g, g)), 1.0, DotOf(g, m));
  EXPECT_EQ(plan.kind, Alignment::kShrunk);
  EXPECT_NEAR(DotOf(Applied(plan, g, m), m), 0.0, 1e-15);
  // A zero momentum (a first step) or gradient keeps the gradient.
  EXPECT_EQ(PlanAlignment(o, 1.0, 0.0, 0.0).kind, Alignment::kKept);
  EXPECT_EQ(PlanAlignment(o, 0.0, 1.0, 0.0).kind, Alignment::kKept);
}

// Nesterov SGD with heloco over 12 steps of random gradients on two parameters, against fp64: each
// gradient is corrected against the momentum before it, then torch.optim.SGD's rule. The test
// insists that all three cases happened, so that it checks each of them.
TEST(MomentumAlignmentTest, SgdStepsMatchTheReference) {
  const GroupOptions o = HelocoSgd();
  auto backend = kernels::NewCpuBackend(1);
  ASSERT_OK_AND_ASSIGN(auto opt, Optimizer::Create(o));
  std::mt19937 rng(11);
  std::normal_distribution<double> normal(0.0, 1.0);
  const int64_t sizes[] = {40, 23};
  std::vector<ParamState> states(2);
  struct Host {
    std::vector<double> p, m;
    int64_t t = 0;
  };
  std::vector<Host> refs(2);
  for (size_t i = 0; i < states.size(); ++i) {
    std::vector<float> w(sizes[i]);
    for (float& x : w) x = static_cast<float>(normal(rng));
    refs[i].p = testing::ToDouble(w);
    refs[i].m.assign(w.size(), 0.0);
    ASSERT_NO_FATAL_FAILURE(testing::SetUpParameter(*backend, *opt, {sizes[i]}, w, states[i]));
  }
  std::vector<ParamState*> ptrs = {&states[0], &states[1]};
  int seen[3] = {0, 0, 0};
  for (int step = 0; step < 12; ++step) {
    const StepHyper h = opt->DefaultHyper();
    for (size_t i = 0; i < states.size(); ++i) {
      states[i].has_grad = true;
      std::vector<float> g(states[i].numel);
      for (float& x : g) x = static_cast<float>(0.01 * normal(rng));
      ASSERT_OK(backend->CopyToDevice(g.data(), states[i].grad->data(), g.size()));
      Host& r = refs[i];
      Alignment kind;
      const std::vector<double> d = Corrected(o, testing::ToDouble(g), r.m, &kind);
      ++seen[static_cast<int>(kind)];
      for (int64_t j = 0; j < states[i].numel; ++j) {
        r.m[j] = r.t == 0 ? d[j] : 0.9 * r.m[j] + d[j];
        r.p[j] -= 0.5 * (d[j] + 0.9 * r.m[j]);
      }
      ++r.t;
    }
    ASSERT_OK(opt->Step(*backend, h, ptrs));
    for (size_t i = 0; i < states.size(); ++i) {
      const auto p = testing::Download(*backend, states[i].master.fp32(), states[i].numel);
      const auto m = testing::Download(*backend, states[i].Slot("momentum_buffer")->fp32(), states[i].numel);
      for (int64_t j = 0; j < states[i].numel; ++j) {
        ASSERT_NEAR(p[j], refs[i].p[j], 1e-6) << "param " << i << " elem " << j << " step " << step;
        ASSERT_NEAR(m[j], refs[i].m[j], 1e-7) << "param " << i << " elem " << j << " step " << step;
      }
    }
  }
  EXPECT_GT(seen[static_cast<int>(Alignment::kKept)], 0);
  EXPECT_GT(seen[static_cast<int>(Alignment::kReoriented)], 0);
  EXPECT_GT(seen[static_cast<int>(Alignment::kShrunk)], 0);
}

// A momentum stored in bf16 is widened first: the result equals that of its fp32 values.
TEST(MomentumAlignmentTest, Bf16MomentumIsWidenedFirst) {
  auto backend = kernels::NewCpuBackend(1);
  const GroupOptions o = HelocoSgd();
  std::vector<float> g = {0.3f, -1.0f, 0.25f, 0.5f}, m = {-1.0f, 0.5f, 0.75f, -0.125f};  // exact in bf16
  std::vector<uint16_t> m16(m.size());
  ASSERT_OK(backend->Narrow(kernels::StorageDtype::kBf16, m.data(), m16.data(), m.size()));
  auto grad = testing::Upload(*backend, g);
  auto momentum = testing::Upload(*backend, m);
  ASSERT_OK_AND_ASSIGN(AlignedGradient wide, AlignWithMomentum(*backend, o, grad->data(), momentum->data(), g.size()));
  ASSERT_OK_AND_ASSIGN(AlignedGradient narrow,
                       AlignWithMomentum(*backend, o, grad->data(),
                                         kernels::StoredRef(m16.data(), kernels::StorageDtype::kBf16), g.size()));
  ASSERT_NE(wide.plan.kind, Alignment::kKept);
  EXPECT_EQ(narrow.plan.kind, wide.plan.kind);
  EXPECT_EQ(testing::Download(*backend, narrow.data, g.size()), testing::Download(*backend, wide.data, g.size()));
  EXPECT_EQ(testing::Download(*backend, grad->data(), g.size()), g);  // the gradient itself untouched
}

// A momentum that decayed to subnormals (a parameter without gradients for many steps), or one so
// small against the gradient that b·m would overflow fp32, has no usable direction: the gradient
// is kept, and the step stays finite.
TEST(MomentumAlignmentTest, AMomentumWithNoUsableDirectionKeepsTheGradient) {
  auto backend = kernels::NewCpuBackend(1);
  const GroupOptions o = HelocoSgd();
  struct Case {
    const char* what;
    float g1, m0;  // g = (0, g1, 0, 0) is orthogonal to m = (m0, 0, 0, 0): reoriented, were m usable
  };
  for (const Case& c : {Case{"subnormal", 1.0f, 2.3e-41f}, Case{"normal, b beyond fp32", 100.0f, 1.5e-38f}}) {
    const std::vector<float> g = {0.0f, c.g1, 0.0f, 0.0f}, m = {c.m0, 0.0f, 0.0f, 0.0f};
    const AlignmentPlan plan = PlanAlignment(o, c.g1, double{c.m0}, 0.0);
    EXPECT_EQ(plan.kind, Alignment::kKept) << c.what;
    auto grad = testing::Upload(*backend, g);
    auto momentum = testing::Upload(*backend, m);
    ASSERT_OK_AND_ASSIGN(AlignedGradient aligned,
                         AlignWithMomentum(*backend, o, grad->data(), momentum->data(), g.size()));
    EXPECT_EQ(aligned.plan.kind, Alignment::kKept) << c.what;
    EXPECT_EQ(testing::Download(*backend, aligned.data, g.size()), g) << c.what;
  }
  // Shrunk too: against a tiny normal momentum, b = β·|c|·|g|/|m| beyond fp32.
  const AlignmentPlan shrunk = PlanAlignment(o, 1e3, 1.5e-38, -0.5 * 1e3 * 1.5e-38);
  EXPECT_EQ(shrunk.kind, Alignment::kKept);
  // The smallest momentum still used: b stays a finite fp32.
  const AlignmentPlan used = PlanAlignment(o, 1.0, 1e-30, 0.0);
  EXPECT_EQ(used.kind, Alignment::kReoriented);
  EXPECT_TRUE(std::isfinite(static_cast<float>(used.momentum_scale)));
}

// The backend's default Dot (|x + y|² − |x|² − |y|², for device backends) against the CPU's exact
// sum, within its stated error 2⁻²⁴·(|x|² + |y|²) and some.
TEST(MomentumAlignmentTest, DefaultDotIsWithinItsBound) {
  auto backend = kernels::NewCpuBackend(1);
  std::mt19937 rng(2);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(1000), y(1000);
  for (float& v : x) v = normal(rng);
  for (float& v : y) v = 3.0f * normal(rng);
  double exact = 0, polarized = 0, squares = 0;
  ASSERT_OK(backend->Dot(x.data(), y.data(), x.size(), &exact));
  ASSERT_OK(backend->kernels::Backend::Dot(x.data(), y.data(), x.size(), &polarized));
  for (size_t i = 0; i < x.size(); ++i) squares += double{x[i]} * x[i] + double{y[i]} * y[i];
  EXPECT_NEAR(polarized, exact, 2 * std::ldexp(squares, -24));
  EXPECT_NE(exact, 0.0);
}

TEST(MomentumAlignmentTest, RefusedWithoutMomentumNamingTheOption) {
  GroupOptions o = HelocoSgd();
  o.nesterov = false;
  o.momentum = 0.0;
  const absl::Status status = ValidateOptions(o);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), ::testing::HasSubstr("heloco needs momentum > 0"));
}

}  // namespace
}  // namespace muond::optim
