// Whole steps from the C++ client (docs/protocol.md, "Steps in one call") against the real daemon,
// whose Prometheus endpoint counts the calls that carried them: a small step goes in one StepWhole
// call and equals the same step on a Step stream bit for bit; ClientOptions::whole_step_bytes is
// the bound on the gradients' and on the answer's payload, 0 sending every step on a stream, and a
// step that would not fit the daemon's message limit takes the stream; a resent step is answered
// from the daemon's record in one call too; a refused one changes nothing.
// Over gRPC only: shared-memory steps carry no chunks.
#include "gmock/gmock.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/metrics_scrape.h"
#include "tests/integration/test_transport.h"
#include "tests/testing/status_matchers.h"

namespace muond::testing {
namespace {

using ::testing::HasSubstr;

class WholeStepTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    daemon_ = new DaemonProcess();
    std::string error;
    ASSERT_TRUE(daemon_->Start({"--backend", "cpu", "--metrics-listen", "127.0.0.1:0"}, &error)) << error;
    std::unique_ptr<client::Client> client = Connect(client::ClientOptions().whole_step_bytes);
    ASSERT_NE(client, nullptr);
    absl::StatusOr<v1::ServerInfo> info = client->GetServerInfo();
    ASSERT_OK(info.status());
    ASSERT_TRUE(info->whole_steps());
    metrics_address_ = info->metrics_address();
  }
  static void TearDownTestSuite() {
    delete daemon_;
    daemon_ = nullptr;
  }
  void SetUp() override {
    if (client::ClientOptions options = TestClientOptions(); options.transport == "shm") {
      GTEST_SKIP() << "whole steps are gRPC's: this suite's clients step over gRPC whatever the transport";
    }
  }

  // A client over gRPC whose whole steps carry at most `whole_step_bytes` each way.
  static std::unique_ptr<client::Client> Connect(size_t whole_step_bytes) {
    client::ClientOptions options;
    options.endpoint = daemon_->endpoint();
    options.transport = "grpc";
    options.whole_step_bytes = whole_step_bytes;
    absl::StatusOr<std::unique_ptr<client::Client>> client = client::Client::Connect(options);
    EXPECT_OK(client.status());
    return client.ok() ? *std::move(client) : nullptr;
  }

  // DaemonTest::SmallSpec's session ("w" 8×4, "b" 4: 144 bytes of fp32 each way) at its initial
  // values, its gradients sent in `wire_dtype`.
  static std::unique_ptr<client::Session> Open(client::Client& client, const std::string& id,
                                               v1::DType wire_dtype = v1::DTYPE_FP32) {
    absl::StatusOr<std::unique_ptr<client::Session>> session =
        client.CreateSession(id, DaemonTest::SmallSpec(wire_dtype));
    EXPECT_OK(session.status());
    if (!session.ok()) return nullptr;
    EXPECT_OK((*session)->UploadParameters(std::vector<client::TensorView>{{"w", {8, 4}, w0_}, {"b", {4}, b0_}}));
    return *std::move(session);
  }

  static absl::StatusOr<client::StepReply> Step(client::Session& session, int step,
                                                const client::StepOptions& options = {}) {
    std::vector<float> w(32), b(4);
    for (size_t i = 0; i < w.size(); ++i) w[i] = 0.01f * static_cast<float>((step * 7 + i * 3) % 11) - 0.05f;
    for (size_t i = 0; i < b.size(); ++i) b[i] = 0.02f * static_cast<float>((step + i) % 5) - 0.04f;
    return session.Step(step, std::vector<client::TensorView>{{"w", {8, 4}, w}, {"b", {4}, b}}, options);
  }

  // How many calls of `method` the daemon has finished.
  static double Calls(const std::string& method) {
    const double count =
        SumOfSamples(ScrapeMetrics(metrics_address_), "muond_call_duration_seconds_count", "method=\"" + method + "\"");
    return count < 0 ? 0 : count;
  }
  // Waits until the daemon has finished `whole` more StepWhole calls and `streamed` more Step calls
  // than `since` (a call's duration is recorded as it ends, which may come after its answer).
  static bool CallsGrewBy(const std::pair<double, double>& since, double whole, double streamed) {
    return Eventually(
        [&] { return Calls("StepWhole") == since.first + whole && Calls("Step") == since.second + streamed; });
  }
  static std::pair<double, double> CallsNow() { return {Calls("StepWhole"), Calls("Step")}; }

  static DaemonProcess* daemon_;
  static std::string metrics_address_;
  static const std::vector<float> w0_, b0_;
};

DaemonProcess* WholeStepTest::daemon_ = nullptr;
std::string WholeStepTest::metrics_address_;
const std::vector<float> WholeStepTest::w0_ = DaemonTest::Initial("w", 32);
const std::vector<float> WholeStepTest::b0_ = DaemonTest::Initial("b", 4);

TEST_F(WholeStepTest, SmallStepsGoInOneCallAndEqualStreamedStepsBitForBit) {
  std::unique_ptr<client::Client> whole = Connect(client::ClientOptions().whole_step_bytes);
  std::unique_ptr<client::Client> streamed = Connect(0);
  ASSERT_NE(whole, nullptr);
  ASSERT_NE(streamed, nullptr);
  std::unique_ptr<client::Session> a = Open(*whole, "whole-a"), b = Open(*streamed, "whole-b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const std::pair<double, double> before = CallsNow();
  for (int step = 1; step <= 5; ++step) {
    ASSERT_OK_AND_ASSIGN(client::StepReply one_call, Step(*a, step));
    ASSERT_OK_AND_ASSIGN(client::StepReply on_stream, Step(*b, step));
    EXPECT_EQ(one_call.step, step);
    EXPECT_TRUE(one_call.applied);
    EXPECT_FALSE(one_call.replayed);
    EXPECT_EQ(one_call.parameters, on_stream.parameters) << "step " << step;
    EXPECT_EQ(one_call.grad_norm, on_stream.grad_norm) << "step " << step;
  }
  EXPECT_TRUE(CallsGrewBy(before, 5, 5)) << "StepWhole " << Calls("StepWhole") << ", Step " << Calls("Step");
  ASSERT_OK(a->Close());
  ASSERT_OK(b->Close());
}

TEST_F(WholeStepTest, TheBoundHoldsForTheGradientsAndTheAnswerEach) {
  // fp32 both ways, 144 bytes each: at a bound of 144 the step goes in one call, at 143 on a stream.
  for (const auto& [bound, whole_calls] : std::vector<std::pair<size_t, double>>{{144, 1}, {143, 0}}) {
    std::unique_ptr<client::Client> client = Connect(bound);
    ASSERT_NE(client, nullptr);
    std::unique_ptr<client::Session> session = Open(*client, "whole-bound-" + std::to_string(bound));
    ASSERT_NE(session, nullptr);
    const std::pair<double, double> before = CallsNow();
    ASSERT_OK(Step(*session, 1).status());
    EXPECT_TRUE(CallsGrewBy(before, whole_calls, 1 - whole_calls)) << "bound " << bound;
    ASSERT_OK(session->Close());
  }
  // bf16 gradients (72 bytes) under a bound of 100: the fp32 answer (144 bytes) puts the step on a
  // stream, a bf16 answer (72 bytes) in one call.
  std::unique_ptr<client::Client> client = Connect(100);
  ASSERT_NE(client, nullptr);
  std::unique_ptr<client::Session> session = Open(*client, "whole-bound-bf16", v1::DTYPE_BF16);
  ASSERT_NE(session, nullptr);
  std::pair<double, double> before = CallsNow();
  ASSERT_OK(Step(*session, 1).status());
  EXPECT_TRUE(CallsGrewBy(before, 0, 1)) << "fp32 answer";
  client::StepOptions bf16_answer;
  bf16_answer.return_dtype = v1::DTYPE_BF16;
  before = CallsNow();
  ASSERT_OK(Step(*session, 2, bf16_answer).status());
  EXPECT_TRUE(CallsGrewBy(before, 1, 0)) << "bf16 answer";
  ASSERT_OK(session->Close());
}

TEST_F(WholeStepTest, AResentStepIsAnsweredFromTheRecordInOneCall) {
  std::unique_ptr<client::Client> client = Connect(client::ClientOptions().whole_step_bytes);
  ASSERT_NE(client, nullptr);
  std::unique_ptr<client::Session> session = Open(*client, "whole-resend");
  ASSERT_NE(session, nullptr);
  ASSERT_OK(Step(*session, 1).status());
  ASSERT_OK_AND_ASSIGN(client::StepReply first, Step(*session, 2));
  const std::pair<double, double> before = CallsNow();
  ASSERT_OK_AND_ASSIGN(client::StepReply again, Step(*session, 2));
  EXPECT_TRUE(again.replayed);
  EXPECT_EQ(again.step, 2);
  EXPECT_EQ(again.parameters, first.parameters);
  ASSERT_OK_AND_ASSIGN(client::StepReply next, Step(*session, 3));
  EXPECT_TRUE(next.applied);
  EXPECT_FALSE(next.replayed);
  EXPECT_NE(next.parameters, first.parameters);
  EXPECT_TRUE(CallsGrewBy(before, 2, 0));
  ASSERT_OK(session->Close());
}

TEST_F(WholeStepTest, ARefusedWholeStepNamesTheFieldAndChangesNothing) {
  std::unique_ptr<client::Client> client = Connect(client::ClientOptions().whole_step_bytes);
  ASSERT_NE(client, nullptr);
  std::unique_ptr<client::Session> session = Open(*client, "whole-refused");
  ASSERT_NE(session, nullptr);
  ASSERT_OK_AND_ASSIGN(client::StepReply applied, Step(*session, 1));
  const std::pair<double, double> before = CallsNow();
  const absl::StatusOr<client::StepReply> skipped = Step(*session, 3);  // step 2 comes next
  EXPECT_EQ(skipped.status().code(), absl::StatusCode::kFailedPrecondition) << skipped.status();
  EXPECT_THAT(skipped.status().message(), HasSubstr("header.step: expected step 2"));
  EXPECT_TRUE(CallsGrewBy(before, 1, 0));
  int64_t last_step = 0;
  ASSERT_OK_AND_ASSIGN(client::ParameterMap now, session->GetParameters(&last_step));
  EXPECT_EQ(last_step, 1);
  EXPECT_EQ(now, applied.parameters);
  ASSERT_OK(session->Close());
}

TEST_F(WholeStepTest, AWholeStepFitsTheDaemonsMessageLimit) {
  // --max-chunk-bytes 4096 limits that daemon's messages to 1 MiB + 4 KiB: 800 KB of gradients in
  // 4 KiB chunks still fit one call; 1 MiB with its chunks' fields does not and takes the stream (a
  // StepWhole of it would be refused RESOURCE_EXHAUSTED). Both are answered in full.
  DaemonProcess small;
  std::string error;
  ASSERT_TRUE(small.Start({"--backend", "cpu", "--max-chunk-bytes", "4096", "--metrics-listen", "127.0.0.1:0"}, &error))
      << error;
  client::ClientOptions options;
  options.endpoint = small.endpoint();
  options.transport = "grpc";
  options.chunk_bytes = 4096;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Client> client, client::Client::Connect(options));
  ASSERT_OK_AND_ASSIGN(v1::ServerInfo info, client->GetServerInfo());
  const auto calls = [&](const std::string& method) {
    const double count = SumOfSamples(ScrapeMetrics(info.metrics_address()), "muond_call_duration_seconds_count",
                                      "method=\"" + method + "\"");
    return count < 0 ? 0 : count;
  };
  for (const auto& [elements, one_call] : std::vector<std::pair<int64_t, bool>>{{200000, true}, {262144, false}}) {
    const bool whole = one_call;  // a copy the lambda below can capture (clang 14 captures no binding)
    v1::SessionSpec spec;
    v1::ParameterGroup* group = spec.add_groups();
    group->set_name("sgd");
    group->mutable_options()->set_optimizer(v1::OPTIMIZER_SGD);
    group->mutable_options()->set_lr(0.5);
    v1::ParameterSpec* p = spec.add_parameters();
    p->set_name("p");
    p->add_shape(elements);
    p->set_group("sgd");
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Session> session,
                         client->CreateSession("limit-" + std::to_string(elements), spec));
    const std::vector<float> zeros(static_cast<size_t>(elements), 0.0f), ones(static_cast<size_t>(elements), 1.0f);
    ASSERT_OK(session->UploadParameters(std::vector<client::TensorView>{{"p", {elements}, zeros}}));
    const double wholes = calls("StepWhole"), streams = calls("Step");
    ASSERT_OK_AND_ASSIGN(client::StepReply reply,
                         session->Step(1, std::vector<client::TensorView>{{"p", {elements}, ones}}));
    EXPECT_EQ(reply.parameters.at("p"), std::vector<float>(static_cast<size_t>(elements), -0.5f)) << elements;
    EXPECT_TRUE(Eventually([&] {
      return calls("StepWhole") == wholes + (whole ? 1 : 0) && calls("Step") == streams + (whole ? 0 : 1);
    })) << elements
        << " elements: StepWhole " << calls("StepWhole") << ", Step " << calls("Step");
    ASSERT_OK(session->Close());
  }
}

}  // namespace
}  // namespace muond::testing
