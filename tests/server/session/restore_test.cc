// Restoring a state directory in process: a session folder that cannot be restored is moved into
// the quarantine (never deleted), logged and counted, and the intact sessions beside it are served;
// with DamagedState::kFail the restore stops naming the file and moves nothing. Links out of the
// state directory are never followed: a linked session folder is quarantined as a link, and the
// folder it points to is neither written nor pruned. LoadSession, the path `muondctl state verify`
// runs, refuses exactly what the restore refuses.
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "kernels/cpu/cpu_backend.h"
#include "nlohmann/json.hpp"
#include "server/durability/file_util.h"
#include "server/durability/step_journal.h"
#include "server/rpc/session_spec_codec.h"
#include "server/session/session_registry.h"
#include "server/session/state_dir.h"
#include "tests/server/session/session_test_util.h"
#include "tests/testing/status_matchers.h"

namespace muond::session {
namespace {

namespace fs = std::filesystem;
using ::muond::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::SizeIs;
using namespace ::muond::session::session_testing;

// Counts quarantined sessions; every other report is dropped.
class QuarantineCounter final : public metrics::Metrics {
 public:
  void CallEnded(std::string_view, absl::StatusCode, absl::Duration) override {}
  void CallStarted(std::string_view) override {}
  void StepAnswered(const metrics::StepReport&) override {}
  void SessionsHeld(int, int64_t) override {}
  void JournalAppended(absl::Duration, bool) override {}
  void CheckpointWritten(absl::Duration, bool) override {}
  void SessionQuarantined() override { ++quarantined; }
  int quarantined = 0;
};

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

class RestoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/muond-restore-XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    root_ = pattern;
    dir_ = root_ + "/state";
    backend_ = kernels::NewCpuBackend(1);
    // Two journaled sessions, three steps each, left as after kill -9 (no final checkpoint).
    ASSERT_OK(Restore(durability::DamagedState::kFail));
    for (const char* id : {"good", "bad"}) {
      ASSERT_OK_AND_ASSIGN(CreateResult created, registry_->CreateOrAttach(id, rpc::SpecToJson(SmallSpec())));
      ASSERT_OK(created.session->Upload(InitialParameters()));
      for (int step = 1; step <= 3; ++step) ASSERT_OK(RunStep(*created.session, Request(step), Gradients(step)));
    }
    registry_.reset();
  }
  void TearDown() override {
    registry_.reset();
    fs::remove_all(root_);
  }

  absl::Status Restore(durability::DamagedState on_damaged) {
    durability::StateDirOptions options = Options();
    options.on_damaged = on_damaged;
    registry_ = std::make_unique<SessionRegistry>(backend_.get(), &codec_, SpecLimits{}, 4, MemoryLimits{}, &metrics_);
    return registry_->EnablePersistence(options);
  }
  durability::StateDirOptions Options() const {
    durability::StateDirOptions options;
    options.state_dir = dir_;
    options.durability = durability::Durability::kJournal;
    options.backend_name = "cpu";
    return options;
  }
  absl::StatusOr<LoadedSession> Load(const std::string& id) {
    return LoadSession(Options(), dir_ + "/" + id, backend_.get(), codec_, SpecLimits{});
  }
  std::vector<std::string> Quarantined() const {
    std::vector<std::string> names;
    if (!fs::exists(dir_ + "/+quarantine")) return names;
    for (const auto& entry : fs::directory_iterator(dir_ + "/+quarantine")) names.push_back(entry.path().string());
    return names;
  }
  // Rewrites the bad session's checkpoint.json through `edit`, with a digest that matches again.
  void EditBadCheckpoint(const std::function<void(nlohmann::json&)>& edit) { EditCheckpoint("bad", edit); }
  // The same for session `id`'s.
  void EditCheckpoint(const std::string& id, const std::function<void(nlohmann::json&)>& edit) {
    const std::string path = dir_ + "/" + id + "/checkpoint.json";
    nlohmann::json metadata = nlohmann::json::parse(ReadAll(path));
    edit(metadata);
    metadata.erase("metadata_sha256");
    metadata["metadata_sha256"] = durability::Sha256Hex(metadata.dump());
    std::ofstream(path, std::ios::trunc) << metadata.dump(2);
  }

  std::string root_;
  std::string dir_;
  rpc::ProtoSpecCodec codec_;
  QuarantineCounter metrics_;
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<SessionRegistry> registry_;
};

TEST_F(RestoreTest, ADamagedFolderIsQuarantinedAndTheOthersAreServed) {
  const std::string journal = dir_ + "/bad/journal.log";
  std::string bytes = ReadAll(journal);
  bytes[30] ^= 0x01;
  std::ofstream(journal, std::ios::binary | std::ios::trunc) << bytes;

  ASSERT_OK(Restore(durability::DamagedState::kQuarantine));
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Session> good, registry_->Find("good"));
  EXPECT_EQ(good->last_step(), 3);
  EXPECT_THAT(registry_->Find("bad"), StatusIs(absl::StatusCode::kNotFound, "bad"));
  EXPECT_EQ(metrics_.quarantined, 1);
  EXPECT_FALSE(fs::exists(dir_ + "/bad"));
  const std::vector<std::string> quarantined = Quarantined();
  ASSERT_THAT(quarantined, SizeIs(1));
  EXPECT_THAT(quarantined[0], ::testing::StartsWith(dir_ + "/+quarantine/bad."));
  EXPECT_EQ(ReadAll(quarantined[0] + "/journal.log"), bytes) << "moved as it was, never rewritten";

  // The next start leaves the quarantine alone and serves the same sessions.
  registry_.reset();
  ASSERT_OK(Restore(durability::DamagedState::kQuarantine));
  EXPECT_EQ(registry_->size(), 1u);
  EXPECT_THAT(Quarantined(), SizeIs(1));
}

// With a state directory, a session whose checkpoints a restore could not read (100 000
// parameters with 256-byte names: over 64 MiB of checkpoint.json) is refused naming the spec, and
// nothing of it is created.
TEST_F(RestoreTest, ASessionThatCouldNotBeRestoredIsNotCreated) {
  ASSERT_OK(Restore(durability::DamagedState::kQuarantine));
  v1::SessionSpec spec;
  auto* group = spec.add_groups();
  group->set_name("g");
  group->mutable_options()->set_optimizer(v1::OPTIMIZER_ADAMW);
  for (int i = 0; i < 100000; ++i) {
    v1::ParameterSpec* parameter = spec.add_parameters();
    parameter->set_name(absl::StrCat(i, std::string(256, 'p')).substr(0, 256));
    parameter->add_shape(1);
    parameter->set_group("g");
  }
  EXPECT_THAT(registry_->CreateOrAttach("unrestorable", rpc::SpecToJson(spec)),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec: a checkpoint of this session could take"));
  EXPECT_FALSE(fs::exists(dir_ + "/unrestorable"));
  EXPECT_THAT(registry_->Find("unrestorable"), StatusIs(absl::StatusCode::kNotFound, ""));
}

// A journal record of an asynchronous push altered on disk, its checksums made to match: a staleness
// its base step does not give (which scaled the learning rate by 1/(1 + s) with s = -1), a push out
// of the rank's order, or contributors other than the pusher. The record is refused, the session
// quarantined naming the journal, never restored with the push applied otherwise; the record as
// written replays.
TEST_F(RestoreTest, AnAlteredAsynchronousPushRecordIsRefusedNotReplayed) {
  v1::SessionSpec spec = SmallSpec();
  spec.set_world_size(2);
  spec.mutable_sync()->set_mode(v1::SYNC_MODE_ASYNC);
  spec.mutable_sync()->set_max_staleness(4);
  spec.mutable_sync()->set_staleness_scaling(v1::STALENESS_SCALING_INVERSE);
  const std::vector<std::pair<std::string, std::function<void(nlohmann::json&)>>> alterations = {
      {"as-written", [](nlohmann::json&) {}},
      {"negative-staleness", [](nlohmann::json& r) { r["staleness"] = -1; }},
      {"push-out-of-order", [](nlohmann::json& r) { r["step"] = 3; }},
      {"other-contributors", [](nlohmann::json& r) { r["contributors"] = {1}; }},
  };
  for (const auto& [id, alter] : alterations) {
    SCOPED_TRACE(id);
    ASSERT_OK(Restore(durability::DamagedState::kQuarantine));
    ASSERT_OK_AND_ASSIGN(CreateResult created, registry_->CreateOrAttach(id, rpc::SpecToJson(spec)));
    ASSERT_OK(created.session->Upload(InitialParameters()));
    StepRequest push = Request(1);
    push.session_id = id;
    push.base_step = 0;
    ASSERT_OK(RunStep(*created.session, push, Gradients(1)).status());
    created.session.reset();
    registry_.reset();

    const std::string journal = dir_ + "/" + id + "/journal.log";
    ASSERT_OK_AND_ASSIGN(durability::JournalContents contents,
                         durability::StepJournal::Read(durability::Env::Default(), journal, {48, 6}));
    ASSERT_THAT(contents.records, SizeIs(1));
    nlohmann::json request = nlohmann::json::parse(contents.records[0].request);
    alter(request);
    fs::remove(journal);
    durability::StepJournal rewritten(durability::Env::Default());
    ASSERT_OK(rewritten.Open(journal));
    ASSERT_OK(
        rewritten.Append(contents.records[0].checkpoint_generation, request.dump(), contents.records[0].gradients));
    rewritten.Close();

    const int quarantined = metrics_.quarantined;
    ASSERT_OK(Restore(durability::DamagedState::kQuarantine));
    if (id == "as-written") {
      ASSERT_OK_AND_ASSIGN(std::shared_ptr<Session> restored, registry_->Find(id));
      EXPECT_EQ(restored->last_step(), 1);
      EXPECT_EQ(metrics_.quarantined, quarantined);
    } else {
      EXPECT_THAT(registry_->Find(id), StatusIs(absl::StatusCode::kNotFound, id));
      EXPECT_EQ(metrics_.quarantined, quarantined + 1);
      EXPECT_FALSE(fs::exists(dir_ + "/" + id));
    }
    registry_.reset();
  }
}

// Something in the way of a checkpoint's temporary file: a link or a FIFO left at its name is
// removed (the link's target untouched) and the restore's checkpoint is written; a folder there
// makes that checkpoint fail, and the session is served from its checkpoint and journal all the
// same, the other sessions too, instead of the daemon not starting at all.
TEST_F(RestoreTest, AnEntryInTheWayOfACheckpointStopsNeitherTheSessionNorTheDaemon) {
  const std::string outside = root_ + "/outside";
  std::ofstream(outside) << "not muond's";
  fs::create_symlink(outside, dir_ + "/good/checkpoint.json.tmp");
  fs::create_directory(dir_ + "/bad/checkpoint.json.tmp");
  ASSERT_OK(Restore(durability::DamagedState::kQuarantine));
  for (const char* id : {"good", "bad"}) {
    ASSERT_OK_AND_ASSIGN(std::shared_ptr<Session> session, registry_->Find(id));
    EXPECT_EQ(session->last_step(), 3) << id;
  }
  EXPECT_EQ(ReadAll(outside), "not muond's");
  EXPECT_FALSE(fs::exists(fs::symlink_status(dir_ + "/good/checkpoint.json.tmp")));
  EXPECT_EQ(ReadAll(dir_ + "/good/journal.log"), "") << "the restore's checkpoint emptied the journal";
  EXPECT_NE(ReadAll(dir_ + "/bad/journal.log"), "") << "without a checkpoint the journal keeps the steps";

  // "bad" steps on, journaled after the records it was restored from, and comes back again.
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Session> bad, registry_->Find("bad"));
  StepRequest next = Request(4);
  next.session_id = "bad";
  ASSERT_OK(RunStep(*bad, next, Gradients(4)).status());
  bad.reset();
  registry_.reset();
  ASSERT_OK(Restore(durability::DamagedState::kQuarantine));
  ASSERT_OK_AND_ASSIGN(bad, registry_->Find("bad"));
  EXPECT_EQ(bad->last_step(), 4);
}

// A quarantine folder that is a link is never followed out of the state directory: the damaged
// folder stays where it is and the start fails, saying why.
// Closing moves the session's folder out of the sessions' names in one rename before removing its
// files, so a crash halfway through the removal leaves a folder in +closed, which the next start
// removes, rather than a session folder without its journal that it would restore.
TEST_F(RestoreTest, AClosedSessionDoesNotComeBackFromAHalfRemovedFolder) {
  ASSERT_OK(Restore(durability::DamagedState::kFail));
  ASSERT_OK(registry_->Close("good"));
  EXPECT_FALSE(fs::exists(dir_ + "/good"));
  EXPECT_TRUE(!fs::exists(dir_ + "/+closed") || fs::is_empty(dir_ + "/+closed"));
  registry_.reset();

  // "bad" as a crash during its removal leaves it: moved aside, its journal already gone.
  fs::create_directories(dir_ + "/+closed");
  fs::rename(dir_ + "/bad", dir_ + "/+closed/bad.20261130T120000.000Z");
  fs::remove(dir_ + "/+closed/bad.20261130T120000.000Z/journal.log");
  ASSERT_OK(Restore(durability::DamagedState::kFail));
  EXPECT_THAT(registry_->Find("bad"), StatusIs(absl::StatusCode::kNotFound, "bad"));
  EXPECT_THAT(registry_->Find("good"), StatusIs(absl::StatusCode::kNotFound, "good"));
  EXPECT_FALSE(fs::exists(dir_ + "/+closed")) << "the leftovers of closed sessions are removed at start";
  EXPECT_EQ(metrics_.quarantined, 0);
}

// With a file in the way of +closed, a closed session's folder is deleted in place, and the file is
// left alone.
TEST_F(RestoreTest, AClosedSessionIsRemovedInPlaceWhenItCannotBeMovedAside) {
  std::ofstream(dir_ + "/+closed") << "not a folder";
  ASSERT_OK(Restore(durability::DamagedState::kFail));
  ASSERT_OK(registry_->Close("good"));
  EXPECT_FALSE(fs::exists(dir_ + "/good"));
  EXPECT_EQ(ReadAll(dir_ + "/+closed"), "not a folder");
  EXPECT_OK(registry_->Find("bad").status());
}

TEST_F(RestoreTest, AQuarantineThatIsALinkIsNotFollowed) {
  const std::string outside = root_ + "/outside";
  fs::create_directory(outside);
  fs::create_directory_symlink(outside, dir_ + "/+quarantine");
  const std::string journal = dir_ + "/bad/journal.log";
  std::string bytes = ReadAll(journal);
  bytes[30] ^= 0x01;
  std::ofstream(journal, std::ios::binary | std::ios::trunc) << bytes;
  EXPECT_THAT(Restore(durability::DamagedState::kQuarantine),
              StatusIs(absl::StatusCode::kInternal, "+quarantine is a symbolic link"));
  EXPECT_TRUE(fs::is_empty(outside));
  EXPECT_TRUE(fs::exists(dir_ + "/bad/checkpoint.json"));
}

TEST_F(RestoreTest, FailStopNamesTheFileAndMovesNothing) {
  // Step 2's payload length inflated in a journal followed by step 3: no torn tail.
  const std::string journal = dir_ + "/bad/journal.log";
  std::string bytes = ReadAll(journal);
  ASSERT_EQ(bytes.substr(0, 4), "MJR4");
  uint64_t first_length = 0;
  std::memcpy(&first_length, bytes.data() + 4, 8);
  const size_t second = 20 + first_length;
  const uint64_t inflated = 0x7fffffff;
  std::memcpy(bytes.data() + second + 4, &inflated, 8);
  std::ofstream(journal, std::ios::binary | std::ios::trunc) << bytes;

  EXPECT_THAT(
      Restore(durability::DamagedState::kFail),
      StatusIs(absl::StatusCode::kDataLoss, journal + " is unusable: record at byte " + std::to_string(second)));
  EXPECT_EQ(ReadAll(journal), bytes) << "the refused journal is kept byte for byte";
  EXPECT_TRUE(Quarantined().empty());
  EXPECT_THAT(Load("bad"), StatusIs(absl::StatusCode::kDataLoss, journal));
  EXPECT_OK(Load("good").status());
}

TEST_F(RestoreTest, ALinkedSessionFolderIsQuarantinedAndItsTargetUntouched) {
  // The bad session's folder moved outside the state directory, a link left in its place.
  const std::string outside = root_ + "/outside";
  fs::rename(dir_ + "/bad", outside);
  fs::create_directory_symlink(outside, dir_ + "/bad");
  std::set<std::string> before;
  for (const auto& entry : fs::directory_iterator(outside)) before.insert(entry.path().filename().string());

  ASSERT_OK(Restore(durability::DamagedState::kQuarantine));
  EXPECT_EQ(registry_->size(), 1u);
  ASSERT_THAT(Quarantined(), SizeIs(1));
  EXPECT_TRUE(fs::is_symlink(Quarantined()[0])) << "the link is moved, not what it points to";
  std::set<std::string> after;
  for (const auto& entry : fs::directory_iterator(outside)) after.insert(entry.path().filename().string());
  EXPECT_EQ(after, before) << "no checkpoint written into, no file pruned from, the outside folder";
}

// The overrides of `session`'s last step as the daemon keeps them (EncodeOverrides), or "unknown".
std::string LastOverridesOf(const Session& session, int64_t expected_step) {
  const Session::LastStepOverrides last = session.LastOverrides();
  EXPECT_EQ(last.step, expected_step);
  return last.overrides.has_value() ? EncodeOverrides(*last.overrides) : "unknown";
}

TEST_F(RestoreTest, TheLastStepsOverridesComeBackFromTheCheckpointAndTheJournal) {
  ASSERT_OK(Restore(durability::DamagedState::kFail));
  ASSERT_OK_AND_ASSIGN(CreateResult created, registry_->CreateOrAttach("sched", rpc::SpecToJson(SmallSpec())));
  ASSERT_OK(created.session->Upload(InitialParameters()));
  EXPECT_EQ(LastOverridesOf(*created.session, 0), "[]");
  StepRequest first = Request(1);
  first.overrides = {{"adamw", std::nullopt, std::nullopt, std::nullopt, 0.85, std::nullopt},
                     {"muon", 0.01, 0.8, std::nullopt, std::nullopt, std::nullopt}};
  ASSERT_OK(RunStep(*created.session, first, Gradients(1)).status());
  const std::string after_first = R"([{"group":"muon","lr":0.01,"momentum":0.8},{"beta1":0.85,"group":"adamw"}])";
  EXPECT_EQ(LastOverridesOf(*created.session, 1), after_first);
  ASSERT_OK_AND_ASSIGN(const int64_t checkpointed, created.session->Checkpoint());
  ASSERT_EQ(checkpointed, 1);
  EXPECT_EQ(nlohmann::json::parse(ReadAll(dir_ + "/sched/checkpoint.json"))["last_overrides"].dump(), after_first);
  created.session.reset();
  registry_.reset();

  // From the checkpoint.
  ASSERT_OK(Restore(durability::DamagedState::kFail));
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Session> restored, registry_->Find("sched"));
  EXPECT_EQ(LastOverridesOf(*restored, 1), after_first);
  StepRequest second = Request(2);
  second.overrides = {
      {"muon", std::nullopt, std::nullopt, std::nullopt, std::nullopt, std::nullopt},
      {"adamw", 0.003, std::nullopt, std::nullopt, std::nullopt, std::nullopt}};  // in group order, none empty
  ASSERT_OK(RunStep(*restored, second, Gradients(2)).status());
  restored.reset();
  registry_.reset();

  // From the checkpoint, then the journal's step 2 replayed.
  ASSERT_OK(Restore(durability::DamagedState::kFail));
  ASSERT_OK_AND_ASSIGN(restored, registry_->Find("sched"));
  EXPECT_EQ(LastOverridesOf(*restored, 2), R"([{"group":"adamw","lr":0.003}])");

  // A SetState's state does not carry them: unknown until the next step, which says them again.
  ASSERT_OK_AND_ASSIGN(SessionState state, restored->ExportState());
  state.last_overrides.reset();
  ASSERT_OK(restored->ImportState(std::move(state)));
  EXPECT_EQ(LastOverridesOf(*restored, 2), "unknown");
  ASSERT_OK(RunStep(*restored, Request(3), Gradients(3)).status());
  EXPECT_EQ(LastOverridesOf(*restored, 3), "[]");
}

// A session an earlier muond created with an option its group does not read (namo_clamp with
// moment2_method namo, refused at creation since) comes back at a restart and is attached to with its
// spec; a new session with that spec is refused naming the option.
TEST_F(RestoreTest, ASpecOfAnEarlierMuondWithAnUnreadOptionIsRestoredAndAttachedTo) {
  v1::SessionSpec spec = SmallSpec();
  spec.mutable_groups(0)->mutable_options()->set_moment2_method("namo");
  ASSERT_OK(Restore(durability::DamagedState::kFail));
  ASSERT_OK_AND_ASSIGN(CreateResult created, registry_->CreateOrAttach("namo", rpc::SpecToJson(spec)));
  ASSERT_OK(created.session->Upload(InitialParameters()));
  ASSERT_OK(RunStep(*created.session, Request(1), Gradients(1)).status());
  ASSERT_OK(created.session->Checkpoint().status());
  created.session.reset();
  registry_.reset();
  spec.mutable_groups(0)->mutable_options()->set_namo_clamp(0.5);
  const std::string earlier = rpc::SpecToJson(spec);
  EditCheckpoint("namo", [&](nlohmann::json& m) { m["spec"] = nlohmann::json::parse(earlier); });

  ASSERT_OK(Restore(durability::DamagedState::kFail));
  EXPECT_THAT(Quarantined(), SizeIs(0));
  ASSERT_OK_AND_ASSIGN(CreateResult attached, registry_->CreateOrAttach("namo", earlier));
  EXPECT_TRUE(attached.attached);
  EXPECT_EQ(attached.session->last_step(), 1);
  ASSERT_OK(RunStep(*attached.session, Request(2), Gradients(2)).status());
  EXPECT_THAT(registry_->CreateOrAttach("other", earlier),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "spec.groups[0].options.namo_clamp: this muon group reads it only with moment2_method namo_d"));
}

// The checkpoint's record of the last step's overrides only informs an attach's answer: one that
// does not decode, or that no step could have been sent with, is dropped as unknown, and the session
// restores with the rest of its state.
TEST_F(RestoreTest, LastOverridesThatDoNotFitAreDroppedAsUnknown) {
  const std::vector<std::pair<std::string, nlohmann::json>> cases = {
      {"not an array", {{"group", "muon"}, {"lr", 0.1}}},
      {"an entry without its group", nlohmann::json::array({{{"lr", 0.1}}})},
      {"an unknown group", nlohmann::json::array({{{"group", "nope"}, {"lr", 0.1}}})},
      {"a value out of its range", nlohmann::json::array({{{"group", "muon"}, {"lr", -1}}})},
      {"a group given twice",
       nlohmann::json::array({{{"group", "muon"}, {"lr", 0.1}}, {{"group", "muon"}, {"lr", 0.2}}})},
      {"betas of a muon group", nlohmann::json::array({{{"group", "muon"}, {"beta1", 0.5}}})},
  };
  const std::string saved = ReadAll(dir_ + "/bad/checkpoint.json");
  for (const auto& [name, overrides] : cases) {
    SCOPED_TRACE(name);
    const nlohmann::json forged = overrides;  // a structured binding cannot be captured before C++20's P1091
    EditBadCheckpoint([&](nlohmann::json& m) { m["last_overrides"] = forged; });
    ASSERT_OK_AND_ASSIGN(LoadedSession loaded, Load("bad"));
    EXPECT_EQ(loaded.session->last_step(), 3) << "the journal's steps replayed";
    EXPECT_EQ(LastOverridesOf(*loaded.session, 3), "[]") << "step 3's own (none), after the checkpoint's dropped";
    // Without the journal: step 0, where nothing was overridden whatever the file says.
    const std::string journal = ReadAll(dir_ + "/bad/journal.log");
    fs::remove(dir_ + "/bad/journal.log");
    ASSERT_OK_AND_ASSIGN(LoadedSession alone, Load("bad"));
    EXPECT_EQ(LastOverridesOf(*alone.session, 0), "[]");
    std::ofstream(dir_ + "/bad/journal.log", std::ios::binary | std::ios::trunc) << journal;
    std::ofstream(dir_ + "/bad/checkpoint.json", std::ios::trunc) << saved;
  }
}

// A journal record of an earlier muond holds what a request may no longer: a base_step outside an
// asynchronous session (ignored then) and a group in two override entries (applied in order then).
// Replayed as that daemon applied it, not refused (which would lose the session at an upgrade).
TEST_F(RestoreTest, AJournalRecordOfAnEarlierMuondReplaysAsItWasApplied) {
  const std::string journal = dir_ + "/bad/journal.log";
  ASSERT_OK_AND_ASSIGN(durability::JournalContents contents,
                       durability::StepJournal::Read(durability::Env::Default(), journal, {48, 6}));
  ASSERT_THAT(contents.records, SizeIs(3));
  fs::remove(journal);
  durability::StepJournal rewritten(durability::Env::Default());
  ASSERT_OK(rewritten.Open(journal));
  for (size_t i = 0; i < contents.records.size(); ++i) {
    nlohmann::json request = nlohmann::json::parse(contents.records[i].request);
    if (i == 2) {
      request["base_step"] = 1;
      request["overrides"] = {{{"group", "muon"}, {"lr", 0.05}},
                              {{"group", "adamw"}, {"lr", 0.001}},
                              {{"group", "muon"}, {"momentum", 0.8}}};
    }
    ASSERT_OK(
        rewritten.Append(contents.records[i].checkpoint_generation, request.dump(), contents.records[i].gradients));
  }
  rewritten.Close();
  ASSERT_OK_AND_ASSIGN(LoadedSession loaded, Load("bad"));
  EXPECT_EQ(loaded.session->last_step(), 3);
  EXPECT_EQ(LastOverridesOf(*loaded.session, 3),
            R"([{"group":"muon","lr":0.05,"momentum":0.8},{"group":"adamw","lr":0.001}])");
}

TEST_F(RestoreTest, LoadSessionRefusesWhatTheRestoreRefuses) {
  const struct {
    const char* name;
    std::function<void(nlohmann::json&)> edit;
    const char* expected;
  } cases[] = {
      {"another session's id", [](nlohmann::json& m) { m["session_id"] = "other"; }, "session_id 'other'"},
      {"a step count above last_step", [](nlohmann::json& m) { m["step_counts"]["w"] = 99; }, "step_counts"},
      {"an unknown optimizer",
       [](nlohmann::json& m) { m["spec"]["groups"][0]["options"]["optimizer"] = "OPTIMIZER_NOPE"; }, "checkpoint"},
      {"parts written by a rank the session lacks",
       [](nlohmann::json& m) {
         m["parts_written"] = {{"of", "upload"}, {"ranks", {7}}};
       },
       "parts_written.ranks holds 7, not a rank of the session's 1"},
      {"parts written of a load, a count missing",
       [](nlohmann::json& m) {
         m["parts_written"] = {{"of", "load"}, {"ranks", {0}}, {"last_step", 0}, {"step_counts", {{"w", 0}}}};
       },
       "parts_written.step_counts has 1 counts for 2 parameters"},
      {"parts written of a load, an unknown parameter",
       [](nlohmann::json& m) {
         m["parts_written"] = {
             {"of", "load"}, {"ranks", {0}}, {"last_step", 0}, {"step_counts", {{"w", 0}, {"nope", 0}}}};
       },
       "parts_written.step_counts names 'nope'"},
      // Refused before the session is made from the spec: the spec sizes its memory.
      {"a spec shape its tensor file contradicts",
       [](nlohmann::json& m) {
         m["spec"]["parameters"][1]["shape"] = {3, 2};
       },
       "tensor 'b/master' does not have the shape its spec gives the parameter"},
      // Bounded by the spec before the tensors file is read: a forged size is not read into memory.
      {"a tensors file larger than its spec could fill",
       [](nlohmann::json& m) { m["tensors"]["bytes"] = uint64_t{1} << 40; },
       "tensors.bytes declares 1099511627776 bytes, more than its spec's tensors could fill"},
      {"parts written in a session without a partition",
       [](nlohmann::json& m) {
         m["parts_written"] = {{"of", "upload"}, {"ranks", {0}}};
       },
       "parts_written: the session has no partition"},
  };
  const std::string saved = ReadAll(dir_ + "/bad/checkpoint.json");
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    EditBadCheckpoint(c.edit);
    absl::StatusOr<LoadedSession> loaded = Load("bad");
    EXPECT_THAT(loaded, StatusIs(absl::StatusCode::kDataLoss, c.expected));
    EXPECT_FALSE(Restore(durability::DamagedState::kFail).ok());
    std::ofstream(dir_ + "/bad/checkpoint.json", std::ios::trunc) << saved;
  }
  ASSERT_OK_AND_ASSIGN(LoadedSession loaded, Load("bad"));
  EXPECT_EQ(loaded.checkpoint_step, 0);
  EXPECT_EQ(loaded.replayed, 3);
  EXPECT_EQ(loaded.session->last_step(), 3);
}

// In journal mode without --checkpoint-every the journal does not grow without end: a checkpoint
// follows once the gradients journaled since the last one take the session's state bytes (here,
// with the floor at 0; the daemon's is 64 MiB), so a restore reads at most about that much journal.
TEST_F(RestoreTest, TheJournalIsFoldedIntoACheckpointOnceItHoldsTheStatesBytes) {
  durability::StateDirOptions options = Options();
  options.journal_floor_bytes = 0;
  registry_ = std::make_unique<SessionRegistry>(backend_.get(), &codec_, SpecLimits{}, 4, MemoryLimits{}, &metrics_);
  ASSERT_OK(registry_->EnablePersistence(options));
  ASSERT_OK_AND_ASSIGN(CreateResult created, registry_->CreateOrAttach("folded", rpc::SpecToJson(SmallSpec())));
  ASSERT_OK(created.session->Upload(InitialParameters()));
  const int64_t gradient_bytes = 54 * sizeof(float);  // SmallSpec's 8×6 and 6 elements, each step
  const int64_t per_checkpoint = (created.session->state_bytes() + gradient_bytes - 1) / gradient_bytes;
  ASSERT_GT(per_checkpoint, 1);
  const int64_t steps = 3 * per_checkpoint + 1;
  for (int64_t step = 1; step <= steps; ++step) ASSERT_OK(RunStep(*created.session, Request(step), Gradients(step)));
  registry_.reset();  // as after kill -9: no final checkpoint
  ASSERT_OK_AND_ASSIGN(LoadedSession loaded, Load("folded"));
  EXPECT_EQ(loaded.session->last_step(), steps);
  EXPECT_EQ(loaded.checkpoint_step, 3 * per_checkpoint);
  EXPECT_EQ(loaded.replayed, 1);
}

}  // namespace
}  // namespace muond::session
