// The crash test: a model trains through the daemon for hundreds of steps while another thread kills
// the daemon with SIGKILL at random moments; after each kill the daemon is restarted on the same
// port and state directory, and the client library reconnects and retries. In journal mode the final
// parameters must be bit-identical to an uninterrupted run from the same start.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>
#include <random>
#include <thread>

#include "client/streamed_step.h"
#include "gmock/gmock.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/one_parameter_spec.h"
#include "tests/testing/status_matchers.h"

namespace muond::testing {
namespace {

constexpr int kSteps = 300;

// Gradients depend on the parameters the daemon returned, so a lost or doubled step shows.
std::vector<client::TensorView> Gradients(const client::ParameterMap& params, int step, std::vector<float>* w,
                                          std::vector<float>* b) {
  w->resize(32);
  b->resize(4);
  for (int i = 0; i < 32; ++i) (*w)[i] = params.at("w")[i] - std::sin(0.3f * i) + 0.2f * std::cos(0.9f * step + i);
  for (int i = 0; i < 4; ++i) (*b)[i] = params.at("b")[i] - 0.5f + 0.1f * std::sin(1.7f * step + i);
  return {{"w", {8, 4}, *w}, {"b", {4}, *b}};
}

// Trains kSteps steps; `on_failure` is called when a step fails even after the client's retries and
// returns whether to try the step again. `progress` (when given) holds the step being sent.
client::ParameterMap Train(client::Session& session, const std::function<bool(const absl::Status&)>& on_failure,
                           std::atomic<int>* progress = nullptr) {
  client::ParameterMap params = {{"w", DaemonTest::Initial("w", 32)}, {"b", DaemonTest::Initial("b", 4)}};
  std::vector<float> w, b;
  for (int step = 1; step <= kSteps; ++step) {
    if (progress != nullptr) progress->store(step);
    while (true) {
      absl::StatusOr<client::StepReply> reply = session.Step(step, Gradients(params, step, &w, &b));
      if (reply.ok()) {
        params = std::move(reply->parameters);
        break;
      }
      if (!on_failure(reply.status())) return {};
    }
  }
  return params;
}

std::unique_ptr<client::Session> Upload(client::Client& client, const std::string& id) {
  auto session = client.CreateSession(id, DaemonTest::SmallSpec());
  if (!session.ok()) return nullptr;
  const std::vector<float> w = DaemonTest::Initial("w", 32), b = DaemonTest::Initial("b", 4);
  const std::vector<client::TensorView> initial = {{"w", {8, 4}, w}, {"b", {4}, b}};
  if (!(*session)->UploadParameters(initial).ok()) return nullptr;
  return std::move(*session);
}

// A daemon that journals every step into its own state folder (restarted with the same flags).
std::vector<std::string> JournalFlags(DaemonProcess& daemon) {
  return {"--backend", "cpu", "--durability", "journal", "--state-dir", daemon.dir() + "/state"};
}

TEST(CrashTest, RandomKill9sLeaveTheRunBitIdenticalToAnUninterruptedOne) {
  DaemonProcess daemon;
  const std::vector<std::string> flags = JournalFlags(daemon);
  std::string error;
  ASSERT_TRUE(daemon.Start(flags, &error)) << error;
  const int port = daemon.port();
  client::ClientOptions options = testing::TestClientOptions();
  options.endpoint = daemon.endpoint();
  options.max_step_attempts = 3;
  options.retry_backoff = std::chrono::milliseconds(10);
  options.rpc_timeout = std::chrono::seconds(20);
  ASSERT_OK_AND_ASSIGN(auto client, client::Client::Connect(options));

  auto reference_session = Upload(*client, "uninterrupted");
  ASSERT_NE(reference_session, nullptr);
  const client::ParameterMap reference = Train(*reference_session, [](const absl::Status& s) {
    ADD_FAILURE() << "the uninterrupted run failed: " << s;
    return false;
  });
  ASSERT_FALSE(reference.empty());

  auto session = Upload(*client, "crashed");
  ASSERT_NE(session, nullptr);
  std::mutex mu;  // guards the daemon process against the killer and the restarts racing
  std::atomic<bool> done{false};
  std::atomic<int> kills{0};
  std::atomic<int> progress{0};
  // Six kills at random steps, each up to 3 ms after the step was sent, so that they land before,
  // inside and after the daemon applies it. Tied to the training's progress rather than to wall
  // time, so that a fast machine and a loaded one get the same number of kills.
  std::mt19937 rng(20261122);
  std::vector<int> kill_steps;
  std::uniform_int_distribution<int> any_step(2, kSteps - 10);
  while (kill_steps.size() < 6) {
    const int step = any_step(rng);
    if (std::find(kill_steps.begin(), kill_steps.end(), step) == kill_steps.end()) kill_steps.push_back(step);
  }
  std::sort(kill_steps.begin(), kill_steps.end());
  std::thread killer([&, rng]() mutable {
    std::uniform_int_distribution<int> delay_us(0, 3000);
    for (const int step : kill_steps) {
      while (!done && progress.load() < step) std::this_thread::sleep_for(std::chrono::microseconds(200));
      if (done) return;
      std::this_thread::sleep_for(std::chrono::microseconds(delay_us(rng)));
      std::lock_guard<std::mutex> lock(mu);
      if (done || !daemon.running()) continue;
      daemon.Kill();
      ++kills;
    }
  });
  int restarts = 0;
  auto restart_if_killed = [&](const absl::Status& status) {
    if (status.code() != absl::StatusCode::kUnavailable && status.code() != absl::StatusCode::kDeadlineExceeded) {
      ADD_FAILURE() << "unexpected failure: " << status;
      return false;
    }
    std::lock_guard<std::mutex> lock(mu);
    if (!daemon.running()) {
      std::string restart_error;
      if (!daemon.Start(flags, &restart_error, port)) {
        ADD_FAILURE() << "restart failed: " << restart_error;
        return false;
      }
      ++restarts;
    }
    return true;
  };
  const client::ParameterMap crashed = Train(*session, restart_if_killed, &progress);
  done = true;
  killer.join();
  ASSERT_FALSE(crashed.empty());
  EXPECT_GE(kills.load(), 3) << "the daemon should have been killed several times during the run";
  EXPECT_EQ(crashed, reference) << "after " << kills << " kills and " << restarts << " restarts";
  ASSERT_OK_AND_ASSIGN(auto attached, client->CreateSession("crashed", DaemonTest::SmallSpec()));
  EXPECT_EQ(attached->last_step(), kSteps);
  RecordProperty("kills", kills.load());
  RecordProperty("restarts", restarts);
}

// After a restart the client's own retries find the new daemon: the connection attempt gRPC makes
// while the client waits between tries is noticed at once, not when gRPC's backup poller next runs
// (every 5 s), which would be after the client has given up. The longer the client kept failing
// while the daemon was down (one, two, then three steps: over 4 s), the longer its channel waits
// between attempts, up to 2 s, past the retries' pauses: each pause asks for an attempt now.
TEST(CrashTest, AStepRightAfterARestartSucceedsWithinTheClientsRetries) {
  DaemonProcess daemon;
  const std::vector<std::string> flags = JournalFlags(daemon);
  std::string error;
  ASSERT_TRUE(daemon.Start(flags, &error)) << error;
  const int port = daemon.port();
  client::ClientOptions options = testing::TestClientOptions();
  options.endpoint = daemon.endpoint();
  options.retry_backoff = std::chrono::milliseconds(200);  // 4 tries within 1.4 s
  ASSERT_OK_AND_ASSIGN(auto client, client::Client::Connect(options));
  auto session = Upload(*client, "restarted");
  ASSERT_NE(session, nullptr);
  std::vector<float> w, b;
  const client::ParameterMap initial = {{"w", DaemonTest::Initial("w", 32)}, {"b", DaemonTest::Initial("b", 4)}};
  ASSERT_OK_AND_ASSIGN(client::StepReply last, session->Step(1, Gradients(initial, 1, &w, &b)));
  for (int restart = 1; restart <= 3; ++restart) {
    daemon.Kill();
    const int64_t step = restart + 1;
    // While the daemon is down the step fails after the client's tries, and the channel backs off.
    const std::string gave_up = "(gave up after " + std::to_string(options.max_step_attempts) + " tries)";
    for (int call = 0; call < restart; ++call) {
      EXPECT_THAT(session->Step(step, Gradients(last.parameters, step, &w, &b)),
                  StatusIs(absl::StatusCode::kUnavailable, gave_up));
    }
    ASSERT_TRUE(daemon.Start(flags, &error, port)) << error;
    absl::StatusOr<client::StepReply> reply = session->Step(step, Gradients(last.parameters, step, &w, &b));
    ASSERT_TRUE(reply.ok()) << "after restart " << restart << ": " << reply.status();
    EXPECT_TRUE(reply->applied);
    EXPECT_GE(reply->attempts, 2) << "the first try cannot have reached the new daemon";
    last = *std::move(reply);
  }
  // Closing is retried too; a session that is not there is NOT_FOUND when the first try says so.
  daemon.Kill();
  EXPECT_THAT(session->Close(), StatusIs(absl::StatusCode::kUnavailable,
                                         "(gave up after " + std::to_string(options.max_step_attempts) + " tries)"));
  ASSERT_TRUE(daemon.Start(flags, &error, port)) << error;
  EXPECT_OK(session->Close());
  EXPECT_THAT(session->Close(), StatusIs(absl::StatusCode::kNotFound, "restarted"));
}

// A daemon restarted with a smaller --max-chunk-bytes than the client fitted its chunks to refuses
// them (CHUNK_TOO_LARGE): the client asks the limit again and sends the same step in smaller chunks,
// streamed (the try is made again whole) and plain alike, and the steps are applied once each, as in a
// session that never had larger chunks.
TEST(CrashTest, ADaemonRestartedWithASmallerChunkLimitGetsSmallerChunks) {
  DaemonProcess daemon;
  std::vector<std::string> flags = JournalFlags(daemon);
  std::string error;
  ASSERT_TRUE(daemon.Start(flags, &error)) << error;
  const int port = daemon.port();
  client::ClientOptions options = testing::TestClientOptions();
  options.endpoint = daemon.endpoint();
  options.transport = "grpc";  // the transport that sends chunks
  ASSERT_OK_AND_ASSIGN(auto client, client::Client::Connect(options));
  const v1::SessionSpec spec = OneParameterSpec({64, 64}, v1::OPTIMIZER_ADAMW);  // 16 KiB of fp32
  const std::vector<float> initial = DaemonTest::Initial("w", 64 * 64);
  auto views = [](const std::vector<float>& values) {
    return std::vector<client::TensorView>{{"w", {64, 64}, values}};
  };
  auto open = [&](const std::string& id) -> std::unique_ptr<client::Session> {
    auto session = client->CreateSession(id, spec);
    if (!session.ok() || !(*session)->UploadParameters(views(initial)).ok()) return nullptr;
    return std::move(*session);
  };
  auto gradient = [](int step) {
    std::vector<float> g(64 * 64);
    for (size_t i = 0; i < g.size(); ++i) g[i] = std::sin(0.01f * static_cast<float>(i) + 0.7f * step);
    return g;
  };
  std::unique_ptr<client::Session> session = open("shrinking-chunks");
  ASSERT_NE(session, nullptr);
  ASSERT_EQ(client->chunk_bytes(), options.chunk_bytes);
  std::vector<float> g = gradient(1);
  ASSERT_OK(session->Step(1, views(g)).status());

  // Restarted taking 8 KiB chunks: a streamed step, whose stream carried 16 KiB ones.
  ASSERT_EQ(daemon.Stop(), 0);
  flags.push_back("--max-chunk-bytes=8192");
  ASSERT_TRUE(daemon.Start(flags, &error, port)) << error;
  ASSERT_OK(client->GetServerInfo().status());  // the channel on the new daemon before the measured call
  g = gradient(2);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::StreamedStep> streamed, session->BeginStreamedStep(2, {}));
  const absl::Status added = streamed->Add({"w", {64, 64}, g});  // refused here or at Finish
  absl::StatusOr<client::StepReply> reply = streamed->Finish();
  ASSERT_TRUE(reply.ok()) << reply.status() << " (Add: " << added << ")";
  EXPECT_TRUE(reply->applied);
  EXPECT_EQ(client->chunk_bytes(), 8192u);

  // Restarted taking 2 KiB chunks: an ordinary step.
  ASSERT_EQ(daemon.Stop(), 0);
  flags.back() = "--max-chunk-bytes=2048";
  ASSERT_TRUE(daemon.Start(flags, &error, port)) << error;
  ASSERT_OK(client->GetServerInfo().status());
  g = gradient(3);
  ASSERT_OK_AND_ASSIGN(reply, session->Step(3, views(g)));
  EXPECT_TRUE(reply->applied);
  EXPECT_EQ(reply->attempts, 1) << "a try refused for its chunks' size is no try";
  EXPECT_EQ(client->chunk_bytes(), 2048u);

  // Each step once: a session stepped in 2 KiB chunks throughout ends with the same parameters.
  std::unique_ptr<client::Session> twin = open("small-chunks-throughout");
  ASSERT_NE(twin, nullptr);
  for (int step = 1; step <= 3; ++step) {
    g = gradient(step);
    ASSERT_OK(twin->Step(step, views(g)).status());
  }
  ASSERT_OK_AND_ASSIGN(client::ParameterMap got, session->GetParameters());
  ASSERT_OK_AND_ASSIGN(client::ParameterMap want, twin->GetParameters());
  EXPECT_EQ(got, want);
}

}  // namespace
}  // namespace muond::testing
