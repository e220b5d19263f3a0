// The state digest through the C++ client against real daemons (Session::GetStateDigest,
// ShardedSession::GetStateDigest): equal for equal states, different after one more step, the same
// after a kill -9 and a restart from the journal, NOT_FOUND for an unknown session; a sharded
// session's digest is its shards' combined by the documented rule, the same rule as the Python
// client's (the combination of two fixed digests is pinned to the value hashlib gives).
#include "client/state_digest.h"

#include <cmath>

#include "client/sharded_session.h"
#include "gmock/gmock.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/testing/status_matchers.h"

namespace muond::testing {
namespace {

using StateDigestTest = DaemonTest;

std::unique_ptr<client::Client> ConnectTo(const DaemonProcess& daemon) {
  client::ClientOptions options = TestClientOptions();
  options.endpoint = daemon.endpoint();
  options.retry_backoff = std::chrono::milliseconds(20);
  auto client = client::Client::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? std::move(*client) : nullptr;
}

// Gradients of step `step` for the small spec's tensors (deterministic, different per step).
std::vector<float> GradientOf(int step, size_t count) {
  std::vector<float> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = std::cos(0.7f * i + 1.3f * step);
  return v;
}

// The small spec's tensors ("w" [8, 4], "b" [4]) as views of `w` and `b`.
std::vector<client::TensorView> Views(const std::vector<float>& w, const std::vector<float>& b) {
  return {{"w", {8, 4}, w}, {"b", {4}, b}};
}

TEST_F(StateDigestTest, EqualForTheSameStepsAndChangedByOneMore) {
  auto a = NewSession("digest-a");
  auto b = NewSession("digest-b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ASSERT_OK_AND_ASSIGN(client::StateDigest initial, a->GetStateDigest());
  EXPECT_EQ(initial.step, 0);
  for (int step = 1; step <= 3; ++step) {
    ASSERT_OK(a->Step(step, Gradients(step)).status());
    ASSERT_OK(b->Step(step, Gradients(step)).status());
  }
  ASSERT_OK_AND_ASSIGN(client::StateDigest da, a->GetStateDigest());
  ASSERT_OK_AND_ASSIGN(client::StateDigest db, b->GetStateDigest());
  EXPECT_EQ(da.step, 3);
  EXPECT_EQ(da.algorithm, "sha256");
  EXPECT_EQ(da.format, "muond-state-v1");
  EXPECT_EQ(da.digest.size(), 64u);
  EXPECT_EQ(da.digest, db.digest);
  EXPECT_NE(da.digest, initial.digest);
  // w: master and Muon's momentum; b: master and AdamW's two moments; all fp32.
  EXPECT_EQ(da.num_tensors, 5);
  EXPECT_EQ(da.num_bytes, 4 * (32 + 32 + 4 + 4 + 4));
  ASSERT_OK(b->Step(4, Gradients(4)).status());
  ASSERT_OK_AND_ASSIGN(client::StateDigest after, b->GetStateDigest());
  EXPECT_EQ(after.step, 4);
  EXPECT_NE(after.digest, da.digest);
  ASSERT_OK(a->Close());
  ASSERT_OK(b->Close());
  EXPECT_THAT(a->GetStateDigest(), StatusIs(absl::StatusCode::kNotFound, "digest-a"));
}

TEST(StateDigestRestartTest, AKill9AndARestartFromTheJournalKeepTheDigest) {
  DaemonProcess daemon;
  std::string error;
  const std::vector<std::string> flags = {"--backend",    "cpu",    "--state-dir", daemon.dir() + "/state",
                                          "--durability", "journal"};
  ASSERT_TRUE(daemon.Start(flags, &error)) << error;
  client::StateDigest live;
  {
    auto client = ConnectTo(daemon);
    ASSERT_NE(client, nullptr);
    ASSERT_OK_AND_ASSIGN(auto session, client->CreateSession("resumed", DaemonTest::SmallSpec()));
    const std::vector<float> w = DaemonTest::Initial("w", 32), b = DaemonTest::Initial("b", 4);
    ASSERT_OK(session->UploadParameters(Views(w, b)));
    for (int step = 1; step <= 3; ++step) {
      const std::vector<float> gw = GradientOf(step, 32), gb = GradientOf(step + 7, 4);
      ASSERT_OK(session->Step(step, Views(gw, gb)).status());
    }
    ASSERT_OK_AND_ASSIGN(live, session->GetStateDigest());
  }
  const int port = daemon.port();
  daemon.Kill();
  ASSERT_TRUE(daemon.Start(flags, &error, port)) << error;
  auto client = ConnectTo(daemon);
  ASSERT_NE(client, nullptr);
  ASSERT_OK_AND_ASSIGN(auto session, client->CreateSession("resumed", DaemonTest::SmallSpec()));
  EXPECT_TRUE(session->attached());
  ASSERT_OK_AND_ASSIGN(client::StateDigest restored, session->GetStateDigest());
  EXPECT_EQ(restored.step, 3);
  EXPECT_EQ(restored.digest, live.digest);
  EXPECT_EQ(restored.num_bytes, live.num_bytes);
}

TEST(StateDigestShardTest, ShardsCombineInOrderByTheDocumentedRule) {
  DaemonProcess daemons[2];
  std::vector<std::string> endpoints;
  for (DaemonProcess& daemon : daemons) {
    std::string error;
    ASSERT_TRUE(daemon.Start({"--backend", "cpu", "--log-level", "warn"}, &error)) << error;
    endpoints.push_back(daemon.endpoint());
  }
  ASSERT_OK_AND_ASSIGN(auto sharded,
                       client::ShardedSession::Open(TestClientOptions(), endpoints, "model", DaemonTest::SmallSpec()));
  const std::vector<float> w = DaemonTest::Initial("w", 32), b = DaemonTest::Initial("b", 4);
  ASSERT_OK(sharded->UploadParameters(Views(w, b)));
  const std::vector<float> gw = GradientOf(1, 32), gb = GradientOf(8, 4);
  ASSERT_OK(sharded->Step(1, Views(gw, gb)).status());
  ASSERT_OK_AND_ASSIGN(client::StateDigest combined, sharded->GetStateDigest());

  std::vector<client::StateDigest> shards;
  for (DaemonProcess& daemon : daemons) {
    auto client = ConnectTo(daemon);
    ASSERT_NE(client, nullptr);
    v1::GetStateDigestRequest request;
    request.set_session_id("model");
    v1::StateDigest answer;
    grpc::ClientContext context;
    client->PrepareContext(context);
    ASSERT_TRUE(client->stub().GetStateDigest(&context, request, &answer).ok());
    shards.push_back(client::FromProto(answer));
  }
  ASSERT_OK_AND_ASSIGN(client::StateDigest expected, client::CombineShardDigests(shards));
  EXPECT_EQ(combined.digest, expected.digest);
  EXPECT_EQ(combined.format, "muond-sharded-state-v1");
  EXPECT_EQ(combined.step, 1);
  EXPECT_THAT(combined.shards, ::testing::ElementsAre(shards[0].digest, shards[1].digest));
  EXPECT_EQ(combined.num_tensors, shards[0].num_tensors + shards[1].num_tensors);
  EXPECT_NE(shards[0].digest, shards[1].digest);

  ASSERT_OK(sharded->Step(2, Views(gw, gb)).status());
  ASSERT_OK_AND_ASSIGN(client::StateDigest later, sharded->GetStateDigest());
  EXPECT_NE(later.digest, combined.digest);
  ASSERT_OK(sharded->Close());
}

TEST(StateDigestRuleTest, TheCombinationIsTheOneThePythonClientComputes) {
  client::StateDigest zeros{.step = 7, .algorithm = "sha256", .digest = std::string(64, '0')};
  client::StateDigest fs{.step = 7, .algorithm = "sha256", .digest = std::string(64, 'f')};
  ASSERT_OK_AND_ASSIGN(client::StateDigest combined, client::CombineShardDigests({zeros, fs}));
  // hashlib.sha256(("muond-sharded-state-v1\n" + "0" * 64 + "\n" + "f" * 64 + "\n").encode())
  EXPECT_EQ(combined.digest, "90adfbd523dc4391a55724306ca620d5a04d11b43d5086dd852ffd575a625dd8");
  fs.step = 8;
  EXPECT_THAT(client::CombineShardDigests({zeros, fs}),
              StatusIs(absl::StatusCode::kFailedPrecondition, "shard 1 at step 8"));
  ASSERT_OK_AND_ASSIGN(client::StateDigest alone, client::CombineShardDigests({zeros}));
  EXPECT_EQ(alone.digest, zeros.digest);
}

}  // namespace
}  // namespace muond::testing
