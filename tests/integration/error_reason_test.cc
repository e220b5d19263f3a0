// Machine-readable error reasons against the real daemon: every reason a client acts on arrives in the
// status details (google.rpc.ErrorInfo, domain "muond.v1") with its code, refusals no client acts on
// carry none, and the client's recovery follows the reason whatever the message says.
#include "client/error_reason.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/test_transport.h"
#include "tests/testing/status_matchers.h"

namespace muond::testing {
namespace {

class ErrorReasonTest : public DaemonTest {
 protected:
  static absl::Status StepShared(const v1::StepSharedRequest& request) {
    v1::StepSharedResponse response;
    grpc::ClientContext context;
    return client::FromGrpcStatus(client_->stub().StepShared(&context, request, &response));
  }

  // A step of `session_id` whose only gradient is "b" at offset 0 of region `region`.
  static v1::StepSharedRequest StepNaming(const std::string& session_id, const std::string& parameter,
                                          const std::string& region) {
    v1::StepSharedRequest request;
    request.mutable_header()->set_session_id(session_id);
    request.mutable_header()->set_step(1);
    v1::SharedTensor* gradient = request.add_gradients();
    gradient->set_name(parameter);
    gradient->set_region(region);
    gradient->set_byte_size(parameter == "b" ? 16 : 128);
    return request;
  }

  // The names of the caller's registered shared-memory regions.
  static std::vector<std::string> Regions() {
    v1::SharedMemoryStatusResponse response;
    grpc::ClientContext context;
    EXPECT_OK(client::FromGrpcStatus(
        client_->stub().SharedMemoryStatus(&context, v1::SharedMemoryStatusRequest(), &response)));
    std::vector<std::string> names;
    for (const v1::SharedMemoryRegion& region : response.regions()) names.push_back(region.name());
    return names;
  }
};

TEST_F(ErrorReasonTest, AStepNamingAnUnregisteredRegionIsRegionNotFound) {
  ASSERT_NE(NewSession("reason-region"), nullptr);
  const absl::Status status = StepShared(StepNaming("reason-region", "b", "never-registered"));
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kNotFound, "gradients[0].region"));
  EXPECT_EQ(client::ReasonOf(status), v1::REGION_NOT_FOUND);
}

TEST_F(ErrorReasonTest, AnUnknownParameterIsNotFoundWithoutAReason) {
  ASSERT_NE(NewSession("reason-parameter"), nullptr);
  const absl::Status status = StepShared(StepNaming("reason-parameter", "nope", "never-registered"));
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kNotFound, "gradients[0].name"));
  EXPECT_EQ(client::ReasonOf(status), v1::ERROR_REASON_UNSPECIFIED);
}

TEST_F(ErrorReasonTest, AnUnknownSessionIsSessionNotFound) {
  v1::CloseSessionRequest request;
  request.set_session_id("reason-never-created");
  v1::CloseSessionResponse response;
  grpc::ClientContext context;
  const absl::Status closed = client::FromGrpcStatus(client_->stub().CloseSession(&context, request, &response));
  EXPECT_THAT(closed, StatusIs(absl::StatusCode::kNotFound, "session_id"));
  EXPECT_EQ(client::ReasonOf(closed), v1::SESSION_NOT_FOUND);
  const absl::Status stepped = StepShared(StepNaming("reason-never-created", "b", "never-registered"));
  EXPECT_EQ(client::ReasonOf(stepped), v1::SESSION_NOT_FOUND);
}

TEST_F(ErrorReasonTest, ACommitThatWasNotPreparedIsStepNotPrepared) {
  v1::SessionSpec spec = SmallSpec();
  v1::ShardPlacement* shard = spec.mutable_shard();
  shard->add_endpoints(daemon_->endpoint());
  shard->set_index(0);
  shard->set_num_parameters(spec.parameters_size());
  for (int i = 0; i < spec.parameters_size(); ++i) shard->add_parameters(i);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Session> session, client_->CreateSession("reason-commit", spec));
  const std::vector<float> w = Initial("w", 32), b = Initial("b", 4);
  const std::vector<client::TensorView> initial = {{"w", {8, 4}, w}, {"b", {4}, b}};
  ASSERT_OK(session->UploadParameters(initial));
  client::StepOptions commit;
  commit.phase = v1::STEP_PHASE_COMMIT;
  commit.decision = v1::ShardDecision();
  commit.decision->set_grad_norm(1.0);
  const absl::StatusOr<client::StepReply> reply = session->Step(1, {}, commit);
  EXPECT_THAT(reply.status(), StatusIs(absl::StatusCode::kFailedPrecondition, "header.step"));
  EXPECT_EQ(client::ReasonOf(reply.status()), v1::STEP_NOT_PREPARED);
}

TEST_F(ErrorReasonTest, AClientWhoseRegionWasDroppedRegistersAgainAndSteps) {
  client::ClientOptions options = TestClientOptions();
  options.endpoint = daemon_->endpoint();
  options.transport = "shm";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Client> over_shm, client::Client::Connect(options));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Session> session,
                       over_shm->CreateSession("reason-recovers", SmallSpec()));
  const std::vector<float> w = Initial("w", 32), b = Initial("b", 4);
  const std::vector<client::TensorView> initial = {{"w", {8, 4}, w}, {"b", {4}, b}};
  ASSERT_OK(session->UploadParameters(initial));
  ASSERT_OK(session->Step(1, Gradients(1)).status());
  const std::vector<std::string> before = Regions();
  ASSERT_FALSE(before.empty());
  for (const std::string& name : before) {  // what a restarted daemon would have forgotten
    v1::UnregisterSharedMemoryRequest request;
    request.set_name(name);
    v1::UnregisterSharedMemoryResponse response;
    grpc::ClientContext context;
    ASSERT_OK(client::FromGrpcStatus(client_->stub().UnregisterSharedMemory(&context, request, &response)));
  }
  ASSERT_OK_AND_ASSIGN(client::StepReply reply, session->Step(2, Gradients(2)));
  EXPECT_TRUE(reply.applied);
  EXPECT_FALSE(Regions().empty());
}

// The client reads the reason, not the message: a reworded message keeps the reason, and a message
// that quotes an old wording without the detail carries none.
grpc::Status WithDetails(grpc::StatusCode code, const std::string& message, const std::string& reason,
                         const std::string& domain = "muond.v1") {
  v1::ErrorInfo info;
  info.set_reason(reason);
  info.set_domain(domain);
  v1::RpcStatus details;
  details.set_code(code);
  details.set_message(message);
  v1::AnyDetail* any = details.add_details();
  any->set_type_url("type.googleapis.com/google.rpc.ErrorInfo");
  any->set_value(info.SerializeAsString());
  return grpc::Status(code, message, details.SerializeAsString());
}

TEST(ErrorReasonWording, TheReasonSurvivesAnyMessage) {
  const absl::Status reworded =
      client::FromGrpcStatus(WithDetails(grpc::StatusCode::NOT_FOUND, "the memory went away", "REGION_NOT_FOUND"));
  EXPECT_EQ(client::ReasonOf(reworded), v1::REGION_NOT_FOUND);
  EXPECT_EQ(reworded.message(), "the memory went away");
  const absl::Status prepared =
      client::FromGrpcStatus(WithDetails(grpc::StatusCode::FAILED_PRECONDITION, "commit refused", "STEP_NOT_PREPARED"));
  EXPECT_EQ(client::ReasonOf(prepared), v1::STEP_NOT_PREPARED);
  // A rewritten message (as ShardedSession names the shard) keeps the reason.
  EXPECT_EQ(client::ReasonOf(client::WithReasonOf(prepared, absl::FailedPreconditionError("shard 1: x"))),
            v1::STEP_NOT_PREPARED);
}

// A retried call's refusal on a later try says what the try before met, keeping its code and reason
// (the clients' retries: a NOT_FOUND after UNAVAILABLE is a daemon that restarted without the session).
TEST(ErrorReasonWording, ARefusalOnALaterTrySaysWhatTheTryBeforeMet) {
  const absl::Status refused =
      client::FromGrpcStatus(WithDetails(grpc::StatusCode::NOT_FOUND, "session 's' not found", "SESSION_NOT_FOUND"));
  const absl::Status before = absl::UnavailableError(std::string(200, 'x'));
  const absl::Status later = client::OnLaterTry(refused, 3, before);
  EXPECT_EQ(later.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client::ReasonOf(later), v1::SESSION_NOT_FOUND);
  EXPECT_EQ(later.message(),
            "session 's' not found (on try 3; the try before met UNAVAILABLE: " + std::string(160, 'x') + "…)");
  // The cut counts characters: a multibyte one is never split.
  std::string dots;
  for (int i = 0; i < 200; ++i) dots += "·";
  EXPECT_EQ(client::OnLaterTry(refused, 2, absl::UnavailableError(dots)).message(),
            "session 's' not found (on try 2; the try before met UNAVAILABLE: " + dots.substr(0, 2 * 160) + "…)");
  EXPECT_EQ(client::OnLaterTry(refused, 1, before), refused);
  EXPECT_EQ(client::OnLaterTry(absl::OkStatus(), 2, before), absl::OkStatus());
}

TEST(ErrorReasonWording, OldWordingWithoutTheDetailCarriesNoReason) {
  const absl::Status text_only = client::FromGrpcStatus(
      grpc::Status(grpc::StatusCode::NOT_FOUND, "gradients[0].region: no shared-memory region 'r'"));
  EXPECT_EQ(client::ReasonOf(text_only), v1::ERROR_REASON_UNSPECIFIED);
  const absl::Status other_domain =
      client::FromGrpcStatus(WithDetails(grpc::StatusCode::NOT_FOUND, "x", "REGION_NOT_FOUND", "example.com"));
  EXPECT_EQ(client::ReasonOf(other_domain), v1::ERROR_REASON_UNSPECIFIED);
  const absl::Status unknown = client::FromGrpcStatus(WithDetails(grpc::StatusCode::NOT_FOUND, "x", "SOMETHING_NEWER"));
  EXPECT_EQ(client::ReasonOf(unknown), v1::ERROR_REASON_UNSPECIFIED);
}

}  // namespace
}  // namespace muond::testing
