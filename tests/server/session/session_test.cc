// Session in process: exactly-once steps (next, replay, refused), refusals that change nothing, the
// non-finite skip, two streams of one step, and multi-rank gathering.
#include "server/session/session.h"

#include <cmath>
#include <limits>
#include <thread>

#include "gmock/gmock.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/server/session/session_test_util.h"
#include "tests/testing/status_matchers.h"

namespace muond::session {
namespace {

using ::muond::testing::StatusIs;
using namespace ::muond::session::session_testing;

class SessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = kernels::NewCpuBackend(1);
    session_ = NewSession(backend_.get());
    ASSERT_NE(session_, nullptr);
    ASSERT_OK(session_->Upload(InitialParameters()));
  }
  std::vector<std::vector<float>> Parameters() const {
    int64_t step = 0;
    return CopyValues(*session_->Parameters(&step));
  }

  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<Session> session_;
};

TEST_F(SessionTest, StepsBeforeUploadAreRefused) {
  std::unique_ptr<Session> fresh = NewSession(backend_.get());
  EXPECT_THAT(fresh->BeginStep(Request(1)), StatusIs(absl::StatusCode::kFailedPrecondition, "upload them first"));
}

TEST_F(SessionTest, ARetryOfTheLastStepIsAnsweredWithoutASecondUpdate) {
  ASSERT_OK_AND_ASSIGN(StepOutcome first, RunStep(*session_, Request(1), Gradients(1)));
  EXPECT_TRUE(first.result.applied);
  EXPECT_FALSE(first.result.replayed);
  const auto after_1 = Parameters();
  EXPECT_NE(after_1[0], InitialParameters()[0].values);

  ASSERT_OK_AND_ASSIGN(std::unique_ptr<IncomingStep> retry, session_->BeginStep(Request(1)));
  EXPECT_TRUE(retry->replay()) << "decided when the step begins, before its gradients are read";
  ASSERT_OK_AND_ASSIGN(StepOutcome replayed, session_->FinishStep(std::move(retry)));
  EXPECT_TRUE(replayed.result.replayed);
  EXPECT_EQ(replayed.result.grad_norm, first.result.grad_norm);
  EXPECT_EQ(CopyValues(*replayed.parameters), after_1);
  EXPECT_EQ(Parameters(), after_1);
  EXPECT_EQ(session_->last_step(), 1);
}

TEST_F(SessionTest, OtherStepNumbersNameTheExpectedStep) {
  EXPECT_THAT(session_->BeginStep(Request(2)), StatusIs(absl::StatusCode::kFailedPrecondition, "expected step 1"));
  ASSERT_OK(RunStep(*session_, Request(1), Gradients(1)).status());
  EXPECT_THAT(session_->BeginStep(Request(3)),
              StatusIs(absl::StatusCode::kFailedPrecondition, "expected step 2 (or 1 to replay the last one), got 3"));
}

TEST_F(SessionTest, ABadRequestIsRefusedBeforeAnyGradientAndChangesNothing) {
  StepRequest bad_lr = Request(1);
  bad_lr.overrides.push_back({"muon", -1.0, std::nullopt, std::nullopt, std::nullopt, std::nullopt});
  EXPECT_THAT(session_->BeginStep(bad_lr), StatusIs(absl::StatusCode::kInvalidArgument, "header.overrides[0].lr"));
  StepRequest unknown_group = Request(1);
  unknown_group.overrides.push_back({"nope", 0.1, std::nullopt, std::nullopt, std::nullopt, std::nullopt});
  EXPECT_THAT(session_->BeginStep(unknown_group), StatusIs(absl::StatusCode::kNotFound, "unknown group 'nope'"));
  StepRequest twice = Request(1);
  twice.overrides.push_back({"muon", 0.1, std::nullopt, std::nullopt, std::nullopt, std::nullopt});
  twice.overrides.push_back({"adamw", 0.1, std::nullopt, std::nullopt, std::nullopt, std::nullopt});
  twice.overrides.push_back({"muon", std::nullopt, 0.9, std::nullopt, std::nullopt, std::nullopt});
  EXPECT_THAT(session_->BeginStep(twice),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "header.overrides[2].group: 'muon' is given twice (also header.overrides[0])"));
  StepRequest lock_step_base = Request(1);
  lock_step_base.base_step = 0;
  EXPECT_THAT(session_->BeginStep(lock_step_base),
              StatusIs(absl::StatusCode::kInvalidArgument, "header.base_step: applies to spec.sync.mode async only"));
  for (int64_t number : {int64_t{-1}, int64_t{0}, std::numeric_limits<int64_t>::max()}) {
    EXPECT_THAT(session_->BeginStep(Request(number)), StatusIs(absl::StatusCode::kInvalidArgument, "header.step"))
        << number;
  }
  StepRequest bad_clip = Request(1);
  bad_clip.max_grad_norm = 0;
  EXPECT_THAT(session_->BeginStep(bad_clip), StatusIs(absl::StatusCode::kInvalidArgument, "header.max_grad_norm"));
  StepRequest bad_rank = Request(1, 1);
  EXPECT_THAT(session_->BeginStep(bad_rank), StatusIs(absl::StatusCode::kInvalidArgument, "header.rank"));
  StepRequest bad_logits = Request(1);
  bad_logits.qk_logits.push_back({"w", {1.0}});
  EXPECT_THAT(session_->BeginStep(bad_logits), StatusIs(absl::StatusCode::kInvalidArgument, "header.qk_logits[0]"));
  EXPECT_EQ(session_->last_step(), 0);
  EXPECT_EQ(Parameters()[0], InitialParameters()[0].values);
}

TEST_F(SessionTest, ANonFiniteGradientSkipsTheUpdateButAdvancesTheCounter) {
  ASSERT_OK_AND_ASSIGN(SessionState before, session_->ExportState());
  std::vector<HostTensor> gradients = Gradients(1);
  gradients[1].values[2] = std::nanf("");
  gradients[1].sum_squares = std::nan("");
  ASSERT_OK_AND_ASSIGN(StepOutcome outcome, RunStep(*session_, Request(1), std::move(gradients)));
  EXPECT_FALSE(outcome.result.applied);
  EXPECT_THAT(outcome.result.skip_reason, ::testing::HasSubstr("non-finite gradient in 'b'"));
  EXPECT_EQ(session_->last_step(), 1);
  ASSERT_OK_AND_ASSIGN(SessionState after, session_->ExportState());
  ASSERT_EQ(after.tensors.size(), before.tensors.size());
  for (size_t i = 0; i < after.tensors.size(); ++i) EXPECT_EQ(after.tensors[i].values, before.tensors[i].values);
}

TEST_F(SessionTest, TwoStreamsOfOneStepApplyItOnce) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<IncomingStep> first, session_->BeginStep(Request(1)));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<IncomingStep> second, session_->BeginStep(Request(1)));
  EXPECT_FALSE(first->replay());
  EXPECT_FALSE(second->replay());
  first->gradients() = Gradients(1);
  second->gradients() = Gradients(1);
  ASSERT_OK_AND_ASSIGN(StepOutcome applied, session_->FinishStep(std::move(first)));
  ASSERT_OK_AND_ASSIGN(StepOutcome answered, session_->FinishStep(std::move(second)));
  EXPECT_FALSE(applied.result.replayed);
  EXPECT_TRUE(answered.result.replayed) << "the later one finds the step applied";
  EXPECT_EQ(CopyValues(*answered.parameters), CopyValues(*applied.parameters));

  // Equal to a session that saw the step once.
  std::unique_ptr<Session> once = NewSession(backend_.get());
  ASSERT_OK(once->Upload(InitialParameters()));
  ASSERT_OK_AND_ASSIGN(StepOutcome reference, RunStep(*once, Request(1), Gradients(1)));
  EXPECT_EQ(Parameters(), CopyValues(*reference.parameters));
}

// A step whose gradients are still arriving learns of a close at once (its transport asks between
// pieces), and the step is not applied.
TEST_F(SessionTest, AStepUnderWayLearnsOfACloseBeforeItsGradientsEnd) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<IncomingStep> step, session_->BeginStep(Request(1)));
  ASSERT_OK(step->CheckOpen());
  session_->Close();
  EXPECT_THAT(step->CheckOpen(), StatusIs(absl::StatusCode::kNotFound, "session 's' was closed"));
  EXPECT_THAT(session_->CheckOpen(), StatusIs(absl::StatusCode::kNotFound, "was closed"));
  step->gradients() = Gradients(1);
  EXPECT_THAT(session_->FinishStep(std::move(step)).status(), StatusIs(absl::StatusCode::kNotFound, "was closed"));
  EXPECT_EQ(session_->last_step(), 0);
}

// A resend begun as a replay (its gradients not read) and finished after a SetState rewound the
// session, where it would be the next step: refused, nothing applied, rather than applied with no
// gradients.
TEST_F(SessionTest, AReplayWhoseSessionWasRewoundMeanwhileIsRefusedNotAppliedEmpty) {
  ASSERT_OK_AND_ASSIGN(SessionState at_zero, session_->ExportState());
  ASSERT_OK(RunStep(*session_, Request(1), Gradients(1)).status());
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<IncomingStep> resend, session_->BeginStep(Request(1)));
  ASSERT_TRUE(resend->replay());
  ASSERT_OK(session_->ImportState(at_zero));
  const auto rewound = Parameters();
  EXPECT_THAT(session_->FinishStep(std::move(resend)).status(),
              StatusIs(absl::StatusCode::kAborted, "was replaced while this step was read"));
  EXPECT_EQ(session_->last_step(), 0);
  EXPECT_EQ(Parameters(), rewound);
  ASSERT_OK(RunStep(*session_, Request(1), Gradients(1)).status()) << "the step sent again is applied";
  EXPECT_EQ(session_->last_step(), 1);
}

// The values a reader shows, read while it is held.
std::vector<std::vector<float>> ReadAll(ParameterReader& reader) {
  EXPECT_OK(reader.Hold());
  std::vector<std::vector<float>> out;
  for (size_t i = 0; i < reader.snapshot()->values.size(); ++i) {
    const std::span<const float> values = reader.Values(i);
    out.emplace_back(values.begin(), values.end());
  }
  reader.Release();
  return out;
}

// On the CPU backend answers read the masters themselves (no per-step copy): a snapshot can be
// opened while the masters are as it saw them, and is refused, naming the step, once they changed.
TEST_F(SessionTest, AnswersReadTheMastersWhileTheyLast) {
  ASSERT_OK_AND_ASSIGN(StepOutcome first, RunStep(*session_, Request(1), Gradients(1)));
  EXPECT_TRUE(first.parameters->views) << "the CPU backend's masters are host memory";
  EXPECT_TRUE(first.parameters->copies.empty());
  const auto after_1 = Parameters();
  {
    ASSERT_OK_AND_ASSIGN(ParameterReader reader, session_->OpenParameters(first.parameters));
    EXPECT_EQ(reader.Values(0).data(), first.parameters->values[0].data()) << "the masters, not a copy";
    EXPECT_EQ(ReadAll(reader), after_1);
  }
  ASSERT_OK(RunStep(*session_, Request(2), Gradients(2)).status());
  EXPECT_THAT(session_->OpenParameters(first.parameters),
              StatusIs(absl::StatusCode::kAborted, "the parameters after step 1 were replaced"));
  int64_t step = 0;
  std::shared_ptr<const ParameterSnapshot> now = session_->Parameters(&step);
  EXPECT_EQ(step, 2);
  EXPECT_OK(session_->OpenParameters(now).status());
}

// A reader that is not held does not hold up a step (a slow client between two chunks): the step
// changes the masters, and the reader reads on from a copy of them as they were, for every
// parameter it had not finished; a later step leaves it as it is. A SetState leaves a copy as well.
TEST_F(SessionTest, AReleasedReaderIsLeftTheValuesItShows) {
  ASSERT_OK_AND_ASSIGN(StepOutcome first, RunStep(*session_, Request(1), Gradients(1)));
  const auto after_1 = Parameters();
  ASSERT_OK_AND_ASSIGN(const SessionState state_1, session_->ExportState());
  ASSERT_OK_AND_ASSIGN(ParameterReader reader, session_->OpenParameters(first.parameters));
  reader.Release();  // before anything else of the session is called
  ASSERT_OK(RunStep(*session_, Request(2), Gradients(2)).status()) << "not held up by the reader";
  ASSERT_NE(Parameters(), after_1);
  EXPECT_EQ(ReadAll(reader), after_1);
  ASSERT_OK(RunStep(*session_, Request(3), Gradients(3)).status());
  EXPECT_EQ(ReadAll(reader), after_1) << "copied once, as of its own step";
  reader = ParameterReader();  // closed: its copy no longer counts
  const auto after_3 = Parameters();
  ASSERT_OK_AND_ASSIGN(Session::LatestParameters at_3, session_->ReadLatestParameters());
  at_3.reader.Release();
  ASSERT_OK(session_->ImportState(state_1));
  ASSERT_EQ(Parameters(), after_1);
  EXPECT_EQ(ReadAll(at_3.reader), after_3);
  EXPECT_EQ(at_3.last_step, 3);
}

// The copies left to a session's readers take at most its parameters' fp32 bytes at once: of two
// readers that each need every parameter, one reads on from its copy and the other is replaced
// (UNAVAILABLE: its client reads again). A parameter a reader finished is not copied: two readers
// that finished the larger one both fit.
TEST_F(SessionTest, ReadersAreLeftCopiesWithinTheParametersBytesAndTheOthersReplaced) {
  ASSERT_OK_AND_ASSIGN(StepOutcome first, RunStep(*session_, Request(1), Gradients(1)));
  const auto after_1 = Parameters();
  {
    ASSERT_OK_AND_ASSIGN(ParameterReader a, session_->OpenParameters(first.parameters));
    a.Release();
    ASSERT_OK_AND_ASSIGN(ParameterReader b, session_->OpenParameters(first.parameters));
    b.Release();
    ASSERT_OK(RunStep(*session_, Request(2), Gradients(2)).status());
    int copied = 0, replaced = 0;
    for (ParameterReader* reader : {&a, &b}) {
      const absl::Status held = reader->Hold();
      if (held.ok()) {
        ++copied;
        EXPECT_EQ(ReadAll(*reader), after_1);
      } else {
        ++replaced;
        EXPECT_THAT(held, StatusIs(absl::StatusCode::kUnavailable, "the parameters after step 1 were replaced"));
      }
    }
    EXPECT_EQ(copied, 1);
    EXPECT_EQ(replaced, 1);
  }
  int64_t step = 0;
  const std::shared_ptr<const ParameterSnapshot> second = session_->Parameters(&step);
  const auto after_2 = Parameters();
  ASSERT_OK_AND_ASSIGN(ParameterReader c, session_->OpenParameters(second));
  c.Finished(0);  // the 8x6 weight sent, the bias of 6 not yet
  c.Release();
  ASSERT_OK_AND_ASSIGN(ParameterReader d, session_->OpenParameters(second));
  d.Finished(0);
  d.Release();
  ASSERT_OK(RunStep(*session_, Request(3), Gradients(3)).status());
  for (ParameterReader* reader : {&c, &d}) {
    ASSERT_OK(reader->Hold());
    const std::span<const float> bias = reader->Values(1);
    EXPECT_EQ(std::vector<float>(bias.begin(), bias.end()), after_2[1]);
    reader->Release();
  }
}

// ReadLatestParameters opens the current snapshot at once: the step it names and the values it
// holds agree, before and after a later step.
TEST_F(SessionTest, LatestParametersComeWithTheirStep) {
  ASSERT_OK_AND_ASSIGN(StepOutcome first, RunStep(*session_, Request(1), Gradients(1)));
  {
    ASSERT_OK_AND_ASSIGN(Session::LatestParameters latest, session_->ReadLatestParameters());
    EXPECT_EQ(latest.last_step, 1);
    EXPECT_EQ(latest.reader.snapshot()->step, 1);
    EXPECT_EQ(ReadAll(latest.reader), CopyValues(*first.parameters));
  }
  ASSERT_OK_AND_ASSIGN(StepOutcome second, RunStep(*session_, Request(2), Gradients(2)));
  ASSERT_OK_AND_ASSIGN(Session::LatestParameters latest, session_->ReadLatestParameters());
  EXPECT_EQ(latest.last_step, 2);
  EXPECT_EQ(ReadAll(latest.reader), CopyValues(*second.parameters));
}

TEST_F(SessionTest, JournaledStepsApplyOnlyInOrder) {
  ASSERT_OK(session_->ApplyJournaledStep(Request(1), Gradients(1)).status());
  EXPECT_THAT(session_->ApplyJournaledStep(Request(1), Gradients(1)),
              StatusIs(absl::StatusCode::kFailedPrecondition, "step"));
  EXPECT_THAT(session_->ApplyJournaledStep(Request(3), Gradients(3)),
              StatusIs(absl::StatusCode::kFailedPrecondition, "step"));
  EXPECT_EQ(session_->last_step(), 1);
}

// Two ranks: the step waits for both, applies the mean once and answers both alike; it equals one
// rank sending the mean.
TEST(MultiRankSessionTest, RanksAreAveragedAndAppliedOnce) {
  auto backend = kernels::NewCpuBackend(1);
  std::unique_ptr<Session> session = NewSession(backend.get(), SmallSpec(/*world_size=*/2));
  ASSERT_NE(session, nullptr);
  ASSERT_OK(session->Upload(InitialParameters()));
  std::vector<HostTensor> rank0 = Gradients(1), rank1 = Gradients(2);
  std::vector<std::vector<float>> mean(2);
  for (size_t p = 0; p < 2; ++p) {
    for (size_t i = 0; i < rank0[p].values.size(); ++i) {
      mean[p].push_back(static_cast<float>((static_cast<double>(rank0[p].values[i]) + rank1[p].values[i]) / 2));
    }
  }
  absl::StatusOr<StepOutcome> other;
  std::thread second([&] { other = RunStep(*session, Request(1, 1), std::move(rank1)); });
  ASSERT_OK_AND_ASSIGN(StepOutcome first, RunStep(*session, Request(1, 0), std::move(rank0)));
  second.join();
  ASSERT_OK(other.status());
  EXPECT_EQ(CopyValues(*first.parameters), CopyValues(*other->parameters));
  EXPECT_EQ(session->last_step(), 1);

  std::unique_ptr<Session> single = NewSession(backend.get());
  ASSERT_OK(single->Upload(InitialParameters()));
  ASSERT_OK_AND_ASSIGN(StepOutcome reference, RunStep(*single, Request(1), {Tensor(mean[0]), Tensor(mean[1])}));
  EXPECT_EQ(CopyValues(*first.parameters), CopyValues(*reference.parameters));
}

TEST(MultiRankSessionTest, AMissingRankAbortsTheStepForAllAndChangesNothing) {
  auto backend = kernels::NewCpuBackend(1);
  rpc::ProtoSpecCodec codec;
  SpecLimits limits;
  limits.straggler_timeout_seconds = 0.05;  // rank 1 never comes: the wait ends only by the timeout
  ASSERT_OK_AND_ASSIGN(SessionConfig config, codec.Parse(rpc::SpecToJson(SmallSpec(2)), limits));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Session> session, Session::Create("s", std::move(config), backend.get()));
  ASSERT_OK(session->Upload(InitialParameters()));
  EXPECT_THAT(RunStep(*session, Request(1, 0), Gradients(1)),
              StatusIs(absl::StatusCode::kAborted, "ranks 1 did not arrive"));
  EXPECT_EQ(session->last_step(), 0);
  int64_t step = 0;
  EXPECT_EQ(CopyValues(*session->Parameters(&step))[0], InitialParameters()[0].values);
}

}  // namespace
}  // namespace muond::session

namespace muond::session {
namespace {

using session_testing::Gradients;
using session_testing::Request;
using session_testing::RunStep;
using session_testing::Tensor;

int64_t ZerosIn(const std::vector<HostTensor>& gradients) {
  int64_t zeros = 0;
  for (const HostTensor& g : gradients) {
    for (float v : g.values) zeros += v == 0.0f;
  }
  return zeros;
}

class CountZerosTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = kernels::NewCpuBackend(1);
    session_ = session_testing::NewSession(backend_.get());
    ASSERT_NE(session_, nullptr);
    ASSERT_OK(session_->Upload(session_testing::InitialParameters()));
  }
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<Session> session_;
};

TEST_F(CountZerosTest, AStepThatAsksCountsExactZerosOfThePresentGradients) {
  StepRequest plain = Request(1);
  ASSERT_OK_AND_ASSIGN(StepOutcome first, RunStep(*session_, plain, Gradients(1)));
  EXPECT_EQ(first.result.num_zeros_in_grad, 0) << "not asked for";

  std::vector<HostTensor> gradients = Gradients(2);
  gradients[0].values[0] = -0.0f;   // -0 counts as a zero
  gradients[0].values[1] = 1e-40f;  // a denormal does not
  const int64_t expected = ZerosIn(gradients);
  ASSERT_GT(expected, 1);
  StepRequest counted = Request(2);
  counted.count_zeros = true;
  ASSERT_OK_AND_ASSIGN(StepOutcome second, RunStep(*session_, counted, gradients));
  EXPECT_TRUE(second.result.applied);
  EXPECT_EQ(second.result.num_zeros_in_grad, expected);

  // A retry is answered with the same count, without reading its gradients.
  ASSERT_OK_AND_ASSIGN(StepOutcome replayed, RunStep(*session_, counted, {}));
  EXPECT_TRUE(replayed.result.replayed);
  EXPECT_EQ(replayed.result.num_zeros_in_grad, expected);

  // A parameter left out of the step is not counted.
  std::vector<HostTensor> only_w = Gradients(3);
  only_w[1] = HostTensor();
  StepRequest third = Request(3);
  third.count_zeros = true;
  ASSERT_OK_AND_ASSIGN(StepOutcome partial, RunStep(*session_, third, only_w));
  EXPECT_EQ(partial.result.num_zeros_in_grad, ZerosIn({only_w[0]}));
}

TEST_F(CountZerosTest, TheRequestToCountSurvivesTheJournalEncoding) {
  StepRequest counted = Request(4);
  counted.count_zeros = true;
  ASSERT_OK_AND_ASSIGN(StepRequest decoded, DecodeStepRequest(EncodeStepRequest(counted)));
  EXPECT_TRUE(decoded.count_zeros);
  ASSERT_OK_AND_ASSIGN(decoded, DecodeStepRequest(EncodeStepRequest(Request(4))));
  EXPECT_FALSE(decoded.count_zeros);
}

// QK-clip takes non-finite logits (the heads it leaves alone); JSON writes them as null, which must
// read back (as NaN, left alone the same way) or a journal holding such a step could not be replayed.
TEST(StepRequestEncodingTest, NonFiniteQkLogitsSurviveTheJournalEncoding) {
  StepRequest request;
  request.session_id = "s";
  request.step = 2;
  request.qk_logits.push_back(
      {"wq",
       {1.5, std::numeric_limits<double>::infinity(), -300.0, -std::numeric_limits<double>::infinity(), std::nan("")}});
  ASSERT_OK_AND_ASSIGN(StepRequest decoded, DecodeStepRequest(EncodeStepRequest(request)));
  ASSERT_EQ(decoded.qk_logits.size(), 1u);
  const std::vector<double>& logits = decoded.qk_logits[0].max_logits;
  ASSERT_EQ(logits.size(), 5u);
  EXPECT_EQ(logits[0], 1.5);
  EXPECT_TRUE(std::isnan(logits[1]));
  EXPECT_EQ(logits[2], -300.0);
  EXPECT_TRUE(std::isnan(logits[3]));
  EXPECT_TRUE(std::isnan(logits[4]));
}

}  // namespace
}  // namespace muond::session
