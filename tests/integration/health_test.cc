// Per-group telemetry and health warnings against the real daemon (docs/algorithms.md, Telemetry;
// docs/operations.md, Warnings): the figures every answer carries, checked against what the answer's
// own parameters imply, each warning reproduced and raised once when its condition starts, none in a
// healthy run, the options' checks, and the Prometheus families.
#include <cmath>
#include <future>

#include "gmock/gmock.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/metrics_scrape.h"
#include "tests/integration/rank_gradients.h"
#include "tests/integration/test_transport.h"
#include "tests/testing/status_matchers.h"

namespace muond::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

class HealthTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    daemon_ = new DaemonProcess();
    std::string error;
    ASSERT_TRUE(daemon_->Start({"--backend", "cpu", "--metrics-listen", "127.0.0.1:0"}, &error)) << error;
    client::ClientOptions options = TestClientOptions();
    options.endpoint = daemon_->endpoint();
    auto client = client::Client::Connect(options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
    absl::StatusOr<v1::ServerInfo> info = client_->GetServerInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    metrics_address_ = info->metrics_address();
  }
  static void TearDownTestSuite() {
    client_.reset();
    delete daemon_;
    daemon_ = nullptr;
  }

  // "w" [8, 4] in a Muon group "matrices"; "b" [4] in an AdamW group "vectors".
  static v1::SessionSpec Spec() { return DaemonTest::SmallSpec(); }
  static v1::GroupOptions* Matrices(v1::SessionSpec& spec) { return spec.mutable_groups(0)->mutable_options(); }
  static v1::GroupOptions* Vectors(v1::SessionSpec& spec) { return spec.mutable_groups(1)->mutable_options(); }

  static std::vector<float> Initial(const std::string& name, size_t count) { return DaemonTest::Initial(name, count); }

  static std::unique_ptr<client::Session> Open(const std::string& id, const v1::SessionSpec& spec) {
    absl::StatusOr<std::unique_ptr<client::Session>> session = client_->CreateSession(id, spec);
    EXPECT_OK(session.status());
    if (!session.ok()) return nullptr;
    const std::vector<float> w = Initial("w", 32), b = Initial("b", 4);
    EXPECT_OK((*session)->UploadParameters(std::vector<client::TensorView>{{"w", {8, 4}, w}, {"b", {4}, b}}));
    return std::move(*session);
  }

  // Steps 1..steps with GradsOf(step), b scaled by `b_scale`; the answers.
  static std::vector<client::StepReply> Run(client::Session& session, int steps, float b_scale = 1.0f,
                                            std::optional<double> max_grad_norm = std::nullopt) {
    std::vector<client::StepReply> replies;
    for (int step = 1; step <= steps; ++step) {
      Grads g = GradsOf(static_cast<float>(step));
      for (float& x : g.b) x *= b_scale;
      client::StepOptions options;
      if (max_grad_norm) options.max_grad_norm = *max_grad_norm;
      absl::StatusOr<client::StepReply> reply = session.Step(step, g.views(), options);
      EXPECT_OK(reply.status());
      if (!reply.ok()) break;
      replies.push_back(*std::move(reply));
    }
    return replies;
  }

  static std::vector<std::string> Warnings(const client::StepReply& reply, const std::string& group) {
    const v1::GroupTelemetry& t = reply.group_telemetry.at(group);
    return {t.warnings().begin(), t.warnings().end()};
  }

  static double WarningsCounted(const std::string& kind) {
    return std::max(
        0.0, SumOfSamples(ScrapeMetrics(metrics_address_), "muond_health_warnings_total", "kind=\"" + kind + "\""));
  }

  static DaemonProcess* daemon_;
  static std::unique_ptr<client::Client> client_;
  static std::string metrics_address_;
};

DaemonProcess* HealthTest::daemon_ = nullptr;
std::unique_ptr<client::Client> HealthTest::client_;
std::string HealthTest::metrics_address_;

double SumSquares(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return s;
}

// The update RMS and ratio are those of the answer's own parameters; the Muon step's orthogonalized
// update, recovered from them, has the reported residual; the momentum norm is that of step 1's
// Nesterov momentum. fp32 rounding of W and ΔW (|W| ≤ 0.1, |ΔW| ≈ 0.02) bounds the differences far
// below the tolerances.
TEST_F(HealthTest, TelemetryMatchesTheParametersItDescribes) {
  std::unique_ptr<client::Session> session = Open("telemetry", Spec());
  ASSERT_NE(session, nullptr);
  const std::vector<client::StepReply> replies = Run(*session, 1);
  ASSERT_EQ(replies.size(), 1u);
  const client::StepReply& reply = replies[0];
  const v1::GroupTelemetry& m = reply.group_telemetry.at("matrices");
  const v1::GroupTelemetry& v = reply.group_telemetry.at("vectors");

  for (const auto& [name, t] : {std::pair{std::string("w"), &m}, std::pair{std::string("b"), &v}}) {
    const std::vector<float>& after = reply.parameters.at(name);
    const std::vector<float> before = Initial(name, after.size());
    std::vector<double> delta(after.size()), w(after.size());
    for (size_t i = 0; i < after.size(); ++i) {
      delta[i] = static_cast<double>(after[i]) - before[i];
      w[i] = before[i];
    }
    ASSERT_TRUE(t->has_update_rms() && t->has_update_ratio()) << name;
    EXPECT_NEAR(t->update_rms(), std::sqrt(SumSquares(delta) / delta.size()), 1e-5 * t->update_rms()) << name;
    EXPECT_NEAR(t->update_ratio(), std::sqrt(SumSquares(delta) / SumSquares(w)), 1e-5 * t->update_ratio()) << name;
    EXPECT_EQ(t->stale_parameters(), 0);
    EXPECT_THAT(t->warnings(), IsEmpty());
  }

  // Step 1: m = (1−μ)·g, u = g + μ·(m − g) = (1 − μ²)·g with μ = 0.95 (fp32 steps, ≤ 1e-6 apart).
  const Grads g = GradsOf(1.0f);
  std::vector<double> gw(g.w.begin(), g.w.end());
  ASSERT_TRUE(m.has_momentum_norm());
  EXPECT_NEAR(m.momentum_norm(), (1 - 0.95 * 0.95) * std::sqrt(SumSquares(gw)), 1e-5 * m.momentum_norm());
  EXPECT_DOUBLE_EQ(m.smallest_momentum_norm(), m.momentum_norm()) << "one matrix";
  EXPECT_FALSE(v.has_momentum_norm()) << "adamw has no Newton–Schulz";
  EXPECT_FALSE(v.has_orthogonality_residual());

  // W' = W − η·scale·O (weight decay 0): O = −ΔW/(0.02·√2) for the 8×4 w (shape scaling √(8/4)); with
  // G = OᵀO the residual is ‖G² − G‖_F/‖G‖_F. ΔW's fp32 rounding (≤ 2⁻²⁴·0.1 a element) moves it by
  // < 1e-4.
  ASSERT_TRUE(m.has_orthogonality_residual());
  EXPECT_EQ(m.residual_parameter(), "w");
  const std::vector<float>& after = reply.parameters.at("w");
  const std::vector<float> before = Initial("w", 32);
  double o[8][4];
  for (int r = 0; r < 8; ++r) {
    for (int c = 0; c < 4; ++c) {
      o[r][c] = -(static_cast<double>(after[r * 4 + c]) - before[r * 4 + c]) / (0.02 * std::sqrt(2.0));
    }
  }
  double gram[4][4] = {};
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 4; ++j) {
      for (int r = 0; r < 8; ++r) gram[i][j] += o[r][i] * o[r][j];
    }
  }
  double off = 0, whole = 0;  // ‖G² − G‖² and ‖G‖²
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 4; ++j) {
      double square = 0;
      for (int k = 0; k < 4; ++k) square += gram[i][k] * gram[k][j];
      off += (square - gram[i][j]) * (square - gram[i][j]);
      whole += gram[i][j] * gram[i][j];
    }
  }
  EXPECT_NEAR(m.orthogonality_residual(), std::sqrt(off / whole), 1e-4);
  EXPECT_GT(m.orthogonality_residual(), 0.01) << "five simple steps leave singular values near, not at, 1";
  EXPECT_LT(m.orthogonality_residual(), 0.77) << "the simple set's derived bound";
}

TEST_F(HealthTest, HealthyRunRaisesNoWarning) {
  const double before = WarningsCounted("clip_stall") + WarningsCounted("momentum_below_eps") +
                        WarningsCounted("parameter_stale") + WarningsCounted("residual_high");
  std::unique_ptr<client::Session> session = Open("healthy", Spec());
  ASSERT_NE(session, nullptr);
  for (const client::StepReply& reply : Run(*session, 12, 1.0f, 10.0)) {
    ASSERT_EQ(reply.group_telemetry.size(), 2u);
    for (const auto& [group, t] : reply.group_telemetry) {
      EXPECT_THAT(t.warnings(), IsEmpty()) << group << " at step " << reply.step;
      EXPECT_TRUE(t.has_update_rms()) << group;
    }
    EXPECT_EQ(reply.group_clips.at("matrices").coefficient, 1.0);
  }
  const double after = WarningsCounted("clip_stall") + WarningsCounted("momentum_below_eps") +
                       WarningsCounted("parameter_stale") + WarningsCounted("residual_high");
  EXPECT_EQ(after, before);
}

// Megatron-LM#5394: one huge group dominates the global norm, and clip_scope global shrinks the Muon
// group's gradients by ~1e-12: under warn_clip_below for warn_clip_steps steps, and its momentum
// under ns_eps (so its update far from orthogonal) from the first step. clip_scope none on the Muon group is the cure:
// no warning.
TEST_F(HealthTest, AHugeGlobalNormStallsTheMuonGroup) {
  const double stalls = WarningsCounted("clip_stall"), lows = WarningsCounted("momentum_below_eps");
  v1::SessionSpec spec = Spec();
  Matrices(spec)->set_warn_clip_steps(3);
  std::unique_ptr<client::Session> session = Open("stalled", spec);
  ASSERT_NE(session, nullptr);
  const std::vector<client::StepReply> replies = Run(*session, 5, 1e12f, 1.0);
  ASSERT_EQ(replies.size(), 5u);
  for (size_t i = 0; i < replies.size(); ++i) {
    const int step = static_cast<int>(i) + 1;
    EXPECT_LT(replies[i].group_clips.at("matrices").coefficient, 1e-11);
    std::vector<std::string> expected;
    // Newton–Schulz's output of a momentum under eps is far from orthogonal too: its singular values
    // are all ≪ 1, so the residual is near 1.
    if (step == 1) expected = {"momentum_below_eps", "residual_high"};
    if (step == 3) expected.push_back("clip_stall");
    EXPECT_EQ(Warnings(replies[i], "matrices"), expected) << "step " << step;
    EXPECT_LT(replies[i].group_telemetry.at("matrices").smallest_momentum_norm(), 1e-7);
    EXPECT_THAT(Warnings(replies[i], "vectors"), IsEmpty());
  }
  EXPECT_EQ(WarningsCounted("clip_stall"), stalls + 1);
  EXPECT_EQ(WarningsCounted("momentum_below_eps"), lows + 1);

  Matrices(spec)->set_clip_scope("none");
  std::unique_ptr<client::Session> cured = Open("cured", spec);
  ASSERT_NE(cured, nullptr);
  for (const client::StepReply& reply : Run(*cured, 5, 1e12f, 1.0)) {
    EXPECT_EQ(reply.group_clips.at("matrices").coefficient, 1.0);
    EXPECT_THAT(Warnings(reply, "matrices"), IsEmpty()) << "step " << reply.step;
  }
}

// A parameter without a gradient: counted as stale from warn_stale_steps steps on, warned about once,
// and no longer stale once a gradient comes.
TEST_F(HealthTest, AParameterWithoutGradientsIsWarnedAboutOnce) {
  const double before = WarningsCounted("parameter_stale");
  v1::SessionSpec spec = Spec();
  Vectors(spec)->set_warn_stale_steps(3);
  std::unique_ptr<client::Session> session = Open("stale", spec);
  ASSERT_NE(session, nullptr);
  for (int step = 1; step <= 5; ++step) {
    const Grads g = GradsOf(static_cast<float>(step));
    std::vector<client::TensorView> views = {{"w", {8, 4}, g.w}};
    if (step == 5) views.push_back({"b", {4}, g.b});
    absl::StatusOr<client::StepReply> reply = session->Step(step, views);
    ASSERT_OK(reply.status());
    const v1::GroupTelemetry& t = reply->group_telemetry.at("vectors");
    EXPECT_EQ(t.stale_parameters(), step == 3 || step == 4 ? 1 : 0) << "step " << step;
    EXPECT_EQ(Warnings(*reply, "vectors"),
              step == 3 ? std::vector<std::string>{"parameter_stale"} : std::vector<std::string>{})
        << "step " << step;
    EXPECT_EQ(t.has_update_rms(), step == 5) << "nothing of the group was updated before";
  }
  EXPECT_EQ(WarningsCounted("parameter_stale"), before + 1);
}

// A residual bound below what five quintic steps leave (≈ 0.3–0.4): raised on the first step, not
// again while it stays above.
TEST_F(HealthTest, AResidualAboveTheBoundIsWarnedAbout) {
  const double before = WarningsCounted("residual_high");
  v1::SessionSpec spec = Spec();
  Matrices(spec)->set_warn_residual_above(0.01);
  std::unique_ptr<client::Session> session = Open("residual", spec);
  ASSERT_NE(session, nullptr);
  const std::vector<client::StepReply> replies = Run(*session, 3);
  ASSERT_EQ(replies.size(), 3u);
  EXPECT_THAT(Warnings(replies[0], "matrices"), ElementsAre("residual_high"));
  EXPECT_THAT(Warnings(replies[1], "matrices"), IsEmpty());
  EXPECT_THAT(Warnings(replies[2], "matrices"), IsEmpty());
  EXPECT_EQ(WarningsCounted("residual_high"), before + 1);
}

// A step of two ranks is answered twice, each answer with its warning; it is counted once.
TEST_F(HealthTest, AStepOfTwoRanksCountsItsWarningOnce) {
  const double before = WarningsCounted("residual_high");
  v1::SessionSpec spec = Spec();
  spec.set_world_size(2);
  Matrices(spec)->set_warn_residual_above(0.01);
  std::unique_ptr<client::Session> rank0 = Open("two-ranks", spec);
  ASSERT_NE(rank0, nullptr);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Session> rank1, client_->CreateSession("two-ranks", spec));
  const Grads g = GradsOf(1.0f);
  client::StepOptions as_rank1;
  as_rank1.rank = 1;
  auto second = std::async(std::launch::async, [&] { return rank1->Step(1, g.views(), as_rank1); });
  ASSERT_OK_AND_ASSIGN(client::StepReply first, rank0->Step(1, g.views()));
  ASSERT_OK_AND_ASSIGN(client::StepReply other, second.get());
  EXPECT_THAT(Warnings(first, "matrices"), ElementsAre("residual_high"));
  EXPECT_THAT(Warnings(other, "matrices"), ElementsAre("residual_high"));
  EXPECT_EQ(WarningsCounted("residual_high"), before + 1);
}

TEST_F(HealthTest, TelemetryOffLeavesOutTheMeasuredFigures) {
  v1::SessionSpec spec = Spec();
  Matrices(spec)->set_telemetry(false);
  std::unique_ptr<client::Session> session = Open("unmeasured", spec);
  ASSERT_NE(session, nullptr);
  const std::vector<client::StepReply> replies = Run(*session, 2);
  ASSERT_EQ(replies.size(), 2u);
  const v1::GroupTelemetry& m = replies[1].group_telemetry.at("matrices");
  EXPECT_FALSE(m.has_update_rms());
  EXPECT_FALSE(m.has_orthogonality_residual());
  EXPECT_TRUE(m.has_momentum_norm()) << "read from sums the step computes anyway";
  EXPECT_TRUE(replies[1].group_telemetry.at("vectors").has_update_rms());
}

TEST_F(HealthTest, GroupFiguresAreExported) {
  std::unique_ptr<client::Session> session = Open("exported", Spec());
  ASSERT_NE(session, nullptr);
  const std::vector<client::StepReply> replies = Run(*session, 1);
  ASSERT_EQ(replies.size(), 1u);
  const std::string text = ScrapeMetrics(metrics_address_);
  const std::string labels = "session=\"exported\",group=\"matrices\"";
  EXPECT_EQ(SumOfSamples(text, "muond_group_update_rms", labels),
            replies[0].group_telemetry.at("matrices").update_rms());
  EXPECT_EQ(SumOfSamples(text, "muond_group_clip_coefficient", labels), 1.0);
  EXPECT_GE(SumOfSamples(text, "muond_group_orthogonality_residual", labels), 0.0);
  ASSERT_OK(client_->CloseSession("exported"));
  EXPECT_EQ(SumOfSamples(ScrapeMetrics(metrics_address_), "muond_group_update_rms", labels), -1)
      << "a closed session's series go";
}

// An SGD group with heloco counts its parameters in each case of HeLoCo's correction (one parameter
// "b" here: one case a step; the first step's momentum is zero, so its gradient is kept), in the
// answer and in Prometheus; a group without it has no counts.
TEST_F(HealthTest, HelocoCountsItsCasesInTheAnswerAndInPrometheus) {
  v1::SessionSpec spec = Spec();
  v1::GroupOptions* vectors = Vectors(spec);
  vectors->set_optimizer(v1::OPTIMIZER_SGD);
  vectors->set_momentum(0.9);
  vectors->set_nesterov(true);
  vectors->set_heloco(true);
  vectors->set_heloco_keep_cosine(1.0);  // nothing short of the momentum's own direction is kept
  std::unique_ptr<client::Session> session = Open("heloco", spec);
  ASSERT_NE(session, nullptr);
  const std::vector<client::StepReply> replies = Run(*session, 3);
  ASSERT_EQ(replies.size(), 3u);
  for (size_t i = 0; i < replies.size(); ++i) {
    const v1::GroupTelemetry& t = replies[i].group_telemetry.at("vectors");
    ASSERT_TRUE(t.has_heloco()) << i;
    EXPECT_EQ(t.heloco().kept() + t.heloco().reoriented() + t.heloco().shrunk(), 1) << i;
    EXPECT_EQ(t.heloco().kept(), i == 0 ? 1 : 0) << i;
    EXPECT_FALSE(replies[i].group_telemetry.at("matrices").has_heloco());
  }
  const std::string text = ScrapeMetrics(metrics_address_);
  const v1::HelocoCounts& last = replies.back().group_telemetry.at("vectors").heloco();
  const std::string labels = "session=\"heloco\",group=\"vectors\",case=";
  EXPECT_EQ(SumOfSamples(text, "muond_group_heloco_parameters", labels + "\"kept\""), last.kept());
  EXPECT_EQ(SumOfSamples(text, "muond_group_heloco_parameters", labels + "\"reoriented\""), last.reoriented());
  EXPECT_EQ(SumOfSamples(text, "muond_group_heloco_parameters", labels + "\"shrunk\""), last.shrunk());
  EXPECT_EQ(SumOfSamples(text, "muond_group_heloco_parameters", "session=\"heloco\",group=\"matrices\""), -1);
  ASSERT_OK(client_->CloseSession("heloco"));
}

// The group series are bounded: at most 16 groups of a session are exported.
TEST_F(HealthTest, AtMostSixteenGroupsOfASessionAreExported) {
  v1::SessionSpec spec;
  std::vector<std::vector<float>> values;
  for (int g = 0; g < 18; ++g) {
    auto* group = spec.add_groups();
    group->set_name("g" + std::to_string(g));
    group->mutable_options()->set_optimizer(v1::OPTIMIZER_ADAMW);
    auto* p = spec.add_parameters();
    p->set_name("p" + std::to_string(g));
    p->add_shape(2);
    p->set_group(group->name());
    values.push_back({0.5f, -0.25f});
  }
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Session> session, client_->CreateSession("many-groups", spec));
  std::vector<client::TensorView> views;
  for (int g = 0; g < 18; ++g) views.push_back({"p" + std::to_string(g), {2}, values[g]});
  ASSERT_OK(session->UploadParameters(views));
  ASSERT_OK_AND_ASSIGN(client::StepReply reply, session->Step(1, views));
  EXPECT_EQ(reply.group_telemetry.size(), 18u) << "the answer has them all";
  const std::string text = ScrapeMetrics(metrics_address_);
  int series = 0;
  for (size_t at = 0; (at = text.find("muond_group_grad_norm{session=\"many-groups\"", at)) != std::string::npos;
       ++at) {
    ++series;
  }
  EXPECT_EQ(series, 16);
  EXPECT_NE(text.find("group=\"g15\""), std::string::npos);
  EXPECT_EQ(text.find("group=\"g16\""), std::string::npos);
}

TEST_F(HealthTest, BadHealthOptionsAreRefusedNamingTheField) {
  std::vector<std::pair<v1::SessionSpec, std::string>> cases;
  v1::SessionSpec spec = Spec();
  Matrices(spec)->set_warn_clip_steps(0);
  cases.push_back({spec, "spec.groups[0].options.warn_clip_steps must be in [1, 1000000]"});
  spec = Spec();
  Matrices(spec)->set_warn_clip_below(2);
  cases.push_back({spec, "spec.groups[0].options.warn_clip_below must be in [0, 1]"});
  spec = Spec();
  Matrices(spec)->set_warn_residual_above(0);
  cases.push_back({spec, "spec.groups[0].options.warn_residual_above must be > 0"});
  spec = Spec();
  Vectors(spec)->set_warn_clip_below(0.1);
  cases.push_back({spec, "spec.groups[1].options.warn_clip_below: does not apply to optimizer adamw"});
  for (const auto& [bad, message] : cases) {
    EXPECT_THAT(client_->CreateSession("bad-health", bad), StatusIs(absl::StatusCode::kInvalidArgument, message));
  }
}

}  // namespace
}  // namespace muond::testing
