// AdamW against an fp64 reference of torch.optim.AdamW (decoupled decay, bias corrections from each
// parameter's own step count), and with weight_decay_mode l2 against torch.optim.Adam's coupled L2
// (g ← g + λ·p before the moments, no decoupled factor).
#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/optim/optimizer.h"
#include "tests/kernels/reference.h"
#include "tests/testing/status_matchers.h"

namespace muond::optim {
namespace {

struct RefAdam {
  std::vector<double> p, m, v;
  int64_t t = 0;
  void Step(const GroupOptions& o, const StepHyper& h, const std::vector<double>& grad) {
    ++t;
    const bool coupled = o.weight_decay_mode == WeightDecayMode::kL2;
    const double bc1 = 1 - std::pow(o.beta1, t), bc2 = 1 - std::pow(o.beta2, t);
    for (size_t i = 0; i < p.size(); ++i) {
      const double g = coupled ? grad[i] + h.weight_decay * p[i] : grad[i];
      if (!coupled) p[i] *= 1 - h.lr * h.weight_decay;
      m[i] = o.beta1 * m[i] + (1 - o.beta1) * g;
      v[i] = o.beta2 * v[i] + (1 - o.beta2) * g * g;
      p[i] -= h.lr * (m[i] / bc1) / (std::sqrt(v[i] / bc2) + o.eps);
    }
  }
};

class AdamWModeTest : public ::testing::TestWithParam<WeightDecayMode> {};

TEST_P(AdamWModeTest, MatchesTorchSemanticsOverSteps) {
  auto backend = kernels::NewCpuBackend(1);
  GroupOptions o = DefaultOptions(OptimizerKind::kAdamW);
  o.lr = 1e-2;
  o.weight_decay = 0.1;
  o.weight_decay_mode = GetParam();
  ASSERT_OK(ValidateOptions(o));
  ASSERT_OK_AND_ASSIGN(auto opt, Optimizer::Create(o));
  EXPECT_EQ(opt->SlotNames(), (std::vector<std::string>{"exp_avg", "exp_avg_sq"}));
  std::mt19937 rng(7);
  std::normal_distribution<double> normal(0.0, 1.0);

  // Three parameters of different shapes, ranks included that Muon would refuse; the second skips
  // every third step (grad = None) so its bias corrections must follow its own step count.
  const std::vector<std::vector<int64_t>> shapes = {{33}, {4, 5}, {1}};
  std::vector<ParamState> states(shapes.size());
  std::vector<RefAdam> refs(shapes.size());
  for (size_t i = 0; i < shapes.size(); ++i) {
    ParamState& s = states[i];
    s.shape = shapes[i];
    s.numel = 1;
    for (int64_t d : s.shape) s.numel *= d;
    std::vector<float> w(s.numel);
    for (float& x : w) x = static_cast<float>(normal(rng));
    refs[i].p = testing::ToDouble(w);
    refs[i].m.assign(s.numel, 0.0);
    refs[i].v.assign(s.numel, 0.0);
    s.master = testing::Upload(*backend, w);
    ASSERT_OK_AND_ASSIGN(s.grad, backend->Allocate(s.numel));
    ASSERT_OK(opt->InitState(*backend, s));
  }
  std::vector<ParamState*> ptrs;
  for (ParamState& s : states) ptrs.push_back(&s);

  for (int step = 0; step < 12; ++step) {
    StepHyper h = opt->DefaultHyper();
    h.lr = o.lr * (1.0 - 0.05 * step);  // a client-side scheduler's per-step override
    for (size_t i = 0; i < states.size(); ++i) {
      states[i].has_grad = !(i == 1 && step % 3 == 2);
      if (!states[i].has_grad) continue;
      std::vector<float> g(states[i].numel);
      // Gradient scales from 1e-3 to 10 so that ε and √v both matter somewhere.
      for (size_t j = 0; j < g.size(); ++j) g[j] = static_cast<float>(normal(rng) * std::pow(10.0, (j % 5) - 3.0));
      ASSERT_OK(backend->CopyToDevice(g.data(), states[i].grad->data(), g.size()));
      refs[i].Step(o, h, testing::ToDouble(g));
    }
    ASSERT_OK(opt->Step(*backend, h, ptrs));
    for (size_t i = 0; i < states.size(); ++i) {
      EXPECT_EQ(states[i].step_count, refs[i].t);
      const auto p = testing::Download(*backend, states[i].master.fp32(), states[i].numel);
      const auto m = testing::Download(*backend, states[i].Slot("exp_avg")->fp32(), states[i].numel);
      const auto v = testing::Download(*backend, states[i].Slot("exp_avg_sq")->fp32(), states[i].numel);
      for (int64_t j = 0; j < states[i].numel; ++j) {
        // Each step moves p by about lr = 1e-2; the fp32 element-wise formula is good to a few
        // ulps of |p| ≈ 1 per step (≈ 1e-7), so 1e-6 over 12 steps has margin while a missing or
        // off-by-one bias correction (≥ 10% of the first steps' updates, ≥ 1e-4) fails.
        EXPECT_NEAR(p[j], refs[i].p[j], 1e-6) << "param " << i << " elem " << j << " step " << step;
        EXPECT_NEAR(m[j], refs[i].m[j], 1e-6 * (1 + std::abs(refs[i].m[j])));
        EXPECT_NEAR(v[j], refs[i].v[j], 1e-6 * (1e-6 + std::abs(refs[i].v[j])));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, AdamWModeTest, ::testing::Values(WeightDecayMode::kDecoupled, WeightDecayMode::kL2),
                         [](const auto& param_info) {
                           return param_info.param == WeightDecayMode::kL2 ? "coupled_l2" : "decoupled";
                         });

TEST(AdamWTest, CoupledL2DiffersFromDecoupledDecay) {
  // One step from p = 1, g = 0: AdamW only decays (p ← 1 − ηλ); Adam with L2 moves by about η
  // (the decay enters the gradient and is normalized by √v).
  auto backend = kernels::NewCpuBackend(1);
  for (WeightDecayMode mode : {WeightDecayMode::kDecoupled, WeightDecayMode::kL2}) {
    GroupOptions o = DefaultOptions(OptimizerKind::kAdamW);
    o.lr = 1e-2;
    o.weight_decay = 0.1;
    o.weight_decay_mode = mode;
    ASSERT_OK_AND_ASSIGN(auto opt, Optimizer::Create(o));
    ParamState s;
    s.shape = {1};
    s.numel = 1;
    s.master = testing::Upload(*backend, std::vector<float>{1.0f});
    s.grad = testing::Upload(*backend, std::vector<float>{0.0f});
    ASSERT_OK(opt->InitState(*backend, s));
    s.has_grad = true;
    ParamState* ptrs[] = {&s};
    ASSERT_OK(opt->Step(*backend, opt->DefaultHyper(), ptrs));
    const float p = testing::Download(*backend, s.master.fp32(), 1)[0];
    if (mode == WeightDecayMode::kDecoupled) {
      EXPECT_FLOAT_EQ(p, 1.0f - 1e-2f * 0.1f);
    } else {
      EXPECT_NEAR(p, 1.0f - 1e-2f, 1e-6f);
    }
  }
}

TEST(AdamWTest, RefusesIndependentDecayNamingTheOption) {
  GroupOptions o = DefaultOptions(OptimizerKind::kAdamW);
  o.weight_decay_mode = WeightDecayMode::kIndependent;
  const absl::Status refused = ValidateOptions(o);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("weight_decay_mode independent applies to muon only"), std::string::npos) << refused;
}

TEST(AdamWTest, AcceptsAnyShape) {
  ASSERT_OK_AND_ASSIGN(auto opt, Optimizer::Create(DefaultOptions(OptimizerKind::kAdamW)));
  ParamState p;
  p.shape = {};
  p.numel = 1;
  EXPECT_OK(opt->CheckParameter(p));
}

}  // namespace
}  // namespace muond::optim
