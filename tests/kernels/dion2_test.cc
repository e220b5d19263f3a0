// Dion2 against an fp64 host reference of docs/algorithms.md, Dion2 (microsoft/dion's dion2.py):
// momentum, the choice of lines, the error feedback, Newton–Schulz on the chosen lines and the
// update, over several steps, on wide, tall, batched-expert and conv-shaped parameters.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/optim/optimizer.h"
#include "tests/kernels/reference.h"
#include "tests/testing/error_bounds.h"
#include "tests/testing/status_matchers.h"

namespace muond::optim {
namespace {

using ::muond::testing::Mat;
using ::muond::testing::StatusIs;

// One Dion2 step in fp64 on host vectors w (master) and m (momentum) of a parameter of `shape`.
void RefStep(const GroupOptions& o, const StepHyper& h, const std::vector<int64_t>& shape, const std::vector<double>& g,
             std::vector<double>& w, std::vector<double>& m) {
  const int64_t batch = shape.size() == 3 ? shape[0] : 1;
  const int64_t rows = shape.size() == 3 ? shape[1] : shape[0];
  const int64_t cols = static_cast<int64_t>(w.size()) / (batch * rows);
  for (size_t i = 0; i < m.size(); ++i) m[i] += g[i];
  const double beta =
      o.weight_decay_mode == WeightDecayMode::kIndependent ? 1 - h.weight_decay : 1 - h.lr * h.weight_decay;
  for (double& x : w) x *= beta;
  const bool columns = o.dion2_select == Dion2Select::kCols || (o.dion2_select == Dion2Select::kAuto && rows > cols);
  const int64_t lines = columns ? cols : rows, length = columns ? rows : cols;
  const int64_t k = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(o.dion2_fraction * lines)));
  const double scale = UpdateScale(o, rows, cols);
  for (int64_t e = 0; e < batch; ++e) {
    const int64_t base = e * rows * cols;
    auto at = [&](int64_t line, int64_t j) { return base + (columns ? j * cols + line : line * cols + j); };
    std::vector<double> norms(lines, 0.0);
    for (int64_t l = 0; l < lines; ++l) {
      for (int64_t j = 0; j < length; ++j) norms[l] += std::abs(m[at(l, j)]);
    }
    std::vector<int64_t> order(lines);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return norms[a] > norms[b]; });
    order.resize(k);
    std::sort(order.begin(), order.end());
    Mat picked(k, length);
    for (int64_t i = 0; i < k; ++i) {
      for (int64_t j = 0; j < length; ++j) {
        picked(i, j) = m[at(order[i], j)];
        m[at(order[i], j)] *= o.dion2_ef_decay;
      }
    }
    const Mat out = testing::ReferenceNs(picked, o.ns_schedule, o.ns_steps, o.ns_eps, NsInputSafety(o));
    for (int64_t i = 0; i < k; ++i) {
      for (int64_t j = 0; j < length; ++j) w[at(order[i], j)] -= h.lr * scale * out(i, j);
    }
  }
}

struct Dion2Case {
  std::string name;
  GroupOptions options;
  std::vector<std::vector<int64_t>> shapes;
};
void PrintTo(const Dion2Case& c, std::ostream* os) { *os << c.name; }

GroupOptions Dion2Options(Dion2Select select = Dion2Select::kAuto, double fraction = 0.25) {
  GroupOptions o = DefaultOptions(OptimizerKind::kDion2);
  o.lr = 0.05;  // large enough that each step's update dominates fp32 rounding of W
  o.weight_decay = 0.1;
  o.dion2_select = select;
  o.dion2_fraction = fraction;
  return o;
}

class Dion2ReferenceTest : public ::testing::TestWithParam<Dion2Case> {};

TEST_P(Dion2ReferenceTest, MatchesFp64ReferenceOverSteps) {
  const Dion2Case& c = GetParam();
  auto backend = kernels::NewCpuBackend(1);
  ASSERT_OK_AND_ASSIGN(auto opt, Optimizer::Create(c.options));
  std::mt19937 rng(7);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<ParamState> states(c.shapes.size());
  std::vector<std::vector<double>> ref_w(c.shapes.size()), ref_m(c.shapes.size());
  for (size_t i = 0; i < c.shapes.size(); ++i) {
    ParamState& s = states[i];
    s.name = "p" + std::to_string(i);
    s.shape = c.shapes[i];
    s.numel = 1;
    for (int64_t d : s.shape) s.numel *= d;
    std::vector<float> w(s.numel);
    for (float& x : w) x = static_cast<float>(normal(rng));
    ref_w[i] = testing::ToDouble(w);
    ref_m[i].assign(s.numel, 0.0);
    s.master = testing::Upload(*backend, w);
    ASSERT_OK_AND_ASSIGN(s.grad, backend->Allocate(s.numel));
    ASSERT_OK(opt->InitState(*backend, s));
    ASSERT_OK(opt->CheckParameter(s));
  }
  std::vector<ParamState*> ptrs;
  for (ParamState& s : states) ptrs.push_back(&s);
  const StepHyper hyper = opt->DefaultHyper();
  for (int step = 0; step < 6; ++step) {
    for (size_t i = 0; i < states.size(); ++i) {
      std::vector<float> g(states[i].numel);
      for (float& x : g) x = static_cast<float>(normal(rng));
      ASSERT_OK(backend->CopyToDevice(g.data(), states[i].grad->data(), g.size()));
      states[i].has_grad = true;
      RefStep(c.options, hyper, c.shapes[i], testing::ToDouble(g), ref_w[i], ref_m[i]);
    }
    ASSERT_OK(opt->Step(*backend, hyper, ptrs));
    for (size_t i = 0; i < states.size(); ++i) {
      const auto w = testing::Download(*backend, states[i].master.fp32(), states[i].numel);
      const auto m = testing::Download(*backend, states[i].Slot("momentum")->fp32(), states[i].numel);
      double dw = 0, dm = 0;
      for (int64_t j = 0; j < states[i].numel; ++j) {
        dw = std::max(dw, std::abs(w[j] - ref_w[i][j]));
        dm = std::max(dm, std::abs(m[j] - ref_m[i][j]) / (1 + std::abs(ref_m[i][j])));
      }
      // As muon_test's bound: W rounds twice a step (≤ 5e-7 for |W| ≤ 4) and moves by lr·scale
      // (≤ 0.08) times Newton–Schulz's fp32 drift (≤ 1e-5, newton_schulz_test): 5e-6 over 6 steps,
      // while a wrong line, decay or scale moves W by ≥ 1e-3 in the first step.
      EXPECT_TRUE(testing::WithinBound("dion2.weights_vs_fp64", dw, 5e-6))
          << c.name << " param " << i << " step " << step;
      // The momentum is sums and one product per step in fp32: a few ulps of its magnitude a step.
      EXPECT_TRUE(testing::WithinBound("dion2.momentum_vs_fp64", dm, 2e-6))
          << c.name << " param " << i << " step " << step;
      EXPECT_EQ(states[i].step_count, step + 1);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Variants, Dion2ReferenceTest,
    ::testing::Values(Dion2Case{"auto", Dion2Options(), {{16, 24}, {24, 16}, {3, 12, 20}, {6, 4, 3, 3}}},
                      Dion2Case{"rows_of_tall", Dion2Options(Dion2Select::kRows, 0.3), {{24, 16}, {16, 24}}},
                      Dion2Case{"cols_of_wide", Dion2Options(Dion2Select::kCols, 0.5), {{16, 24}, {2, 20, 12}}},
                      Dion2Case{"whole_independent_spectral",
                                [] {
                                  GroupOptions o = Dion2Options(Dion2Select::kAuto, 1.0);
                                  o.weight_decay_mode = WeightDecayMode::kIndependent;
                                  o.weight_decay = 0.01;
                                  o.scale_mode = ScaleMode::kSpectral;
                                  o.extra_scale_factor = 0.2;
                                  o.dion2_ef_decay = 0.5;
                                  return o;
                                }(),
                                {{16, 24}, {24, 16}}}),
    [](const ::testing::TestParamInfo<Dion2Case>& param_info) { return param_info.param.name; });

TEST(Dion2Test, RefusesWhatItCannotRead) {
  GroupOptions o = DefaultOptions(OptimizerKind::kDion2);
  o.weight_decay_mode = WeightDecayMode::kCautious;
  EXPECT_THAT(Optimizer::Create(o).status(), StatusIs(absl::StatusCode::kInvalidArgument, "does not apply to dion2"));
  ASSERT_OK_AND_ASSIGN(auto opt, Optimizer::Create(DefaultOptions(OptimizerKind::kDion2)));
  ParamState vector;
  vector.shape = {8};
  vector.numel = 8;
  EXPECT_THAT(opt->CheckParameter(vector), StatusIs(absl::StatusCode::kInvalidArgument, "at least 2 dimensions"));
}

}  // namespace
}  // namespace muond::optim
