// Ranks that differ: weighted averages, and quorum steps that go on without a late or absent rank.
// The real daemon, one C++ client handle per rank; arrival order is pinned by waiting for the
// daemon's own log line that a rank waits, never by sleeping.
#include <algorithm>
#include <future>
#include <map>
#include <optional>
#include <utility>

#include "gmock/gmock.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/rank_gradients.h"
#include "tests/testing/status_matchers.h"

namespace muond::testing {
namespace {

using ::testing::ElementsAre;

class HeterogeneousRanksTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string error;
    ASSERT_TRUE(daemon_.Start({"--backend", "cpu", "--straggler-timeout", "60", "--log-level", "debug"}, &error))
        << error;
    client::ClientOptions options = TestClientOptions();
    options.endpoint = daemon_.endpoint();
    ASSERT_OK_AND_ASSIGN(client_, client::Client::Connect(options));
  }

  static v1::SessionSpec Spec(int world_size, v1::SyncMode mode = v1::SYNC_MODE_LOCKSTEP, int min_ranks = 0,
                              double grace_seconds = 0) {
    v1::SessionSpec spec = DaemonTest::SmallSpec();
    spec.set_world_size(world_size);
    spec.mutable_sync()->set_mode(mode);
    spec.mutable_sync()->set_min_ranks(min_ranks);
    spec.mutable_sync()->set_grace_seconds(grace_seconds);
    return spec;
  }

  // One handle per rank of session `id`, its parameters uploaded.
  std::vector<std::unique_ptr<client::Session>> Ranks(const std::string& id, const v1::SessionSpec& spec) {
    std::vector<std::unique_ptr<client::Session>> ranks;
    for (int r = 0; r < spec.world_size(); ++r) {
      absl::StatusOr<std::unique_ptr<client::Session>> session = client_->CreateSession(id, spec);
      EXPECT_OK(session.status());
      if (!session.ok()) return {};
      ranks.push_back(*std::move(session));
    }
    EXPECT_OK(ranks[0]->UploadParameters(Initial()));
    return ranks;
  }

  static std::vector<client::TensorView> Initial() {
    static const std::vector<float> w = DaemonTest::Initial("w", 32), b = DaemonTest::Initial("b", 4);
    return {{"w", {8, 4}, w}, {"b", {4}, b}};
  }

  // The parameters a one-rank session reaches from the initial ones with `steps` (in order).
  client::ParameterMap OneRank(const std::string& id, const std::vector<Grads>& steps) {
    absl::StatusOr<std::unique_ptr<client::Session>> single = client_->CreateSession(id, DaemonTest::SmallSpec());
    EXPECT_OK(single.status());
    EXPECT_OK((*single)->UploadParameters(Initial()));
    client::ParameterMap last;
    for (size_t k = 0; k < steps.size(); ++k) {
      absl::StatusOr<client::StepReply> reply = (*single)->Step(static_cast<int64_t>(k + 1), steps[k].views());
      EXPECT_OK(reply.status());
      if (reply.ok()) last = reply->parameters;
    }
    return last;
  }

  // Rank `rank` sends `step`; returns once the daemon says it waits for the others.
  std::future<absl::StatusOr<client::StepReply>> SendAndWait(const std::string& id, client::Session& session, int rank,
                                                             int64_t step, const Grads& g, int arrived) {
    auto sent = std::async(std::launch::async, [&session, rank, step, g] {
      client::StepOptions options;
      options.rank = rank;
      return session.Step(step, g.views(), options);
    });
    EXPECT_TRUE(daemon_.WaitForLog(absl::StrCat("session ", id, ": step ", step, " has ", arrived, " of ")))
        << daemon_.ReadStderr();
    return sent;
  }

  static absl::StatusOr<client::StepReply> Send(client::Session& session, int rank, int64_t step, const Grads& g,
                                                std::optional<double> weight = std::nullopt) {
    client::StepOptions options;
    options.rank = rank;
    options.weight = weight;
    return session.Step(step, g.views(), options);
  }

  DaemonProcess daemon_;
  std::unique_ptr<client::Client> client_;
};

TEST_F(HeterogeneousRanksTest, AWeightedStepIsOneRankSendingTheWeightedMeanBitForBit) {
  auto ranks = Ranks("weighted", Spec(3));
  const double weights[] = {1.0, 2.5, 4.0};
  const Grads g[] = {GradsOf(0.1f), GradsOf(1.3f), GradsOf(2.9f)};
  std::vector<std::future<absl::StatusOr<client::StepReply>>> replies;
  for (int r = 0; r < 3; ++r) {
    replies.push_back(std::async(std::launch::async, [&, r] { return Send(*ranks[r], r, 1, g[r], weights[r]); }));
  }
  std::vector<client::StepReply> answers;
  for (auto& reply : replies) {
    ASSERT_OK_AND_ASSIGN(client::StepReply answer, reply.get());
    answers.push_back(std::move(answer));
  }
  const client::ParameterMap expected =
      OneRank("weighted-reference", {WeightedMean({{1.0, g[0]}, {2.5, g[1]}, {4.0, g[2]}})});
  for (const client::StepReply& answer : answers) {
    EXPECT_TRUE(answer.applied);
    EXPECT_TRUE(answer.included);
    EXPECT_THAT(answer.contributors, ElementsAre(0, 1, 2));
    EXPECT_EQ(answer.total_weight, 7.5);
    EXPECT_EQ(answer.parameters, expected);
  }
}

// The largest weights there are: their sums stay finite, so the step is the weighted mean's, not one
// skipped as non-finite (weights of 1e308 each, once taken, overflowed the sum).
TEST_F(HeterogeneousRanksTest, TheLargestWeightsStillMakeTheWeightedMean) {
  auto ranks = Ranks("heaviest", Spec(2));
  const Grads g[] = {GradsOf(0.3f), GradsOf(2.1f)};
  auto first = std::async(std::launch::async, [&] { return Send(*ranks[0], 0, 1, g[0], 1e30); });
  ASSERT_OK_AND_ASSIGN(client::StepReply second, Send(*ranks[1], 1, 1, g[1], 1e30));
  ASSERT_OK_AND_ASSIGN(client::StepReply answer, first.get());
  EXPECT_TRUE(answer.applied) << answer.skip_reason;
  EXPECT_EQ(answer.total_weight, 2e30);
  EXPECT_EQ(answer.parameters, second.parameters);
  EXPECT_EQ(answer.parameters, OneRank("heaviest-reference", {WeightedMean({{1e30, g[0]}, {1e30, g[1]}})}));
}

// Each rank multiplied its loss by a scale of its own (one by none): each rank's gradients are
// divided by its own scale, so the step is the one of the unscaled weighted mean — bit for bit, the
// scales being powers of two.
TEST_F(HeterogeneousRanksTest, RanksWithLossScalesOfTheirOwnStepAsIfUnscaled) {
  auto ranks = Ranks("scaled", Spec(3));
  const double weights[] = {1.0, 2.0, 1.0};
  const std::optional<double> scales[] = {1024.0, std::nullopt, 0.25};
  const Grads g[] = {GradsOf(0.4f), GradsOf(1.7f), GradsOf(2.2f)};
  std::vector<std::future<absl::StatusOr<client::StepReply>>> replies;
  for (int r = 0; r < 3; ++r) {
    replies.push_back(std::async(std::launch::async, [&, r] {
      Grads scaled = g[r];
      const float s = static_cast<float>(scales[r].value_or(1.0));
      for (float& v : scaled.w) v *= s;
      for (float& v : scaled.b) v *= s;
      client::StepOptions options;
      options.rank = r;
      options.weight = weights[r];
      options.grad_scale = scales[r];
      return ranks[r]->Step(1, scaled.views(), options);
    }));
  }
  const client::ParameterMap expected =
      OneRank("scaled-reference", {WeightedMean({{1.0, g[0]}, {2.0, g[1]}, {1.0, g[2]}})});
  for (auto& reply : replies) {
    ASSERT_OK_AND_ASSIGN(client::StepReply answer, reply.get());
    EXPECT_TRUE(answer.applied);
    EXPECT_EQ(answer.parameters, expected);
  }
}

TEST_F(HeterogeneousRanksTest, ABadWeightIsRefusedNamingTheFieldAndChangesNothing) {
  auto ranks = Ranks("bad-weight", Spec(1));
  for (double weight : {0.0, -1.0, std::nan(""), std::numeric_limits<double>::infinity(), 1.0000001e30, 1e308}) {
    EXPECT_THAT(Send(*ranks[0], 0, 1, GradsOf(0.5f), weight),
                StatusIs(absl::StatusCode::kInvalidArgument, "header.weight: must be > 0 and at most 1e+30"));
  }
  int64_t last_step = -1;
  ASSERT_OK(ranks[0]->GetParameters(&last_step).status());
  EXPECT_EQ(last_step, 0);
  // A weight on a one-rank session changes nothing but the total it reports.
  ASSERT_OK_AND_ASSIGN(client::StepReply reply, Send(*ranks[0], 0, 1, GradsOf(0.5f), 3.0));
  EXPECT_EQ(reply.parameters, OneRank("bad-weight-reference", {GradsOf(0.5f)}));
  EXPECT_EQ(reply.total_weight, 3.0);
  EXPECT_THAT(reply.contributors, ElementsAre(0));
}

TEST_F(HeterogeneousRanksTest, ASyncSpecOutOfRangeIsRefusedNamingTheField) {
  const std::pair<v1::SessionSpec, std::string> cases[] = {
      {Spec(3, v1::SYNC_MODE_QUORUM, 4), "spec.sync.min_ranks: must be between 1 and world_size (3), got 4"},
      {Spec(3, v1::SYNC_MODE_QUORUM, -1), "spec.sync.min_ranks"},
      {Spec(3, v1::SYNC_MODE_QUORUM, 2, -0.5), "spec.sync.grace_seconds: must be finite and >= 0"},
      {Spec(3, v1::SYNC_MODE_QUORUM, 2, std::numeric_limits<double>::infinity()), "spec.sync.grace_seconds"},
      {Spec(3, v1::SYNC_MODE_LOCKSTEP, 2), "spec.sync.min_ranks: applies to mode quorum only"},
      {Spec(3, v1::SYNC_MODE_LOCKSTEP, 0, 1.0), "spec.sync.grace_seconds: applies to mode quorum only"},
      {Spec(3, static_cast<v1::SyncMode>(9)), "spec.sync.mode: unknown mode 9"},
  };
  for (const auto& [spec, message] : cases) {
    EXPECT_THAT(client_->CreateSession("bad-sync", spec), StatusIs(absl::StatusCode::kInvalidArgument, message));
  }
  ASSERT_OK_AND_ASSIGN(auto sessions, client_->ListSessions());
  EXPECT_TRUE(sessions.empty());
}

// Q = 2 of 3 with no grace: a step is taken as soon as two ranks sent it.
TEST_F(HeterogeneousRanksTest, AQuorumStepGoesOnWithoutTheLateRankWhichIsToldAndContinues) {
  const std::string id = "quorum";
  auto ranks = Ranks(id, Spec(3, v1::SYNC_MODE_QUORUM, 2, 0));
  const Grads g0 = GradsOf(0.1f), g1 = GradsOf(1.3f), g2 = GradsOf(2.9f);
  // Step 1: ranks 0 and 1; rank 2 absent.
  auto first = SendAndWait(id, *ranks[0], 0, 1, g0, 1);
  ASSERT_OK_AND_ASSIGN(client::StepReply by1, Send(*ranks[1], 1, 1, g1));
  ASSERT_OK_AND_ASSIGN(client::StepReply by0, first.get());
  EXPECT_THAT(by0.contributors, ElementsAre(0, 1));
  EXPECT_TRUE(by0.included && by1.included);
  EXPECT_EQ(by0.total_weight, 2.0);
  EXPECT_EQ(by0.parameters, by1.parameters);
  const Grads step1 = WeightedMean({{1, g0}, {1, g1}});
  EXPECT_EQ(by0.parameters, OneRank("quorum-reference-1", {step1}));

  // Rank 2's step 1 comes late: not used, answered with the parameters after step 1; a retry too.
  for (int attempt = 0; attempt < 2; ++attempt) {
    ASSERT_OK_AND_ASSIGN(client::StepReply late, Send(*ranks[2], 2, 1, g2));
    EXPECT_FALSE(late.included);
    EXPECT_EQ(late.step, 1);
    EXPECT_EQ(late.parameters, by0.parameters);
  }
  // A retry by a rank that was used is the usual replay.
  ASSERT_OK_AND_ASSIGN(client::StepReply replay, Send(*ranks[0], 0, 1, g0));
  EXPECT_TRUE(replay.replayed && replay.included);

  // Steps 2 and 3 by ranks 0 and 1; rank 2, still at step 2, hears where the session is.
  for (int64_t step = 2; step <= 3; ++step) {
    auto waiting = SendAndWait(id, *ranks[0], 0, step, g0, 1);
    ASSERT_OK(Send(*ranks[1], 1, step, g1).status());
    ASSERT_OK(waiting.get().status());
  }
  ASSERT_OK_AND_ASSIGN(client::StepReply behind, Send(*ranks[2], 2, 2, g2));
  EXPECT_FALSE(behind.included);
  EXPECT_EQ(behind.step, 3);
  EXPECT_EQ(ranks[2]->last_step(), 3);

  // Step 4: rank 2 first, then rank 0: taken with [0, 2]; rank 1 is the late one now.
  auto by2 = SendAndWait(id, *ranks[2], 2, 4, g2, 1);
  ASSERT_OK_AND_ASSIGN(client::StepReply with0, Send(*ranks[0], 0, 4, g0));
  EXPECT_THAT(with0.contributors, ElementsAre(0, 2));
  ASSERT_OK_AND_ASSIGN(client::StepReply with2, by2.get());
  EXPECT_TRUE(with2.included);
  ASSERT_OK_AND_ASSIGN(client::StepReply without1, Send(*ranks[1], 1, 4, g1));
  EXPECT_FALSE(without1.included);
  EXPECT_EQ(without1.parameters, with0.parameters);
  EXPECT_EQ(with0.parameters, OneRank("quorum-reference-4", {step1, step1, step1, WeightedMean({{1, g0}, {1, g2}})}));
}

// Q = 2 of 3 with a grace no busy machine exhausts: the third rank, arriving within it, counts.
TEST_F(HeterogeneousRanksTest, ARankArrivingWithinTheGraceCounts) {
  const std::string id = "quorum-grace";
  auto ranks = Ranks(id, Spec(3, v1::SYNC_MODE_QUORUM, 2, 60));
  const Grads g[] = {GradsOf(0.1f), GradsOf(1.3f), GradsOf(2.9f)};
  auto r0 = SendAndWait(id, *ranks[0], 0, 1, g[0], 1);
  auto r1 = SendAndWait(id, *ranks[1], 1, 1, g[1], 2);
  ASSERT_OK_AND_ASSIGN(client::StepReply r2, Send(*ranks[2], 2, 1, g[2], 2.0));
  EXPECT_THAT(r2.contributors, ElementsAre(0, 1, 2));
  EXPECT_EQ(r2.total_weight, 4.0);
  ASSERT_OK(r0.get().status());
  ASSERT_OK(r1.get().status());
  EXPECT_EQ(r2.parameters, OneRank("grace-reference", {WeightedMean({{1, g[0]}, {1, g[1]}, {2, g[2]}})}));
}

// HSDP under quorum: 4 ranks as 2 replicas of a 2-way rows partition (rank r holds shard r mod 2:
// rows [0, 4) of w and [0, 2) of b, or the rest), min_ranks 2, no grace. Ranks 0 and 2, both shard 0,
// are two ranks but not a whole gradient: the step waits. Rank 3 brings shard 1 and the step is
// taken with ranks 0, 2 and 3 — shard 0 the mean of its two replicas, shard 1 rank 3's alone — and
// rank 1, late, is answered its part of the parameters after it.
TEST_F(HeterogeneousRanksTest, AnHsdpQuorumGoesOnWithoutAReplicaButNeverWithoutAShard) {
  const std::string id = "hsdp-quorum";
  v1::SessionSpec spec = Spec(4, v1::SYNC_MODE_QUORUM, 2, 0);
  for (v1::ParameterGroup& group : *spec.mutable_groups()) {
    group.mutable_partition()->set_kind(v1::PARTITION_KIND_ROWS);
    group.mutable_partition()->set_replicas(2);
  }
  auto ranks = Ranks(id, spec);  // a whole upload writes every rank's parts
  ASSERT_EQ(ranks.size(), 4u);
  for (int r = 0; r < 4; ++r) ASSERT_OK(ranks[static_cast<size_t>(r)]->HoldParts(r));
  const Grads g[] = {GradsOf(0.1f), GradsOf(1.3f), GradsOf(2.9f), GradsOf(4.2f)};
  // Shard s of a whole tensor: w's rows [4s, 4s + 4), b's elements [2s, 2s + 2).
  auto shard_of = [](const Grads& whole, int s) {
    return Grads{{whole.w.begin() + 16 * s, whole.w.begin() + 16 * (s + 1)},
                 {whole.b.begin() + 2 * s, whole.b.begin() + 2 * (s + 1)}};
  };
  auto send = [&](int rank) {
    return std::async(std::launch::async, [&, rank] {
      const Grads part = shard_of(g[rank], rank % 2);
      client::StepOptions options;
      options.rank = rank;
      const std::vector<client::TensorView> views = {{"w", {4, 4}, part.w}, {"b", {2}, part.b}};
      return ranks[static_cast<size_t>(rank)]->Step(1, views, options);
    });
  };
  auto r0 = send(0);
  ASSERT_TRUE(daemon_.WaitForLog("session hsdp-quorum: step 1 has 1 of ")) << daemon_.ReadStderr();
  auto r2 = send(2);
  ASSERT_TRUE(daemon_.WaitForLog("session hsdp-quorum: step 1 has 2 of ")) << daemon_.ReadStderr();
  auto r3 = send(3);
  ASSERT_OK_AND_ASSIGN(client::StepReply by3, r3.get());
  EXPECT_THAT(by3.contributors, ElementsAre(0, 2, 3));
  EXPECT_TRUE(by3.included);
  ASSERT_OK(r0.get().status());
  ASSERT_OK(r2.get().status());
  ASSERT_OK_AND_ASSIGN(client::StepReply late, send(1).get());
  EXPECT_FALSE(late.included);
  EXPECT_EQ(late.step, 1);

  const Grads replicas_of_0 = WeightedMean({{1, g[0]}, {1, g[2]}}), whole_1 = g[3];
  Grads assembled = g[0];
  std::copy(replicas_of_0.w.begin(), replicas_of_0.w.begin() + 16, assembled.w.begin());
  std::copy(whole_1.w.begin() + 16, whole_1.w.end(), assembled.w.begin() + 16);
  std::copy(replicas_of_0.b.begin(), replicas_of_0.b.begin() + 2, assembled.b.begin());
  std::copy(whole_1.b.begin() + 2, whole_1.b.end(), assembled.b.begin() + 2);
  const client::ParameterMap want = OneRank("hsdp-quorum-reference", {assembled});
  for (const auto& [reply, s] : {std::pair{&by3, 1}, std::pair{&late, 1}}) {
    EXPECT_EQ(reply->parameters.at("w"),
              std::vector<float>(want.at("w").begin() + 16 * s, want.at("w").begin() + 16 * (s + 1)));
    EXPECT_EQ(reply->parameters.at("b"),
              std::vector<float>(want.at("b").begin() + 2 * s, want.at("b").begin() + 2 * (s + 1)));
  }
}

TEST_F(HeterogeneousRanksTest, QuorumNeedsReplicasOfEveryPartition) {
  v1::SessionSpec spec = Spec(4, v1::SYNC_MODE_QUORUM, 2, 0);
  spec.mutable_groups(0)->mutable_partition()->set_kind(v1::PARTITION_KIND_ROWS);
  spec.mutable_groups(0)->mutable_partition()->set_replicas(2);
  spec.mutable_groups(1)->mutable_partition()->set_kind(v1::PARTITION_KIND_ROWS);
  EXPECT_THAT(client_->CreateSession("hsdp-quorum-bad", spec).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "spec.sync.mode: lock-step only with partitioned groups (spec.groups[1].partition)"));
  spec.mutable_groups(1)->mutable_partition()->set_replicas(2);
  spec.mutable_sync()->set_mode(v1::SYNC_MODE_ASYNC);
  spec.mutable_sync()->clear_min_ranks();
  spec.mutable_sync()->clear_grace_seconds();
  EXPECT_THAT(client_->CreateSession("hsdp-async-bad", spec).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec.sync.mode: lock-step only with partitioned groups"));
}

}  // namespace
}  // namespace muond::testing
