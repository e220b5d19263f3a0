// The two phases of a sharded session's step (docs/sharding.md) on one session: a prepare holds the
// gradients and answers their sums of squares without changing anything; a commit applies them with
// the decision it carries, exactly as a whole step with that norm would; commits are exactly-once;
// what cannot be committed is refused, naming the field, with nothing changed.
#include <cmath>
#include <thread>

#include "gmock/gmock.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/server/session/session_test_util.h"
#include "tests/testing/status_matchers.h"

namespace muond::session {
namespace {

using ::muond::testing::StatusIs;
using namespace ::muond::session::session_testing;

StepRequest Prepare(int64_t step, int rank = 0) {
  StepRequest request = Request(step, rank);
  request.phase = StepPhase::kPrepare;
  return request;
}

StepRequest Commit(int64_t step, double grad_norm, std::string skip_reason = "", int rank = 0) {
  StepRequest request = Request(step, rank);
  request.phase = StepPhase::kCommit;
  request.decision = ShardDecision{grad_norm, std::move(skip_reason)};
  return request;
}

// The spec of shard 1 of 2 holding every parameter of SmallSpec (indices 0 and 1 of 3).
v1::SessionSpec ShardSpec(int world_size = 1) {
  v1::SessionSpec spec = SmallSpec(world_size);
  v1::ShardPlacement* shard = spec.mutable_shard();
  shard->add_endpoints("a:1");
  shard->add_endpoints("b:2");
  shard->set_index(1);
  shard->set_num_parameters(3);
  shard->add_parameters(0);
  shard->add_parameters(2);
  return spec;
}

class ShardedStepTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = kernels::NewCpuBackend(1);
    shard_ = NewSession(backend_.get(), ShardSpec());
    whole_ = NewSession(backend_.get());
    ASSERT_NE(shard_, nullptr);
    ASSERT_NE(whole_, nullptr);
    ASSERT_OK(shard_->Upload(InitialParameters()));
    ASSERT_OK(whole_->Upload(InitialParameters()));
  }
  static std::vector<std::vector<float>> Parameters(const Session& session) {
    int64_t step = 0;
    return CopyValues(*session.Parameters(&step));
  }

  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<Session> shard_;
  std::unique_ptr<Session> whole_;
};

TEST_F(ShardedStepTest, APrepareAnswersTheSumsAndChangesNothing) {
  ASSERT_OK_AND_ASSIGN(StepOutcome prepared, RunStep(*shard_, Prepare(1), Gradients(1)));
  EXPECT_TRUE(prepared.result.prepared);
  EXPECT_EQ(prepared.parameters, nullptr) << "a prepare sends no parameters back";
  const std::vector<HostTensor> gradients = Gradients(1);
  ASSERT_EQ(prepared.result.sum_squares.size(), 2u);
  EXPECT_EQ(prepared.result.sum_squares[0], gradients[0].sum_squares);
  EXPECT_EQ(prepared.result.sum_squares[1], gradients[1].sum_squares);
  EXPECT_TRUE(prepared.result.skip_reason.empty());
  EXPECT_EQ(shard_->last_step(), 0);
  EXPECT_EQ(Parameters(*shard_)[0], InitialParameters()[0].values);
}

// With the global norm of a larger session (so clipping bites harder than this shard's own norm
// would), a commit applies what a whole step with the same clip coefficient applies.
TEST_F(ShardedStepTest, ACommitAppliesThePreparedStepWithTheGlobalNorm) {
  for (int step = 1; step <= 3; ++step) {
    StepRequest prepare = Prepare(step);
    prepare.max_grad_norm = 0.5;
    ASSERT_OK_AND_ASSIGN(StepOutcome prepared, RunStep(*shard_, prepare, Gradients(step)));
    const double global_norm = std::sqrt(prepared.result.sum_squares[0] + prepared.result.sum_squares[1] + 4.0);
    ASSERT_OK_AND_ASSIGN(StepOutcome committed, RunStep(*shard_, Commit(step, global_norm), {}));
    EXPECT_TRUE(committed.result.applied);
    EXPECT_FALSE(committed.result.replayed);
    EXPECT_EQ(committed.result.grad_norm, global_norm);

    // The whole session gets the same clip coefficient, max/(norm + 1e-6), from a limit chosen
    // for its own norm.
    std::vector<HostTensor> gradients = Gradients(step);
    const double own = std::sqrt(gradients[0].sum_squares + gradients[1].sum_squares);
    StepRequest whole = Request(step);
    whole.max_grad_norm = 0.5 * (own + 1e-6) / (global_norm + 1e-6);
    ASSERT_OK(RunStep(*whole_, whole, std::move(gradients)).status());
  }
  const auto shard = Parameters(*shard_);
  const auto whole = Parameters(*whole_);
  // The two clip coefficients are the same number computed two ways in fp64, a few fp64 ulps apart,
  // so as fp32 they are equal or one ulp (2⁻²⁴ relative) apart. That changes the gradient by one
  // ulp, the Muon update (normalized) and the AdamW update (m/√v) by far less, and can flip the
  // rounding of a weight (|w| ≤ 1: ≤ 2⁻²⁴ = 6e-8) once a step: ≤ 2e-7 over 3 steps. 1e-6 covers
  // that, while clipping with the shard's own norm instead of the global one changes the
  // coefficient by ≥ 10% and the weights by ≥ 1e-4.
  for (size_t p = 0; p < shard.size(); ++p) {
    for (size_t i = 0; i < shard[p].size(); ++i) EXPECT_NEAR(shard[p][i], whole[p][i], 1e-6) << p << "," << i;
  }
}

TEST_F(ShardedStepTest, CommitsApplyOnceAndAPrepareAfterTheCommitAnswersItsDecision) {
  ASSERT_OK(RunStep(*shard_, Prepare(1), Gradients(1)).status());
  ASSERT_OK_AND_ASSIGN(StepOutcome committed, RunStep(*shard_, Commit(1, 12.5), {}));
  const auto after_1 = Parameters(*shard_);
  ASSERT_OK_AND_ASSIGN(StepOutcome again, RunStep(*shard_, Commit(1, 17.0), {}));
  EXPECT_TRUE(again.result.replayed);
  EXPECT_EQ(again.result.grad_norm, 12.5);
  EXPECT_EQ(CopyValues(*again.parameters), after_1);
  // A client that lost the answers prepares again: the shard answers the decision it applied.
  ASSERT_OK_AND_ASSIGN(StepOutcome prepare_again, RunStep(*shard_, Prepare(1), Gradients(5)));
  EXPECT_TRUE(prepare_again.result.replayed);
  EXPECT_FALSE(prepare_again.result.prepared);
  EXPECT_EQ(prepare_again.result.grad_norm, 12.5);
  EXPECT_EQ(prepare_again.parameters, nullptr);
  EXPECT_EQ(Parameters(*shard_), after_1);
  EXPECT_EQ(shard_->last_step(), 1);
}

TEST_F(ShardedStepTest, ASkipDecisionSkipsTheStepAndAdvancesTheCounter) {
  ASSERT_OK(RunStep(*shard_, Prepare(1), Gradients(1)).status());
  ASSERT_OK_AND_ASSIGN(StepOutcome committed, RunStep(*shard_, Commit(1, NAN, "non-finite gradient in 'x'"), {}));
  EXPECT_FALSE(committed.result.applied);
  EXPECT_EQ(committed.result.skip_reason, "non-finite gradient in 'x'");
  EXPECT_EQ(shard_->last_step(), 1);
  EXPECT_EQ(Parameters(*shard_)[0], InitialParameters()[0].values);
}

// The global norm sums every shard's prepare answer, so it is never below this shard's own: a
// commit whose decision is (one a client took from an answer that did not know the step, say) is
// refused, naming the field, and the prepared step waits for a right one.
TEST_F(ShardedStepTest, ADecisionBelowTheShardsOwnNormIsRefused) {
  ASSERT_OK_AND_ASSIGN(StepOutcome prepared, RunStep(*shard_, Prepare(1), Gradients(1)));
  const double own = prepared.result.grad_norm;
  ASSERT_GT(own, 0);
  EXPECT_THAT(RunStep(*shard_, Commit(1, 0.0), {}),
              StatusIs(absl::StatusCode::kInvalidArgument, "header.decision.grad_norm: 0 is below this shard's own"));
  EXPECT_THAT(RunStep(*shard_, Commit(1, own * 0.999), {}),
              StatusIs(absl::StatusCode::kInvalidArgument, "header.decision.grad_norm"));
  EXPECT_EQ(shard_->last_step(), 0);
  EXPECT_EQ(Parameters(*shard_)[0], InitialParameters()[0].values);
  ASSERT_OK_AND_ASSIGN(StepOutcome committed, RunStep(*shard_, Commit(1, own), {}));
  EXPECT_TRUE(committed.result.applied);
}

// How the last step went travels with the session's state into a checkpoint (ExportState's
// last_decision), so that a shard restored from it answers a resent prepare with the decision it
// applied; a state without it (SetState, a checkpoint of an earlier version) makes the shard refuse
// the resent prepare rather than answer a made-up decision the other shards would commit with.
TEST_F(ShardedStepTest, AShardRestoredFromItsStateAnswersTheDecisionItApplied) {
  for (const bool skip : {false, true}) {
    SCOPED_TRACE(skip ? "skipped" : "applied");
    std::unique_ptr<Session> shard = NewSession(backend_.get(), ShardSpec());
    ASSERT_OK(shard->Upload(InitialParameters()));
    StepRequest prepare = Prepare(1);
    prepare.max_grad_norm = 1.0;
    ASSERT_OK(RunStep(*shard, prepare, Gradients(1)).status());
    ASSERT_OK(RunStep(*shard, skip ? Commit(1, NAN, "non-finite gradient in 'x'") : Commit(1, 13.0), {}).status());
    ASSERT_OK_AND_ASSIGN(SessionState state, shard->ExportState());
    ASSERT_TRUE(state.last_decision.has_value());

    std::unique_ptr<Session> restored = NewSession(backend_.get(), ShardSpec());
    ASSERT_OK(restored->ImportState(state));
    ASSERT_OK_AND_ASSIGN(StepOutcome again, RunStep(*restored, prepare, Gradients(1)));
    EXPECT_TRUE(again.result.replayed);
    EXPECT_EQ(again.result.applied, !skip);
    if (skip) {
      EXPECT_EQ(again.result.skip_reason, "non-finite gradient in 'x'");
    } else {
      EXPECT_EQ(again.result.grad_norm, 13.0);
    }

    state.last_decision.reset();
    std::unique_ptr<Session> loaded = NewSession(backend_.get(), ShardSpec());
    ASSERT_OK(loaded->ImportState(state));
    EXPECT_THAT(RunStep(*loaded, prepare, Gradients(1)),
                StatusIs(absl::StatusCode::kFailedPrecondition, "how it went is not known here"));
    // The next step is taken as ever, and is then known.
    ASSERT_OK_AND_ASSIGN(StepOutcome next, RunStep(*loaded, Prepare(2), Gradients(2)));
    ASSERT_OK(RunStep(*loaded, Commit(2, next.result.grad_norm), {}).status());
    ASSERT_OK(RunStep(*loaded, Prepare(2), Gradients(2)).status());
  }
}

TEST_F(ShardedStepTest, ANonFiniteGradientIsReportedByThePrepare) {
  std::vector<HostTensor> gradients = Gradients(1);
  gradients[1].values[2] = NAN;
  gradients[1].sum_squares = NAN;
  ASSERT_OK_AND_ASSIGN(StepOutcome prepared, RunStep(*shard_, Prepare(1), std::move(gradients)));
  EXPECT_TRUE(std::isnan(prepared.result.sum_squares[1]));
  EXPECT_EQ(prepared.result.skip_reason, "non-finite gradient in 'b'");
}

TEST_F(ShardedStepTest, WhatCannotBeCommittedIsRefusedAndChangesNothing) {
  EXPECT_THAT(RunStep(*shard_, Request(1), Gradients(1)),
              StatusIs(absl::StatusCode::kInvalidArgument, "header.phase: this session is shard 1 of 2"));
  EXPECT_THAT(RunStep(*shard_, Commit(1, 1.0), {}),
              StatusIs(absl::StatusCode::kFailedPrecondition, "step 1 was not prepared on this shard"));
  ASSERT_OK(RunStep(*shard_, Prepare(1), Gradients(1)).status());
  EXPECT_THAT(RunStep(*shard_, Commit(1, INFINITY), {}),
              StatusIs(absl::StatusCode::kInvalidArgument, "header.decision.grad_norm"));
  StepRequest no_decision = Commit(1, 1.0);
  no_decision.decision.reset();
  EXPECT_THAT(RunStep(*shard_, no_decision, {}), StatusIs(absl::StatusCode::kInvalidArgument, "header.decision"));
  StepRequest stray = Prepare(1);
  stray.decision = ShardDecision{1.0, ""};
  EXPECT_THAT(RunStep(*shard_, stray, Gradients(1)), StatusIs(absl::StatusCode::kInvalidArgument, "header.decision"));
  EXPECT_THAT(RunStep(*shard_, Commit(1, 1.0), Gradients(1)),
              StatusIs(absl::StatusCode::kInvalidArgument, "header.num_chunks: a commit carries no gradients"));
  EXPECT_EQ(shard_->last_step(), 0);
  EXPECT_EQ(Parameters(*shard_)[0], InitialParameters()[0].values);
  // The refusals left the prepared step as it was: it commits now (with a global norm, which is at
  // least this shard's own, 3.1).
  ASSERT_OK(RunStep(*shard_, Commit(1, 10.0), {}).status());
  EXPECT_EQ(shard_->last_step(), 1);
}

// A commit is recorded with its decision: the journal's record decodes to the same request.
TEST(ShardedStepRecordTest, TheDecisionSurvivesTheJournalEncoding) {
  StepRequest commit = Commit(4, std::nextafter(1.25, 2.0), "");
  ASSERT_OK_AND_ASSIGN(StepRequest decoded, DecodeStepRequest(EncodeStepRequest(commit)));
  EXPECT_EQ(decoded.phase, StepPhase::kCommit);
  ASSERT_TRUE(decoded.decision.has_value());
  EXPECT_EQ(decoded.decision->grad_norm, commit.decision->grad_norm);
  StepRequest skipped = Commit(5, NAN, "non-finite gradient in 'w'");
  ASSERT_OK_AND_ASSIGN(decoded, DecodeStepRequest(EncodeStepRequest(skipped)));
  EXPECT_TRUE(std::isnan(decoded.decision->grad_norm));
  EXPECT_EQ(decoded.decision->skip_reason, "non-finite gradient in 'w'");
  ASSERT_OK_AND_ASSIGN(decoded, DecodeStepRequest(EncodeStepRequest(Request(6))));
  EXPECT_EQ(decoded.phase, StepPhase::kWhole);
  EXPECT_FALSE(decoded.decision.has_value());
}

// Two ranks prepare: both get the sums of the average; one commit applies it.
TEST(ShardedMultiRankTest, RanksPrepareTogetherAndOneCommitApplies) {
  auto backend = kernels::NewCpuBackend(1);
  std::unique_ptr<Session> session = NewSession(backend.get(), ShardSpec(/*world_size=*/2));
  ASSERT_NE(session, nullptr);
  ASSERT_OK(session->Upload(InitialParameters()));
  absl::StatusOr<StepOutcome> other;
  std::thread second([&] { other = RunStep(*session, Prepare(1, 1), Gradients(2)); });
  ASSERT_OK_AND_ASSIGN(StepOutcome first, RunStep(*session, Prepare(1, 0), Gradients(1)));
  second.join();
  ASSERT_OK(other.status());
  EXPECT_TRUE(first.result.prepared);
  EXPECT_TRUE(other->result.prepared);
  EXPECT_EQ(first.result.sum_squares, other->result.sum_squares);
  EXPECT_EQ(session->last_step(), 0);
  ASSERT_OK_AND_ASSIGN(StepOutcome committed, RunStep(*session, Commit(1, 5.0, "", 1), {}));  // ≥ its own 1.7
  EXPECT_TRUE(committed.result.applied);
  ASSERT_OK_AND_ASSIGN(StepOutcome rank0, RunStep(*session, Commit(1, 5.0, "", 0), {}));
  EXPECT_TRUE(rank0.result.replayed);
  EXPECT_EQ(CopyValues(*rank0.parameters), CopyValues(*committed.parameters));
  EXPECT_EQ(session->last_step(), 1);
}

}  // namespace
}  // namespace muond::session
