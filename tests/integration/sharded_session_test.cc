// A session spread over three real daemons through client::ShardedSession (docs/sharding.md): it
// trains exactly as one daemon does — Muon and AdamW groups, global clipping, a non-finite step,
// QK-clip — steps are exactly-once across shards (a step cut off is kept and sent again with its own
// gradients, with one rank or several), and a different endpoint list for an existing session is
// refused, naming it. The placement rule is checked on the same example as the Python client's
// (tests/python/test_shards.py), so both clients place alike. Ranks that hold parts on shards:
// sharded_parts_test.cc.
#include "client/sharded_session.h"

#include <cmath>
#include <future>
#include <limits>
#include <memory>
#include <set>

#include "absl/strings/str_cat.h"
#include "client/error_reason.h"
#include "gmock/gmock.h"
#include "tests/integration/call_cutting_proxy.h"
#include "tests/integration/sharded_session_fixture.h"

namespace muond::testing {
namespace {

using ::muond::testing::StatusIs;

constexpr int kNanStep = 4;

// Steps `from` to `to` on both sessions with the same gradients and options: they answer alike, bit
// for bit.
void StepBoth(const v1::SessionSpec& spec, client::ShardedSession& sharded, client::Session& single, int from, int to) {
  for (int step = from; step <= to; ++step) {
    Tensors grads(spec, 100 * step, 0.3f);
    ASSERT_OK_AND_ASSIGN(client::StepReply got, sharded.Step(step, grads.views, OptionsOf(step)));
    ASSERT_OK_AND_ASSIGN(client::StepReply want, single.Step(step, grads.views, OptionsOf(step)));
    EXPECT_EQ(got.grad_norm, want.grad_norm) << "step " << step;
    EXPECT_EQ(got.parameters, want.parameters) << "step " << step;
  }
}

// The session's record of its last step: the muon group's lr override and nothing else.
void ExpectLastLr(const client::ShardedSession& session, double lr) {
  ASSERT_TRUE(session.last_overrides().has_value());
  ASSERT_EQ(session.last_overrides()->size(), 1u);
  const v1::GroupOverride& o = session.last_overrides()->front();
  EXPECT_EQ(o.group(), "muon");
  EXPECT_EQ(o.lr(), lr);
  EXPECT_FALSE(o.has_momentum() || o.has_weight_decay() || o.has_beta1() || o.has_beta2());
}

TEST_F(ShardedSessionTest, ThreeDaemonsTrainBitIdenticalToOne) {
  const v1::SessionSpec spec = ModelSpec();
  const std::vector<std::string> shards(endpoints_.begin(), endpoints_.begin() + 3);
  ASSERT_OK_AND_ASSIGN(auto sharded, client::ShardedSession::Open(options_, shards, "model", spec));
  EXPECT_FALSE(sharded->initialized());
  client::ClientOptions one = options_;
  one.endpoint = endpoints_[3];
  ASSERT_OK_AND_ASSIGN(auto client, client::Client::Connect(one));
  ASSERT_OK_AND_ASSIGN(auto single, client->CreateSession("model", spec));
  const Tensors initial(spec, 0, 0.5f);
  ASSERT_OK(sharded->UploadParameters(initial.views));
  ASSERT_OK(single->UploadParameters(initial.views));
  // Every daemon holds whole parameters, the QK-clip pair on one of them.
  EXPECT_EQ(sharded->placement().shard_of[1], sharded->placement().shard_of[2]);
  EXPECT_EQ(std::set<int>(sharded->placement().shard_of.begin(), sharded->placement().shard_of.end()).size(), 3u);

  bool clipped = false;
  for (int step = 1; step <= 12; ++step) {
    Tensors grads(spec, 100 * step, 0.3f);
    if (step == kNanStep) grads.data[5][7] = std::numeric_limits<float>::quiet_NaN();
    ASSERT_OK_AND_ASSIGN(client::StepReply got, sharded->Step(step, grads.views, OptionsOf(step)));
    ASSERT_OK_AND_ASSIGN(client::StepReply expected, single->Step(step, grads.views, OptionsOf(step)));
    EXPECT_EQ(got.applied, expected.applied) << step;
    EXPECT_EQ(got.skip_reason, expected.skip_reason) << step;
    if (step != kNanStep) {
      EXPECT_EQ(got.grad_norm, expected.grad_norm) << step;
    }
    EXPECT_EQ(got.parameters, expected.parameters) << "step " << step;
    clipped = clipped || expected.grad_norm > 0.8;
  }
  EXPECT_TRUE(clipped) << "the clipping limit never bit";

  // A resend of the last step applies nothing twice on any shard.
  Tensors again(spec, 1200, 0.3f);
  ASSERT_OK_AND_ASSIGN(client::StepReply replayed, sharded->Step(12, again.views, OptionsOf(12)));
  EXPECT_TRUE(replayed.replayed);
  int64_t last_step = 0;
  ASSERT_OK_AND_ASSIGN(client::ParameterMap now, sharded->GetParameters(&last_step));
  ASSERT_OK_AND_ASSIGN(client::ParameterMap expected, single->GetParameters());
  EXPECT_EQ(last_step, 12);
  EXPECT_EQ(now, expected);
  EXPECT_EQ(replayed.parameters, expected);

  // Attaching again with the same endpoints resumes; another order or count is refused.
  ASSERT_OK_AND_ASSIGN(auto attached, client::ShardedSession::Open(options_, shards, "model", spec));
  EXPECT_TRUE(attached->attached());
  EXPECT_EQ(attached->last_step(), 12);
  ExpectLastLr(*attached, OptionsOf(12).lr.at("muon"));
  EXPECT_THAT(client::ShardedSession::Open(options_, {shards[2], shards[1], shards[0]}, "model", spec),
              StatusIs(absl::StatusCode::kAlreadyExists, "spec.shard.endpoints"));
  EXPECT_THAT(client::ShardedSession::Open(options_, {shards[0], shards[1]}, "model", spec),
              StatusIs(absl::StatusCode::kAlreadyExists, "give the endpoints in the order"));
  EXPECT_THAT(client::ShardedSession::Open(options_, {shards[0], shards[0]}, "model", spec),
              StatusIs(absl::StatusCode::kInvalidArgument, "endpoints[1]"));
  ASSERT_OK(sharded->Close());
}

// One endpoint: the session is not sharded (no spec.shard) and its steps are whole ones.
TEST_F(ShardedSessionTest, OneDaemonStepsAsAPlainSession) {
  const v1::SessionSpec spec = ModelSpec();
  std::unique_ptr<client::ShardedSession> sharded;
  std::unique_ptr<client::Session> single;
  OpenBoth("one", spec, {endpoints_[0]}, &sharded, &single);
  ASSERT_NE(single, nullptr);
  StepBoth(spec, *sharded, *single, 1, 3);
  ASSERT_OK(sharded->Close());
}

// A shard that is down: the whole step is tried max_step_attempts times (a shard's part is not
// retried inside each try), and the error names the shard and its tries once.
TEST_F(ShardedSessionTest, AStepWithAShardDownGivesUpAfterItsTriesNamingTheShard) {
  const v1::SessionSpec spec = ModelSpec();
  options_.retry_backoff = std::chrono::milliseconds(10);
  const std::vector<std::string> shards(endpoints_.begin(), endpoints_.begin() + 3);
  ASSERT_OK_AND_ASSIGN(auto sharded, client::ShardedSession::Open(options_, shards, "down", spec));
  ASSERT_OK(sharded->UploadParameters(Tensors(spec, 0, 0.5f).views));
  ASSERT_OK(sharded->Step(1, Tensors(spec, 100, 0.3f).views, OptionsOf(1)).status());
  daemons_[1].Kill();
  const absl::StatusOr<client::StepReply> reply = sharded->Step(2, Tensors(spec, 200, 0.3f).views, OptionsOf(2));
  ASSERT_THAT(reply, StatusIs(absl::StatusCode::kUnavailable, "shard 1 (" + endpoints_[1] + ")"));
  const std::string message(reply.status().message());
  const std::string tries = "(gave up after " + std::to_string(options_.max_step_attempts) + " tries)";
  EXPECT_NE(message.find(tries), std::string::npos) << message;
  EXPECT_EQ(message.find(tries), message.rfind(tries)) << "said twice: " << message;
}

// A trainer that stopped after shard 2 committed a step and before the others did: the next Open
// commits it on the others with shard 2's decision, and every shard ends as one daemon does. What
// that step ran with comes from shard 2 (the others answered the attach for the step before).
TEST_F(ShardedSessionTest, AnOpenFinishesAStepItsTrainerLeftBetweenCommits) {
  const v1::SessionSpec spec = ModelSpec();
  const std::vector<std::string> shards(endpoints_.begin(), endpoints_.begin() + 3);
  std::unique_ptr<client::ShardedSession> sharded;
  std::unique_ptr<client::Session> single;
  OpenBoth("cut", spec, shards, &sharded, &single);
  ASSERT_NE(single, nullptr);
  StepBoth(spec, *sharded, *single, 1, 3);
  // Step 4 as the stopped trainer sent it: prepared on every shard, committed on shard 2 alone
  // with the decision the three prepares give (one daemon's norm of the same gradients).
  Tensors grads(spec, 400, 0.3f);
  ASSERT_OK_AND_ASSIGN(client::StepReply expected, single->Step(4, grads.views, OptionsOf(4)));
  const client::Placement& placement = sharded->placement();
  std::vector<std::unique_ptr<client::Client>> clients;
  std::vector<std::unique_ptr<client::Session>> parts;
  for (int k = 0; k < 3; ++k) {
    client::ClientOptions mine = options_;
    mine.endpoint = shards[k];
    ASSERT_OK_AND_ASSIGN(auto c, client::Client::Connect(mine));
    ASSERT_OK_AND_ASSIGN(auto part, c->CreateSession("cut", client::ShardSpec(spec, placement, shards, k)));
    ASSERT_TRUE(part->attached());
    std::vector<client::TensorView> mine_grads;
    for (int i : placement.ParametersOf(k)) mine_grads.push_back(grads.views[i]);
    client::StepOptions prepare = OptionsOf(4);
    prepare.phase = v1::STEP_PHASE_PREPARE;
    prepare.qk_logits.clear();
    if (k == placement.shard_of[1]) prepare.qk_logits = OptionsOf(4).qk_logits;
    ASSERT_OK(part->Step(4, mine_grads, prepare).status());
    clients.push_back(std::move(c));
    parts.push_back(std::move(part));
  }
  client::StepOptions commit;
  commit.phase = v1::STEP_PHASE_COMMIT;
  commit.decision.emplace();
  commit.decision->set_grad_norm(expected.grad_norm);
  ASSERT_OK(parts[2]->Step(4, {}, commit).status());

  ASSERT_OK_AND_ASSIGN(auto reopened, client::ShardedSession::Open(options_, shards, "cut", spec));
  EXPECT_EQ(reopened->last_step(), 4);
  ExpectLastLr(*reopened, OptionsOf(4).lr.at("muon"));
  int64_t last_step = 0;
  ASSERT_OK_AND_ASSIGN(client::ParameterMap now, reopened->GetParameters(&last_step));
  EXPECT_EQ(last_step, 4);
  EXPECT_EQ(now, expected.parameters);
  Tensors next(spec, 500, 0.3f);
  ASSERT_OK_AND_ASSIGN(client::StepReply got, reopened->Step(5, next.views, OptionsOf(5)));
  ASSERT_OK_AND_ASSIGN(client::StepReply want, single->Step(5, next.views, OptionsOf(5)));
  EXPECT_EQ(got.grad_norm, want.grad_norm);
  EXPECT_EQ(got.parameters, want.parameters);

  ASSERT_OK(reopened->Close());
}

// A shard restored to an older checkpoint (snapshot mode): the next step is refused naming the
// shards behind, as an Open would be, not by that shard's step number alone.
TEST_F(ShardedSessionTest, AStepAfterAShardWentBackNamesTheShardsBehind) {
  const v1::SessionSpec spec = ModelSpec();
  DaemonProcess shards[3];
  std::vector<std::string> endpoints;
  auto flags = [&](DaemonProcess& d) {
    return std::vector<std::string>{"--backend", "cpu", "--log-level", "warn", "--state-dir", d.dir() + "/state"};
  };
  for (DaemonProcess& d : shards) {
    std::string error;
    ASSERT_TRUE(d.Start(flags(d), &error)) << error;
    endpoints.push_back(d.endpoint());
  }
  ASSERT_OK_AND_ASSIGN(auto sharded, client::ShardedSession::Open(options_, endpoints, "back", spec));
  const Tensors initial(spec, 0, 0.5f);
  ASSERT_OK(sharded->UploadParameters(initial.views));
  for (int step = 1; step <= 5; ++step) {
    Tensors grads(spec, 100 * step, 0.3f);
    ASSERT_OK(sharded->Step(step, grads.views, OptionsOf(step)).status());
    if (step == 3) {
      ASSERT_OK_AND_ASSIGN(const int64_t checkpointed, sharded->Checkpoint());
      ASSERT_EQ(checkpointed, 3);
    }
  }
  const int port = shards[1].port();
  shards[1].Kill();  // snapshot mode: steps 4 and 5 are lost on shard 1
  std::string error;
  ASSERT_TRUE(shards[1].Start(flags(shards[1]), &error, port)) << error;
  Tensors grads(spec, 600, 0.3f);
  EXPECT_THAT(sharded->Step(6, grads.views, OptionsOf(6)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       absl::StrCat("shard 1 (", endpoints[1], ") at step 3, the others at step 5")));
}

// Shard 0 commits step 6; the commits on shards 1 and 2 are cut before they reach their daemons and
// every later try finds them unreachable, so Step() fails with step 6 applied on shard 0 only. The
// session keeps the step, and the caller's next Step(6) (another batch, other options) sends it
// with the gradients and options it was first sent with: shard 0 answers with the decision it
// applied, the others commit that decision with the gradients it was computed from. Training goes
// on as on one daemon, bit for bit; the new call's gradients were not used, its output was.
TEST_F(ShardedSessionTest, AStepCutOffInItsCommitIsSentAgainWithItsOwnGradients) {
  const v1::SessionSpec spec = ModelSpec();
  options_.transport = "grpc";  // steps through the proxies (shared memory would go around them)
  options_.retry_backoff = std::chrono::milliseconds(10);
  // Shared with the options (the fixture's, which outlive this body).
  auto warnings = std::make_shared<std::vector<std::string>>();
  options_.warn = [warnings](const std::string& line) { warnings->push_back(line); };
  CallCuttingProxy proxy1(daemons_[1].port()), proxy2(daemons_[2].port());
  const std::vector<std::string> shards = {endpoints_[0], proxy1.endpoint(), proxy2.endpoint()};
  std::unique_ptr<client::ShardedSession> sharded;
  std::unique_ptr<client::Session> single;
  OpenBoth("cut-commit", spec, shards, &sharded, &single);
  ASSERT_NE(single, nullptr);
  StepBoth(spec, *sharded, *single, 1, 5);
  EXPECT_EQ(sharded->cut_off_step(), std::nullopt);

  Tensors grads(spec, 600, 0.3f);
  proxy1.CutAfterCalls(1);  // the prepare goes through, the commit does not
  proxy2.CutAfterCalls(1);
  EXPECT_THAT(sharded->Step(6, grads.views, OptionsOf(6)), StatusIs(absl::StatusCode::kUnavailable, "shard 1 ("));
  EXPECT_GE(proxy1.cut_calls(), 1);
  EXPECT_GE(proxy2.cut_calls(), 1);
  EXPECT_EQ(sharded->cut_off_step(), 6);
  std::vector<int64_t> steps;
  for (int k = 0; k < 3; ++k) {
    client::ClientOptions direct = options_;
    direct.endpoint = endpoints_[k];
    ASSERT_OK_AND_ASSIGN(auto c, client::Client::Connect(direct));
    ASSERT_OK_AND_ASSIGN(std::vector<v1::SessionSummary> sessions, c->ListSessions());
    for (const v1::SessionSummary& s : sessions) {
      if (s.session_id() == "cut-commit") steps.push_back(s.last_step());
    }
  }
  EXPECT_EQ(steps, (std::vector<int64_t>{6, 5, 5}));
  EXPECT_TRUE(warnings->empty());

  proxy1.Heal();
  proxy2.Heal();
  // Every shard answers again, at two steps: what needs one step names the kept one.
  const absl::StatusOr<client::ParameterMap> split = sharded->GetParameters();
  EXPECT_THAT(split, StatusIs(absl::StatusCode::kFailedPrecondition, "step 6 was cut off in its commit: shard 1 ("));
  EXPECT_THAT(split, StatusIs(absl::StatusCode::kFailedPrecondition, "the next Step(6) sends it"));
  EXPECT_THAT(sharded->GetStateDigest(),
              StatusIs(absl::StatusCode::kFailedPrecondition, "step 6 was cut off in its commit: shard 1 ("));
  // Refused before any shard is asked to write one (these daemons have no --state-dir, which they
  // would have answered first).
  EXPECT_THAT(sharded->Checkpoint(),
              StatusIs(absl::StatusCode::kFailedPrecondition, "step 6 was cut off in its commit: shard 1 ("));
  ASSERT_OK_AND_ASSIGN(client::StepReply expected, single->Step(6, grads.views, OptionsOf(6)));
  Tensors next_batch(spec, 606, 0.3f);
  client::StepOptions other = OptionsOf(7);
  const v1::ParameterSpec& on_shard_1_spec = spec.parameters(sharded->placement().ParametersOf(1).front());
  const std::string on_shard_1 = on_shard_1_spec.name();
  std::vector<float> out(Numel(on_shard_1_spec));
  other.parameters_out[on_shard_1] = out;
  ASSERT_OK_AND_ASSIGN(client::StepReply resent, sharded->Step(6, next_batch.views, other));
  EXPECT_EQ(sharded->cut_off_step(), std::nullopt);
  EXPECT_EQ(resent.grad_norm, expected.grad_norm);
  EXPECT_EQ(out, expected.parameters.at(on_shard_1));
  expected.parameters.erase(on_shard_1);
  EXPECT_EQ(resent.parameters, expected.parameters);
  ASSERT_EQ(warnings->size(), 1u);
  EXPECT_NE((*warnings)[0].find("step 6 failed once some shards may have applied it"), std::string::npos)
      << (*warnings)[0];
  StepBoth(spec, *sharded, *single, 7, 8);

  // Step 9 is cut off the same way, then another trainer's attach finishes it on shards 1 and 2:
  // this one still keeps step 9, which every shard has applied. Step 10's prepares all go through,
  // which shows every shard past 9: the kept step is dropped, and step 10, cut off in its commit in
  // turn, is kept in its place and sent again with its own gradients.
  // Step `step` with `calls` let through shards 1 and 2 before their commits are cut: it fails and
  // is kept; the proxies forward again afterwards.
  auto cut_in_its_commit = [&](int step, const Tensors& sent, int calls) {
    proxy1.CutAfterCalls(calls);
    proxy2.CutAfterCalls(calls);
    EXPECT_THAT(sharded->Step(step, sent.views, OptionsOf(step)),
                StatusIs(absl::StatusCode::kUnavailable, "shard 1 ("));
    EXPECT_EQ(sharded->cut_off_step(), step);
    proxy1.Heal();
    proxy2.Heal();
  };
  Tensors grads9(spec, 900, 0.3f);
  cut_in_its_commit(9, grads9, 1);
  {
    ASSERT_OK_AND_ASSIGN(auto other_trainer, client::ShardedSession::Open(options_, shards, "cut-commit", spec));
    EXPECT_EQ(other_trainer->last_step(), 9);
  }
  ASSERT_OK(single->Step(9, grads9.views, OptionsOf(9)).status());
  // Every shard at step 9: one step to read (and this session's connections, cut by step 9's tries,
  // made again before the proxies count calls).
  int64_t at = 0;
  ASSERT_OK(sharded->GetParameters(&at).status());
  EXPECT_EQ(at, 9);
  EXPECT_EQ(sharded->cut_off_step(), 9);
  Tensors grads10(spec, 1000, 0.3f);
  // Two calls through: the daemon's offer, which a session asks again after a step answered
  // UNAVAILABLE (the daemon may have restarted), then the prepare; the commit is cut.
  cut_in_its_commit(10, grads10, 2);
  ASSERT_OK_AND_ASSIGN(client::StepReply want, single->Step(10, grads10.views, OptionsOf(10)));
  ASSERT_OK_AND_ASSIGN(client::StepReply got, sharded->Step(10, next_batch.views, OptionsOf(10)));
  EXPECT_EQ(got.grad_norm, want.grad_norm);
  EXPECT_EQ(got.parameters, want.parameters);
  ASSERT_OK(sharded->Close());
}

TEST(ShardPlacementTest, LongestFirstOntoTheLeastLoadedWithPairsTogether) {
  // The example of the Python client's test: the same rule gives the same placement.
  v1::SessionSpec spec;
  spec.add_groups()->set_name("muon");
  v1::ParameterGroup* adamw = spec.add_groups();
  adamw->set_name("adamw");
  adamw->mutable_options()->set_optimizer(v1::OPTIMIZER_ADAMW);
  AddParameter(spec, "a", {768, 768}, "muon");
  AddParameter(spec, "b", {3072, 768}, "muon");
  AddParameter(spec, "c", {768, 3072}, "muon");
  AddParameter(spec, "d", {768}, "adamw");
  AddParameter(spec, "e", {768, 768}, "muon");
  AddParameter(spec, "f", {50257, 768}, "adamw");
  v1::QkClipPair* pair = spec.add_qk_clip();
  pair->set_query("a");
  pair->set_key("e");
  pair->set_num_heads(12);
  ASSERT_OK_AND_ASSIGN(client::Placement placement, client::PlaceSpec(spec, 3));
  EXPECT_EQ(placement.shard_of, (std::vector<int>{2, 0, 1, 2, 2, 2}));
  EXPECT_EQ(client::PlacementCost(spec, 1), 3072.0 * 768 * 768);
  EXPECT_EQ(client::PlacementCost(spec, 5), 4.0 * 50257 * 768);
  EXPECT_DOUBLE_EQ(placement.Imbalance(),
                   3 * placement.loads[0] / (placement.loads[0] + placement.loads[1] + placement.loads[2]));
  EXPECT_THAT(client::PlaceSpec(spec, 0), StatusIs(absl::StatusCode::kInvalidArgument, "endpoints"));
  // Every shard's spec carries the session's labels, which each daemon compares at attach.
  (*spec.mutable_labels())["run"] = "r42";
  const std::vector<std::string> three = {"a:1", "b:2", "c:3"};
  for (int k = 0; k < 3; ++k) EXPECT_EQ(client::ShardSpec(spec, placement, three, k).labels().at("run"), "r42") << k;
}

// A ShardedSession is told how its ranks synchronize like every shard: quorum and asynchronous steps
// are refused as one daemon refuses them on a sharded spec, not run lock-step without a word.
TEST_F(ShardedSessionTest, QuorumOrAsyncStepsAreRefusedOnShards) {
  const std::vector<std::string> shards(endpoints_.begin(), endpoints_.begin() + 2);
  v1::SessionSpec spec = ModelSpec();
  spec.set_world_size(2);
  spec.mutable_sync()->set_mode(v1::SYNC_MODE_QUORUM);
  spec.mutable_sync()->set_min_ranks(1);
  EXPECT_THAT(
      client::ShardedSession::Open(options_, shards, "quorum", spec),
      StatusIs(absl::StatusCode::kInvalidArgument, "spec.sync.mode: quorum steps are not available on a sharded"));
  spec.mutable_sync()->set_mode(v1::SYNC_MODE_ASYNC);
  spec.mutable_sync()->clear_min_ranks();
  EXPECT_THAT(client::ShardedSession::Open(options_, shards, "async", spec),
              StatusIs(absl::StatusCode::kInvalidArgument, "asynchronous steps are not available on a sharded"));
}

// Checkpoint() asks each shard's step before any shard writes one; a shard that no longer holds the
// session leaves that to its own checkpoint call, which the daemon refuses with its reason.
TEST_F(ShardedSessionTest, ACheckpointWithAShardThatLostTheSessionKeepsTheDaemonsReason) {
  const v1::SessionSpec spec = ModelSpec();
  const std::vector<std::string> shards(endpoints_.begin(), endpoints_.begin() + 3);
  ASSERT_OK_AND_ASSIGN(auto sharded, client::ShardedSession::Open(options_, shards, "lost", spec));
  const Tensors initial(spec, 0, 0.5f);
  ASSERT_OK(sharded->UploadParameters(initial.views));
  client::ClientOptions first = options_;
  first.endpoint = shards[0];
  ASSERT_OK_AND_ASSIGN(auto first_client, client::Client::Connect(first));
  ASSERT_OK(first_client->CloseSession("lost"));
  const absl::StatusOr<int64_t> checkpointed = sharded->Checkpoint();
  EXPECT_THAT(checkpointed, StatusIs(absl::StatusCode::kNotFound, "shard 0 ("));
  EXPECT_EQ(client::ReasonOf(checkpointed.status()), v1::SESSION_NOT_FOUND);
}

TEST_F(ShardedSessionTest, ARefusedOpenRollsBackTheSessionsItCreated) {
  const v1::SessionSpec spec = ModelSpec();
  const std::vector<std::string> shards(endpoints_.begin(), endpoints_.begin() + 3);
  // The middle daemon holds an unsharded session "model"; the first holds another session.
  client::ClientOptions one = options_;
  one.endpoint = shards[1];
  ASSERT_OK_AND_ASSIGN(auto plain_client, client::Client::Connect(one));
  ASSERT_OK(plain_client->CreateSession("model", spec).status());
  one.endpoint = shards[0];
  ASSERT_OK_AND_ASSIGN(auto first_client, client::Client::Connect(one));
  ASSERT_OK(first_client->CreateSession("kept", spec).status());

  EXPECT_THAT(client::ShardedSession::Open(options_, shards, "model", spec),
              StatusIs(absl::StatusCode::kAlreadyExists, "spec.shard"));
  auto ids = [&](const std::string& endpoint) {
    client::ClientOptions o = options_;
    o.endpoint = endpoint;
    std::vector<std::string> out;
    auto c = client::Client::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status();
    if (!c.ok()) return out;
    auto sessions = (*c)->ListSessions();
    EXPECT_TRUE(sessions.ok()) << sessions.status();
    if (sessions.ok()) {
      for (const auto& s : *sessions) out.push_back(s.session_id());
    }
    return out;
  };
  EXPECT_THAT(ids(shards[0]), ::testing::ElementsAre("kept"));
  EXPECT_THAT(ids(shards[1]), ::testing::ElementsAre("model"));
  EXPECT_THAT(ids(shards[2]), ::testing::IsEmpty());
}

// Each daemon sees only its own shard's pairs; the placement gives the whole session's count, so a
// sharded session that names no pair refuses QK-clip's threshold on every shard, as one daemon does,
// and nothing is left behind. With the pair named the same spec opens.
TEST_F(ShardedSessionTest, QkClipOptionsWithoutAnyPairAreRefusedAsOneDaemonRefusesThem) {
  v1::SessionSpec spec = ModelSpec();
  spec.clear_qk_clip();
  const std::vector<std::string> shards(endpoints_.begin(), endpoints_.begin() + 3);
  EXPECT_THAT(client::ShardedSession::Open(options_, shards, "no-pairs", spec),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "spec.groups[0].options.qk_clip_threshold: only QK-clip reads it, and this session names no "
                       "QK-clip pair"));
  client::ClientOptions one = options_;
  one.endpoint = endpoints_[3];
  ASSERT_OK_AND_ASSIGN(auto single, client::Client::Connect(one));
  EXPECT_THAT(single->CreateSession("no-pairs", spec).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec.groups[0].options.qk_clip_threshold"));
  for (const std::string& endpoint : shards) {
    one.endpoint = endpoint;
    ASSERT_OK_AND_ASSIGN(auto c, client::Client::Connect(one));
    ASSERT_OK_AND_ASSIGN(auto sessions, c->ListSessions());
    EXPECT_TRUE(sessions.empty()) << endpoint;
  }
  ASSERT_OK_AND_ASSIGN(auto opened, client::ShardedSession::Open(options_, shards, "no-pairs", ModelSpec()));
  EXPECT_FALSE(opened->attached());
}

// An output buffer that does not fit is refused before any shard prepares, so no commit applies the
// step on some shards while another refuses it: the shards stay at one step and the step goes on.
TEST_F(ShardedSessionTest, AParametersOutThatDoesNotFitIsRefusedBeforeAnyShardApplies) {
  const v1::SessionSpec spec = ModelSpec();
  const std::vector<std::string> shards(endpoints_.begin(), endpoints_.begin() + 2);
  ASSERT_OK_AND_ASSIGN(auto sharded, client::ShardedSession::Open(options_, shards, "outputs", spec));
  ASSERT_OK(sharded->UploadParameters(Tensors(spec, 0, 0.5f).views));
  // A parameter of the last shard, whose commit the client would otherwise make after the first's.
  int on_last = -1;
  for (int i = 0; i < spec.parameters_size(); ++i) {
    if (sharded->placement().shard_of[i] == 1) on_last = i;
  }
  ASSERT_GE(on_last, 0);
  const std::string name = spec.parameters(on_last).name();
  std::vector<float> short_out(Numel(spec.parameters(on_last)) - 1);
  client::StepOptions options = OptionsOf(1);
  options.parameters_out[name] = short_out;
  const Tensors grads(spec, 1, 0.1f);
  EXPECT_THAT(sharded->Step(1, grads.views, options),
              StatusIs(absl::StatusCode::kInvalidArgument, absl::StrCat("parameters_out['", name, "']")));
  int64_t last = -1;
  ASSERT_OK(sharded->GetParameters(&last).status());
  EXPECT_EQ(last, 0);
  std::vector<float> out(Numel(spec.parameters(on_last)));
  options.parameters_out[name] = out;
  ASSERT_OK_AND_ASSIGN(client::StepReply reply, sharded->Step(1, grads.views, options));
  EXPECT_EQ(reply.step, 1);
  EXPECT_FALSE(reply.replayed);
  ASSERT_OK_AND_ASSIGN(client::ParameterMap now, sharded->GetParameters(&last));
  EXPECT_EQ(last, 1);
  EXPECT_EQ(now.at(name), out);
}

// Sessions of two ranks whose missing rank each daemon gives up on after 5 s: far longer than two
// ranks sent together take to meet, even on a loaded machine.

// With several ranks a step is kept as soon as its prepare went out (a shard holds the rank's part,
// and another rank's commit could apply it). A later step that fails while one is kept keeps nothing
// of its own: rank 0's step 2 is aborted on both shards (rank 1 never sent it), its caller then
// tries step 3, which the shards (at step 1) refuse; step 2 stays kept, and rank 0's next Step(2),
// with another batch, sends it with its own gradients. Both ranks then train on as on one daemon.
TEST_F(ShardedRanksTest, ALaterStepThatFailsDoesNotReplaceTheStepKept) {
  v1::SessionSpec spec = ModelSpec();
  spec.set_world_size(2);
  spec.clear_qk_clip();  // each rank's logits are not this test's subject
  spec.mutable_groups(0)->mutable_options()->clear_qk_clip_threshold();
  const std::vector<std::string> shards(endpoints_.begin(), endpoints_.begin() + 2);
  std::unique_ptr<client::ShardedSession> rank0;
  std::unique_ptr<client::Session> one0;
  OpenBoth("kept-with-ranks", spec, shards, &rank0, &one0);
  ASSERT_NE(one0, nullptr);
  ASSERT_OK_AND_ASSIGN(auto rank1, client::ShardedSession::Open(options_, shards, "kept-with-ranks", spec));
  ASSERT_OK_AND_ASSIGN(auto one1, single_client_->CreateSession("kept-with-ranks", spec));
  auto options_of = [](int step, int rank) {
    client::StepOptions options = OptionsOf(step);
    options.qk_logits.clear();
    options.rank = rank;
    return options;
  };
  // Step `step` by both ranks at once, sharded with rank 0 sending `sent0`, and on the one daemon
  // with `grads0`: they answer alike, bit for bit.
  // (Each pair of ranks goes together, so neither waits on the other pair.)
  auto step_both = [&](int step, const Tensors& sent0, const Tensors& grads0, const Tensors& grads1) {
    auto sharded1 =
        std::async(std::launch::async, [&] { return rank1->Step(step, grads1.views, options_of(step, 1)); });
    absl::StatusOr<client::StepReply> got = rank0->Step(step, sent0.views, options_of(step, 0));
    ASSERT_OK(sharded1.get().status());
    auto single1 = std::async(std::launch::async, [&] { return one1->Step(step, grads1.views, options_of(step, 1)); });
    absl::StatusOr<client::StepReply> want = one0->Step(step, grads0.views, options_of(step, 0));
    ASSERT_OK(single1.get().status());
    ASSERT_OK(got.status());
    ASSERT_OK(want.status());
    EXPECT_EQ(got->grad_norm, want->grad_norm) << "step " << step;
    EXPECT_EQ(got->parameters, want->parameters) << "step " << step;
  };
  const Tensors a1(spec, 100, 0.3f), b1(spec, 150, 0.3f);
  step_both(1, a1, a1, b1);

  const Tensors a2(spec, 200, 0.3f), b2(spec, 250, 0.3f);
  EXPECT_THAT(rank0->Step(2, a2.views, options_of(2, 0)), StatusIs(absl::StatusCode::kAborted, "did not arrive"));
  EXPECT_EQ(rank0->cut_off_step(), 2);
  const Tensors a3(spec, 300, 0.3f);
  EXPECT_THAT(rank0->Step(3, a3.views, options_of(3, 0)), StatusIs(absl::StatusCode::kFailedPrecondition, "step"));
  EXPECT_EQ(rank0->cut_off_step(), 2);

  const Tensors another_batch(spec, 700, 0.3f);
  step_both(2, another_batch, a2, b2);
  EXPECT_EQ(rank0->cut_off_step(), std::nullopt);
  const Tensors b3(spec, 350, 0.3f);
  step_both(3, a3, a3, b3);
  ASSERT_OK(rank0->Close());
}

}  // namespace
}  // namespace muond::testing
