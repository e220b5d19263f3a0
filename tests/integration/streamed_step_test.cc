// Streamed steps (docs/protocol.md, "Streamed steps") against the real daemon: the C++ client's
// StreamedStep equals a plain step bit for bit, takes its options at the end, and a cancelled one
// applies nothing; hand-built streams that break the rules are refused naming the field, and leave
// the session as it was.
#include "client/streamed_step.h"

#include "gmock/gmock.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/test_transport.h"
#include "tests/testing/status_matchers.h"

namespace muond::testing {
namespace {

using ::testing::HasSubstr;

class StreamedStepTest : public DaemonTest {
 protected:
  // Step `step` of `session` as a streamed step: "b" first, then "w" (backward's order: the last
  // layer first), then Finish with `options`.
  absl::StatusOr<client::StepReply> Streamed(client::Session& session, int step,
                                             const client::StepOptions& options = {}) {
    absl::StatusOr<std::unique_ptr<client::StreamedStep>> streamed = session.BeginStreamedStep(step, options);
    if (!streamed.ok()) return streamed.status();
    const std::vector<client::TensorView> grads = Gradients(step);
    for (auto it = grads.rbegin(); it != grads.rend(); ++it) {
      if (absl::Status added = (*streamed)->Add(*it); !added.ok()) return added;
    }
    return (*streamed)->Finish(options);
  }

  static v1::StepHeader StreamedHeader(const std::string& id, int64_t step) {
    v1::StepHeader header;
    header.set_session_id(id);
    header.set_step(step);
    header.set_streamed(true);
    return header;
  }
  static v1::StepRequest HeaderMessage(const v1::StepHeader& header) {
    v1::StepRequest request;
    *request.mutable_header() = header;
    return request;
  }
  v1::StepRequest ChunkMessage(const std::string& name, int step, size_t count) {
    v1::StepRequest request;
    *request.mutable_chunk() = Chunk(name, Gradient(name, step, count), v1::DTYPE_FP32);
    return request;
  }
  static v1::StepRequest EndMessage(uint32_t num_chunks) {
    v1::StepRequest request;
    request.mutable_end()->set_num_chunks(num_chunks);
    return request;
  }
  // The session's last step as the daemon has it.
  static int64_t LastStep(client::Session& session) {
    int64_t last = -1;
    EXPECT_OK(session.GetParameters(&last).status());
    return last;
  }
};

TEST_F(StreamedStepTest, EqualsAPlainStepBitForBit) {
  std::unique_ptr<client::Session> plain = NewSession("streamed-plain");
  std::unique_ptr<client::Session> streamed = NewSession("streamed-streamed");
  client::StepOptions options;
  options.max_grad_norm = 0.5;
  options.lr["matrices"] = 0.01;
  for (int step = 1; step <= 3; ++step) {
    absl::StatusOr<client::StepReply> a = plain->Step(step, Gradients(step), options);
    absl::StatusOr<client::StepReply> b = Streamed(*streamed, step, options);
    ASSERT_OK(a.status());
    ASSERT_OK(b.status());
    EXPECT_EQ(b->step, step);
    EXPECT_EQ(b->grad_norm, a->grad_norm);
    EXPECT_EQ(b->parameters, a->parameters);
    EXPECT_EQ(b->attempts, 1);
  }
  EXPECT_EQ(streamed->last_step(), 3);
}

TEST_F(StreamedStepTest, GoesOutAsItIsAddedOverGrpc) {
  std::unique_ptr<client::Session> session = NewSession("streamed-streaming");
  absl::StatusOr<std::unique_ptr<client::StreamedStep>> streamed = session->BeginStreamedStep(1);
  ASSERT_OK(streamed.status());
  const bool over_grpc = client_->Transport().value_or("") == "grpc";
  EXPECT_EQ((*streamed)->streaming(), over_grpc);  // shared memory gathers them for one call
  for (const client::TensorView& g : Gradients(1)) ASSERT_OK((*streamed)->Add(g));
  ASSERT_OK((*streamed)->Finish().status());
}

TEST_F(StreamedStepTest, TakesItsOptionsAtTheEnd) {
  std::unique_ptr<client::Session> plain = NewSession("streamed-late-plain");
  std::unique_ptr<client::Session> late = NewSession("streamed-late");
  client::StepOptions at_end;
  at_end.lr["vectors"] = 0.2;
  at_end.grad_scale = 4.0;
  absl::StatusOr<std::unique_ptr<client::StreamedStep>> streamed = late->BeginStreamedStep(1);
  ASSERT_OK(streamed.status());
  for (const client::TensorView& g : Gradients(1)) ASSERT_OK((*streamed)->Add(g));
  absl::StatusOr<client::StepReply> b = (*streamed)->Finish(at_end);
  absl::StatusOr<client::StepReply> a = plain->Step(1, Gradients(1), at_end);
  ASSERT_OK(a.status());
  ASSERT_OK(b.status());
  EXPECT_EQ(b->parameters, a->parameters);
}

TEST_F(StreamedStepTest, RefusesAnotherStepAtTheEndAndBadAdds) {
  std::unique_ptr<client::Session> session = NewSession("streamed-identity");
  absl::StatusOr<std::unique_ptr<client::StreamedStep>> streamed = session->BeginStreamedStep(1);
  ASSERT_OK(streamed.status());
  const std::vector<float> short_w(3);
  EXPECT_THAT((*streamed)->Add({"w", {8, 4}, short_w}), StatusIs(absl::StatusCode::kInvalidArgument, ""));
  EXPECT_THAT((*streamed)->Add({"nope", {1}, short_w}), StatusIs(absl::StatusCode::kInvalidArgument, ""));
  const std::vector<client::TensorView> grads = Gradients(1);
  ASSERT_OK((*streamed)->Add(grads[0]));
  EXPECT_THAT((*streamed)->Add(grads[0]), StatusIs(absl::StatusCode::kInvalidArgument, ""));
  client::StepOptions other;
  other.rank = 1;
  absl::StatusOr<client::StepReply> refused = (*streamed)->Finish(other);
  EXPECT_THAT(refused.status(), StatusIs(absl::StatusCode::kInvalidArgument, ""));
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("options.rank"));
  client::StepOptions decided;
  decided.decision.emplace().set_grad_norm(1.0);
  refused = (*streamed)->Finish(decided);
  EXPECT_THAT(refused.status(), StatusIs(absl::StatusCode::kInvalidArgument, "options.decision"));
  (*streamed)->Cancel();
  EXPECT_EQ(LastStep(*session), 0);
}

TEST_F(StreamedStepTest, ACancelledStepAppliesNothingAndItsNumberStaysFree) {
  std::unique_ptr<client::Session> plain = NewSession("streamed-cancel-plain");
  std::unique_ptr<client::Session> session = NewSession("streamed-cancel");
  {
    absl::StatusOr<std::unique_ptr<client::StreamedStep>> streamed = session->BeginStreamedStep(1);
    ASSERT_OK(streamed.status());
    ASSERT_OK((*streamed)->Add(Gradients(9)[0]));
    (*streamed)->Cancel();
  }
  {
    absl::StatusOr<std::unique_ptr<client::StreamedStep>> dropped = session->BeginStreamedStep(1);
    ASSERT_OK(dropped.status());
    ASSERT_OK((*dropped)->Add(Gradients(9)[1]));
  }  // destroyed unfinished: cancelled
  EXPECT_EQ(LastStep(*session), 0);
  absl::StatusOr<client::StepReply> a = plain->Step(1, Gradients(1));
  absl::StatusOr<client::StepReply> b = Streamed(*session, 1);
  ASSERT_OK(a.status());
  ASSERT_OK(b.status());
  EXPECT_EQ(b->parameters, a->parameters);
}

// Over shared memory Add writes each gradient into its slot at once: a streamed step cancelled, or
// whose Finish was refused, must not leave those values for the next plain step to send.
TEST_F(StreamedStepTest, AnAbandonedStepLeavesNothingForAPlainStep) {
  std::unique_ptr<client::Session> plain = NewSession("abandoned-plain");
  std::unique_ptr<client::Session> session = NewSession("abandoned");
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::StreamedStep> streamed, session->BeginStreamedStep(1));
    for (const client::TensorView& g : Gradients(9)) ASSERT_OK(streamed->Add(g));
    streamed->Cancel();
  }
  ASSERT_OK_AND_ASSIGN(client::StepReply expected, plain->Step(1, Gradients(1)));
  ASSERT_OK_AND_ASSIGN(client::StepReply got, session->Step(1, Gradients(1)));
  EXPECT_EQ(got.parameters, expected.parameters);
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::StreamedStep> streamed, session->BeginStreamedStep(2));
    for (const client::TensorView& g : Gradients(9)) ASSERT_OK(streamed->Add(g));
    std::vector<float> too_small(1);
    client::StepOptions refused;
    refused.parameters_out["w"] = too_small;
    EXPECT_THAT(streamed->Finish(refused), StatusIs(absl::StatusCode::kInvalidArgument, "parameters_out"));
  }
  ASSERT_OK_AND_ASSIGN(expected, plain->Step(2, Gradients(2)));
  ASSERT_OK_AND_ASSIGN(got, session->Step(2, Gradients(2)));
  EXPECT_EQ(got.parameters, expected.parameters);
}

TEST_F(StreamedStepTest, AStreamWithoutItsEndIsRefusedNamingIt) {
  std::unique_ptr<client::Session> session = NewSession("streamed-no-end");
  grpc::Status status = RawStepMessages({HeaderMessage(StreamedHeader(session->id(), 1)), ChunkMessage("w", 1, 32)});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("end:"));
  EXPECT_EQ(LastStep(*session), 0);
}

TEST_F(StreamedStepTest, AWrongCountAtTheEndIsRefusedNamingIt) {
  std::unique_ptr<client::Session> session = NewSession("streamed-count");
  grpc::Status status =
      RawStepMessages({HeaderMessage(StreamedHeader(session->id(), 1)), ChunkMessage("w", 1, 32), EndMessage(2)});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("end.num_chunks"));
  EXPECT_EQ(LastStep(*session), 0);
}

TEST_F(StreamedStepTest, AMessageAfterTheEndIsRefused) {
  std::unique_ptr<client::Session> session = NewSession("streamed-after-end");
  grpc::Status status = RawStepMessages({HeaderMessage(StreamedHeader(session->id(), 1)), ChunkMessage("w", 1, 32),
                                         EndMessage(1), ChunkMessage("b", 1, 4)});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("end:"));
  EXPECT_EQ(LastStep(*session), 0);
}

TEST_F(StreamedStepTest, AStreamedHeaderWithACountOrAnOptionIsRefusedNamingIt) {
  std::unique_ptr<client::Session> session = NewSession("streamed-header");
  v1::StepHeader counted = StreamedHeader(session->id(), 1);
  counted.set_num_chunks(1);
  grpc::Status status = RawStepMessages({HeaderMessage(counted), ChunkMessage("w", 1, 32), EndMessage(1)});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("header.num_chunks"));
  v1::StepHeader clipped = StreamedHeader(session->id(), 1);
  clipped.set_max_grad_norm(1.0);
  status = RawStepMessages({HeaderMessage(clipped), ChunkMessage("w", 1, 32), EndMessage(1)});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("header.max_grad_norm"));
  EXPECT_EQ(LastStep(*session), 0);
}

TEST_F(StreamedStepTest, ABadOptionAtTheEndIsRefusedNamingTheEndsField) {
  std::unique_ptr<client::Session> session = NewSession("streamed-bad-option");
  v1::StepRequest end = EndMessage(1);
  end.mutable_end()->set_max_grad_norm(-1.0);
  grpc::Status status =
      RawStepMessages({HeaderMessage(StreamedHeader(session->id(), 1)), ChunkMessage("w", 1, 32), end});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("end.max_grad_norm"));
  end = EndMessage(1);
  end.mutable_end()->add_overrides()->set_group("no-such-group");
  status = RawStepMessages({HeaderMessage(StreamedHeader(session->id(), 1)), ChunkMessage("w", 1, 32), end});
  EXPECT_THAT(status.error_message(), HasSubstr("end.overrides"));
  EXPECT_EQ(LastStep(*session), 0);
  // The session takes the same step afterwards.
  ASSERT_OK(Streamed(*session, 1).status());
  EXPECT_EQ(LastStep(*session), 1);
}

TEST_F(StreamedStepTest, AHandBuiltStreamedStepIsApplied) {
  std::unique_ptr<client::Session> plain = NewSession("streamed-raw-plain");
  std::unique_ptr<client::Session> session = NewSession("streamed-raw");
  v1::StepRequest end = EndMessage(2);
  end.mutable_end()->set_weight(1.0);
  v1::StepResult result;
  grpc::Status status = RawStepMessages(
      {HeaderMessage(StreamedHeader(session->id(), 1)), ChunkMessage("b", 1, 4), ChunkMessage("w", 1, 32), end},
      &result);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(result.step(), 1);
  EXPECT_TRUE(result.applied());
  absl::StatusOr<client::StepReply> a = plain->Step(1, Gradients(1));
  ASSERT_OK(a.status());
  EXPECT_EQ(session->GetParameters().value(), a->parameters);
}

// A daemon killed while a streamed step is open (journal mode) and started again: Finish's first try
// fails with the stream, and its retry sends the step again, plainly, to the new daemon, which
// applies it once — the parameters equal a plain step's.
TEST_F(StreamedStepTest, ADaemonKilledMidStreamIsRetriedAndAppliesTheStepOnce) {
  std::unique_ptr<client::Session> plain = NewSession("streamed-killed-plain");
  absl::StatusOr<client::StepReply> expected = plain->Step(1, Gradients(1));
  ASSERT_OK(expected.status());

  DaemonProcess own;
  const std::vector<std::string> flags = {"--backend", "cpu",         "--durability",
                                          "journal",   "--state-dir", own.dir() + "/state"};
  std::string error;
  ASSERT_TRUE(own.Start(flags, &error)) << error;
  client::ClientOptions options = TestClientOptions();
  options.endpoint = own.endpoint();
  options.max_step_attempts = 6;
  options.retry_backoff = std::chrono::milliseconds(100);
  ASSERT_OK_AND_ASSIGN(auto client, client::Client::Connect(options));
  ASSERT_OK_AND_ASSIGN(auto session, client->CreateSession("streamed-killed", SmallSpec()));
  const std::vector<float> w = Initial("w", 32), b = Initial("b", 4);
  ASSERT_OK(session->UploadParameters(std::vector<client::TensorView>{{"w", {8, 4}, w}, {"b", {4}, b}}));

  ASSERT_OK_AND_ASSIGN(auto streamed, session->BeginStreamedStep(1));
  const std::vector<client::TensorView> grads = Gradients(1);
  ASSERT_OK(streamed->Add(grads[1]));
  const bool streaming = streamed->streaming();
  const int port = own.port();
  own.Kill();
  ASSERT_TRUE(own.Start(flags, &error, port)) << error;
  ASSERT_OK(streamed->Add(grads[0]));
  absl::StatusOr<client::StepReply> reply = streamed->Finish();
  ASSERT_OK(reply.status());
  EXPECT_TRUE(reply->applied);
  EXPECT_FALSE(reply->replayed);
  EXPECT_EQ(reply->parameters, expected->parameters);
  if (streaming) {
    EXPECT_GE(reply->attempts, 2);  // the stream broke: the first try failed
  }
}

}  // namespace
}  // namespace muond::testing
