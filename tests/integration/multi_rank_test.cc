// Sessions with several ranks: the daemon waits for every rank's gradients, averages them, applies
// the step once and gives every rank the same answer; a missing rank aborts the step for all after
// the straggler timeout, with the state unchanged.
#include <sys/wait.h>

#include <csignal>
#include <future>

#include "client/error_reason.h"
#include "gmock/gmock.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/testing/status_matchers.h"

namespace muond::testing {
namespace {

v1::SessionSpec TwoRankSpec() {
  v1::SessionSpec spec = DaemonTest::SmallSpec();
  spec.set_world_size(2);
  return spec;
}

class MultiRankTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string error;
    // Debug logging says when a rank waits for the others (SigtermDrainsAStepInFlight waits for it).
    ASSERT_TRUE(
        daemon_.Start({"--backend", "cpu", "--straggler-timeout", straggler_timeout_, "--log-level", "debug"}, &error))
        << error;
    client::ClientOptions options = testing::TestClientOptions();
    options.endpoint = daemon_.endpoint();
    ASSERT_OK_AND_ASSIGN(client_, client::Client::Connect(options));
  }

  static std::vector<client::TensorView> Initial() {
    static const std::vector<float> w = DaemonTest::Initial("w", 32), b = DaemonTest::Initial("b", 4);
    return {{"w", {8, 4}, w}, {"b", {4}, b}};
  }

  // Creates the session (rank 0) and attaches a second handle (rank 1).
  void TwoRanks(const std::string& id, v1::SessionSpec spec) {
    ASSERT_OK_AND_ASSIGN(rank0_, client_->CreateSession(id, spec));
    ASSERT_OK(rank0_->UploadParameters(Initial()));
    ASSERT_OK_AND_ASSIGN(rank1_, client_->CreateSession(id, spec));
  }

  // The answer of a one-rank session `id` from the initial parameters to step 1 with `mean`.
  absl::StatusOr<client::StepReply> OneRankStep(const std::string& id, const std::vector<client::TensorView>& mean) {
    absl::StatusOr<std::unique_ptr<client::Session>> single = client_->CreateSession(id, DaemonTest::SmallSpec());
    if (!single.ok()) return single.status();
    if (absl::Status uploaded = (*single)->UploadParameters(Initial()); !uploaded.ok()) return uploaded;
    return (*single)->Step(1, mean);
  }

  static std::vector<float> Grad(size_t n, float phase) {
    std::vector<float> g(n);
    for (size_t i = 0; i < n; ++i) g[i] = std::sin(phase + 0.37f * i);
    return g;
  }

  std::string straggler_timeout_ = "1";  // seconds
  DaemonProcess daemon_;
  std::unique_ptr<client::Client> client_;
  std::unique_ptr<client::Session> rank0_, rank1_;
};

TEST_F(MultiRankTest, EveryRankGetsTheStepOfTheAveragedGradients) {
  TwoRanks("two-ranks", TwoRankSpec());
  const std::vector<float> w0 = Grad(32, 0.1f), b0 = Grad(4, 0.2f), w1 = Grad(32, 1.3f), b1 = Grad(4, 2.1f);
  client::StepOptions as_rank1;
  as_rank1.rank = 1;
  auto second = std::async(std::launch::async, [&] {
    const std::vector<client::TensorView> g = {{"w", {8, 4}, w1}, {"b", {4}, b1}};
    return rank1_->Step(1, g, as_rank1);
  });
  const std::vector<client::TensorView> g0 = {{"w", {8, 4}, w0}, {"b", {4}, b0}};
  ASSERT_OK_AND_ASSIGN(client::StepReply first_reply, rank0_->Step(1, g0));
  ASSERT_OK_AND_ASSIGN(client::StepReply second_reply, second.get());
  EXPECT_TRUE(first_reply.applied);
  EXPECT_EQ(first_reply.parameters, second_reply.parameters);

  // The same step in a one-rank session fed the mean (computed as the daemon does: fp64 sum / 2).
  std::vector<float> wm(32), bm(4);
  for (int i = 0; i < 32; ++i) wm[i] = static_cast<float>((double(w0[i]) + w1[i]) / 2);
  for (int i = 0; i < 4; ++i) bm[i] = static_cast<float>((double(b0[i]) + b1[i]) / 2);
  const std::vector<client::TensorView> mean = {{"w", {8, 4}, wm}, {"b", {4}, bm}};
  ASSERT_OK_AND_ASSIGN(client::StepReply expected, OneRankStep("one-rank", mean));
  EXPECT_EQ(first_reply.parameters, expected.parameters);
  EXPECT_DOUBLE_EQ(first_reply.grad_norm, expected.grad_norm);

  // Both ranks retrying the applied step get it replayed.
  ASSERT_OK_AND_ASSIGN(client::StepReply replay, rank1_->Step(1, mean, as_rank1));
  EXPECT_TRUE(replay.replayed);
  EXPECT_EQ(replay.parameters, expected.parameters);
}

TEST_F(MultiRankTest, AMissingRankAbortsTheStepForAllAndChangesNothing) {
  TwoRanks("straggler", TwoRankSpec());
  const std::vector<float> w0 = Grad(32, 0.1f), b0 = Grad(4, 0.2f);
  const std::vector<client::TensorView> g0 = {{"w", {8, 4}, w0}, {"b", {4}, b0}};
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THAT(rank0_->Step(1, g0), StatusIs(absl::StatusCode::kAborted, "ranks 1 did not arrive"));
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(900));
  int64_t last_step = -1;
  ASSERT_OK_AND_ASSIGN(client::ParameterMap params, rank0_->GetParameters(&last_step));
  EXPECT_EQ(last_step, 0);
  EXPECT_EQ(params["w"], DaemonTest::Initial("w", 32));

  // Sent again by both ranks, the step goes through.
  client::StepOptions as_rank1;
  as_rank1.rank = 1;
  auto second = std::async(std::launch::async, [&] { return rank1_->Step(1, g0, as_rank1); });
  ASSERT_OK_AND_ASSIGN(client::StepReply reply, rank0_->Step(1, g0));
  EXPECT_TRUE(reply.applied);
  ASSERT_OK(second.get().status());
}

// A straggler timeout no busy machine reaches between two lines of a test.
class MultiRankDrainTest : public MultiRankTest {
 protected:
  MultiRankDrainTest() { straggler_timeout_ = "60"; }
};

// SIGTERM while rank 0 waits inside a step: the daemon lets that step finish when rank 1 arrives,
// answers both, and then exits 0.
TEST_F(MultiRankDrainTest, SigtermDrainsAStepInFlight) {
  TwoRanks("drained", TwoRankSpec());
  const std::vector<float> w0 = Grad(32, 0.1f), b0 = Grad(4, 0.2f);
  const std::vector<client::TensorView> g0 = {{"w", {8, 4}, w0}, {"b", {4}, b0}};
  auto first = std::async(std::launch::async, [&] { return rank0_->Step(1, g0); });
  ASSERT_TRUE(daemon_.WaitForLog("step 1 has 1 of 2 ranks; rank 0 waits")) << daemon_.ReadStderr();
  daemon_.Signal(SIGTERM);
  ASSERT_TRUE(daemon_.WaitForLog("draining in-flight requests")) << daemon_.ReadStderr();
  client::StepOptions as_rank1;
  as_rank1.rank = 1;
  ASSERT_OK_AND_ASSIGN(client::StepReply second, rank1_->Step(1, g0, as_rank1));
  ASSERT_OK_AND_ASSIGN(client::StepReply first_reply, first.get());
  EXPECT_TRUE(first_reply.applied);
  EXPECT_EQ(first_reply.parameters, second.parameters);
  const int status = daemon_.Stop();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_THAT(daemon_.ReadStderr(), ::testing::HasSubstr("draining in-flight requests"));
}

// The session's whole state as SetState takes it, with `last_step` in its header.
std::vector<v1::SetStateRequest> StateOf(client::Client& client, const std::string& id, int64_t last_step) {
  grpc::ClientContext context;
  client.PrepareContext(context);
  v1::GetStateRequest request;
  request.set_session_id(id);
  auto reader = client.stub().GetState(&context, request);
  std::vector<v1::SetStateRequest> messages(1);
  messages[0].set_session_id(id);
  v1::GetStateResponse response;
  while (reader->Read(&response)) {
    if (response.has_header()) {
      *messages.emplace_back().mutable_header() = response.header();
      messages.back().mutable_header()->set_last_step(last_step);
    } else {
      *messages.emplace_back().mutable_chunk() = response.chunk();
    }
  }
  EXPECT_TRUE(reader->Finish().ok());
  return messages;
}

absl::Status SetState(client::Client& client, const std::vector<v1::SetStateRequest>& messages) {
  grpc::ClientContext context;
  client.PrepareContext(context);
  v1::SetStateResponse response;
  auto writer = client.stub().SetState(&context, &response);
  for (const v1::SetStateRequest& message : messages) {
    if (!writer->Write(message)) break;
  }
  writer->WritesDone();
  return client::FromGrpcStatus(writer->Finish());
}

// A SetState that moves the session past the step a rank waits in: that rank is answered ABORTED,
// not as if its step had been applied, and nothing of its gradients is; the session goes on from
// the loaded state.
TEST_F(MultiRankDrainTest, ASetStatePastAWaitingStepAbortsItAndAppliesNothing) {
  TwoRanks("loaded-past", TwoRankSpec());
  const std::vector<v1::SetStateRequest> at_five = StateOf(*client_, "loaded-past", 5);
  const std::vector<float> w0 = Grad(32, 0.1f), b0 = Grad(4, 0.2f);
  const std::vector<client::TensorView> g0 = {{"w", {8, 4}, w0}, {"b", {4}, b0}};
  auto first = std::async(std::launch::async, [&] { return rank0_->Step(1, g0); });
  ASSERT_TRUE(daemon_.WaitForLog("step 1 has 1 of 2 ranks; rank 0 waits")) << daemon_.ReadStderr();
  ASSERT_OK(SetState(*client_, at_five));
  EXPECT_THAT(first.get(), StatusIs(absl::StatusCode::kAborted,
                                    "step 1: a SetState replaced the session's state "
                                    "with that of step 5 while ranks waited in it"));
  ASSERT_OK_AND_ASSIGN(client::ParameterMap params, rank0_->GetParameters());
  EXPECT_EQ(params["w"], DaemonTest::Initial("w", 32));
  EXPECT_EQ(params["b"], DaemonTest::Initial("b", 4));
  client::StepOptions as_rank1;
  as_rank1.rank = 1;
  auto second = std::async(std::launch::async, [&] { return rank1_->Step(6, g0, as_rank1); });
  ASSERT_OK_AND_ASSIGN(client::StepReply reply, rank0_->Step(6, g0));
  EXPECT_TRUE(reply.applied);
  EXPECT_EQ(reply.step, 6);
  ASSERT_OK(second.get().status());
}

// A session closed while a rank waits in its step: the rank is told at once that the session was
// closed (not, after the straggler timeout, to send the step again).
TEST_F(MultiRankDrainTest, ARankWaitingInAStepOfAClosedSessionIsToldAtOnce) {
  TwoRanks("closed-waiting", TwoRankSpec());
  const std::vector<float> w0 = Grad(32, 0.1f), b0 = Grad(4, 0.2f);
  const std::vector<client::TensorView> g0 = {{"w", {8, 4}, w0}, {"b", {4}, b0}};
  auto first = std::async(std::launch::async, [&] { return rank0_->Step(1, g0); });
  ASSERT_TRUE(daemon_.WaitForLog("step 1 has 1 of 2 ranks; rank 0 waits")) << daemon_.ReadStderr();
  ASSERT_OK(client_->CloseSession("closed-waiting"));
  EXPECT_THAT(first.get(), StatusIs(absl::StatusCode::kNotFound, "session 'closed-waiting' was closed"));
}

// Ranks that each load the same state before their next step (a lock-step load_state_dict): the
// step one of them waits in follows the loaded state, so a later load leaves it waiting, and it is
// applied once every rank has sent it.
TEST_F(MultiRankDrainTest, RanksLoadingTheSameStateBeforeTheirStepStepOnIt) {
  TwoRanks("loaded-alike", TwoRankSpec());
  const std::vector<v1::SetStateRequest> at_three = StateOf(*client_, "loaded-alike", 3);
  const std::vector<float> w0 = Grad(32, 0.1f), b0 = Grad(4, 0.2f);
  const std::vector<client::TensorView> g0 = {{"w", {8, 4}, w0}, {"b", {4}, b0}};
  ASSERT_OK(SetState(*client_, at_three));  // rank 0's load
  auto first = std::async(std::launch::async, [&] { return rank0_->Step(4, g0); });
  ASSERT_TRUE(daemon_.WaitForLog("step 4 has 1 of 2 ranks; rank 0 waits")) << daemon_.ReadStderr();
  ASSERT_OK(SetState(*client_, at_three));  // rank 1's
  client::StepOptions as_rank1;
  as_rank1.rank = 1;
  ASSERT_OK_AND_ASSIGN(client::StepReply second, rank1_->Step(4, g0, as_rank1));
  ASSERT_OK_AND_ASSIGN(client::StepReply first_reply, first.get());
  EXPECT_TRUE(first_reply.applied);
  EXPECT_TRUE(second.applied);
  EXPECT_EQ(first_reply.parameters, second.parameters);
}

// A rank that sends its step again while the first send waits (a retry on a new stream): the second
// send's gradients replace the first's, and the first send's answer says its gradients were not used
// (included false) rather than that they were; the step is the one of the second send's.
TEST_F(MultiRankDrainTest, ASendReplacedByTheSameRanksResendIsNotToldItWasUsed) {
  TwoRanks("resent", TwoRankSpec());
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Session> rank0_again, client_->CreateSession("resent", TwoRankSpec()));
  const std::vector<float> w_first = Grad(32, 0.1f), w_again = Grad(32, 0.7f), w1 = Grad(32, 1.3f);
  const std::vector<client::TensorView> first = {{"w", {8, 4}, w_first}}, again = {{"w", {8, 4}, w_again}},
                                        other = {{"w", {8, 4}, w1}};
  auto first_send = std::async(std::launch::async, [&] { return rank0_->Step(1, first); });
  ASSERT_TRUE(daemon_.WaitForLog("step 1 has 1 of 2 ranks; rank 0 waits")) << daemon_.ReadStderr();
  auto second_send = std::async(std::launch::async, [&] { return rank0_again->Step(1, again); });
  ASSERT_TRUE(daemon_.WaitForLog("step 1 has 1 of 2 ranks; rank 0 waits", 2)) << daemon_.ReadStderr();
  client::StepOptions as_rank1;
  as_rank1.rank = 1;
  ASSERT_OK_AND_ASSIGN(client::StepReply rank1, rank1_->Step(1, other, as_rank1));
  ASSERT_OK_AND_ASSIGN(client::StepReply replaced, first_send.get());
  ASSERT_OK_AND_ASSIGN(client::StepReply used, second_send.get());
  EXPECT_TRUE(rank1.included);
  EXPECT_TRUE(used.included);
  EXPECT_FALSE(replaced.included) << "its gradients were replaced by the second send's";
  EXPECT_TRUE(replaced.applied);
  EXPECT_EQ(replaced.parameters, used.parameters);

  // The step is one of the second send's gradients averaged with rank 1's.
  std::vector<float> mean(32);
  for (int i = 0; i < 32; ++i) mean[i] = static_cast<float>((double(w_again[i]) + w1[i]) / 2);
  ASSERT_OK_AND_ASSIGN(client::StepReply expected, OneRankStep("resent-reference", {{"w", {8, 4}, mean}}));
  EXPECT_EQ(used.parameters, expected.parameters);
}

TEST_F(MultiRankTest, RankOutsideTheWorldIsInvalidArgument) {
  TwoRanks("bad-rank", TwoRankSpec());
  const std::vector<float> w0 = Grad(32, 0.1f);
  client::StepOptions options;
  options.rank = 2;
  const std::vector<client::TensorView> g = {{"w", {8, 4}, w0}};
  EXPECT_THAT(rank0_->Step(1, g, options),
              StatusIs(absl::StatusCode::kInvalidArgument, "header.rank: must be in [0, 2), got 2"));
}

}  // namespace
}  // namespace muond::testing
