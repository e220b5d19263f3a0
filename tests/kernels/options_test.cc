#include "kernels/optim/options.h"

#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/optim/optimizer.h"
#include "tests/testing/status_matchers.h"

namespace muond::optim {
namespace {

using ::muond::testing::StatusIs;
using ::testing::ElementsAre;

void ExpectTuple(const NsCoefficient& t, double a, double b, double c) {
  EXPECT_EQ(t.a, a);
  EXPECT_EQ(t.b, b);
  EXPECT_EQ(t.c, c);
}

// The coefficient table of docs/algorithms.md, typed in again here so a slip in either copy fails.
struct ExpectedSet {
  std::string name;
  std::vector<NsCoefficient> tuples;
  CoefficientsAfter after;
};

TEST(NamedScheduleTest, TablesMatchDesign) {
  EXPECT_THAT(NamedScheduleNames(), ElementsAre("simple", "quintic", "polar_express", "cans", "aol", "deepseekv4",
                                                "cubic5", "gram_polar_express"));
  const NsCoefficient jordan = {3.4445, -4.7750, 2.0315};
  const std::vector<ExpectedSet> expected = {
      {"simple", {{3.4445, -4.7750, 2.0315}}, CoefficientsAfter::kCycle},
      {"quintic",
       {{4.0848, -6.8946, 2.9270},
        {3.9505, -6.3029, 2.6377},
        {3.7418, -5.5913, 2.3037},
        {2.8769, -3.1427, 1.2046},
        {2.8366, -3.0525, 1.2012}},
       CoefficientsAfter::kCycle},
      {"polar_express",
       {{8.2051, -22.9019, 16.4607},
        {4.0664, -2.8612, 0.5184},
        {3.9096, -2.8234, 0.5250},
        {3.2856, -2.4153, 0.4853},
        {2.2779, -1.6198, 0.3985},
        {1.8726, -1.2307, 0.3585},
        {1.8564, -1.2132, 0.3568},
        {1.8750, -1.2500, 0.3750}},
       CoefficientsAfter::kRepeatLast},
      {"cans",
       {{8.4703, -25.1081, 18.6293},
        {4.1828, -3.1087, 0.5806},
        {3.9619, -2.9541, 0.5630},
        {3.2866, -2.4647, 0.5074},
        {2.2737, -1.6447, 0.4162}},
       CoefficientsAfter::kRepeatLast},
      {"aol",
       {{3.9505, -6.3029, 2.6377}, {3.7418, -5.5913, 2.3037}, {2.8769, -3.1427, 1.2046}, {2.8366, -3.0525, 1.2012}},
       CoefficientsAfter::kRepeatLast},
      {"deepseekv4",
       {jordan, jordan, jordan, jordan, jordan, jordan, jordan, jordan, {2.0, -1.5, 0.5}, {2.0, -1.5, 0.5}},
       CoefficientsAfter::kRepeatLast},
      {"cubic5",
       {{3.3656576, -3.3420992, 0.0},
        {2.5744352, -1.4957376, 0.0},
        {2.5368962, -1.4312570, 0.0},
        {2.4418906, -1.2764040, 0.0},
        {2.2230472, -0.9630650, 0.0}},
       CoefficientsAfter::kRepeatLast},
  };
  for (const ExpectedSet& e : expected) {
    ASSERT_OK_AND_ASSIGN(NsSchedule s, NamedSchedule(e.name));
    EXPECT_EQ(s.name, e.name);
    EXPECT_EQ(s.after, e.after) << e.name;
    ASSERT_EQ(s.tuples.size(), e.tuples.size()) << e.name;
    for (size_t i = 0; i < s.tuples.size(); ++i) {
      SCOPED_TRACE(e.name + "[" + std::to_string(i) + "]");
      ExpectTuple(s.tuples[i], e.tuples[i].a, e.tuples[i].b, e.tuples[i].c);
    }
  }

  // gram_polar_express is computed from the Polar Express paper's tuples: its first and last tuples
  // as docs/algorithms.md quotes them to 4 decimals.
  ASSERT_OK_AND_ASSIGN(NsSchedule gram, NamedSchedule("gram_polar_express"));
  ASSERT_EQ(gram.tuples.size(), 5u);
  EXPECT_EQ(gram.after, CoefficientsAfter::kRepeatLast);
  for (const auto& [i, a, b, c] : {std::tuple{0, 7.8926, -20.3830, 13.5553}, std::tuple{4, 2.1911, -1.4417, 0.3281}}) {
    EXPECT_NEAR(gram.tuples[i].a, a, 5e-5);
    EXPECT_NEAR(gram.tuples[i].b, b, 5e-5);
    EXPECT_NEAR(gram.tuples[i].c, c, 5e-5);
  }
  // Only gram_polar_express restarts the Gram iteration (before iteration 2).
  EXPECT_EQ(NamedSchedule("gram_polar_express")->gram_restarts, std::vector<int>{2});
  EXPECT_TRUE(NamedSchedule("polar_express")->gram_restarts.empty());

  // The default-constructed schedule is `simple`.
  GroupOptions defaults;
  EXPECT_EQ(defaults.ns_schedule.name, "simple");
  ASSERT_EQ(defaults.ns_schedule.tuples.size(), 1u);
  ExpectTuple(defaults.ns_schedule.tuples[0], 3.4445, -4.7750, 2.0315);
}

TEST(NamedScheduleTest, UnknownNameIsInvalidArgument) {
  EXPECT_THAT(NamedSchedule("jordan"), StatusIs(absl::StatusCode::kInvalidArgument, "ns_coefficients"));
  // "custom" is not a named set: its tuples come from the client.
  EXPECT_THAT(NamedSchedule("custom"), StatusIs(absl::StatusCode::kInvalidArgument, "custom"));
}

TEST(NsScheduleTest, CycleAndRepeatLast) {
  NsSchedule s{"custom", {{1, 0, 0}, {2, 0, 0}, {3, 0, 0}}, CoefficientsAfter::kCycle};
  std::vector<double> cycle, repeat;
  for (int t = 0; t < 7; ++t) cycle.push_back(s.At(t).a);
  s.after = CoefficientsAfter::kRepeatLast;
  for (int t = 0; t < 7; ++t) repeat.push_back(s.At(t).a);
  EXPECT_THAT(cycle, ElementsAre(1, 2, 3, 1, 2, 3, 1));
  EXPECT_THAT(repeat, ElementsAre(1, 2, 3, 3, 3, 3, 3));
}

TEST(DefaultOptionsTest, MatchDesignTable) {
  const GroupOptions muon = DefaultOptions(OptimizerKind::kMuon);
  EXPECT_EQ(muon.optimizer, OptimizerKind::kMuon);
  EXPECT_EQ(muon.lr, 0.02);
  EXPECT_EQ(muon.weight_decay, 0.0);
  EXPECT_EQ(muon.momentum, 0.95);
  EXPECT_TRUE(muon.nesterov);
  EXPECT_EQ(muon.weight_decay_mode, WeightDecayMode::kDecoupled);
  EXPECT_EQ(muon.momentum_style, kernels::MomentumStyle::kEma);
  EXPECT_EQ(muon.ns_steps, 5);
  EXPECT_EQ(muon.ns_schedule.name, "simple");
  EXPECT_EQ(muon.ns_eps, 1e-7);
  EXPECT_EQ(muon.ns_norm_safety, 1.0);
  EXPECT_EQ(muon.scale_mode, ScaleMode::kShapeScaling);
  EXPECT_EQ(muon.extra_scale_factor, 1.0);
  EXPECT_EQ(muon.qk_clip_threshold, 100.0);
  EXPECT_EQ(muon.qk_clip_alpha, 0.5);

  const GroupOptions adamw = DefaultOptions(OptimizerKind::kAdamW);
  EXPECT_EQ(adamw.lr, 1e-3);
  EXPECT_EQ(adamw.weight_decay, 0.01);
  EXPECT_EQ(adamw.beta1, 0.9);
  EXPECT_EQ(adamw.beta2, 0.999);
  EXPECT_EQ(adamw.eps, 1e-8);

  const GroupOptions lion = DefaultOptions(OptimizerKind::kLion);
  EXPECT_EQ(lion.lr, 1e-4);
  EXPECT_EQ(lion.weight_decay, 0.0);
  EXPECT_EQ(lion.beta1, 0.9);
  EXPECT_EQ(lion.beta2, 0.99);

  const GroupOptions sgd = DefaultOptions(OptimizerKind::kSgd);
  EXPECT_EQ(sgd.lr, 1e-2);
  EXPECT_EQ(sgd.momentum, 0.0);
  EXPECT_FALSE(sgd.nesterov);
  EXPECT_EQ(sgd.weight_decay, 0.0);

  for (OptimizerKind kind : {OptimizerKind::kMuon, OptimizerKind::kAdamW, OptimizerKind::kLion, OptimizerKind::kSgd}) {
    EXPECT_OK(ValidateOptions(DefaultOptions(kind))) << OptimizerName(kind);
    EXPECT_EQ(DefaultOptions(kind).optimizer, kind);
  }
  EXPECT_EQ(OptimizerName(OptimizerKind::kLion), "lion");
}

struct BadOption {
  std::string option;  // expected in the message
  void (*mutate)(GroupOptions&);
};

TEST(ValidateOptionsTest, RejectsOutOfRangeNamingTheOption) {
  const std::vector<BadOption> cases = {
      {"lr", [](GroupOptions& o) { o.lr = -1; }},
      {"lr", [](GroupOptions& o) { o.lr = std::nan(""); }},
      {"weight_decay", [](GroupOptions& o) { o.weight_decay = -0.1; }},
      {"momentum", [](GroupOptions& o) { o.momentum = 1.0; }},
      {"momentum", [](GroupOptions& o) { o.momentum = -0.5; }},
      {"ns_steps must be >= 1, got 0", [](GroupOptions& o) { o.ns_steps = 0; }},
      {"ns_steps", [](GroupOptions& o) { o.ns_steps = 1000; }},
      {"ns_coefficients",
       [](GroupOptions& o) {
         o.ns_schedule = {"custom", {}, CoefficientsAfter::kCycle};
       }},
      {"ns_coefficients[0]", [](GroupOptions& o) { o.ns_schedule.tuples[0].b = INFINITY; }},
      {"ns_eps", [](GroupOptions& o) { o.ns_eps = -1e-7; }},
      {"ns_norm_safety", [](GroupOptions& o) { o.ns_norm_safety = 0; }},
      {"extra_scale_factor", [](GroupOptions& o) { o.extra_scale_factor = -1; }},
      {"qk_clip_threshold", [](GroupOptions& o) { o.qk_clip_threshold = 0; }},
      {"qk_clip_alpha", [](GroupOptions& o) { o.qk_clip_alpha = 1.5; }},
      {"betas[0]", [](GroupOptions& o) { o.beta1 = 1.0; }},
      {"betas[1]", [](GroupOptions& o) { o.beta2 = -0.1; }},
      {"eps", [](GroupOptions& o) { o.eps = -1; }},
      {"eps must be in [1e-30, 1]", [](GroupOptions& o) { o.eps = 0; }},
      {"eps must be in [1e-30, 1], got 1e-46", [](GroupOptions& o) { o.eps = 1e-46; }},
      {"lr must be in [0, 100], got 1e+308", [](GroupOptions& o) { o.lr = 1e308; }},
      {"weight_decay must be in [0, 100]", [](GroupOptions& o) { o.weight_decay = 1e3; }},
      {"lr * weight_decay must be <= 1",
       [](GroupOptions& o) {
         o.lr = 0.5;
         o.weight_decay = 3;
       }},
      {"weight_decay must be <= 1 with weight_decay_mode independent",
       [](GroupOptions& o) {
         o.weight_decay_mode = WeightDecayMode::kIndependent;
         o.weight_decay = 1.5;
       }},
      {"extra_scale_factor", [](GroupOptions& o) { o.extra_scale_factor = 1e6; }},
      {"ns_norm_safety", [](GroupOptions& o) { o.ns_norm_safety = 1e9; }},
      // A finite custom set whose iteration runs away: singular values grow without bound.
      {"ns_coefficients: with 5 steps",
       [](GroupOptions& o) {
         o.ns_schedule = {"custom", {{30, 0, 0}}, CoefficientsAfter::kCycle};
       }},
      // The simple set diverges when the normalization leaves singular values up to 1/0.25 = 4.
      {"grows singular values", [](GroupOptions& o) { o.ns_norm_safety = 0.25; }},
      {"nesterov",
       [](GroupOptions& o) {
         o.optimizer = OptimizerKind::kSgd;
         o.momentum = 0;
         o.nesterov = true;
       }},
  };
  for (const BadOption& c : cases) {
    GroupOptions o = DefaultOptions(OptimizerKind::kMuon);
    c.mutate(o);
    EXPECT_THAT(ValidateOptions(o), StatusIs(absl::StatusCode::kInvalidArgument, c.option)) << c.option;
    // Optimizer::Create refuses what ValidateOptions refuses.
    EXPECT_THAT(Optimizer::Create(o), StatusIs(absl::StatusCode::kInvalidArgument, c.option)) << c.option;
  }
}

// The step counts each named set is tuned for (the defaults the clients document).
int OwnSteps(const std::string& name) {
  if (name == "polar_express") return 8;
  if (name == "aol") return 4;
  if (name == "deepseekv4") return 10;
  return 5;
}

GroupOptions MuonWith(const std::string& set, int steps, kernels::MatmulPrecision precision, double safety) {
  GroupOptions o = DefaultOptions(OptimizerKind::kMuon);
  o.ns_schedule = *NamedSchedule(set);
  o.ns_steps = steps;
  o.matmul_precision = precision;
  o.ns_norm_safety = safety;
  return o;
}

// Every named set keeps singular values near 1 at its own step count with the defaults (fp32, no
// safety margin), and with a safety of 1.01 at any precision and any step count; so the growth check
// refuses none of those. The bound is at least twice the input's largest singular value, 1.
TEST(ValidateOptionsTest, NamedSetsKeepSingularValuesNearOne) {
  using kernels::MatmulPrecision;
  for (const std::string& name : NamedScheduleNames()) {
    const GroupOptions own = MuonWith(name, OwnSteps(name), MatmulPrecision::kFp32, 1.0);
    EXPECT_OK(ValidateOptions(own)) << name;
    EXPECT_LT(NsSingularValueBound(own), 11.0) << name;
    EXPECT_GE(NsSingularValueBound(own), 2.0) << name;
    for (MatmulPrecision precision : {MatmulPrecision::kFp32, MatmulPrecision::kTf32, MatmulPrecision::kBf16}) {
      for (int steps : {1, 5, 10, 100}) {
        if (name == "cubic5" && steps != 5) continue;  // tuned for exactly 5 steps
        const GroupOptions safe = MuonWith(name, steps, precision, 1.01);
        EXPECT_OK(ValidateOptions(safe)) << name << " with " << steps << " steps";
        EXPECT_LT(NsSingularValueBound(safe), 10.0) << name << " with " << steps << " steps";
      }
    }
  }
}

// cans takes its whole input range to the top: an input a rounding above it runs away (1 + 2⁻¹⁰
// reaches 10²³ in its five steps). With products in tf32 or bf16 it needs a safety margin, which the
// refusal names; the sets that contract towards 1, and gram_polar_express with its own 1.05, need none.
TEST(ValidateOptionsTest, SetsSensitiveAboveTheirRangeNeedASafetyMarginAtLowPrecision) {
  using kernels::MatmulPrecision;
  EXPECT_THAT(
      ValidateOptions(MuonWith("cans", 5, MatmulPrecision::kBf16, 1.0)),
      StatusIs(absl::StatusCode::kInvalidArgument, "and matmul_precision bf16 the iteration grows singular values"));
  EXPECT_THAT(ValidateOptions(MuonWith("cans", 5, MatmulPrecision::kBf16, 1.0)),
              StatusIs(absl::StatusCode::kInvalidArgument, "; ns_norm_safety 1.01 keeps them bounded"));
  EXPECT_THAT(ValidateOptions(MuonWith("cans", 5, MatmulPrecision::kTf32, 1.0)),
              StatusIs(absl::StatusCode::kInvalidArgument, "; ns_norm_safety 1.001 keeps them bounded"));
  EXPECT_OK(ValidateOptions(MuonWith("cans", 5, MatmulPrecision::kTf32, 1.001)));
  for (const char* set : {"simple", "quintic", "polar_express", "aol", "gram_polar_express"}) {
    EXPECT_OK(ValidateOptions(MuonWith(set, OwnSteps(set), MatmulPrecision::kBf16, 1.0))) << set;
  }
}

// The Chebyshev polynomial T5 = 16σ⁵ − 20σ³ + 5σ maps [−1, 1] onto itself but is chaotic there:
// rounding's excess above 1 grows 25-fold a step, so thirty steps overflow whatever the margin.
TEST(ValidateOptionsTest, AChaoticCustomSetIsRefusedAtAnySafety) {
  GroupOptions o = DefaultOptions(OptimizerKind::kMuon);
  o.ns_schedule = {"custom", {{5, -20, 16}}, CoefficientsAfter::kCycle};
  o.ns_steps = 30;
  EXPECT_THAT(ValidateOptions(o),
              StatusIs(absl::StatusCode::kInvalidArgument, "; no ns_norm_safety up to 2 keeps them bounded"));
  o.ns_norm_safety = 1.5;
  EXPECT_THAT(ValidateOptions(o), StatusIs(absl::StatusCode::kInvalidArgument, "grows singular values"));
  // In exact arithmetic on [0, 1] the map stays within 1: only rounding's model refuses it.
  EXPECT_LE(NsSingularValueBound(o.ns_schedule, 30, 1.0, NsRounding{}), 2.0 + 1e-9);
}

// The band each set maps the directions of a momentum into, and the residual bound derived from it
// (docs/algorithms.md, Telemetry): `simple` maps [2⁻⁷, 1] into about [0.68, 1.13], so its bound is
// (1 + (1 − 0.68²))/2 ≈ 0.77; a converged iteration's band is {1} and its bound 0.5; an iteration
// that does nothing keeps the cap, so that it is still told.
TEST(ResidualThresholdTest, DerivedFromEachSetsBand) {
  ASSERT_OK_AND_ASSIGN(NsSchedule simple, NamedSchedule("simple"));
  const NsBand band = NsOutputBand(simple, 5, 1.0);
  EXPECT_NEAR(band.lo, 0.682, 1e-3);
  EXPECT_NEAR(band.hi, 1.134, 1e-3);
  EXPECT_NEAR(NsResidualThreshold(simple, 5, 1.0), (2 - band.lo * band.lo) / 2, 1e-12);
  ASSERT_OK_AND_ASSIGN(NsSchedule polar, NamedSchedule("polar_express"));
  EXPECT_NEAR(NsResidualThreshold(polar, 8, 1.0), 0.5, 1e-3);
  ASSERT_OK_AND_ASSIGN(NsSchedule deepseek, NamedSchedule("deepseekv4"));
  EXPECT_NEAR(NsResidualThreshold(deepseek, 10, 1.0), 0.5, 1e-2);
  NsSchedule nothing;
  nothing.name = "custom";
  nothing.tuples = {{1.0, 0.0, 0.0}};
  EXPECT_EQ(NsResidualThreshold(nothing, 5, 1.0), kMaxResidualThreshold);
  for (const std::string& name : NamedScheduleNames()) {
    ASSERT_OK_AND_ASSIGN(NsSchedule schedule, NamedSchedule(name));
    const double bound = NsResidualThreshold(schedule, 5, 1.0);
    EXPECT_GE(bound, 0.5) << name;
    EXPECT_LE(bound, kMaxResidualThreshold) << name;
  }
  GroupOptions o = DefaultOptions(OptimizerKind::kMuon);
  EXPECT_FALSE(o.warn_residual_above.has_value()) << "derived unless given";
  EXPECT_EQ(ResidualThreshold(o), NsResidualThreshold(o.ns_schedule, o.ns_steps, o.ns_norm_safety));
  o.warn_residual_above = 0.25;
  EXPECT_EQ(ResidualThreshold(o), 0.25);
}

TEST(ValidateOptionsTest, Cubic5TakesExactlyFiveSteps) {
  GroupOptions o = DefaultOptions(OptimizerKind::kMuon);
  ASSERT_OK_AND_ASSIGN(o.ns_schedule, NamedSchedule("cubic5"));
  EXPECT_OK(ValidateOptions(o));  // ns_steps 5, the default
  for (int steps : {4, 6, 10}) {
    o.ns_steps = steps;
    EXPECT_THAT(ValidateOptions(o),
                StatusIs(absl::StatusCode::kInvalidArgument, "ns_steps must be 5 with ns_coefficients cubic5"))
        << steps;
  }
  ASSERT_OK_AND_ASSIGN(o.ns_schedule, NamedSchedule("deepseekv4"));
  o.ns_steps = 10;
  EXPECT_OK(ValidateOptions(o));
}

TEST(ValidateOptionsTest, OverridableValuesShareTheRanges) {
  const GroupOptions muon = DefaultOptions(OptimizerKind::kMuon);
  EXPECT_OK(ValidateStepHyper(muon, 100, 0.99, 0.01));
  EXPECT_THAT(ValidateStepHyper(muon, 100.5, 0.9, 0), StatusIs(absl::StatusCode::kInvalidArgument, "lr"));
  EXPECT_THAT(ValidateStepHyper(muon, 0.1, 0.9, 20), StatusIs(absl::StatusCode::kInvalidArgument, "lr * weight_decay"));
  GroupOptions coupled = muon;
  coupled.weight_decay_mode = WeightDecayMode::kL2;
  EXPECT_OK(ValidateStepHyper(coupled, 0.1, 0.9, 20)) << "L2 decay goes into the gradient, not a decay factor";
}

TEST(OptimizerTest, OnlyMuonSplitsFusedQkv) {
  ParamState param;
  param.shape = {12, 4};
  param.numel = 48;
  param.qkv = {2, 1, 1, 3};
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kLion, OptimizerKind::kSgd}) {
    ASSERT_OK_AND_ASSIGN(auto opt, Optimizer::Create(DefaultOptions(kind)));
    EXPECT_THAT(opt->CheckParameter(param),
                StatusIs(absl::StatusCode::kInvalidArgument, "qkv_split applies only to parameters of Muon groups"));
  }
  ASSERT_OK_AND_ASSIGN(auto muon, Optimizer::Create(DefaultOptions(OptimizerKind::kMuon)));
  EXPECT_OK(muon->CheckParameter(param));
}

TEST(OptimizerTest, CreateAndDefaultHyper) {
  GroupOptions o = DefaultOptions(OptimizerKind::kSgd);
  o.momentum = 0.9;
  o.weight_decay = 0.5;
  ASSERT_OK_AND_ASSIGN(auto opt, Optimizer::Create(o));
  const StepHyper h = opt->DefaultHyper();
  EXPECT_EQ(h.lr, 1e-2);
  EXPECT_EQ(h.momentum, 0.9);
  EXPECT_EQ(h.weight_decay, 0.5);
  EXPECT_EQ(opt->options().optimizer, OptimizerKind::kSgd);
}

}  // namespace
}  // namespace muond::optim
