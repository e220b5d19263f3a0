// Lion and SGD against fp64 references written from docs/algorithms.md (Lion) and torch.optim.SGD.
#include <cmath>
#include <functional>
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

// Host state of one parameter: weights and its single slot.
struct Ref {
  std::vector<double> p, buf;
  int64_t t = 0;
};
using RefStep = std::function<void(const StepHyper&, Ref&, const std::vector<double>&)>;

// Drives `steps` steps of an optimizer over two parameters (one skipping a step) and compares master
// and slot with the fp64 reference after each. Updates are ~lr = 1e-2 per step on O(1) weights;
// fp32 element-wise arithmetic is good to a few ulps (~1e-7) per step, so 1e-6 after 10 steps has
// margin, while a wrong sign, a missed decay or a wrong momentum form is off by ≥ 1e-4 at once.
void RunAgainstReference(const GroupOptions& o, const std::string& slot, const RefStep& ref_step, int steps = 10) {
  auto backend = kernels::NewCpuBackend(1);
  ASSERT_OK_AND_ASSIGN(auto opt, Optimizer::Create(o));
  EXPECT_EQ(opt->SlotNames(), std::vector<std::string>{slot});
  std::mt19937 rng(3);
  std::normal_distribution<double> normal(0.0, 1.0);
  const std::vector<std::vector<int64_t>> shapes = {{6, 7}, {19}};
  std::vector<ParamState> states(shapes.size());
  std::vector<Ref> refs(shapes.size());
  for (size_t i = 0; i < shapes.size(); ++i) {
    int64_t numel = 1;
    for (int64_t d : shapes[i]) numel *= d;
    std::vector<float> w(numel);
    for (float& x : w) x = static_cast<float>(normal(rng));
    refs[i].p = testing::ToDouble(w);
    refs[i].buf.assign(numel, 0.0);
    ASSERT_NO_FATAL_FAILURE(testing::SetUpParameter(*backend, *opt, shapes[i], w, states[i]));
  }
  std::vector<ParamState*> ptrs;
  for (ParamState& s : states) ptrs.push_back(&s);
  for (int step = 0; step < steps; ++step) {
    const StepHyper h = opt->DefaultHyper();
    for (size_t i = 0; i < states.size(); ++i) {
      states[i].has_grad = !(i == 1 && step == 0);  // the second parameter starts one step late
      if (!states[i].has_grad) continue;
      std::vector<float> g(states[i].numel);
      for (float& x : g) x = static_cast<float>(normal(rng));
      ASSERT_OK(backend->CopyToDevice(g.data(), states[i].grad->data(), g.size()));
      ref_step(h, refs[i], testing::ToDouble(g));
      ++refs[i].t;
    }
    ASSERT_OK(opt->Step(*backend, h, ptrs));
    for (size_t i = 0; i < states.size(); ++i) {
      EXPECT_EQ(states[i].step_count, refs[i].t);
      const auto p = testing::Download(*backend, states[i].master.fp32(), states[i].numel);
      const auto b = testing::Download(*backend, states[i].Slot(slot)->fp32(), states[i].numel);
      for (int64_t j = 0; j < states[i].numel; ++j) {
        ASSERT_NEAR(p[j], refs[i].p[j], 1e-6) << "param " << i << " elem " << j << " step " << step;
        ASSERT_NEAR(b[j], refs[i].buf[j], 1e-6 * (1 + std::abs(refs[i].buf[j]))) << "step " << step;
      }
    }
  }
}

TEST(LionTest, MatchesReference) {
  GroupOptions o = DefaultOptions(OptimizerKind::kLion);
  o.lr = 1e-2;
  o.weight_decay = 0.5;
  RunAgainstReference(o, "exp_avg", [&](const StepHyper& h, Ref& r, const std::vector<double>& g) {
    for (size_t i = 0; i < g.size(); ++i) {
      const double c = o.beta1 * r.buf[i] + (1 - o.beta1) * g[i];
      const double u = c > 0 ? 1.0 : (c < 0 ? -1.0 : 0.0);
      r.p[i] = r.p[i] * (1 - h.lr * h.weight_decay) - h.lr * u;
      r.buf[i] = o.beta2 * r.buf[i] + (1 - o.beta2) * g[i];
    }
  });
}

// torch.optim.SGD, dampening 0: g += λp; buf = g on the first step, else μ·buf + g;
// d = nesterov ? g + μ·buf : buf; p -= lr·d.
void TorchSgd(const GroupOptions& o, const StepHyper& h, Ref& r, const std::vector<double>& grad) {
  for (size_t i = 0; i < grad.size(); ++i) {
    const double g = grad[i] + h.weight_decay * r.p[i];
    double d = g;
    if (h.momentum != 0) {
      r.buf[i] = r.t == 0 ? g : h.momentum * r.buf[i] + g;
      d = o.nesterov ? g + h.momentum * r.buf[i] : r.buf[i];
    }
    r.p[i] -= h.lr * d;
  }
}

struct SgdCase {
  std::string name;
  double momentum, weight_decay;
  bool nesterov;
};
// Readable test names in ctest instead of a byte dump.
void PrintTo(const SgdCase& c, std::ostream* os) { *os << c.name; }

class SgdTest : public ::testing::TestWithParam<SgdCase> {};

TEST_P(SgdTest, MatchesTorchSemantics) {
  GroupOptions o = DefaultOptions(OptimizerKind::kSgd);
  o.momentum = GetParam().momentum;
  o.weight_decay = GetParam().weight_decay;
  o.nesterov = GetParam().nesterov;
  RunAgainstReference(o, "momentum_buffer",
                      [&](const StepHyper& h, Ref& r, const std::vector<double>& g) { TorchSgd(o, h, r, g); });
}

INSTANTIATE_TEST_SUITE_P(Variants, SgdTest,
                         ::testing::Values(SgdCase{"plain", 0.0, 0.0, false}, SgdCase{"decay", 0.0, 0.1, false},
                                           SgdCase{"momentum", 0.9, 0.0, false},
                                           SgdCase{"nesterov_decay", 0.9, 0.05, true}),
                         [](const auto& param_info) { return param_info.param.name; });

// Delayed Nesterov (docs/algorithms.md, SGD), N = 3, c = 0.2, per parameter by its own step count
// (the second parameter starts a step late, so its boundaries fall one call later), against fp64.
TEST(DelayedNesterovTest, MatchesReference) {
  GroupOptions o = DefaultOptions(OptimizerKind::kSgd);
  o.lr = 0.7;
  o.momentum = 0.9;
  o.nesterov = true;
  o.nesterov_delay = 3;
  o.momentum_activation = 0.2;
  auto backend = kernels::NewCpuBackend(1);
  ASSERT_OK_AND_ASSIGN(auto opt, Optimizer::Create(o));
  EXPECT_EQ(opt->SlotNames(), (std::vector<std::string>{"momentum_buffer", "delay_buffer"}));
  std::mt19937 rng(5);
  std::normal_distribution<double> normal(0.0, 1.0);
  const int64_t sizes[] = {42, 19};
  std::vector<ParamState> states(2);
  struct Host {
    std::vector<double> p, m, d;
    int64_t t = 0;
  };
  std::vector<Host> refs(2);
  for (size_t i = 0; i < states.size(); ++i) {
    std::vector<float> w(sizes[i]);
    for (float& x : w) x = static_cast<float>(normal(rng));
    refs[i] = {testing::ToDouble(w), std::vector<double>(w.size(), 0.0), std::vector<double>(w.size(), 0.0)};
    ASSERT_NO_FATAL_FAILURE(testing::SetUpParameter(*backend, *opt, {sizes[i]}, w, states[i]));
  }
  std::vector<ParamState*> ptrs = {&states[0], &states[1]};
  const double n = 3, c = 0.2, beta = 0.9, lr = 0.7;
  for (int step = 0; step < 10; ++step) {
    const StepHyper h = opt->DefaultHyper();
    for (size_t i = 0; i < states.size(); ++i) {
      states[i].has_grad = !(i == 1 && step == 0);
      if (!states[i].has_grad) continue;
      std::vector<float> g(states[i].numel);
      for (float& x : g) x = static_cast<float>(0.01 * normal(rng));
      ASSERT_OK(backend->CopyToDevice(g.data(), states[i].grad->data(), g.size()));
      Host& r = refs[i];
      const bool boundary = (r.t + 1) % 3 == 0;
      for (int64_t j = 0; j < states[i].numel; ++j) {
        r.d[j] += g[j];
        if (boundary) {
          r.m[j] = beta * r.m[j] + r.d[j] / n;
          r.p[j] -= lr * (1 - c * n + c) * beta * r.m[j];
          r.d[j] = 0;
        } else {
          r.p[j] -= lr * c * beta * r.m[j];
        }
        r.p[j] -= lr / n * g[j];
      }
      ++r.t;
    }
    ASSERT_OK(opt->Step(*backend, h, ptrs));
    for (size_t i = 0; i < states.size(); ++i) {
      EXPECT_EQ(states[i].step_count, refs[i].t);
      const auto p = testing::Download(*backend, states[i].master.fp32(), states[i].numel);
      const auto m = testing::Download(*backend, states[i].Slot("momentum_buffer")->fp32(), states[i].numel);
      const auto d = testing::Download(*backend, states[i].Slot("delay_buffer")->fp32(), states[i].numel);
      for (int64_t j = 0; j < states[i].numel; ++j) {
        ASSERT_NEAR(p[j], refs[i].p[j], 1e-6) << "param " << i << " elem " << j << " step " << step;
        ASSERT_NEAR(m[j], refs[i].m[j], 1e-7) << "param " << i << " elem " << j << " step " << step;
        ASSERT_NEAR(d[j], refs[i].d[j], 1e-7) << "param " << i << " elem " << j << " step " << step;
      }
    }
  }
}

TEST(DelayedNesterovTest, RefusesWhatItCannotDoNamingTheOption) {
  struct Case {
    int delay;
    double activation, weight_decay;
    bool nesterov;
    std::string words;
  };
  for (const Case& c : {Case{2, 0.0, 0.1, true, "nesterov_delay > 1 takes none"},
                        Case{2, 0.0, 0.0, false, "nesterov_delay > 1 needs nesterov"},
                        Case{1, 0.1, 0.0, true, "momentum_activation > 0 needs nesterov_delay > 1"},
                        Case{4, 0.3, 0.0, true, "momentum_activation must be at most 1/nesterov_delay"}}) {
    GroupOptions o = DefaultOptions(OptimizerKind::kSgd);
    o.momentum = 0.9;
    o.nesterov = c.nesterov;
    o.nesterov_delay = c.delay;
    o.momentum_activation = c.activation;
    o.weight_decay = c.weight_decay;
    const absl::Status status = ValidateOptions(o);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.words;
    EXPECT_THAT(std::string(status.message()), ::testing::HasSubstr(c.words));
  }
}

}  // namespace
}  // namespace muond::optim
