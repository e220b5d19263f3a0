// Clipping group by group (group option clip_scope) against the real daemon: what each scope counts
// and scales, the coefficients every answer reports, and parameters equal, bit for bit, to an
// unclipped session given the gradients pre-multiplied by the reported coefficients (the daemon
// multiplies each fp32 gradient element by the fp32 coefficient, as done here).
#include "gmock/gmock.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/rank_gradients.h"
#include "tests/testing/status_matchers.h"

namespace muond::testing {
namespace {

class ClipScopeTest : public DaemonTest {
 protected:
  // SmallSpec's groups: "matrices" (muon, parameter w) and "vectors" (adamw, parameter b).
  static v1::SessionSpec Spec(const std::string& matrices_scope, const std::string& vectors_scope,
                              std::optional<double> matrices_limit = std::nullopt) {
    v1::SessionSpec spec = SmallSpec();
    if (!matrices_scope.empty()) spec.mutable_groups(0)->mutable_options()->set_clip_scope(matrices_scope);
    if (!vectors_scope.empty()) spec.mutable_groups(1)->mutable_options()->set_clip_scope(vectors_scope);
    if (matrices_limit) spec.mutable_groups(0)->mutable_options()->set_max_grad_norm(*matrices_limit);
    return spec;
  }

  // The step's parameters, and those of an unclipped session given the gradients times the
  // coefficients the step reported.
  struct Outcome {
    client::StepReply clipped;
    client::ParameterMap reference;
  };
  Outcome StepBoth(const std::string& id, const v1::SessionSpec& spec, const Grads& g, double max_grad_norm) {
    Outcome outcome;
    absl::StatusOr<std::unique_ptr<client::Session>> session = client_->CreateSession(id, spec);
    EXPECT_OK(session.status());
    const std::vector<float> w = Initial("w", 32), b = Initial("b", 4);
    EXPECT_OK((*session)->UploadParameters(std::vector<client::TensorView>{{"w", {8, 4}, w}, {"b", {4}, b}}));
    client::StepOptions options;
    options.max_grad_norm = max_grad_norm;
    absl::StatusOr<client::StepReply> reply = (*session)->Step(1, g.views(), options);
    EXPECT_OK(reply.status());
    outcome.clipped = *reply;

    Grads scaled = g;
    const float cw = static_cast<float>(reply->group_clips["matrices"].coefficient);
    const float cb = static_cast<float>(reply->group_clips["vectors"].coefficient);
    for (float& x : scaled.w) x *= cw;
    for (float& x : scaled.b) x *= cb;
    v1::SessionSpec plain = spec;
    for (auto& group : *plain.mutable_groups()) {
      group.mutable_options()->clear_clip_scope();
      group.mutable_options()->clear_max_grad_norm();
    }
    absl::StatusOr<std::unique_ptr<client::Session>> reference = client_->CreateSession(id + "-reference", plain);
    EXPECT_OK(reference.status());
    EXPECT_OK((*reference)->UploadParameters(std::vector<client::TensorView>{{"w", {8, 4}, w}, {"b", {4}, b}}));
    absl::StatusOr<client::StepReply> unclipped = (*reference)->Step(1, scaled.views());
    EXPECT_OK(unclipped.status());
    outcome.reference = unclipped->parameters;
    return outcome;
  }
};

double Coefficient(double limit, double norm) { return std::min(1.0, limit / (norm + 1e-6)); }

TEST_F(ClipScopeTest, GlobalClipsEveryGroupByTheOneGlobalNorm) {
  const Outcome o = StepBoth("clip-global", Spec("", ""), GradsOf(0.3f), 0.05);
  const auto& clips = o.clipped.group_clips;
  const double wn = clips.at("matrices").grad_norm, bn = clips.at("vectors").grad_norm;
  EXPECT_DOUBLE_EQ(o.clipped.grad_norm * o.clipped.grad_norm, wn * wn + bn * bn);
  EXPECT_LT(clips.at("matrices").coefficient, 1.0);
  EXPECT_EQ(clips.at("matrices").coefficient, Coefficient(0.05, o.clipped.grad_norm));
  EXPECT_EQ(clips.at("vectors").coefficient, clips.at("matrices").coefficient);
  EXPECT_EQ(o.clipped.parameters, o.reference);
}

TEST_F(ClipScopeTest, NoneIsNeitherCountedNorClipped) {
  const Outcome o = StepBoth("clip-none", Spec("none", ""), GradsOf(0.3f), 0.05);
  const auto& clips = o.clipped.group_clips;
  EXPECT_EQ(clips.at("matrices").coefficient, 1.0);
  EXPECT_GT(clips.at("matrices").grad_norm, 0.05);
  EXPECT_DOUBLE_EQ(o.clipped.grad_norm, clips.at("vectors").grad_norm) << "the global norm leaves matrices out";
  EXPECT_EQ(clips.at("vectors").coefficient, Coefficient(0.05, clips.at("vectors").grad_norm));
  EXPECT_EQ(o.clipped.parameters, o.reference);
}

TEST_F(ClipScopeTest, GroupClipsByItsOwnNormAndLimit) {
  // The group's own limit (0.5), and without one the step's (0.05).
  for (const auto& [limit, expected_limit] : {std::pair{std::optional<double>(0.5), 0.5}, {std::nullopt, 0.05}}) {
    const Outcome o =
        StepBoth(absl::StrCat("clip-group-", expected_limit), Spec("group", "none", limit), GradsOf(0.3f), 0.05);
    const auto& clips = o.clipped.group_clips;
    EXPECT_EQ(clips.at("matrices").coefficient, Coefficient(expected_limit, clips.at("matrices").grad_norm));
    EXPECT_LT(clips.at("matrices").coefficient, 1.0);
    EXPECT_EQ(clips.at("vectors").coefficient, 1.0);
    EXPECT_EQ(o.clipped.grad_norm, 0.0) << "no group counts in the global norm";
    EXPECT_EQ(o.clipped.parameters, o.reference);
  }
}

TEST_F(ClipScopeTest, BadClipOptionsAreRefusedNamingTheField) {
  v1::SessionSpec sharded = Spec("group", "", 1.0);
  sharded.mutable_shard()->add_endpoints("127.0.0.1:1");
  sharded.mutable_shard()->add_endpoints("127.0.0.1:2");
  sharded.mutable_shard()->set_index(0);
  sharded.mutable_shard()->set_num_parameters(2);
  sharded.mutable_shard()->add_parameters(0);
  sharded.mutable_shard()->add_parameters(1);
  const std::pair<v1::SessionSpec, std::string> cases[] = {
      {Spec("sideways", ""), "spec.groups[0].options.clip_scope"},
      {Spec("", "", 1.0), "spec.groups[0].options.max_grad_norm applies with clip_scope group only"},
      {Spec("group", "", -1.0), "spec.groups[0].options.max_grad_norm must be > 0"},
      {sharded, "spec.groups[0].options.clip_scope: only global on a sharded session"},
  };
  for (const auto& [spec, message] : cases) {
    EXPECT_THAT(client_->CreateSession("bad-clip", spec), StatusIs(absl::StatusCode::kInvalidArgument, message));
  }
}

}  // namespace
}  // namespace muond::testing
