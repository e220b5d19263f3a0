// Step semantics beyond the happy path: non-finite gradients, per-step learning rates, gradient
// clipping, wire and return dtypes, absent gradients; and the standard health service.
#include <algorithm>
#include <cmath>
#include <limits>

#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "proto/wire/dtype_codec.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/testing/status_matchers.h"

namespace muond::testing {
namespace {

TEST_F(DaemonTest, NonFiniteGradientSkipsTheStepAndSaysSo) {
  auto session = NewSession("nan");
  ASSERT_NE(session, nullptr);
  ASSERT_OK(session->Step(1, Gradients(1)).status());
  ASSERT_OK_AND_ASSIGN(client::ParameterMap before, session->GetParameters());
  auto gradients = Gradients(2);
  std::vector<float> bad(gradients[1].values.begin(), gradients[1].values.end());
  bad[2] = std::numeric_limits<float>::quiet_NaN();
  gradients[1].values = bad;
  ASSERT_OK_AND_ASSIGN(client::StepReply skipped, session->Step(2, gradients));
  EXPECT_FALSE(skipped.applied);
  EXPECT_THAT(skipped.skip_reason, ::testing::HasSubstr("non-finite gradient in 'b'"));
  EXPECT_TRUE(std::isnan(skipped.grad_norm));
  EXPECT_EQ(skipped.parameters, before);
  // The counter advanced; the next step applies, and equals a session that never saw the NaN step's
  // gradients (state untouched by the skipped step).
  ASSERT_OK_AND_ASSIGN(client::StepReply next, session->Step(3, Gradients(3)));
  EXPECT_TRUE(next.applied);
  auto reference = NewSession("nan-reference");
  ASSERT_OK(reference->Step(1, Gradients(1)).status());
  ASSERT_OK_AND_ASSIGN(client::StepReply expected, reference->Step(2, Gradients(3)));
  EXPECT_EQ(next.parameters, expected.parameters);
}

TEST_F(DaemonTest, InfiniteGradientIsSkippedToo) {
  auto session = NewSession("inf");
  ASSERT_NE(session, nullptr);
  auto gradients = Gradients(1);
  std::vector<float> bad(gradients[0].values.begin(), gradients[0].values.end());
  bad[0] = std::numeric_limits<float>::infinity();
  gradients[0].values = bad;
  ASSERT_OK_AND_ASSIGN(client::StepReply skipped, session->Step(1, gradients));
  EXPECT_FALSE(skipped.applied);
  EXPECT_THAT(skipped.skip_reason, ::testing::HasSubstr("'w'"));
}

TEST_F(DaemonTest, LogNumZerosInGradCountsExactZeros) {
  auto session = NewSession("zeros");
  ASSERT_NE(session, nullptr);
  auto gradients = Gradients(1);
  std::vector<float> w(gradients[0].values.begin(), gradients[0].values.end());
  std::vector<float> b(gradients[1].values.begin(), gradients[1].values.end());
  w[0] = 0.0f;
  w[1] = -0.0f;
  w[2] = 1e-40f;  // a denormal is not zero
  b[3] = 0.0f;
  gradients[0].values = w;
  gradients[1].values = b;
  int64_t expected = 0;
  for (const auto* values : {&w, &b}) expected += std::count(values->begin(), values->end(), 0.0f);
  ASSERT_GE(expected, 3);
  client::StepOptions count;
  count.log_num_zeros_in_grad = true;
  ASSERT_OK_AND_ASSIGN(client::StepReply counted, session->Step(1, gradients, count));
  EXPECT_EQ(counted.num_zeros_in_grad, expected);
  ASSERT_OK_AND_ASSIGN(client::StepReply plain, session->Step(2, Gradients(2)));
  EXPECT_EQ(plain.num_zeros_in_grad, 0) << "not asked for";
}

TEST_F(DaemonTest, LossScalerThroughTheCppClient) {
  v1::SessionSpec spec = SmallSpec();
  spec.mutable_loss_scaler()->set_initial_scale(1024);
  spec.mutable_loss_scaler()->set_window(2);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Session> session, client_->CreateSession("scaled", spec));
  EXPECT_EQ(session->loss_scale(), 1024);
  const std::vector<float> w = Initial("w", 32), b = Initial("b", 4);
  const std::vector<client::TensorView> initial = {{"w", {8, 4}, w}, {"b", {4}, b}};
  ASSERT_OK(session->UploadParameters(initial));
  // The gradients arrive multiplied by the scale; the reported norm is the unscaled one.
  std::vector<std::vector<float>> scaled;
  for (const client::TensorView& g : Gradients(1)) {
    scaled.emplace_back(g.values.begin(), g.values.end());
    for (float& x : scaled.back()) x *= 1024;
  }
  const std::vector<client::TensorView> views = {{"w", {8, 4}, scaled[0]}, {"b", {4}, scaled[1]}};
  client::StepOptions wrong;
  wrong.grad_scale = 512;
  EXPECT_THAT(session->Step(1, views, wrong).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "header.grad_scale: 512 differs"));
  ASSERT_OK_AND_ASSIGN(client::StepReply first, session->Step(1, views));
  auto reference = NewSession("unscaled");
  ASSERT_OK_AND_ASSIGN(client::StepReply plain, reference->Step(1, Gradients(1)));
  EXPECT_DOUBLE_EQ(first.grad_norm, plain.grad_norm);
  EXPECT_EQ(first.parameters, plain.parameters);  // a power-of-two scale divides out exactly
  EXPECT_EQ(first.loss_scale, 1024);
  ASSERT_OK_AND_ASSIGN(client::StepReply second, session->Step(2, Gradients(2)));
  EXPECT_EQ(second.loss_scale, 2048) << "a window of 2 clean steps doubles the scale";
  // A trainer that attaches learns the current scale.
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Session> attached, client_->CreateSession("scaled", spec));
  EXPECT_EQ(attached->loss_scale(), 2048);
  // A session without a scaler reports none.
  EXPECT_EQ(plain.loss_scale, 0);
}

TEST_F(DaemonTest, LearningRateOverrideAppliesToThatStep) {
  auto session = NewSession("lr-zero");
  ASSERT_NE(session, nullptr);
  client::StepOptions frozen;
  frozen.lr = {{"matrices", 0.0}, {"vectors", 0.0}};
  ASSERT_OK_AND_ASSIGN(client::StepReply reply, session->Step(1, Gradients(1), frozen));
  EXPECT_EQ(reply.parameters["w"], Initial("w", 32));
  EXPECT_EQ(reply.parameters["b"], Initial("b", 4));
  // Doubling Muon's learning rate doubles its first update (no weight decay by default).
  auto base = NewSession("lr-base");
  auto doubled = NewSession("lr-double");
  client::StepOptions twice;
  twice.lr = {{"matrices", 0.04}};
  ASSERT_OK_AND_ASSIGN(client::StepReply r1, base->Step(1, Gradients(1)));
  ASSERT_OK_AND_ASSIGN(client::StepReply r2, doubled->Step(1, Gradients(1), twice));
  const std::vector<float> w0 = Initial("w", 32);
  for (int i = 0; i < 32; ++i) {
    EXPECT_NEAR(r2.parameters["w"][i] - w0[i], 2 * (r1.parameters["w"][i] - w0[i]), 1e-6);
  }
}

TEST_F(DaemonTest, MaxGradNormClipsLikeTorch) {
  auto clipped = NewSession("clipped");
  auto manual = NewSession("manually-scaled");
  ASSERT_NE(clipped, nullptr);
  ASSERT_NE(manual, nullptr);
  client::StepOptions options;
  options.max_grad_norm = 0.5;
  ASSERT_OK_AND_ASSIGN(client::StepReply reply, clipped->Step(1, Gradients(1), options));
  // torch.nn.utils.clip_grad_norm_: g · max_norm / (norm + 1e-6) when the norm is larger.
  const float coefficient = static_cast<float>(0.5 / (reply.grad_norm + 1e-6));
  std::vector<float> w = Gradient("w", 1, 32), b = Gradient("b", 1, 4);
  for (float& v : w) v *= coefficient;
  for (float& v : b) v *= coefficient;
  const std::vector<client::TensorView> scaled = {{"w", {8, 4}, w}, {"b", {4}, b}};
  ASSERT_OK_AND_ASSIGN(client::StepReply expected, manual->Step(1, scaled));
  EXPECT_EQ(reply.parameters, expected.parameters);
  EXPECT_GT(reply.grad_norm, 0.5);  // the reported norm is the one before clipping
}

TEST_F(DaemonTest, Bf16GradientsEqualFp32GradientsRoundedToBf16) {
  auto bf16 = NewSession("bf16", v1::DTYPE_BF16);
  ASSERT_NE(bf16, nullptr);
  std::vector<float> w = Gradient("w", 1, 32), b = Gradient("b", 1, 4);
  for (float& v : w) v = wire::Bf16ToFloat(wire::FloatToBf16(v));
  for (float& v : b) v = wire::Bf16ToFloat(wire::FloatToBf16(v));
  const std::vector<client::TensorView> rounded = {{"w", {8, 4}, w}, {"b", {4}, b}};
  // The bf16 session's initial upload was rounded to bf16 too; compare steps from equal starts.
  ASSERT_OK_AND_ASSIGN(client::ParameterMap start, bf16->GetParameters());
  for (float v : start["w"]) EXPECT_EQ(v, wire::Bf16ToFloat(wire::FloatToBf16(v)));
  ASSERT_OK_AND_ASSIGN(client::StepReply from_bf16, bf16->Step(1, Gradients(1)));
  ASSERT_OK_AND_ASSIGN(auto reference_session, client_->CreateSession("bf16-exact", SmallSpec()));
  const std::vector<client::TensorView> start_views = {{"w", {8, 4}, start["w"]}, {"b", {4}, start["b"]}};
  ASSERT_OK(reference_session->UploadParameters(start_views));
  ASSERT_OK_AND_ASSIGN(client::StepReply from_fp32, reference_session->Step(1, rounded));
  EXPECT_EQ(from_bf16.parameters, from_fp32.parameters);
}

TEST_F(DaemonTest, ReturnDTypeFp16RoundsTheAnswer) {
  auto session = NewSession("fp16-answer");
  ASSERT_NE(session, nullptr);
  ASSERT_OK_AND_ASSIGN(client::StepReply exact, session->Step(1, Gradients(1)));
  client::StepOptions options;
  options.return_dtype = v1::DTYPE_FP16;
  ASSERT_OK_AND_ASSIGN(client::StepReply half, session->Step(1, Gradients(1), options));  // a replay
  EXPECT_TRUE(half.replayed);
  for (const auto& [name, values] : exact.parameters) {
    for (size_t i = 0; i < values.size(); ++i) {
      EXPECT_EQ(half.parameters[name][i], wire::Fp16ToFloat(wire::FloatToFp16(values[i])));
    }
  }
}

TEST_F(DaemonTest, ParameterWithoutGradientIsLeftAlone) {
  auto session = NewSession("partial");
  ASSERT_NE(session, nullptr);
  auto gradients = Gradients(1);
  gradients.pop_back();  // no gradient for "b" this step (torch's grad=None)
  ASSERT_OK_AND_ASSIGN(client::StepReply reply, session->Step(1, gradients));
  EXPECT_TRUE(reply.applied);
  EXPECT_EQ(reply.parameters["b"], Initial("b", 4));
  EXPECT_NE(reply.parameters["w"], Initial("w", 32));
}

TEST_F(DaemonTest, TinyAnswerChunksAreRaisedToAFloor) {
  auto session = NewSession("tiny-chunks");
  ASSERT_NE(session, nullptr);
  grpc::ClientContext context;
  v1::GetParametersRequest request;
  request.set_session_id("tiny-chunks");
  request.set_max_chunk_bytes(1);  // would be one element per message without the floor
  auto reader = client_->stub().GetParameters(&context, request);
  v1::GetParametersResponse response;
  int messages = 0;
  while (reader->Read(&response)) ++messages;
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(messages, 2) << "one chunk each for 'w' (32 values) and 'b' (4 values)";
}

TEST_F(DaemonTest, HealthServiceReportsServing) {
  auto channel = grpc::CreateChannel(daemon_->endpoint(), grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  // grpc.health.v1.HealthCheckRequest{service: ""} is the empty message; the answer
  // HealthCheckResponse{status: SERVING} encodes as field 1 = 1: bytes 0x08 0x01.
  grpc::ByteBuffer request, response;
  grpc::Slice empty("");
  request = grpc::ByteBuffer(&empty, 1);
  std::mutex mu;
  std::condition_variable done_cv;
  bool done = false;
  grpc::Status status;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) {
                   std::lock_guard<std::mutex> lock(mu);
                   status = s;
                   done = true;
                   done_cv.notify_one();
                 });
  std::unique_lock<std::mutex> lock(mu);
  done_cv.wait(lock, [&] { return done; });
  ASSERT_TRUE(status.ok()) << status.error_message();
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(response.Dump(&slices).ok());
  std::string bytes;
  for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  EXPECT_EQ(bytes, std::string("\x08\x01", 2));
}

}  // namespace
}  // namespace muond::testing
