// The daemon end to end through the C++ client: a full session, attach, list, close, exactly-once
// steps under retries, and step ordering.
#include <chrono>
#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/test_transport.h"
#include "tests/testing/status_matchers.h"

namespace muond::testing {
namespace {

using ::testing::HasSubstr;

TEST_F(DaemonTest, ServerInfoDescribesTheDaemon) {
  ASSERT_OK_AND_ASSIGN(v1::ServerInfo info, client_->GetServerInfo());
  EXPECT_EQ(info.backend(), "cpu");
  EXPECT_FALSE(info.version().empty());
  EXPECT_GE(info.max_chunk_bytes(), 1024u);
  EXPECT_THAT(info.optimizers(), ::testing::Contains("muon"));
  EXPECT_THAT(info.ns_coefficient_sets(), ::testing::Contains("simple"));
}

TEST_F(DaemonTest, ConnectRefusesOptionsThatCannotWorkNamingThem) {
  using Change = std::function<void(client::ClientOptions&)>;
  using std::chrono::milliseconds;
  const std::vector<std::pair<Change, std::string>> cases = {
      {[](client::ClientOptions& o) { o.chunk_bytes = 0; }, "chunk_bytes: must be at least 1 byte, got 0"},
      {[](client::ClientOptions& o) { o.max_message_bytes = 0; }, "max_message_bytes: must be above 0, got 0"},
      {[](client::ClientOptions& o) { o.chunk_bytes = 64 << 20; },
       "chunk_bytes: 67108864 bytes and a chunk's framing (up to 65536 bytes) must fit in max_message_bytes"},
      {[](client::ClientOptions& o) { o.max_message_bytes = 1 << 20; },
       "chunk_bytes: 1048576 bytes and a chunk's framing"},
      {[](client::ClientOptions& o) { o.max_step_attempts = 0; }, "max_step_attempts: must be at least 1, got 0"},
      {[](client::ClientOptions& o) { o.rpc_timeout = milliseconds(0); }, "rpc_timeout: must be above 0 ms, got 0"},
      {[](client::ClientOptions& o) { o.connect_timeout = milliseconds(-5); },
       "connect_timeout: must be above 0 ms, got -5"},
      {[](client::ClientOptions& o) { o.retry_backoff = milliseconds(-1); },
       "retry_backoff: must be at least 0 ms, got -1"},
      {[](client::ClientOptions& o) { o.transport = "pigeon"; }, "transport: 'pigeon' is not one of"},
      {[](client::ClientOptions& o) { o.endpoint.clear(); }, "endpoint: empty"},  // not after connect_timeout
  };
  for (const auto& [change, message] : cases) {
    client::ClientOptions options = TestClientOptions();
    options.endpoint = daemon_->endpoint();
    change(options);
    EXPECT_THAT(client::Client::Connect(options).status(), StatusIs(absl::StatusCode::kInvalidArgument, message))
        << message;
  }
  client::ClientOptions options = TestClientOptions();
  options.endpoint = daemon_->endpoint();
  options.retry_backoff = milliseconds(0);  // no pause between tries is allowed
  EXPECT_OK(client::Client::Connect(options).status());
}

TEST_F(DaemonTest, FullSessionTrainsAndReportsEveryStep) {
  auto session = NewSession("full");
  ASSERT_NE(session, nullptr);
  EXPECT_FALSE(session->attached());
  std::vector<float> b = Initial("b", 4);
  client::ParameterMap last;
  for (int step = 1; step <= 3; ++step) {
    auto gradients = Gradients(step);
    ASSERT_OK_AND_ASSIGN(client::StepReply reply, session->Step(step, gradients));
    EXPECT_EQ(reply.step, step);
    EXPECT_TRUE(reply.applied);
    EXPECT_FALSE(reply.replayed);
    double norm = 0;
    for (const auto& g : gradients)
      for (float v : g.values) norm += double(v) * v;
    EXPECT_NEAR(reply.grad_norm, std::sqrt(norm), 1e-9 * std::sqrt(norm) + 1e-12);
    ASSERT_EQ(reply.parameters.size(), 2u);
    ASSERT_EQ(reply.parameters["w"].size(), 32u);
    // AdamW on "b": with fresh moments the first update is lr·g/(|g|+eps) ≈ lr·sign(g) after the
    // decoupled decay — an exact check of the AdamW group through the whole wire path.
    if (step == 1) {
      for (int i = 0; i < 4; ++i) {
        const float g = gradients[1].values[i];
        const double expected = b[i] * (1 - 1e-3 * 0.01) - 1e-3 * g / (std::fabs(g) + 1e-8);
        EXPECT_NEAR(reply.parameters["b"][i], expected, 1e-7);
      }
    }
    last = reply.parameters;
  }
  int64_t last_step = 0;
  ASSERT_OK_AND_ASSIGN(client::ParameterMap fetched, session->GetParameters(&last_step));
  EXPECT_EQ(last_step, 3);
  EXPECT_EQ(fetched, last);
  ASSERT_OK_AND_ASSIGN(client::ParameterMap only_b, session->GetParameters(nullptr, {"b"}));
  EXPECT_EQ(only_b.size(), 1u);
  EXPECT_EQ(only_b["b"], last["b"]);
}

TEST_F(DaemonTest, AttachWithTheSameSpecResumesAtTheLastStep) {
  auto session = NewSession("attach");
  ASSERT_NE(session, nullptr);
  ASSERT_OK(session->Step(1, Gradients(1)).status());
  ASSERT_OK(session->Step(2, Gradients(2)).status());
  ASSERT_OK_AND_ASSIGN(auto attached, client_->CreateSession("attach", SmallSpec()));
  EXPECT_TRUE(attached->attached());
  EXPECT_TRUE(attached->initialized());
  EXPECT_EQ(attached->last_step(), 2);
  ASSERT_OK_AND_ASSIGN(client::StepReply reply, attached->Step(3, Gradients(3)));
  EXPECT_TRUE(reply.applied);
}

TEST_F(DaemonTest, AnAttachIsAnsweredWhatTheLastStepRanWith) {
  auto session = NewSession("last-overrides");
  ASSERT_NE(session, nullptr);
  ASSERT_TRUE(session->last_overrides().has_value());
  EXPECT_TRUE(session->last_overrides()->empty()) << "a new session: no step, nothing overridden";
  client::StepOptions first;
  first.lr = {{"matrices", 0.01}, {"vectors", 0.003}};
  ASSERT_OK(session->Step(1, Gradients(1), first).status());
  client::StepOptions second;
  second.lr = {{"vectors", 0.002}};  // the matrices run with their group's lr
  ASSERT_OK(session->Step(2, Gradients(2), second).status());

  ASSERT_OK_AND_ASSIGN(auto attached, client_->CreateSession("last-overrides", SmallSpec()));
  EXPECT_EQ(attached->last_step(), 2);
  ASSERT_TRUE(attached->last_overrides().has_value());
  ASSERT_EQ(attached->last_overrides()->size(), 1u);
  const v1::GroupOverride& o = attached->last_overrides()->front();
  EXPECT_EQ(o.group(), "vectors");
  EXPECT_TRUE(o.has_lr());
  EXPECT_EQ(o.lr(), 0.002);
  EXPECT_FALSE(o.has_momentum() || o.has_weight_decay() || o.has_beta1() || o.has_beta2());
}

TEST_F(DaemonTest, AttachWithADifferentSpecIsAlreadyExistsNamingTheField) {
  auto session = NewSession("conflict");
  ASSERT_NE(session, nullptr);
  v1::SessionSpec other = SmallSpec();
  other.mutable_parameters(0)->set_shape(1, 5);
  EXPECT_THAT(client_->CreateSession("conflict", other),
              StatusIs(absl::StatusCode::kAlreadyExists, "parameters[0].shape[1]"));
}

TEST_F(DaemonTest, ListAndCloseSessions) {
  auto session = NewSession("listed");
  ASSERT_NE(session, nullptr);
  ASSERT_OK_AND_ASSIGN(auto sessions, client_->ListSessions());
  bool found = false;
  for (const auto& s : sessions) found |= s.session_id() == "listed" && s.num_parameters() == 36;
  EXPECT_TRUE(found);
  ASSERT_OK(session->Close());
  EXPECT_THAT(session->Step(1, Gradients(1)), StatusIs(absl::StatusCode::kNotFound, "session_id"));
  EXPECT_THAT(client_->CloseSession("listed"), StatusIs(absl::StatusCode::kNotFound, "listed"));
}

TEST_F(DaemonTest, RetriedStepIsNotAppliedTwice) {
  auto retried = NewSession("retried");
  auto reference = NewSession("reference");
  ASSERT_NE(retried, nullptr);
  ASSERT_NE(reference, nullptr);
  ASSERT_OK_AND_ASSIGN(client::StepReply first, retried->Step(1, Gradients(1)));
  // The same step again, even with other gradients, replays the answer and changes nothing.
  ASSERT_OK_AND_ASSIGN(client::StepReply again, retried->Step(1, Gradients(7)));
  EXPECT_TRUE(again.replayed);
  EXPECT_TRUE(again.applied);
  EXPECT_EQ(again.parameters, first.parameters);
  ASSERT_OK_AND_ASSIGN(client::StepReply second, retried->Step(2, Gradients(2)));

  ASSERT_OK(reference->Step(1, Gradients(1)).status());
  ASSERT_OK_AND_ASSIGN(client::StepReply expected, reference->Step(2, Gradients(2)));
  EXPECT_EQ(second.parameters, expected.parameters) << "a replayed step changed the state";
}

TEST_F(DaemonTest, StepsMustBeConsecutive) {
  auto session = NewSession("ordered");
  ASSERT_NE(session, nullptr);
  EXPECT_THAT(session->Step(2, Gradients(2)), StatusIs(absl::StatusCode::kFailedPrecondition, "expected step 1"));
  // 0 is no step number at all (they run from 1): the request's fault, not the session's order.
  EXPECT_THAT(session->Step(0, Gradients(0)),
              StatusIs(absl::StatusCode::kInvalidArgument, "header.step: must be between 1 and"));
  ASSERT_OK(session->Step(1, Gradients(1)).status());
  ASSERT_OK(session->Step(2, Gradients(2)).status());
  EXPECT_THAT(session->Step(1, Gradients(1)),
              StatusIs(absl::StatusCode::kFailedPrecondition, "expected step 3 (or 2 to replay"));
  EXPECT_THAT(session->Step(5, Gradients(5)), StatusIs(absl::StatusCode::kFailedPrecondition, "got 5"));
  ASSERT_OK_AND_ASSIGN(client::StepReply reply, session->Step(3, Gradients(3)));
  EXPECT_TRUE(reply.applied);
}

TEST_F(DaemonTest, StepBeforeUploadIsRefused) {
  ASSERT_OK_AND_ASSIGN(auto session, client_->CreateSession("no-upload", SmallSpec()));
  EXPECT_THAT(session->Step(1, Gradients(1)), StatusIs(absl::StatusCode::kFailedPrecondition, "upload"));
  EXPECT_THAT(session->GetParameters(), StatusIs(absl::StatusCode::kFailedPrecondition, "upload"));
}

TEST_F(DaemonTest, UploadAfterTheFirstStepIsRefused) {
  auto session = NewSession("late-upload");
  ASSERT_NE(session, nullptr);
  ASSERT_OK(session->Step(1, Gradients(1)).status());
  const std::vector<float> w(32, 1.0f), b(4, 1.0f);
  const std::vector<client::TensorView> values = {{"w", {8, 4}, w}, {"b", {4}, b}};
  EXPECT_THAT(session->UploadParameters(values), StatusIs(absl::StatusCode::kFailedPrecondition, "first step"));
}

}  // namespace
}  // namespace muond::testing
