// The crash test: a model trains through the daemon for hundreds of steps while another thread kills
// the daemon with SIGKILL at random moments; after each kill the daemon is restarted on the same
// port and state directory, and the client library reconnects and retries. In journal mode the final
// parameters must be bit-identical to an uninterrupted run from the same start.
#include <atomic>
#include <cmath>
#include <mutex>
#include <random>
#include <thread>

#include "gmock/gmock.h"
#include "tests/integration/daemon_fixture.h"
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
// returns whether to try the step again.
client::ParameterMap Train(client::Session& session, const std::function<bool(const absl::Status&)>& on_failure) {
  client::ParameterMap params = {{"w", DaemonTest::Initial("w", 32)}, {"b", DaemonTest::Initial("b", 4)}};
  std::vector<float> w, b;
  for (int step = 1; step <= kSteps; ++step) {
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

TEST(CrashTest, RandomKill9sLeaveTheRunBitIdenticalToAnUninterruptedOne) {
  DaemonProcess daemon;
  const std::vector<std::string> flags = {"--backend", "cpu", "--durability", "journal", "--state-dir",
                                          daemon.dir() + "/state"};
  std::string error;
  ASSERT_TRUE(daemon.Start(flags, &error)) << error;
  const int port = daemon.port();
  client::ClientOptions options;
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
  std::thread killer([&] {
    std::mt19937 rng(20261122);
    std::uniform_int_distribution<int> pause_ms(40, 250);
    while (!done && kills < 6) {
      std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms(rng)));
      std::lock_guard<std::mutex> lock(mu);
      if (done || !daemon.running()) continue;
      daemon.Kill();
      ++kills;
    }
  });
  int restarts = 0;
  const client::ParameterMap crashed = Train(*session, [&](const absl::Status& status) {
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
  });
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

}  // namespace
}  // namespace muond::testing
