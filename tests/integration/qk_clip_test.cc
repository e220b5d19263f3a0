// QK-clip (MuonClip) through the daemon: heads whose max logit exceeds the threshold get their query
// rows scaled by γ^α and key rows by γ^(1−α), γ = τ/S_h; other heads are untouched.
#include <cmath>

#include "gmock/gmock.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/testing/status_matchers.h"

namespace muond::testing {
namespace {

// wq, wk: 3 heads × 2 rows of width 4, in a Muon group with τ = 10 and α = 0.25.
v1::SessionSpec AttentionSpec(int num_heads = 3) {
  v1::SessionSpec spec;
  auto* group = spec.add_groups();
  group->set_name("attention");
  group->mutable_options()->set_qk_clip_threshold(10);
  group->mutable_options()->set_qk_clip_alpha(0.25);
  for (const char* name : {"wq", "wk"}) {
    auto* p = spec.add_parameters();
    p->set_name(name);
    p->add_shape(6);
    p->add_shape(4);
    p->set_group("attention");
  }
  auto* pair = spec.add_qk_clip();
  pair->set_query("wq");
  pair->set_key("wk");
  pair->set_num_heads(num_heads);
  return spec;
}

TEST_F(DaemonTest, QkClipScalesTheHeadsAboveTheThreshold) {
  ASSERT_OK_AND_ASSIGN(auto session, client_->CreateSession("qk-clip", AttentionSpec()));
  std::vector<float> wq(24), wk(24);
  for (int i = 0; i < 24; ++i) wq[i] = 0.1f * (i + 1), wk[i] = -0.05f * (i + 2);
  const std::vector<client::TensorView> initial = {{"wq", {6, 4}, wq}, {"wk", {6, 4}, wk}};
  ASSERT_OK(session->UploadParameters(initial));

  // Step 1 with lr 0: Muon changes nothing, so the answer is the clip alone.
  client::StepOptions options;
  options.lr = {{"attention", 0.0}};
  options.qk_logits = {{"wq", {5.0, 40.0, 10.0}}};  // only head 1 exceeds τ = 10
  ASSERT_OK_AND_ASSIGN(client::StepReply reply, session->Step(1, std::vector<client::TensorView>{}, options));
  client::ParameterMap& after = reply.parameters;

  const double gamma = 10.0 / 40.0;
  for (int row = 0; row < 6; ++row) {
    const bool clipped = row / 2 == 1;
    for (int col = 0; col < 4; ++col) {
      const int i = row * 4 + col;
      EXPECT_FLOAT_EQ(after["wq"][i], clipped ? wq[i] * std::pow(gamma, 0.25) : wq[i]) << "wq " << i;
      EXPECT_FLOAT_EQ(after["wk"][i], clipped ? wk[i] * std::pow(gamma, 0.75) : wk[i]) << "wk " << i;
    }
  }
}

TEST_F(DaemonTest, QkClipRequestsAreChecked) {
  auto bad = AttentionSpec(4);  // 6 rows do not split into 4 heads
  EXPECT_THAT(client_->CreateSession("qk-bad", bad),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec.qk_clip[0].num_heads"));
  bad = AttentionSpec(0);  // a pair without heads
  EXPECT_THAT(client_->CreateSession("qk-bad", bad),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec.qk_clip[0].num_heads: must be >= 1"));
  bad = AttentionSpec();
  bad.mutable_qk_clip(0)->set_key("nope");
  EXPECT_THAT(client_->CreateSession("qk-bad", bad),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec.qk_clip[0].key: unknown parameter 'nope'"));

  ASSERT_OK_AND_ASSIGN(auto session, client_->CreateSession("qk-checked", AttentionSpec()));
  const std::vector<float> zeros(24, 0.5f);
  const std::vector<client::TensorView> initial = {{"wq", {6, 4}, zeros}, {"wk", {6, 4}, zeros}};
  ASSERT_OK(session->UploadParameters(initial));
  v1::StepHeader header;
  header.set_session_id("qk-checked");
  header.set_step(1);
  auto* logits = header.add_qk_logits();
  logits->set_query("wq");
  logits->add_max_logits(50);  // one value for three heads
  grpc::Status status = RawStep(header, {});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), ::testing::HasSubstr("header.qk_logits[0].max_logits: expected 3"));
  logits->set_query("wk");
  status = RawStep(header, {});
  EXPECT_THAT(status.error_message(), ::testing::HasSubstr("is not the query of a spec.qk_clip pair"));
  ASSERT_OK_AND_ASSIGN(auto parameters, session->GetParameters());
  EXPECT_EQ(parameters["wq"], zeros);
}

}  // namespace
}  // namespace muond::testing
