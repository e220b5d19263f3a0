// Durability through the real daemon: checkpoints and restore, the two durability modes across
// kill -9, refusal of damaged files, and a training run whose daemon is killed at random moments
// ending bit-identical to an uninterrupted run.
#include <sys/stat.h>
#include <sys/wait.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/metrics_scrape.h"
#include "tests/testing/status_matchers.h"

namespace muond::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

std::string ReadWholeFileForTest(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void WriteFileForTest(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << contents;
}

// A daemon with a state directory, restartable on the same port with the same folder.
class DurableDaemon {
 public:
  explicit DurableDaemon(std::vector<std::string> flags) : flags_(std::move(flags)) {}

  bool Start(std::string* error) {
    flags_.insert(flags_.end(), {"--backend", "cpu", "--state-dir", state_dir()});
    return Restart(error);
  }
  bool Restart(std::string* error) {
    if (!process_.Start(flags_, error, port_)) return false;
    port_ = process_.port();
    return true;
  }
  std::string state_dir() { return process_.dir() + "/state"; }
  DaemonProcess& process() { return process_; }

  std::unique_ptr<client::Client> Connect(int attempts = 6) {
    client::ClientOptions options = testing::TestClientOptions();
    options.endpoint = process_.endpoint();
    options.max_step_attempts = attempts;
    options.retry_backoff = std::chrono::milliseconds(20);
    options.connect_timeout = std::chrono::seconds(5);
    auto client = client::Client::Connect(options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? std::move(*client) : nullptr;
  }

 private:
  std::vector<std::string> flags_;
  DaemonProcess process_;
  int port_ = 0;
};

// A small model trained by a rule that depends on the parameters the daemon returns, so a lost or
// doubled step changes everything after it.
struct Trainer {
  client::ParameterMap params;
  std::vector<float> w_grad, b_grad;

  std::vector<client::TensorView> Gradients(int step) {
    w_grad.resize(32);
    b_grad.resize(4);
    for (int i = 0; i < 32; ++i) w_grad[i] = params["w"][i] - std::sin(0.3f * i) + 0.1f * std::cos(0.9f * step + i);
    for (int i = 0; i < 4; ++i) b_grad[i] = params["b"][i] - 0.5f + 0.05f * std::sin(step * 1.7f + i);
    return {{"w", {8, 4}, w_grad}, {"b", {4}, b_grad}};
  }
};

std::unique_ptr<client::Session> UploadedSession(client::Client& client, const std::string& id, Trainer* trainer) {
  auto session = client.CreateSession(id, DaemonTest::SmallSpec());
  EXPECT_TRUE(session.ok()) << session.status();
  if (!session.ok()) return nullptr;
  trainer->params["w"] = DaemonTest::Initial("w", 32);
  trainer->params["b"] = DaemonTest::Initial("b", 4);
  const std::vector<client::TensorView> initial = {{"w", {8, 4}, trainer->params["w"]},
                                                   {"b", {4}, trainer->params["b"]}};
  EXPECT_OK((*session)->UploadParameters(initial));
  return std::move(*session);
}

TEST(DurabilityTest, CheckpointsRestoreTheSessionAfterARestart) {
  DurableDaemon daemon({"--durability", "snapshot"});
  std::string error;
  ASSERT_TRUE(daemon.Start(&error)) << error;
  auto client = daemon.Connect();
  Trainer trainer;
  auto session = UploadedSession(*client, "restored", &trainer);
  ASSERT_NE(session, nullptr);
  for (int step = 1; step <= 4; ++step) {
    ASSERT_OK_AND_ASSIGN(client::StepReply reply, session->Step(step, trainer.Gradients(step)));
    trainer.params = reply.parameters;
  }
  ASSERT_OK_AND_ASSIGN(int64_t checkpointed, session->Checkpoint());
  EXPECT_EQ(checkpointed, 4);
  EXPECT_TRUE(fs::exists(daemon.state_dir() + "/restored/checkpoint.json"));
  EXPECT_TRUE(fs::exists(daemon.state_dir() + "/restored/checkpoint-000000000004.safetensors"));

  // Graceful stop, restart: the session is there, at step 4, with its optimizer state — step 5
  // matches a session that never stopped.
  ASSERT_EQ(daemon.process().Stop(), 0);
  ASSERT_TRUE(daemon.Restart(&error)) << error;
  EXPECT_THAT(daemon.process().ReadStderr(), HasSubstr("session restored restored at step 4"));
  client = daemon.Connect();
  ASSERT_OK_AND_ASSIGN(auto attached, client->CreateSession("restored", DaemonTest::SmallSpec()));
  EXPECT_TRUE(attached->attached());
  EXPECT_EQ(attached->last_step(), 4);
  int64_t last_step = 0;
  ASSERT_OK_AND_ASSIGN(client::ParameterMap fetched, attached->GetParameters(&last_step));
  EXPECT_EQ(fetched, trainer.params);
  ASSERT_OK_AND_ASSIGN(client::StepReply after_restart, attached->Step(5, trainer.Gradients(5)));

  Trainer reference_trainer;
  auto reference = UploadedSession(*client, "never-stopped", &reference_trainer);
  for (int step = 1; step <= 5; ++step) {
    ASSERT_OK_AND_ASSIGN(client::StepReply reply, reference->Step(step, reference_trainer.Gradients(step)));
    reference_trainer.params = reply.parameters;
  }
  EXPECT_EQ(after_restart.parameters, reference_trainer.params);

  // Closing a session removes its files.
  ASSERT_OK(attached->Close());
  EXPECT_FALSE(fs::exists(daemon.state_dir() + "/restored"));
}

TEST(DurabilityTest, CheckpointWithoutAStateDirIsFailedPrecondition) {
  DaemonProcess daemon;
  std::string error;
  ASSERT_TRUE(daemon.Start({"--backend", "cpu"}, &error)) << error;
  client::ClientOptions options = testing::TestClientOptions();
  options.endpoint = daemon.endpoint();
  ASSERT_OK_AND_ASSIGN(auto client, client::Client::Connect(options));
  Trainer trainer;
  auto session = UploadedSession(*client, "volatile", &trainer);
  EXPECT_THAT(session->Checkpoint(), StatusIs(absl::StatusCode::kFailedPrecondition, "--state-dir"));
}

TEST(DurabilityTest, SnapshotModeKeepsTheLastCheckpointAcrossKill9) {
  DurableDaemon daemon({"--durability", "snapshot", "--checkpoint-every", "2"});
  std::string error;
  ASSERT_TRUE(daemon.Start(&error)) << error;
  auto client = daemon.Connect();
  Trainer trainer;
  auto session = UploadedSession(*client, "snap", &trainer);
  for (int step = 1; step <= 3; ++step) ASSERT_OK(session->Step(step, trainer.Gradients(step)).status());
  daemon.process().Kill();
  ASSERT_TRUE(daemon.Restart(&error)) << error;
  client = daemon.Connect();
  ASSERT_OK_AND_ASSIGN(auto attached, client->CreateSession("snap", DaemonTest::SmallSpec()));
  EXPECT_EQ(attached->last_step(), 2) << "snapshot mode keeps the checkpoint at step 2; step 3 is lost";
}

TEST(DurabilityTest, JournalModeKeepsEveryAcknowledgedStepAcrossKill9) {
  DurableDaemon daemon({"--durability", "journal"});
  std::string error;
  ASSERT_TRUE(daemon.Start(&error)) << error;
  auto client = daemon.Connect();
  Trainer trainer;
  auto session = UploadedSession(*client, "journaled", &trainer);
  client::ParameterMap after_5;
  for (int step = 1; step <= 5; ++step) {
    ASSERT_OK_AND_ASSIGN(client::StepReply reply, session->Step(step, trainer.Gradients(step)));
    trainer.params = after_5 = reply.parameters;
  }
  daemon.process().Kill();
  ASSERT_TRUE(daemon.Restart(&error)) << error;
  EXPECT_THAT(daemon.process().ReadStderr(), HasSubstr("(checkpoint at step 0 + 5 journaled steps)"));
  client = daemon.Connect();
  ASSERT_OK_AND_ASSIGN(auto attached, client->CreateSession("journaled", DaemonTest::SmallSpec()));
  EXPECT_EQ(attached->last_step(), 5);
  // A retry of step 5 after the crash is answered, not applied again.
  ASSERT_OK_AND_ASSIGN(client::StepReply retried, attached->Step(5, trainer.Gradients(5)));
  EXPECT_TRUE(retried.replayed);
  EXPECT_EQ(retried.parameters, after_5);
}

// A session restored by replaying its journal shows its last step's group figures on /metrics from
// the start, as its summary does (the replay measured that step), not only after its next step.
TEST(DurabilityTest, ARestoredSessionShowsItsLastStepsGroupFigures) {
  DurableDaemon daemon({"--durability", "journal", "--metrics-listen", "127.0.0.1:0"});
  std::string error;
  ASSERT_TRUE(daemon.Start(&error)) << error;
  auto client = daemon.Connect();
  Trainer trainer;
  auto session = UploadedSession(*client, "figures", &trainer);
  ASSERT_NE(session, nullptr);
  client::StepReply last;
  for (int step = 1; step <= 3; ++step) {
    ASSERT_OK_AND_ASSIGN(last, session->Step(step, trainer.Gradients(step)));
    trainer.params = last.parameters;
  }
  daemon.process().Kill();
  ASSERT_TRUE(daemon.Restart(&error)) << error;
  client = daemon.Connect();
  ASSERT_OK_AND_ASSIGN(v1::ServerInfo info, client->GetServerInfo());
  const std::string text = ScrapeMetrics(info.metrics_address());
  for (const std::string group : {"matrices", "vectors"}) {
    SCOPED_TRACE(group);
    const std::string labels = "session=\"figures\",group=\"" + group + "\"";
    const v1::GroupTelemetry& telemetry = last.group_telemetry.at(group);
    EXPECT_EQ(SumOfSamples(text, "muond_group_grad_norm", labels), last.group_clips.at(group).grad_norm);
    EXPECT_EQ(SumOfSamples(text, "muond_group_clip_coefficient", labels), last.group_clips.at(group).coefficient);
    EXPECT_EQ(SumOfSamples(text, "muond_group_update_rms", labels), telemetry.update_rms());
    EXPECT_EQ(SumOfSamples(text, "muond_group_update_ratio", labels), telemetry.update_ratio());
  }
  EXPECT_LE(SumOfSamples(text, "muond_steps_total", ""), 0) << "the restore answered no step";
  ASSERT_OK_AND_ASSIGN(std::vector<v1::SessionSummary> sessions, client->ListSessions());
  ASSERT_EQ(sessions.size(), 1u);
  EXPECT_EQ(sessions[0].telemetry_step(), 3);
}

// One daemon per state directory: a second started on the folder another is serving exits 1 naming
// the folder and the holder, and touches nothing there; once the first is gone (stopped, or killed:
// the kernel drops its lock) the next starts and restores the session.
TEST(DurabilityTest, ASecondDaemonOnTheSameStateDirRefusesToStart) {
  DurableDaemon first({"--durability", "journal"});
  std::string error;
  ASSERT_TRUE(first.Start(&error)) << error;
  auto client = first.Connect();
  Trainer trainer;
  auto session = UploadedSession(*client, "locked", &trainer);
  ASSERT_OK(session->Step(1, trainer.Gradients(1)).status());
  const std::string journal = first.state_dir() + "/locked/journal.log";
  const std::string saved_journal = ReadWholeFileForTest(journal);

  DaemonProcess second;
  EXPECT_FALSE(second.Start({"--backend", "cpu", "--durability", "journal", "--state-dir", first.state_dir()}, &error));
  EXPECT_TRUE(WIFEXITED(second.exit_status()) && WEXITSTATUS(second.exit_status()) == 1) << second.exit_status();
  EXPECT_THAT(second.ReadStderr(), HasSubstr("--state-dir " + first.state_dir() + " is in use by another muond (pid "));
  EXPECT_EQ(ReadWholeFileForTest(journal), saved_journal);
  ASSERT_OK(session->Step(2, trainer.Gradients(2)).status()) << "the first daemon serves on";

  first.process().Kill();
  ASSERT_TRUE(second.Start({"--backend", "cpu", "--durability", "journal", "--state-dir", first.state_dir()}, &error))
      << error;
  client::ClientOptions options = testing::TestClientOptions();
  options.endpoint = second.endpoint();
  ASSERT_OK_AND_ASSIGN(auto second_client, client::Client::Connect(options));
  ASSERT_OK_AND_ASSIGN(std::vector<v1::SessionSummary> sessions, second_client->ListSessions());
  ASSERT_EQ(sessions.size(), 1u);
  EXPECT_EQ(sessions[0].last_step(), 2);
  EXPECT_EQ(second.Stop(), 0);
}

// Starts the daemon over a damaged state directory and expects a refusal naming `file`.
void ExpectRefusal(DurableDaemon& daemon, const std::string& file) {
  std::string error;
  EXPECT_FALSE(daemon.Restart(&error));
  EXPECT_TRUE(WIFEXITED(daemon.process().exit_status()) && WEXITSTATUS(daemon.process().exit_status()) == 1);
  EXPECT_THAT(daemon.process().ReadStderr(), HasSubstr(file));
}

TEST(DurabilityTest, DamagedCheckpointsAndJournalsAreRefusedNamingTheFile) {
  DurableDaemon daemon({"--durability", "journal", "--on-damaged-state", "fail"});
  std::string error;
  ASSERT_TRUE(daemon.Start(&error)) << error;
  auto client = daemon.Connect();
  Trainer trainer;
  auto session = UploadedSession(*client, "damaged", &trainer);
  for (int step = 1; step <= 3; ++step) ASSERT_OK(session->Step(step, trainer.Gradients(step)).status());
  daemon.process().Kill();
  const std::string dir = daemon.state_dir() + "/damaged";
  const std::string tensors = dir + "/checkpoint-000000000000.safetensors";
  const std::string journal = dir + "/journal.log";
  ASSERT_TRUE(fs::exists(tensors));
  ASSERT_GT(fs::file_size(journal), 100u);
  const std::string saved_tensors = ReadWholeFileForTest(tensors);
  const std::string saved_journal = ReadWholeFileForTest(journal);

  // A truncated tensor file.
  fs::resize_file(tensors, fs::file_size(tensors) - 7);
  ExpectRefusal(daemon, tensors);
  WriteFileForTest(tensors, saved_tensors);
  // One altered byte in the tensor data.
  std::string altered = saved_tensors;
  altered[altered.size() - 3] ^= 0x40;
  WriteFileForTest(tensors, altered);
  ExpectRefusal(daemon, tensors);
  WriteFileForTest(tensors, saved_tensors);
  // One altered byte inside the journal's first record.
  altered = saved_journal;
  altered[40] ^= 0x01;
  WriteFileForTest(journal, altered);
  ExpectRefusal(daemon, journal);
  // A truncated checkpoint.json.
  WriteFileForTest(journal, saved_journal);
  const std::string metadata = dir + "/checkpoint.json";
  const std::string saved_metadata = ReadWholeFileForTest(metadata);
  WriteFileForTest(metadata, saved_metadata.substr(0, saved_metadata.size() / 2));
  ExpectRefusal(daemon, metadata);

  // Repaired, it starts, with every step.
  WriteFileForTest(metadata, saved_metadata);
  ASSERT_TRUE(daemon.Restart(&error)) << error;
  client = daemon.Connect();
  ASSERT_OK_AND_ASSIGN(auto attached, client->CreateSession("damaged", DaemonTest::SmallSpec()));
  EXPECT_EQ(attached->last_step(), 3);
}

// Kills a journaled daemon after steps 1..`steps` of session `id`, leaving its journal unfolded.
void JournalSteps(DurableDaemon& daemon, const std::string& id, int steps) {
  auto client = daemon.Connect();
  Trainer trainer;
  auto session = UploadedSession(*client, id, &trainer);
  ASSERT_NE(session, nullptr);
  for (int step = 1; step <= steps; ++step) ASSERT_OK(session->Step(step, trainer.Gradients(step)).status());
}

TEST(DurabilityTest, AnInflatedJournalLengthStopsTheRestoreAndKeepsTheJournal) {
  DurableDaemon daemon({"--durability", "journal", "--on-damaged-state", "fail"});
  std::string error;
  ASSERT_TRUE(daemon.Start(&error)) << error;
  JournalSteps(daemon, "inflated", 5);
  daemon.process().Kill();
  const std::string journal = daemon.state_dir() + "/inflated/journal.log";
  std::string bytes = ReadWholeFileForTest(journal);
  // Each record: a 20-byte header ("MJR4", u64 payload length, two CRCs) and its payload.
  size_t third = 0;
  for (int record = 0; record < 2; ++record) {
    uint64_t length = 0;
    std::memcpy(&length, bytes.data() + third + 4, 8);
    third += 20 + length;
  }
  const uint64_t inflated = 0x7fffffff;
  std::memcpy(bytes.data() + third + 4, &inflated, 8);  // step 3, followed by steps 4 and 5
  WriteFileForTest(journal, bytes);
  ExpectRefusal(daemon, journal);
  EXPECT_THAT(daemon.process().ReadStderr(), HasSubstr("record at byte " + std::to_string(third)));
  EXPECT_EQ(ReadWholeFileForTest(journal), bytes) << "the refused journal was changed";
}

TEST(DurabilityTest, DamagedFoldersAreQuarantinedAndTheIntactSessionIsServed) {
  DurableDaemon daemon({"--durability", "journal"});
  std::string error;
  ASSERT_TRUE(daemon.Start(&error)) << error;
  for (const char* id : {"intact", "deep", "fifo", "dangling", "linked"}) JournalSteps(daemon, id, 2);
  daemon.process().Kill();
  const std::string state = daemon.state_dir();
  const std::string outside = daemon.process().dir() + "/outside";
  fs::create_directory(outside);
  // 200,000 nested arrays as checkpoint.json (a stack overflow when copied recursively).
  WriteFileForTest(state + "/deep/checkpoint.json", std::string(200000, '[') + std::string(200000, ']'));
  // A FIFO as the journal (an open without O_NONBLOCK waits forever).
  fs::remove(state + "/fifo/journal.log");
  ASSERT_EQ(mkfifo((state + "/fifo/journal.log").c_str(), 0600), 0);
  // A dangling journal link (opening it for appending would create the outside file).
  fs::remove(state + "/dangling/journal.log");
  fs::create_symlink(outside + "/created.log", state + "/dangling/journal.log");
  // A session folder that is a link to a folder outside the state directory.
  fs::rename(state + "/linked", outside + "/linked");
  fs::create_directory_symlink(outside + "/linked", state + "/linked");
  const std::set<std::string> outside_before = {"checkpoint-000000000000.safetensors", "checkpoint.json",
                                                "journal.log"};

  ASSERT_TRUE(daemon.Restart(&error)) << error;
  const std::string log = daemon.process().ReadStderr();
  for (const char* id : {"deep", "fifo", "dangling", "linked"}) {
    EXPECT_THAT(log, HasSubstr(absl::StrCat("session folder ", state, "/", id, " cannot be restored"))) << id;
  }
  EXPECT_THAT(log, HasSubstr("nests deeper than 64 levels"));
  EXPECT_THAT(log, HasSubstr("not a regular file"));
  EXPECT_THAT(log, HasSubstr("symbolic link"));
  auto client = daemon.Connect();
  ASSERT_OK_AND_ASSIGN(auto attached, client->CreateSession("intact", DaemonTest::SmallSpec()));
  EXPECT_EQ(attached->last_step(), 2);
  ASSERT_OK_AND_ASSIGN(std::vector<v1::SessionSummary> sessions, client->ListSessions());
  EXPECT_EQ(sessions.size(), 1u);

  // Moved aside, never deleted; nothing created or changed outside the state directory.
  int quarantined = 0;
  for (const auto& entry : fs::directory_iterator(state + "/+quarantine")) {
    ++quarantined;
    EXPECT_TRUE(fs::exists(entry.path().string() + "/checkpoint.json")) << entry.path();
  }
  EXPECT_EQ(quarantined, 4);
  EXPECT_FALSE(fs::exists(outside + "/created.log"));
  std::set<std::string> outside_after;
  for (const auto& entry : fs::directory_iterator(outside + "/linked")) {
    outside_after.insert(entry.path().filename().string());
  }
  EXPECT_EQ(outside_after, outside_before);
}

TEST(DurabilityTest, ATornJournalTailIsAnUnacknowledgedStepAndIsDropped) {
  DurableDaemon daemon({"--durability", "journal"});
  std::string error;
  ASSERT_TRUE(daemon.Start(&error)) << error;
  auto client = daemon.Connect();
  Trainer trainer;
  auto session = UploadedSession(*client, "torn", &trainer);
  for (int step = 1; step <= 2; ++step) ASSERT_OK(session->Step(step, trainer.Gradients(step)).status());
  daemon.process().Kill();
  const std::string journal = daemon.state_dir() + "/torn/journal.log";
  fs::resize_file(journal, fs::file_size(journal) - 10);  // the second record, cut short mid-write
  ASSERT_TRUE(daemon.Restart(&error)) << error;
  EXPECT_THAT(daemon.process().ReadStderr(), HasSubstr("partly written record"));
  client = daemon.Connect();
  ASSERT_OK_AND_ASSIGN(auto attached, client->CreateSession("torn", DaemonTest::SmallSpec()));
  EXPECT_EQ(attached->last_step(), 1);
}

TEST(DurabilityTest, ARestoredSessionKeepsItsOwner) {
  DaemonProcess scratch;
  const std::string tokens = scratch.dir() + "/tokens";
  WriteFileForTest(tokens, "alice:alice-secret-token\nbob:bob-secret-token\n");
  fs::permissions(tokens, fs::perms::owner_read | fs::perms::owner_write);
  DurableDaemon daemon({"--auth-token-file", tokens});
  std::string error;
  ASSERT_TRUE(daemon.Start(&error)) << error;
  auto connect_as = [&](const std::string& token) {
    client::ClientOptions options = testing::TestClientOptions();
    options.endpoint = daemon.process().endpoint();
    options.auth_token = token;
    auto client = client::Client::Connect(options);
    EXPECT_TRUE(client.ok()) << client.status();
    return std::move(*client);
  };
  auto alice = connect_as("alice-secret-token");
  Trainer trainer;
  auto session = UploadedSession(*alice, "alices-run", &trainer);
  ASSERT_NE(session, nullptr);
  ASSERT_OK(session->Step(1, trainer.Gradients(1)).status());
  ASSERT_EQ(daemon.process().Stop(), 0);
  ASSERT_TRUE(daemon.Restart(&error)) << error;

  auto bob = connect_as("bob-secret-token");
  EXPECT_THAT(bob->CreateSession("alices-run", DaemonTest::SmallSpec()),
              StatusIs(absl::StatusCode::kPermissionDenied, "alices-run"));
  alice = connect_as("alice-secret-token");
  ASSERT_OK_AND_ASSIGN(auto attached, alice->CreateSession("alices-run", DaemonTest::SmallSpec()));
  EXPECT_EQ(attached->last_step(), 1);
}

// Two daemons on one address would share its connections (SO_REUSEPORT, gRPC's default on Linux):
// a trainer's steps would reach either, its session held by one (found as a restarted daemon's
// step answered NOT_FOUND by a daemon that had taken the port meanwhile). The second one fails at
// start-up instead, and the first serves on.
TEST(ListenTest, ASecondDaemonOnTheSamePortFailsAtStartUp) {
  DaemonProcess first, second;
  std::string error;
  ASSERT_TRUE(first.Start({"--backend", "cpu"}, &error)) << error;
  EXPECT_FALSE(second.Start({"--backend", "cpu"}, &error, first.port()));
  EXPECT_THAT(error, HasSubstr("cannot listen on 127.0.0.1:" + std::to_string(first.port())));
  client::ClientOptions options = testing::TestClientOptions();
  options.endpoint = first.endpoint();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Client> client, client::Client::Connect(options));
  EXPECT_OK(client->GetServerInfo().status());
  EXPECT_FALSE(first.Exited());
}

}  // namespace
}  // namespace muond::testing
