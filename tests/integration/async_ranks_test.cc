// Asynchronous sessions against the real daemon: every push applied once, on arrival, as the next
// global step; the staleness bound; resends answered from the rank's record; the order and the push
// records surviving a crash (journal) and a checkpoint. Pushes are sent one after another, so the
// global order is the order of the calls.
#include "gmock/gmock.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/rank_gradients.h"
#include "tests/testing/status_matchers.h"

namespace muond::testing {
namespace {

using ::testing::ElementsAre;

constexpr double kMatrixLr = 0.02, kVectorLr = 0.003;

v1::SessionSpec LrSpec() {
  v1::SessionSpec spec = DaemonTest::SmallSpec();
  spec.mutable_groups(0)->mutable_options()->set_lr(kMatrixLr);
  spec.mutable_groups(1)->mutable_options()->set_lr(kVectorLr);
  return spec;
}

v1::SessionSpec AsyncSpec(int world_size, int64_t max_staleness,
                          v1::StalenessScaling scaling = v1::STALENESS_SCALING_NONE) {
  v1::SessionSpec spec = LrSpec();
  spec.set_world_size(world_size);
  spec.mutable_sync()->set_mode(v1::SYNC_MODE_ASYNC);
  spec.mutable_sync()->set_max_staleness(max_staleness);
  spec.mutable_sync()->set_staleness_scaling(scaling);
  return spec;
}

std::vector<client::TensorView> Initial() {
  static const std::vector<float> w = DaemonTest::Initial("w", 32), b = DaemonTest::Initial("b", 4);
  return {{"w", {8, 4}, w}, {"b", {4}, b}};
}

struct Push {
  int rank;
  int64_t push;
  int64_t base_step;
  Grads g;
};

class AsyncRanksTest : public ::testing::Test {
 protected:
  void Start(std::vector<std::string> flags = {}) {
    flags.insert(flags.end(), {"--backend", "cpu"});
    flags_ = flags;
    std::string error;
    ASSERT_TRUE(daemon_.Start(flags_, &error)) << error;
    Connect();
  }
  void Restart() {
    daemon_.Kill();
    std::string error;
    ASSERT_TRUE(daemon_.Start(flags_, &error, daemon_.port())) << error;
    Connect();
  }
  void Connect() {
    client::ClientOptions options = TestClientOptions();
    options.endpoint = daemon_.endpoint();
    ASSERT_OK_AND_ASSIGN(client_, client::Client::Connect(options));
  }

  std::vector<std::unique_ptr<client::Session>> Ranks(const std::string& id, const v1::SessionSpec& spec,
                                                      bool upload = true) {
    std::vector<std::unique_ptr<client::Session>> ranks;
    for (int r = 0; r < spec.world_size(); ++r) {
      absl::StatusOr<std::unique_ptr<client::Session>> session = client_->CreateSession(id, spec, r);
      EXPECT_OK(session.status());
      if (!session.ok()) return {};
      ranks.push_back(*std::move(session));
    }
    if (upload) {
      EXPECT_OK(ranks[0]->UploadParameters(Initial()));
    }
    return ranks;
  }

  static absl::StatusOr<client::StepReply> Send(client::Session& session, const Push& p) {
    client::StepOptions options;
    options.rank = p.rank;
    options.base_step = p.base_step;
    return session.Step(p.push, p.g.views(), options);
  }

  // A one-rank session given the same gradients in the global order, each step's lrs multiplied by
  // the factor given with it.
  client::ParameterMap Reference(const std::string& id, const std::vector<std::pair<Grads, double>>& steps) {
    absl::StatusOr<std::unique_ptr<client::Session>> single = client_->CreateSession(id, LrSpec());
    EXPECT_OK(single.status());
    EXPECT_OK((*single)->UploadParameters(Initial()));
    client::ParameterMap last;
    for (size_t k = 0; k < steps.size(); ++k) {
      client::StepOptions options;
      options.lr = {{"matrices", kMatrixLr * steps[k].second}, {"vectors", kVectorLr * steps[k].second}};
      absl::StatusOr<client::StepReply> reply =
          (*single)->Step(static_cast<int64_t>(k + 1), steps[k].first.views(), options);
      EXPECT_OK(reply.status());
      if (reply.ok()) last = reply->parameters;
    }
    return last;
  }

  std::vector<std::string> flags_;
  DaemonProcess daemon_;
  std::unique_ptr<client::Client> client_;
};

TEST_F(AsyncRanksTest, EveryPushIsTheNextGlobalStepOnceAndAStalePushIsRefused) {
  Start();
  auto ranks = Ranks("async", AsyncSpec(3, 2));
  const Grads g0 = GradsOf(0.1f), g1 = GradsOf(1.3f), g2 = GradsOf(2.9f), g3 = GradsOf(4.2f);
  const std::vector<Push> pushes = {{0, 1, 0, g0}, {1, 1, 0, g1}, {2, 1, 0, g2}, {0, 2, 1, g3}};
  const int64_t staleness[] = {0, 1, 2, 2};
  client::StepReply last;
  for (size_t i = 0; i < pushes.size(); ++i) {
    ASSERT_OK_AND_ASSIGN(last, Send(*ranks[pushes[i].rank], pushes[i]));
    EXPECT_EQ(last.global_step, static_cast<int64_t>(i + 1));
    EXPECT_EQ(last.step, static_cast<int64_t>(i + 1));
    EXPECT_EQ(last.staleness, staleness[i]);
    EXPECT_THAT(last.contributors, ElementsAre(pushes[i].rank));
    EXPECT_TRUE(last.applied && last.included);
  }
  // Rank 1's second push computed on global step 0: 4 behind, more than 2. Nothing applied.
  const absl::StatusOr<client::StepReply> stale = Send(*ranks[1], {1, 2, 0, g0});
  EXPECT_THAT(stale, StatusIs(absl::StatusCode::kFailedPrecondition, "header.base_step: 0 is 4 global steps behind 4"));
  EXPECT_EQ(client::ReasonOf(stale.status()), v1::PUSH_TOO_STALE);
  EXPECT_THAT(Send(*ranks[1], {1, 2, 5, g0}), StatusIs(absl::StatusCode::kInvalidArgument, "header.base_step"));
  client::StepOptions no_base;
  no_base.rank = 1;
  EXPECT_THAT(ranks[1]->Step(2, g0.views(), no_base),
              StatusIs(absl::StatusCode::kInvalidArgument, "header.base_step: required"));
  EXPECT_THAT(Send(*ranks[2], {2, 3, 4, g0}),
              StatusIs(absl::StatusCode::kFailedPrecondition, "header.step: rank 2's next push is 2"));
  int64_t global = -1;
  ASSERT_OK_AND_ASSIGN(client::ParameterMap unchanged, ranks[0]->GetParameters(&global));
  EXPECT_EQ(global, 4);
  EXPECT_EQ(unchanged, last.parameters);

  // A resend is answered from the rank's record, with the latest parameters, and applies nothing.
  ASSERT_OK_AND_ASSIGN(client::StepReply resent, Send(*ranks[0], pushes[3]));
  EXPECT_TRUE(resent.replayed);
  EXPECT_EQ(resent.global_step, 4);
  EXPECT_EQ(resent.parameters, last.parameters);
  ASSERT_OK_AND_ASSIGN(client::StepReply fresh, Send(*ranks[1], {1, 2, 4, g3}));
  EXPECT_EQ(fresh.global_step, 5);
  EXPECT_EQ(fresh.parameters, Reference("async-reference", {{g0, 1}, {g1, 1}, {g2, 1}, {g3, 1}, {g3, 1}}));
}

TEST_F(AsyncRanksTest, InverseScalingDividesTheLrsByOnePlusTheStaleness) {
  Start();
  auto ranks = Ranks("async-inverse", AsyncSpec(2, 4, v1::STALENESS_SCALING_INVERSE));
  const Grads g0 = GradsOf(0.1f), g1 = GradsOf(1.3f);
  ASSERT_OK(Send(*ranks[0], {0, 1, 0, g0}).status());
  ASSERT_OK(Send(*ranks[1], {1, 1, 0, g1}).status());                             // staleness 1
  ASSERT_OK_AND_ASSIGN(client::StepReply third, Send(*ranks[1], {1, 2, 0, g0}));  // staleness 2
  EXPECT_EQ(third.staleness, 2);
  EXPECT_EQ(third.parameters, Reference("inverse-reference", {{g0, 1.0}, {g1, 1.0 / 2.0}, {g0, 1.0 / 3.0}}));
}

TEST_F(AsyncRanksTest, ACrashReplaysTheSameGlobalOrderAndKeepsEveryRanksRecord) {
  Start({"--state-dir", daemon_.dir() + "/state", "--durability", "journal"});
  auto ranks = Ranks("async-journal", AsyncSpec(3, 8));
  const Grads g[] = {GradsOf(0.1f), GradsOf(1.3f), GradsOf(2.9f), GradsOf(4.2f)};
  const std::vector<Push> pushes = {{2, 1, 0, g[0]}, {0, 1, 0, g[1]}, {2, 2, 2, g[2]}, {1, 1, 1, g[3]}};
  client::StepReply last;
  for (const Push& p : pushes) {
    ASSERT_OK_AND_ASSIGN(last, Send(*ranks[p.rank], p));
  }

  Restart();  // SIGKILL: only the journal remains
  ranks = Ranks("async-journal", AsyncSpec(3, 8), /*upload=*/false);
  int64_t global = -1;
  absl::StatusOr<client::ParameterMap> read = ranks[0]->GetParameters(&global);
  ASSERT_OK(read.status()) << daemon_.ReadStderr();
  const client::ParameterMap restored = *std::move(read);
  EXPECT_EQ(global, 4);
  EXPECT_EQ(restored, last.parameters);
  // Attaching, each rank hears its last push; it is a resend still, and the next ones follow.
  EXPECT_EQ(ranks[0]->last_push(), 1);
  EXPECT_EQ(ranks[1]->last_push(), 1);
  EXPECT_EQ(ranks[2]->last_push(), 2);
  ASSERT_OK_AND_ASSIGN(client::StepReply resent, Send(*ranks[2], pushes[2]));
  EXPECT_TRUE(resent.replayed);
  EXPECT_EQ(resent.global_step, 3);
  EXPECT_THAT(Send(*ranks[0], {0, 3, 4, g[0]}), StatusIs(absl::StatusCode::kFailedPrecondition, "next push is 2"));

  // A checkpoint keeps the records too (the journal is emptied by it).
  ASSERT_OK(ranks[0]->Checkpoint().status());
  Restart();
  ranks = Ranks("async-journal", AsyncSpec(3, 8), /*upload=*/false);
  ASSERT_OK_AND_ASSIGN(resent, Send(*ranks[1], pushes[3]));
  EXPECT_TRUE(resent.replayed);
  EXPECT_EQ(resent.global_step, 4);
  ASSERT_OK_AND_ASSIGN(client::StepReply next, Send(*ranks[0], {0, 2, 4, g[0]}));
  EXPECT_EQ(next.global_step, 5);
  EXPECT_EQ(next.parameters, Reference("journal-reference", {{g[0], 1}, {g[1], 1}, {g[2], 1}, {g[3], 1}, {g[0], 1}}));
}

// A resend answers its own push's outcome, never another rank's: an applied push is applied, a
// skipped one skipped with its reason, after a checkpoint and a restart too. A push older than the
// rank's last (a rank back from a state dict saved a few pushes ago) was taken as well: it is
// answered as a resend that applied nothing, and the rank's numbering goes on after the record.
TEST_F(AsyncRanksTest, AResendAnswersItsOwnPushsOutcomeAndAnOlderPushIsOneToo) {
  Start({"--state-dir", daemon_.dir() + "/state"});
  auto ranks = Ranks("async-outcomes", AsyncSpec(2, 8));
  const Grads g0 = GradsOf(0.1f), g1 = GradsOf(1.3f), g2 = GradsOf(2.9f);
  Grads bad = GradsOf(0.5f);
  bad.w[3] = std::nanf("");
  const std::vector<Push> pushes = {{0, 1, 0, g0}, {0, 2, 1, g1}, {1, 1, 2, bad}, {0, 3, 2, g2}};
  client::StepReply last;
  for (const Push& p : pushes) {
    ASSERT_OK_AND_ASSIGN(last, Send(*ranks[p.rank], p));
  }
  EXPECT_EQ(last.global_step, 4);
  const client::ParameterMap after = last.parameters;
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(round == 0 ? "before the restart" : "after a checkpoint and a restart");
    ASSERT_OK_AND_ASSIGN(client::StepReply skipped, Send(*ranks[1], pushes[2]));
    EXPECT_TRUE(skipped.replayed);
    EXPECT_FALSE(skipped.applied);
    EXPECT_THAT(skipped.skip_reason, ::testing::HasSubstr("non-finite"));
    EXPECT_EQ(skipped.global_step, 3);
    EXPECT_THAT(skipped.contributors, ElementsAre(1));
    ASSERT_OK_AND_ASSIGN(client::StepReply applied, Send(*ranks[0], pushes[3]));
    EXPECT_TRUE(applied.replayed && applied.applied);
    EXPECT_EQ(applied.skip_reason, "");
    EXPECT_EQ(applied.global_step, 4);
    for (const Push& older : {pushes[0], pushes[1]}) {
      ASSERT_OK_AND_ASSIGN(client::StepReply again, Send(*ranks[0], older));
      EXPECT_TRUE(again.replayed);
      EXPECT_FALSE(again.applied);
      EXPECT_THAT(again.skip_reason, ::testing::HasSubstr("nothing was applied now"));
      EXPECT_EQ(again.global_step, 0);  // not kept
      EXPECT_EQ(again.step, 4);
      EXPECT_EQ(again.parameters, after);
    }
    if (round == 0) {
      ASSERT_OK(ranks[0]->Checkpoint().status());
      Restart();
      ranks = Ranks("async-outcomes", AsyncSpec(2, 8), /*upload=*/false);
      ASSERT_EQ(ranks.size(), 2u);
    }
  }
  EXPECT_THAT(Send(*ranks[0], {0, 5, 4, g0}),
              StatusIs(absl::StatusCode::kFailedPrecondition, "header.step: rank 0's next push is 4 (or 1 to 3"));
  ASSERT_OK_AND_ASSIGN(client::StepReply next, Send(*ranks[0], {0, 4, 4, g0}));
  EXPECT_TRUE(next.applied && !next.replayed);
  EXPECT_EQ(next.global_step, 5);
}

// A periodic checkpoint (--checkpoint-every) taken on a push's global step holds that push's
// record: after a crash its resend is answered from the record, never applied a second time.
TEST_F(AsyncRanksTest, APeriodicCheckpointHoldsThePushItFollows) {
  Start({"--state-dir", daemon_.dir() + "/state", "--checkpoint-every", "1"});
  auto ranks = Ranks("async-periodic", AsyncSpec(2, 8));
  const Grads g0 = GradsOf(0.1f), g1 = GradsOf(1.3f);
  ASSERT_OK(Send(*ranks[0], {0, 1, 0, g0}).status());
  ASSERT_OK_AND_ASSIGN(client::StepReply last, Send(*ranks[1], {1, 1, 1, g1}));
  Restart();  // SIGKILL: only the checkpoint of global step 2 remains
  ranks = Ranks("async-periodic", AsyncSpec(2, 8), /*upload=*/false);
  ASSERT_EQ(ranks.size(), 2u);
  EXPECT_EQ(ranks[1]->last_push(), 1);
  ASSERT_OK_AND_ASSIGN(client::StepReply resent, Send(*ranks[1], {1, 1, 1, g1}));
  EXPECT_TRUE(resent.replayed && resent.applied);
  EXPECT_EQ(resent.global_step, 2);
  EXPECT_EQ(resent.step, 2);
  EXPECT_EQ(resent.parameters, last.parameters);
}

TEST_F(AsyncRanksTest, AnAsyncSpecOutOfRangeIsRefusedNamingTheField) {
  Start();
  EXPECT_THAT(client_->CreateSession("bad-rank", AsyncSpec(2, 1), 2),
              StatusIs(absl::StatusCode::kInvalidArgument, "rank: must be in [0, spec.world_size 2), got 2"));
  v1::SessionSpec negative = AsyncSpec(2, -1);
  v1::SessionSpec unknown = AsyncSpec(2, 1, static_cast<v1::StalenessScaling>(7));
  v1::SessionSpec staleness_in_lockstep = LrSpec();
  staleness_in_lockstep.mutable_sync()->set_max_staleness(3);
  v1::SessionSpec quorum_fields = AsyncSpec(2, 1);
  quorum_fields.mutable_sync()->set_min_ranks(1);
  v1::SessionSpec polynomial_without_a = AsyncSpec(2, 1, v1::STALENESS_SCALING_POLYNOMIAL);
  v1::SessionSpec hinge_negative_b = AsyncSpec(2, 1, v1::STALENESS_SCALING_HINGE);
  hinge_negative_b.mutable_sync()->set_staleness_a(1.0);
  hinge_negative_b.mutable_sync()->set_staleness_b(-1);
  v1::SessionSpec a_with_inverse = AsyncSpec(2, 1, v1::STALENESS_SCALING_INVERSE);
  a_with_inverse.mutable_sync()->set_staleness_a(0.5);
  v1::SessionSpec b_with_polynomial = AsyncSpec(2, 1, v1::STALENESS_SCALING_POLYNOMIAL);
  b_with_polynomial.mutable_sync()->set_staleness_a(0.5);
  b_with_polynomial.mutable_sync()->set_staleness_b(2);
  v1::SessionSpec a_in_lockstep = LrSpec();
  a_in_lockstep.mutable_sync()->set_staleness_a(0.5);
  const std::pair<v1::SessionSpec, std::string> cases[] = {
      {polynomial_without_a, "spec.sync.staleness_a: must be finite and > 0"},
      {hinge_negative_b, "spec.sync.staleness_b: must be >= 0, got -1"},
      {a_with_inverse, "spec.sync.staleness_a: applies to staleness_scaling polynomial and hinge only"},
      {b_with_polynomial, "spec.sync.staleness_b: applies to staleness_scaling hinge only"},
      {a_in_lockstep, "spec.sync.staleness_a: applies to mode async only"},
      {negative, "spec.sync.max_staleness: must be >= 0"},
      {unknown, "spec.sync.staleness_scaling: unknown scaling 7"},
      {staleness_in_lockstep, "spec.sync.max_staleness: applies to mode async only"},
      {quorum_fields, "spec.sync.min_ranks: applies to mode quorum only"},
  };
  for (const auto& [spec, message] : cases) {
    EXPECT_THAT(client_->CreateSession("bad-async", spec), StatusIs(absl::StatusCode::kInvalidArgument, message));
  }
}

}  // namespace
}  // namespace muond::testing
