// HealthWatch in process (docs/operations.md, Warnings), fed the telemetry a Muon group's steps
// report: the residual of one matrix a step, in turn, raised once while any matrix stays above its
// bound, and the momentum under ns_eps judged by what each Newton–Schulz preconditioner divides by.
#include "server/session/health_watch.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"

namespace muond::session {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

// One Muon group "matrices" of two parameters, "a" and "b".
SessionConfig MuonConfig(optim::NsPreconditioner preconditioner = optim::NsPreconditioner::kFrobenius) {
  SessionConfig config;
  GroupConfig group;
  group.name = "matrices";
  group.options.optimizer = optim::OptimizerKind::kMuon;
  group.options.ns_preconditioner = preconditioner;
  group.options.warn_residual_above = 0.5;
  config.groups.push_back(group);
  for (const char* name : {"a", "b"}) {
    ParameterConfig parameter;
    parameter.name = name;
    parameter.shape = {4, 4};
    parameter.numel = 16;
    config.parameter_index[name] = config.parameters.size();
    config.parameters.push_back(parameter);
  }
  return config;
}

class HealthWatchTest : public ::testing::Test {
 protected:
  // One applied step with `telemetry` for the group (no clipping, every parameter with a gradient);
  // the warnings it raised.
  std::vector<std::string> Step(const SessionConfig& config, const optim::StepTelemetry& telemetry,
                                std::vector<bool> has_gradient = {true, true}) {
    StepClipping clipping;
    clipping.group_norms = {1.0};
    clipping.coefficients = {1.0};
    clipping.clipped = {1.0};
    StepResult result;
    result.step = ++step_;
    watch_.Observe(config, clipping, has_gradient, {telemetry}, result);
    std::vector<std::string> kinds;
    for (const auto& warning : result.warnings) kinds.push_back(warning.kind);
    return kinds;
  }

  static optim::StepTelemetry Residual(const std::string& parameter, double residual) {
    optim::StepTelemetry t;
    t.residual = residual;
    t.residual_parameter = parameter;
    return t;
  }

  static optim::StepTelemetry Momentum(double smallest_nonzero_norm) {
    optim::StepTelemetry t;
    t.matrices = 2;
    t.momentum_sum_squares = 2 * smallest_nonzero_norm * smallest_nonzero_norm;
    t.smallest_momentum_norm = smallest_nonzero_norm;
    t.smallest_nonzero_momentum_norm = smallest_nonzero_norm;
    return t;
  }

  HealthWatch watch_;
  int64_t step_ = 0;
};

// "a" stays above the bound while "b" is healthy: measured in turn, the group's condition lasts from
// a's first measurement until a is measured below the bound, and is raised once; raised again when
// it starts again.
TEST_F(HealthWatchTest, OneMatrixAboveTheBoundAmongHealthyOnesIsRaisedOnce) {
  const SessionConfig config = MuonConfig();
  EXPECT_THAT(Step(config, Residual("a", 0.9)), ElementsAre("residual_high"));
  for (int round = 0; round < 3; ++round) {
    EXPECT_THAT(Step(config, Residual("b", 0.1)), IsEmpty()) << round;
    EXPECT_THAT(Step(config, Residual("a", 0.9)), IsEmpty()) << round;
  }
  EXPECT_THAT(Step(config, Residual("a", 0.1)), IsEmpty());
  EXPECT_THAT(Step(config, Residual("b", 0.1)), IsEmpty());
  EXPECT_THAT(Step(config, Residual("b", 0.9)), ElementsAre("residual_high"));
  EXPECT_THAT(Step(config, Residual("a", 0.9)), IsEmpty()) << "b still above: the same condition";
}

// A matrix whose parameter gets no gradient is no longer measured in turn: its last measurement
// stops holding the condition up, and the next matrix measured above the bound starts it again.
TEST_F(HealthWatchTest, AMatrixWithoutAGradientNoLongerHoldsTheConditionUp) {
  const SessionConfig config = MuonConfig();
  EXPECT_THAT(Step(config, Residual("a", 0.9)), ElementsAre("residual_high"));
  EXPECT_THAT(Step(config, Residual("b", 0.1), {false, true}), IsEmpty()) << "a has no gradient: ended";
  EXPECT_THAT(Step(config, Residual("b", 0.9), {false, true}), ElementsAre("residual_high"));
}

// Two matrices of one parameter (an expert stack) are told apart by where they start.
TEST_F(HealthWatchTest, MatricesOfOneParameterAreToldApart) {
  const SessionConfig config = MuonConfig();
  optim::StepTelemetry first = Residual("a", 0.9), second = Residual("a", 0.1);
  second.residual_offset = 8;
  EXPECT_THAT(Step(config, first), ElementsAre("residual_high"));
  EXPECT_THAT(Step(config, second), IsEmpty());
  EXPECT_THAT(Step(config, first), IsEmpty()) << "the first matrix was never measured below the bound";
}

// Frobenius divides by ns_norm_safety·‖U‖ + eps, so its input is ‖U‖/(‖U‖ + eps); AOL by the root
// of U·Uᵀ's row sums floored at eps, of the order of ‖U‖², so its input is ‖U‖/√eps once ‖U‖² is
// under eps. The iteration lifts small inputs: the default 5 steps of `simple` bring 1.07e-3 to
// half, AOL's 4 steps of `aol` 4.33e-3. Only an input under that is a momentum the update shrinks
// with: 1e-8 (input 0.09) is lifted, 1e-11 (1e-4) is not; with AOL 1e-5 (0.03) is, 1e-7 (3e-4) not.
TEST_F(HealthWatchTest, TheMomentumIsLowWhenTheIterationCannotLiftWhatThePreconditionerLeaves) {
  const SessionConfig frobenius = MuonConfig(optim::NsPreconditioner::kFrobenius);
  EXPECT_THAT(Step(frobenius, Momentum(1e-5)), IsEmpty());
  EXPECT_THAT(Step(frobenius, Momentum(1e-8)), IsEmpty());
  EXPECT_THAT(Step(frobenius, Momentum(1e-11)), ElementsAre("momentum_below_eps"));

  HealthWatch aol_watch;
  std::swap(watch_, aol_watch);
  SessionConfig aol = MuonConfig(optim::NsPreconditioner::kAol);
  aol.groups[0].options.ns_schedule = *optim::NamedSchedule("aol");  // what the choice brings
  aol.groups[0].options.ns_steps = 4;
  EXPECT_THAT(Step(aol, Momentum(1e-3)), IsEmpty());
  EXPECT_THAT(Step(aol, Momentum(1e-5)), IsEmpty());
  EXPECT_THAT(Step(aol, Momentum(1e-7)), ElementsAre("momentum_below_eps"));
  EXPECT_THAT(Step(aol, Momentum(1e-7)), IsEmpty()) << "raised when it starts, not while it lasts";
}

}  // namespace
}  // namespace muond::session
