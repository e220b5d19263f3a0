// Session in process, the rules on what it takes in (docs/protocol.md, Ranges and rules): step
// numbers and counts within range wherever they come from, loaded values finite and in range,
// overrides only where they apply, and the finiteness guard that refuses a step whose result could
// leave the fp32 range while letting one through whose first, loose bound was merely pessimistic.
#include <cmath>
#include <limits>

#include "gmock/gmock.h"
#include "kernels/cpu/cpu_backend.h"
#include "server/session/session.h"
#include "server/session/value_rules.h"
#include "tests/server/session/session_test_util.h"
#include "tests/testing/status_matchers.h"

namespace muond::session {
namespace {

using ::muond::testing::StatusIs;
using ::testing::HasSubstr;
using namespace ::muond::session::session_testing;

class SessionRulesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = kernels::NewCpuBackend(1);
    session_ = NewSession(backend_.get());
    ASSERT_NE(session_, nullptr);
    ASSERT_OK(session_->Upload(InitialParameters()));
    ASSERT_OK(RunStep(*session_, Request(1), Gradients(1)).status());
    ASSERT_OK_AND_ASSIGN(before_, session_->ExportState());
  }

  // The session is as SetUp left it: step 1, the same state bit for bit.
  void ExpectUnchanged() {
    ASSERT_OK_AND_ASSIGN(SessionState now, session_->ExportState());
    EXPECT_EQ(now.last_step, before_.last_step);
    EXPECT_EQ(now.step_counts, before_.step_counts);
    ASSERT_EQ(now.tensors.size(), before_.tensors.size());
    for (size_t i = 0; i < now.tensors.size(); ++i) {
      EXPECT_EQ(now.tensors[i].values, before_.tensors[i].values) << now.tensors[i].slot;
    }
  }

  // before_ with `edit` applied to its tensor (parameter, slot).
  SessionState Edited(size_t parameter, const std::string& slot, float value) const {
    SessionState state = before_;
    for (StateTensor& t : state.tensors) {
      if (t.parameter == parameter && t.slot == slot) t.values[1] = value;
    }
    return state;
  }

  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<Session> session_;
  SessionState before_;
};

TEST_F(SessionRulesTest, StepNumbersOutsideTheRangeAreRefused) {
  for (int64_t step : {std::numeric_limits<int64_t>::min(), int64_t{-1}, int64_t{0}, kMaxStep + 1,
                       std::numeric_limits<int64_t>::max()}) {
    EXPECT_FALSE(session_->BeginStep(Request(step)).ok()) << step;
  }
  ExpectUnchanged();

  // A state at the last step there is: the one after it is refused, naming the range, and nothing
  // wraps around.
  SessionState last = before_;
  last.last_step = kMaxStep;
  ASSERT_OK(session_->ImportState(last));
  EXPECT_THAT(session_->BeginStep(Request(kMaxStep + 1)),
              StatusIs(absl::StatusCode::kInvalidArgument, "header.step: must be between 1 and 9007199254740991"));
  EXPECT_THAT(session_->BeginStep(Request(std::numeric_limits<int64_t>::min())),
              StatusIs(absl::StatusCode::kInvalidArgument, "header.step: must be between 1 and"));
  EXPECT_EQ(session_->last_step(), kMaxStep);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<IncomingStep> replay, session_->BeginStep(Request(kMaxStep)));
  EXPECT_TRUE(replay->replay());
}

TEST_F(SessionRulesTest, AStateOutsideTheRangesIsRefusedAndChangesNothing) {
  for (int64_t last_step : {std::numeric_limits<int64_t>::max(), int64_t{1} << 62, kMaxStep + 1, int64_t{-1}}) {
    SessionState state = before_;
    state.last_step = last_step;
    EXPECT_THAT(session_->ImportState(state), StatusIs(absl::StatusCode::kInvalidArgument, "header.last_step"))
        << last_step;
  }
  SessionState counts = before_;
  counts.last_step = 3;
  counts.step_counts[1] = 4;
  EXPECT_THAT(session_->ImportState(counts), StatusIs(absl::StatusCode::kInvalidArgument,
                                                      "'b' has count 4; counts must be between 0 and last_step (3)"));
  EXPECT_THAT(session_->ImportState(Edited(0, "momentum", std::nanf(""))),
              StatusIs(absl::StatusCode::kInvalidArgument, "chunk.data: 'w/momentum' has the value nan at element 1"));
  EXPECT_THAT(session_->ImportState(Edited(1, "master", INFINITY)),
              StatusIs(absl::StatusCode::kInvalidArgument, "'b/master' has the value inf"));
  EXPECT_THAT(session_->ImportState(Edited(1, "exp_avg", 1e37f)),
              StatusIs(absl::StatusCode::kInvalidArgument, "values must be finite and within +-1e+36"));
  EXPECT_THAT(session_->ImportState(Edited(1, "exp_avg_sq", -0.5f)),
              StatusIs(absl::StatusCode::kInvalidArgument, "b/exp_avg_sq has the negative value -0.5 at element 1"));
  ExpectUnchanged();
}

TEST(SessionUploadRulesTest, NonFiniteOrHugeInitialValuesAreRefused) {
  std::unique_ptr<kernels::Backend> backend = kernels::NewCpuBackend(1);
  std::unique_ptr<Session> session = NewSession(backend.get());
  ASSERT_NE(session, nullptr);
  std::vector<HostTensor> nan = InitialParameters();
  nan[1].values[4] = std::nanf("");
  EXPECT_THAT(session->Upload(std::move(nan)),
              StatusIs(absl::StatusCode::kInvalidArgument, "chunk.data: 'b' has the value nan at element 4"));
  std::vector<HostTensor> huge = InitialParameters();
  huge[0].values[0] = -3e38f;
  EXPECT_THAT(session->Upload(std::move(huge)), StatusIs(absl::StatusCode::kInvalidArgument, "'w' has the value"));
  EXPECT_FALSE(session->initialized()) << "nothing was uploaded";
  ASSERT_OK(session->Upload(InitialParameters()));
}

TEST_F(SessionRulesTest, OverridesOutsideTheRangesOrTheirOptimizerAreRefused) {
  StepRequest momentum_for_adamw = Request(2);
  momentum_for_adamw.overrides.push_back({"adamw", std::nullopt, 0.9, std::nullopt});
  EXPECT_THAT(session_->BeginStep(momentum_for_adamw),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "header.overrides[0].momentum: does not apply to optimizer adamw (group 'adamw')"));
  StepRequest absurd_lr = Request(2);
  absurd_lr.overrides.push_back({"muon", 1e308, std::nullopt, std::nullopt});
  EXPECT_THAT(session_->BeginStep(absurd_lr),
              StatusIs(absl::StatusCode::kInvalidArgument, "header.overrides[0].lr must be in [0, 100], got 1e+308"));
  StepRequest flipping_decay = Request(2);
  flipping_decay.overrides.push_back({"adamw", 0.5, std::nullopt, 4.0});
  EXPECT_THAT(session_->BeginStep(flipping_decay),
              StatusIs(absl::StatusCode::kInvalidArgument, "header.overrides[0].lr * weight_decay must be <= 1"));
  StepRequest fine = Request(2);
  fine.overrides.push_back({"muon", 0.05, 0.9, 0.1});
  fine.overrides.push_back({"adamw", 0.01, std::nullopt, 0.1});
  ASSERT_OK(RunStep(*session_, fine, Gradients(2)).status());
}

// Prepare and commit belong to a sharded session, which steps in lock-step: an asynchronous push
// or a quorum step taking either would apply a prepare, or a commit's gradients with the norm its
// header claims (its clipping skipped). Refused naming header.phase, nothing applied.
// Prepare and commit are a sharded session's: every other session (lock-step included) refuses them.
TEST(SessionPhaseTest, AnUnshardedSessionTakesOnlyWholeSteps) {
  std::unique_ptr<kernels::Backend> backend = kernels::NewCpuBackend(1);
  for (const v1::SyncMode mode : {v1::SYNC_MODE_LOCKSTEP, v1::SYNC_MODE_ASYNC, v1::SYNC_MODE_QUORUM}) {
    v1::SessionSpec spec = SmallSpec(2);
    spec.mutable_sync()->set_mode(mode);
    if (mode == v1::SYNC_MODE_ASYNC) spec.mutable_sync()->set_max_staleness(4);
    if (mode == v1::SYNC_MODE_QUORUM) spec.mutable_sync()->set_min_ranks(1);
    std::unique_ptr<Session> session = NewSession(backend.get(), spec);
    ASSERT_NE(session, nullptr) << mode;
    ASSERT_OK(session->Upload(InitialParameters()));
    for (const StepPhase phase : {StepPhase::kPrepare, StepPhase::kCommit}) {
      StepRequest request = Request(1);
      if (mode == v1::SYNC_MODE_ASYNC) request.base_step = 0;  // refused, naming it, anywhere else
      request.phase = phase;
      if (phase == StepPhase::kCommit) request.decision = ShardDecision{0.0, ""};
      EXPECT_THAT(RunStep(*session, request, Gradients(1)),
                  StatusIs(absl::StatusCode::kInvalidArgument, "header.phase: this session is not sharded"))
          << mode;
    }
    EXPECT_EQ(session->last_step(), 0) << mode;
    StepRequest whole = Request(1);
    if (mode == v1::SYNC_MODE_ASYNC) {
      whole.base_step = 0;
      ASSERT_OK_AND_ASSIGN(StepOutcome outcome, RunStep(*session, whole, Gradients(1)));
      EXPECT_TRUE(outcome.result.applied) << mode;
    }
  }
}

// One SGD parameter of n elements, lr as given, uploaded with `initial`.
std::unique_ptr<Session> SgdSession(kernels::Backend* backend, int64_t n, double lr, std::vector<float> initial) {
  v1::SessionSpec spec;
  auto* group = spec.add_groups();
  group->set_name("sgd");
  group->mutable_options()->set_optimizer(v1::OPTIMIZER_SGD);
  group->mutable_options()->set_lr(lr);
  auto* p = spec.add_parameters();
  p->set_name("p");
  p->add_shape(n);
  p->set_group("sgd");
  std::unique_ptr<Session> session = NewSession(backend, spec);
  if (session == nullptr || !session->Upload({Tensor(std::move(initial))}).ok()) return nullptr;
  return session;
}

TEST(FiniteGuardTest, AStepThatCouldLeaveTheFp32RangeIsNotApplied) {
  std::unique_ptr<kernels::Backend> backend = kernels::NewCpuBackend(1);
  std::unique_ptr<Session> session = SgdSession(backend.get(), 4, 100, {1, -2, 3, -4});
  ASSERT_NE(session, nullptr);
  // A finite gradient that, times lr 100, would overflow fp32: p − 100·3e38 is −inf.
  ASSERT_TRUE(std::isinf(1.0f - 100.0f * 3e38f));
  ASSERT_OK_AND_ASSIGN(StepOutcome outcome, RunStep(*session, Request(1), {Tensor({3e38f, 0, 0, 0})}));
  EXPECT_FALSE(outcome.result.applied);
  EXPECT_THAT(outcome.result.skip_reason, HasSubstr("the update could take 'p'"));
  EXPECT_THAT(outcome.result.skip_reason, HasSubstr("nothing was changed"));
  EXPECT_EQ(session->last_step(), 1) << "a skipped step is answered like a non-finite one";
  ASSERT_OK_AND_ASSIGN(SessionState state, session->ExportState());
  EXPECT_THAT(state.tensors[0].values, ::testing::ElementsAre(1, -2, 3, -4));
  EXPECT_EQ(state.step_counts[0], 0);
  // The session goes on with sane gradients.
  ASSERT_OK_AND_ASSIGN(StepOutcome next, RunStep(*session, Request(2), {Tensor({0.01f, 0, 0, 0})}));
  EXPECT_TRUE(next.result.applied);
  EXPECT_FLOAT_EQ(CopyValues(*next.parameters)[0][0], 1.0f - 100.0f * 0.01f);
}

// Turbo-Muon's AOL forms X·Xᵀ from Newton–Schulz's unscaled input: elements of 1e20 on a 16×32
// matrix give Gram entries of 3.2e41, which overflow fp32, and s = 1/√inf = 0 times inf is NaN. The
// guard bounds that Gram matrix (AolGramBound) and skips the step, for Muon and for Dion2, where
// plain Muon, which scales in fp64 first, applies it finitely.
TEST(FiniteGuardTest, AnAolGramMatrixThatCouldOverflowSkipsTheStep) {
  std::unique_ptr<kernels::Backend> backend = kernels::NewCpuBackend(1);
  std::vector<float> huge(16 * 32), initial(16 * 32, 0.5f);
  for (size_t i = 0; i < huge.size(); ++i) huge[i] = (i % 3 == 0 ? -1e20f : 1e20f) * (1.0f + 0.01f * (i % 7));
  struct Case {
    const char* what;
    v1::OptimizerKind optimizer;
    bool aol;
    bool applied;
  };
  for (const Case& c :
       {Case{"muon aol", v1::OPTIMIZER_MUON, true, false}, Case{"dion2 aol", v1::OPTIMIZER_DION2, true, false},
        Case{"muon", v1::OPTIMIZER_MUON, false, true}}) {
    v1::SessionSpec spec;
    auto* group = spec.add_groups();
    group->set_name("g");
    group->mutable_options()->set_optimizer(c.optimizer);
    if (c.aol) group->mutable_options()->set_ns_preconditioner("aol");
    auto* p = spec.add_parameters();
    p->set_name("w");
    p->add_shape(16);
    p->add_shape(32);
    p->set_group("g");
    std::unique_ptr<Session> session = NewSession(backend.get(), spec);
    ASSERT_NE(session, nullptr) << c.what;
    ASSERT_OK(session->Upload({Tensor(initial)}));
    ASSERT_OK_AND_ASSIGN(StepOutcome outcome, RunStep(*session, Request(1), {Tensor(huge)}));
    EXPECT_EQ(outcome.result.applied, c.applied) << c.what << ": " << outcome.result.skip_reason;
    ASSERT_OK_AND_ASSIGN(SessionState state, session->ExportState());
    for (const StateTensor& t : state.tensors) {
      for (float v : t.values) ASSERT_TRUE(std::isfinite(v)) << c.what << " " << t.slot;
    }
    if (!c.applied) {
      EXPECT_THAT(outcome.result.skip_reason, HasSubstr("the update could take 'w'")) << c.what;
      EXPECT_EQ(state.tensors[0].values, initial) << c.what;
    }
  }
}

// The first bound uses the gradient's L2 norm (free) in place of its largest element: here 200²
// elements of 1e33 make a norm of 2e35, which with a master of 9e35 exceeds the limit. The exact
// magnitudes (largest |g| 1e33) show the step is safe, and it is applied.
TEST(FiniteGuardTest, ALooseFirstBoundIsTightenedBeforeAStepIsRefused) {
  std::unique_ptr<kernels::Backend> backend = kernels::NewCpuBackend(1);
  const int64_t n = 200 * 200;
  std::vector<float> initial(n, 0.0f);
  initial[7] = 9e35f;
  std::unique_ptr<Session> session = SgdSession(backend.get(), n, 1.0, initial);
  ASSERT_NE(session, nullptr);
  ASSERT_OK_AND_ASSIGN(StepOutcome outcome, RunStep(*session, Request(1), {Tensor(std::vector<float>(n, 1e33f))}));
  EXPECT_TRUE(outcome.result.applied) << outcome.result.skip_reason;
  EXPECT_FLOAT_EQ(CopyValues(*outcome.parameters)[0][7], 9e35f - 1e33f);
  EXPECT_FLOAT_EQ(CopyValues(*outcome.parameters)[0][0], -1e33f);
}

}  // namespace
}  // namespace muond::session
