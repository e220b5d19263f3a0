// Sessions with --state-dir in journal mode, over a fault-injecting file Env: a short write, a full
// disk or a failed fsync while a step is journaled refuses that step with a clear error and changes
// nothing; the same faults while a checkpoint is written leave the previous checkpoint loadable; and
// a restore (a new registry over the same folder, as after kill -9) finds every acknowledged step. A
// step that fails after it began changing the state breaks the session until its state is replaced;
// one that fails after its record but before the masters change has its record withdrawn.
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include "common/status_macros.h"
#include "gmock/gmock.h"
#include "kernels/cpu/cpu_backend.h"
#include "server/durability/fault_injecting_env.h"
#include "server/rpc/session_spec_codec.h"
#include "server/session/session_registry.h"
#include "tests/kernels/forwarding_backend.h"
#include "tests/server/session/session_test_util.h"
#include "tests/testing/status_matchers.h"

namespace muond::session {
namespace {

using ::muond::testing::StatusIs;
using ::testing::HasSubstr;
using namespace ::muond::session::session_testing;

// The CPU backend, whose AdamW fails while `fail_adamw` is set (in SmallSpec's session the Muon group
// is stepped first, so a step then fails with its Muon group's masters already updated), and whose
// reads of device memory fail while `fail_reads` is set, and copies into it while `fail_copies_in` is.
class FailsWhenSet final : public ::muond::testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  absl::Status CopyToDevice(const float* host, float* device, size_t count) override {
    if (fail_copies_in) return absl::ResourceExhaustedError("out of device memory (injected)");
    return ForwardingBackend::CopyToDevice(host, device, count);
  }
  absl::Status AdamW(const kernels::AdamWArgs& args, kernels::StoredRef param, const float* grad,
                     kernels::StoredRef exp_avg, kernels::StoredRef exp_avg_sq, size_t count) override {
    if (fail_adamw) return absl::ResourceExhaustedError("out of device memory (injected)");
    return ForwardingBackend::AdamW(args, param, grad, exp_avg, exp_avg_sq, count);
  }
  absl::Status CopyToHost(const float* device, float* host, size_t count) override {
    if (fail_reads) return absl::InternalError("device read failed (injected)");
    return ForwardingBackend::CopyToHost(device, host, count);
  }
  std::atomic<bool> fail_adamw{false};
  std::atomic<bool> fail_reads{false};
  std::atomic<bool> fail_copies_in{false};
};

// Counts journal withdrawals; every other report is dropped.
class WithdrawalCounter final : public metrics::Metrics {
 public:
  void CallEnded(std::string_view, absl::StatusCode, absl::Duration) override {}
  void CallStarted(std::string_view) override {}
  void StepAnswered(const metrics::StepReport&) override {}
  void SessionsHeld(int, int64_t) override {}
  void JournalAppended(absl::Duration, bool) override {}
  void CheckpointWritten(absl::Duration, bool) override {}
  void JournalRecordWithdrawn(bool ok) override { ++(ok ? withdrawn : failed); }
  std::atomic<int> withdrawn{0};
  std::atomic<int> failed{0};
};

// `spec` as the first of two shards, holding two of the session's three parameters.
v1::SessionSpec OneOfTwoShards(v1::SessionSpec spec) {
  v1::ShardPlacement* shard = spec.mutable_shard();
  shard->add_endpoints("a:1");
  shard->add_endpoints("b:2");
  shard->set_num_parameters(3);
  shard->add_parameters(0);
  shard->add_parameters(1);
  return spec;
}

class DurableSessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/muond-durable-XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
    backend_ = kernels::NewCpuBackend(1, host_addressable_);
    failing_ = std::make_unique<FailsWhenSet>(*backend_);
    ASSERT_OK_AND_ASSIGN(std::shared_ptr<Session> session, Open(&env_));
    ASSERT_OK(session->Upload(InitialParameters()));  // the first checkpoint
    session_ = session;
    // The reference: the same steps without any durability.
    reference_ = NewSession(backend_.get());
    ASSERT_OK(reference_->Upload(InitialParameters()));
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // A registry over the state folder through `env` (a fresh one is a restart) and its session "s".
  absl::StatusOr<std::shared_ptr<Session>> Open(durability::Env* env) {
    durability::StateDirOptions options;
    options.state_dir = dir_;
    options.durability = durability::Durability::kJournal;
    options.backend_name = "cpu";
    options.env = env;
    registry_ = std::make_unique<SessionRegistry>(failing_.get(), &codec_, SpecLimits{}, 4, MemoryLimits{}, &metrics_);
    absl::Status restored = registry_->EnablePersistence(options);
    if (!restored.ok()) return restored;
    absl::StatusOr<CreateResult> created = registry_->CreateOrAttach("s", rpc::SpecToJson(SmallSpec()));
    if (!created.ok()) return created.status();
    return created->session;
  }

  // Step `step` on the session and on the reference; the reference only when the session acknowledged.
  absl::Status Step(int step) {
    absl::StatusOr<StepOutcome> outcome = RunStep(*session_, Request(step), Gradients(step));
    if (outcome.ok()) {
      EXPECT_OK(RunStep(*reference_, Request(step), Gradients(step)).status());
    }
    return outcome.status();
  }

  // Steps 1, 2 and 3; returns the state after step 1 (a state dict saved then, to load back).
  absl::StatusOr<SessionState> ThreeStepsKeepingTheFirstState() {
    MUOND_RETURN_IF_ERROR(Step(1));
    MUOND_ASSIGN_OR_RETURN(SessionState first, session_->ExportState());
    MUOND_RETURN_IF_ERROR(Step(2));
    MUOND_RETURN_IF_ERROR(Step(3));
    return first;
  }

  std::vector<std::vector<float>> ParametersOf(const Session& session) {
    int64_t step = 0;
    return CopyValues(*session.Parameters(&step));
  }

  // Restarts on the real Env and checks the restored session against the reference.
  void ExpectRestoreHoldsEveryAcknowledgedStep() {
    const int64_t acknowledged = reference_->last_step();
    session_.reset();
    ASSERT_OK_AND_ASSIGN(std::shared_ptr<Session> restored, Open(durability::Env::Default()));
    EXPECT_EQ(restored->last_step(), acknowledged);
    EXPECT_EQ(ParametersOf(*restored), ParametersOf(*reference_));
    ASSERT_OK_AND_ASSIGN(SessionState got, restored->ExportState());
    ASSERT_OK_AND_ASSIGN(SessionState want, reference_->ExportState());
    ASSERT_EQ(got.tensors.size(), want.tensors.size());
    for (size_t i = 0; i < got.tensors.size(); ++i) EXPECT_EQ(got.tensors[i].values, want.tensors[i].values);
  }

  // Restarts on the real Env (the caller has let go of its sessions) and checks that session `id`
  // of `spec` comes back at `step` with `parameters`.
  void ExpectRestartRestores(const std::string& id, const v1::SessionSpec& spec, int64_t step,
                             const std::vector<std::vector<float>>& parameters) {
    session_.reset();
    ASSERT_OK(Open(durability::Env::Default()).status());
    ASSERT_OK_AND_ASSIGN(CreateResult restored, registry_->CreateOrAttach(id, rpc::SpecToJson(spec)));
    EXPECT_EQ(restored.session->last_step(), step);
    EXPECT_EQ(ParametersOf(*restored.session), parameters);
  }

  bool host_addressable_ = true;  // false: the step paths of a device's memory (a GPU's)
  std::string dir_;
  durability::FaultInjectingEnv env_{durability::Env::Default()};
  rpc::ProtoSpecCodec codec_;
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<FailsWhenSet> failing_;  // the sessions' backend
  WithdrawalCounter metrics_;              // the registries' (outlives them: declared before)
  std::unique_ptr<SessionRegistry> registry_;
  std::shared_ptr<Session> session_;
  std::unique_ptr<Session> reference_;
};

TEST_F(DurableSessionTest, AJournalFaultRefusesTheStepAndLosesNoAcknowledgedOne) {
  const struct {
    const char* name;
    std::function<void(durability::FaultInjectingEnv&)> arm;
  } faults[] = {
      {"short write", [](auto& env) { env.FailAppend("journal.log", durability::AppendFault::kShortWrite); }},
      {"no space", [](auto& env) { env.FailAppend("journal.log", durability::AppendFault::kNoSpace); }},
      {"failed fsync", [](auto& env) { env.FailSync("journal.log"); }},
  };
  int step = 0;
  for (const auto& fault : faults) {
    SCOPED_TRACE(fault.name);
    ASSERT_OK(Step(++step));
    const auto before = ParametersOf(*session_);
    fault.arm(env_);
    EXPECT_THAT(Step(step + 1), StatusIs(absl::StatusCode::kUnavailable, "could not be made durable"));
    EXPECT_EQ(session_->last_step(), step) << "the refused step changed the counter";
    EXPECT_EQ(ParametersOf(*session_), before) << "the refused step changed the parameters";
    ASSERT_OK(Step(++step)) << "the same step goes through once the disk is well again";
  }
  EXPECT_EQ(env_.faults_triggered(), 3);
  ExpectRestoreHoldsEveryAcknowledgedStep();
}

TEST_F(DurableSessionTest, ACheckpointFaultKeepsThePreviousCheckpointLoadable) {
  const struct {
    const char* name;
    std::function<void(durability::FaultInjectingEnv&)> arm;
  } faults[] = {
      {"short write of the tensors",
       [](auto& env) { env.FailAppend("safetensors", durability::AppendFault::kShortWrite); }},
      {"no space for the metadata",
       [](auto& env) { env.FailAppend("checkpoint.json", durability::AppendFault::kNoSpace); }},
      {"failed fsync of the tensors", [](auto& env) { env.FailSync("safetensors"); }},
      {"failed rename of the metadata", [](auto& env) { env.FailRename("checkpoint.json"); }},
      // The tensor file's fsync, the folder's, the metadata's pass; the folder's after the metadata's
      // rename fails: the checkpoint is in place though the write failed, and the steps after it
      // must follow it at a restore.
      {"failed fsync of the folder after the metadata's rename",
       [this](auto& env) { env.FailSync(dir_ + "/s", /*after_syncs=*/3); }},
  };
  int step = 0;
  for (const auto& fault : faults) {
    SCOPED_TRACE(fault.name);
    ASSERT_OK(Step(++step));
    fault.arm(env_);
    absl::StatusOr<int64_t> checkpoint = session_->Checkpoint();
    EXPECT_FALSE(checkpoint.ok());
    EXPECT_THAT(checkpoint.status().message(), HasSubstr(dir_)) << "the error names the file";
    ASSERT_OK(Step(++step)) << "steps go on; the journal still holds them";
  }
  EXPECT_EQ(env_.faults_triggered(), 5);
  ExpectRestoreHoldsEveryAcknowledgedStep();
}

// A SetState back to step 1 whose checkpoint is written but whose journal cannot be emptied: the
// journal still holds steps 1 to 3 of the state replaced, after the new checkpoint's step. They were
// written before it (an older checkpoint generation), so a restart never replays them onto it.
TEST_F(DurableSessionTest, StepsOfAStateReplacedAreNotReplayedOntoItsReplacement) {
  ASSERT_OK_AND_ASSIGN(SessionState loaded, ThreeStepsKeepingTheFirstState());
  env_.FailTruncate("journal.log");
  ASSERT_OK(session_->ImportState(loaded)) << "the checkpoint is written; the journal's records predate it";
  ASSERT_OK(reference_->ImportState(loaded));
  EXPECT_EQ(env_.faults_triggered(), 1);
  ExpectRestoreHoldsEveryAcknowledgedStep();
}

// The same truncation emptying the file but failing its fsync: the steps after it are journaled
// from an empty file, a torn append among them is cut off, and a restart finds every one.
TEST_F(DurableSessionTest, AJournalEmptiedButNotSyncedTakesItsNextStepsWhole) {
  ASSERT_OK_AND_ASSIGN(SessionState loaded, ThreeStepsKeepingTheFirstState());
  env_.FailTruncate("journal.log", durability::TruncateFault::kTruncatedNotSynced);
  ASSERT_OK(session_->ImportState(loaded));
  ASSERT_OK(reference_->ImportState(loaded));
  ASSERT_OK(Step(2));
  env_.FailAppend("journal.log", durability::AppendFault::kShortWrite);
  EXPECT_THAT(Step(3), StatusIs(absl::StatusCode::kUnavailable, "journal"));
  ASSERT_OK(Step(3));
  ASSERT_OK(Step(4));
  EXPECT_EQ(env_.faults_triggered(), 2);
  ExpectRestoreHoldsEveryAcknowledgedStep();
}

// A crash during an append left a torn tail, and the restart's own checkpoint (which would empty the
// journal) fails: the session is served from its journal, and its next record must not follow the
// torn bytes (a later restore would refuse the journal as altered, and lose every step in it). The
// tail is cut off first, and a second restart finds every acknowledged step.
TEST_F(DurableSessionTest, ATornTailIsCutOffBeforeTheNextRecordWhenTheRestartCannotCheckpoint) {
  ASSERT_OK(Step(1));
  ASSERT_OK(Step(2));
  session_.reset();
  registry_.reset();
  {
    std::ofstream journal(dir_ + "/s/journal.log", std::ios::binary | std::ios::app);
    journal << "MJR4" << std::string(7, '\x01');  // a header cut short
  }
  env_.FailRename("checkpoint.json");
  ASSERT_OK_AND_ASSIGN(session_, Open(&env_));
  EXPECT_EQ(env_.faults_triggered(), 1) << "the restart's checkpoint did not fail";
  EXPECT_EQ(session_->last_step(), 2);
  ASSERT_OK(Step(3));
  ExpectRestoreHoldsEveryAcknowledgedStep();
}

// Checkpoint tries that failed before a stop count after it: their generations are in the journal,
// and the restored session goes on from the highest. Had it started again from its checkpoint's, a
// later SetState back (whose journal could not be emptied) would take a generation that records of
// the history it replaced already carry, and a restart would replay them onto it.
// A restart that cannot read a session's files for want of its own (open files, memory) stops, moving
// nothing: the folder is intact, and quarantining it would free its id for a new session. A read
// error of the files themselves (EIO) still quarantines the folder (moved, never deleted).
TEST_F(DurableSessionTest, ARestartShortOfFilesOrMemoryStopsAndLeavesTheFolderInPlace) {
  ASSERT_OK(Step(1));
  ASSERT_OK(Step(2));
  session_.reset();
  for (int shortage : {EMFILE, ENOMEM}) {
    SCOPED_TRACE(shortage);
    env_.FailRead("checkpoint.json", shortage);
    EXPECT_THAT(Open(&env_), StatusIs(absl::StatusCode::kResourceExhausted, "checkpoint.json"));
    EXPECT_TRUE(std::filesystem::exists(dir_ + "/s/checkpoint.json"));
    EXPECT_FALSE(std::filesystem::exists(dir_ + "/+quarantine"));
  }
  ExpectRestoreHoldsEveryAcknowledgedStep();
  session_.reset();
  env_.FailRead("checkpoint.json", EIO);
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Session> fresh, Open(&env_));  // "s" quarantined, then made anew
  EXPECT_EQ(fresh->last_step(), 0);
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/+quarantine"));
}

// A new session's folder is made durable in the state directory (its entry fsynced) when it is made,
// before any step of it is acknowledged.
TEST_F(DurableSessionTest, ANewSessionsFolderIsSyncedIntoTheStateDirectory) {
  const size_t before = env_.synced_folders().size();
  ASSERT_OK(registry_->CreateOrAttach("t", rpc::SpecToJson(SmallSpec())).status());
  ASSERT_TRUE(std::filesystem::is_directory(dir_ + "/t"));
  const std::vector<std::string> synced = env_.synced_folders();
  EXPECT_NE(std::find(synced.begin() + static_cast<std::ptrdiff_t>(before), synced.end(), dir_), synced.end());
}

TEST_F(DurableSessionTest, GenerationsTriedBeforeAStopAreNotGivenAgain) {
  ASSERT_OK(Step(1));
  ASSERT_OK(Step(2));
  for (int step = 3; step <= 5; step += 2) {
    env_.FailRename("checkpoint.json");  // fails before the rename: the checkpoint of the upload stays
    EXPECT_FALSE(session_->Checkpoint().ok());
    ASSERT_OK(Step(step));
    ASSERT_OK(Step(step + 1));
  }
  env_.FailRename("checkpoint.json");  // the restart's own checkpoint fails as well
  session_.reset();
  ASSERT_OK_AND_ASSIGN(session_, Open(&env_));
  ASSERT_EQ(session_->last_step(), 6) << "restored from the upload's checkpoint and the journal";
  // A state dict saved at step 4 (the reference stepped alike), loaded back.
  std::unique_ptr<Session> at_step_four = NewSession(backend_.get());
  ASSERT_OK(at_step_four->Upload(InitialParameters()));
  for (int step = 1; step <= 4; ++step) ASSERT_OK(RunStep(*at_step_four, Request(step), Gradients(step)).status());
  ASSERT_OK_AND_ASSIGN(SessionState loaded, at_step_four->ExportState());
  env_.FailTruncate("journal.log");
  ASSERT_OK(session_->ImportState(loaded));
  ASSERT_OK(reference_->ImportState(loaded));
  ExpectRestoreHoldsEveryAcknowledgedStep();
}

// A SetState whose checkpoint cannot be written (a full disk) is answered UNAVAILABLE: the state is in
// place but not saved, so no step is applied on it until a checkpoint succeeds — a step journaled on
// it would follow the journal's records of the state replaced, and a restart would refuse the lot.
// Once the checkpoint is written the steps go on, and a restart finds every acknowledged one.
TEST_F(DurableSessionTest, AStateThatCouldNotBeSavedTakesNoStepUntilACheckpointSucceeds) {
  ASSERT_OK_AND_ASSIGN(SessionState loaded, ThreeStepsKeepingTheFirstState());
  env_.FailAppend("checkpoint.json", durability::AppendFault::kNoSpace);
  EXPECT_THAT(session_->ImportState(loaded), StatusIs(absl::StatusCode::kUnavailable, "could not be saved"));
  ASSERT_OK(reference_->ImportState(loaded));
  EXPECT_THAT(RunStep(*session_, Request(2), Gradients(2)),
              StatusIs(absl::StatusCode::kFailedPrecondition, "no step is applied until a checkpoint succeeds"));
  EXPECT_EQ(session_->last_step(), 1);
  ASSERT_OK(session_->Checkpoint().status());
  ASSERT_OK(Step(2));
  ASSERT_OK(Step(3));
  ExpectRestoreHoldsEveryAcknowledgedStep();
}

// The same for an upload: a session whose first parameters were not saved takes no step until the
// upload is sent again and saved (a journal without a checkpoint beside it would be dropped at restore).
TEST_F(DurableSessionTest, AnUploadThatCouldNotBeSavedTakesNoStepUntilSentAgain) {
  ASSERT_OK_AND_ASSIGN(CreateResult created, registry_->CreateOrAttach("u", rpc::SpecToJson(SmallSpec())));
  env_.FailAppend("checkpoint.json", durability::AppendFault::kNoSpace);
  EXPECT_THAT(created.session->Upload(InitialParameters()),
              StatusIs(absl::StatusCode::kUnavailable, "the upload put in place could not be saved"));
  EXPECT_THAT(RunStep(*created.session, Request(1), Gradients(1)),
              StatusIs(absl::StatusCode::kFailedPrecondition, "is not saved"));
  ASSERT_OK(created.session->Upload(InitialParameters()));
  ASSERT_OK(RunStep(*created.session, Request(1), Gradients(1)).status());
}

TEST_F(DurableSessionTest, ACheckpointAfterAFailedAppendStartsFromAnEmptyJournal) {
  ASSERT_OK(Step(1));
  env_.FailAppend("journal.log", durability::AppendFault::kShortWrite);
  EXPECT_THAT(Step(2), StatusIs(absl::StatusCode::kUnavailable, "journal"));
  ASSERT_OK_AND_ASSIGN(int64_t checkpointed, session_->Checkpoint());
  EXPECT_EQ(checkpointed, 1);
  ASSERT_OK(Step(2));
  ExpectRestoreHoldsEveryAcknowledgedStep();
}

// The magnitude guard reads the state when a gradient is large enough that its cheap bound does not
// rule out an overflow (here AdamW's second moment, beyond fp32 for a gradient of 1e22). That read
// fails: it comes before the step's journal record, so the step is refused alone: nothing journaled,
// nothing changed, the session not broken, and the same step goes through once reads work again.
TEST_F(DurableSessionTest, AStepThatFailsBeforeItsRecordIsRefusedAloneWithNothingJournaled) {
  ASSERT_OK(Step(1));
  const auto before = ParametersOf(*session_);
  std::vector<HostTensor> huge = Gradients(2);
  std::vector<float> values = huge[1].values;
  values[0] = 1e22f;
  huge[1] = Tensor(values);
  failing_->fail_reads = true;
  EXPECT_THAT(RunStep(*session_, Request(2), huge), StatusIs(absl::StatusCode::kInternal, "injected"));
  failing_->fail_reads = false;
  EXPECT_EQ(session_->last_step(), 1);
  EXPECT_EQ(ParametersOf(*session_), before);
  ASSERT_OK(Step(2)) << "the refused step broke the session";
  ASSERT_OK(Step(3));
  ExpectRestoreHoldsEveryAcknowledgedStep();  // the journal holds steps 2 and 3, not the refused one
}

// The same sessions over a backend whose memory is not the host's, as a GPU's: a step's gradients are
// copied into device buffers after its journal record (the record holds them unclipped).
class DurableDeviceSessionTest : public DurableSessionTest {
 protected:
  DurableDeviceSessionTest() { host_addressable_ = false; }
};

// The copy of step 2's gradients to the device fails (out of memory) after the step was journaled but
// before any master changed: the record is withdrawn and the step refused alone. The session is not
// broken, the resend is applied once, and a restart finds steps 1 to 3 each applied once.
TEST_F(DurableDeviceSessionTest, AStepThatFailsBeforeTheMastersChangeIsWithdrawnAndRefusedAlone) {
  ASSERT_OK(Step(1));
  const auto before = ParametersOf(*session_);
  failing_->fail_copies_in = true;
  EXPECT_THAT(Step(2), StatusIs(absl::StatusCode::kResourceExhausted, "injected"));
  failing_->fail_copies_in = false;
  EXPECT_EQ(session_->last_step(), 1);
  EXPECT_EQ(ParametersOf(*session_), before);
  ASSERT_OK(Step(2)) << "the refused step broke the session";
  ASSERT_OK(Step(3));
  EXPECT_EQ(metrics_.withdrawn, 1);
  EXPECT_EQ(metrics_.failed, 0);
  ExpectRestoreHoldsEveryAcknowledgedStep();  // the journal holds step 2 once
}

// The same failure, and the journal cannot be cut back without the record (its truncation fails): a
// restart would apply step 2, and a resend would be journaled twice, so the session is broken, saying
// so; the state is step 1's, and a restart restores it through step 2 from the record kept.
TEST_F(DurableDeviceSessionTest, ARecordThatCannotBeWithdrawnBreaksTheSession) {
  ASSERT_OK(Step(1));
  const auto before = ParametersOf(*session_);
  failing_->fail_copies_in = true;
  env_.FailTruncate("journal.log");
  EXPECT_THAT(Step(2), StatusIs(absl::StatusCode::kResourceExhausted, "injected"));
  failing_->fail_copies_in = false;
  EXPECT_THAT(Step(2), StatusIs(absl::StatusCode::kFailedPrecondition,
                                "step 2 failed before it changed the state (out of device memory (injected)), "
                                "but its journal record could not be withdrawn"));
  EXPECT_THAT(session_->Checkpoint(),
              StatusIs(absl::StatusCode::kFailedPrecondition, "(through step 2, or step 1 should the record be gone)"));
  EXPECT_EQ(session_->last_step(), 1);
  EXPECT_EQ(ParametersOf(*session_), before);
  EXPECT_EQ(metrics_.withdrawn, 0);
  EXPECT_EQ(metrics_.failed, 1);
  ASSERT_OK(RunStep(*reference_, Request(2), Gradients(2)).status());
  ExpectRestoreHoldsEveryAcknowledgedStep();  // step 2, from its record
}

// The same, and the withdrawal cuts the record off but cannot make the cut durable (its fsync fails):
// whether a crash would keep the record is not known, so the session is broken as above; here the
// daemon is restarted without a crash, the record is gone, and a restart restores step 1, the state
// the session held, so the resend is applied then.
TEST_F(DurableDeviceSessionTest, AWithdrawalNotKnownDurableBreaksTheSessionAndARestartHoldsTheStepBefore) {
  ASSERT_OK(Step(1));
  const auto before = ParametersOf(*session_);
  failing_->fail_copies_in = true;
  env_.FailTruncate("journal.log", durability::TruncateFault::kTruncatedNotSynced);
  EXPECT_THAT(Step(2), StatusIs(absl::StatusCode::kResourceExhausted, "injected"));
  failing_->fail_copies_in = false;
  EXPECT_EQ(env_.faults_triggered(), 1);
  EXPECT_THAT(Step(2), StatusIs(absl::StatusCode::kFailedPrecondition, "its journal record could not be withdrawn"));
  EXPECT_THAT(session_->Checkpoint(),
              StatusIs(absl::StatusCode::kFailedPrecondition, "(through step 2, or step 1 should the record be gone)"));
  EXPECT_EQ(ParametersOf(*session_), before);
  EXPECT_EQ(metrics_.failed, 1);
  ExpectRestoreHoldsEveryAcknowledgedStep();  // step 1: the record is gone
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Session> restored, registry_->Find("s"));
  ASSERT_OK(RunStep(*restored, Request(2), Gradients(2)).status());
  ASSERT_OK(RunStep(*reference_, Request(2), Gradients(2)).status());
  EXPECT_EQ(ParametersOf(*restored), ParametersOf(*reference_));
}

// Two ranks in lock-step: the last to arrive journals their mean, and its copy to the device fails.
// Both ranks are refused with that reason (RESOURCE_EXHAUSTED, not "aborted" or broken), the record is
// withdrawn, the step goes through when both send it again, and a restart finds steps 1 to 3 each
// applied once: the state the session had before the restart.
TEST_F(DurableDeviceSessionTest, AGatheredStepThatFailsBeforeTheMastersChangeIsWithdrawnForEveryRank) {
  ASSERT_OK_AND_ASSIGN(CreateResult created, registry_->CreateOrAttach("g", rpc::SpecToJson(SmallSpec(2))));
  std::shared_ptr<Session> two = created.session;
  ASSERT_OK(two->Upload(InitialParameters()));
  auto both_ranks = [&](int step) {
    std::vector<absl::Status> answers(2);
    std::vector<std::thread> ranks;
    for (int rank = 0; rank < 2; ++rank) {
      ranks.emplace_back([&, rank] {
        StepRequest request = Request(step, rank);
        request.session_id = "g";
        answers[rank] = RunStep(*two, request, Gradients(step + rank)).status();
      });
    }
    for (std::thread& t : ranks) t.join();
    return answers;
  };
  for (const absl::Status& answer : both_ranks(1)) ASSERT_OK(answer);
  const auto after_one = ParametersOf(*two);
  failing_->fail_copies_in = true;
  for (const absl::Status& answer : both_ranks(2)) {
    EXPECT_THAT(answer, StatusIs(absl::StatusCode::kResourceExhausted, "injected"));
  }
  failing_->fail_copies_in = false;
  EXPECT_EQ(two->last_step(), 1);
  EXPECT_EQ(ParametersOf(*two), after_one);
  for (const absl::Status& answer : both_ranks(2)) ASSERT_OK(answer) << "the refusal broke the session";
  for (const absl::Status& answer : both_ranks(3)) ASSERT_OK(answer);
  const auto after_three = ParametersOf(*two);
  two.reset();
  created.session.reset();
  ExpectRestartRestores("g", SmallSpec(2), 3, after_three);
}

// A SetState (load_state_dict of step 1's state) fails once it began writing the state (`fault`):
// its state is no step's. No step is applied and no checkpoint written on it (before, the next step
// was applied on it and journaled after the records of steps 1 to 3, which a restart would refuse or
// replay onto the older state); a restart restores step 3, the state before it; sent again there, the
// SetState succeeds and the steps go on.
class HalfwaySetStateTest : public DurableDeviceSessionTest {
 protected:
  void Run(std::atomic<bool>& fault) {
    ASSERT_OK_AND_ASSIGN(SessionState first, ThreeStepsKeepingTheFirstState());
    fault = true;
    EXPECT_FALSE(session_->ImportState(first).ok());
    fault = false;
    const std::string broken = "a SetState failed after it began replacing the state";
    // The next step of the session as it stands (the read-back fails after the step was replaced).
    EXPECT_THAT(Step(static_cast<int>(session_->last_step()) + 1),
                StatusIs(absl::StatusCode::kFailedPrecondition, broken));
    EXPECT_THAT(session_->Checkpoint(), StatusIs(absl::StatusCode::kFailedPrecondition, broken));
    EXPECT_THAT(session_->ExportState(), StatusIs(absl::StatusCode::kFailedPrecondition, broken));
    ExpectRestoreHoldsEveryAcknowledgedStep();  // step 3
    ASSERT_OK_AND_ASSIGN(session_, Open(durability::Env::Default()));
    ASSERT_OK(session_->ImportState(first));
    ASSERT_OK(reference_->ImportState(first));
    ASSERT_OK(Step(2));
    ExpectRestoreHoldsEveryAcknowledgedStep();
  }
};

// Its first copy to the device fails, after every step count was replaced.
TEST_F(HalfwaySetStateTest, ACopyToTheDeviceFailing) { Run(failing_->fail_copies_in); }

// Reading the parameters back fails, after every tensor was replaced.
TEST_F(HalfwaySetStateTest, TheReadBackFailing) { Run(failing_->fail_reads); }

// An upload sent again before the first step fails halfway: no step until it is sent again.
TEST_F(DurableDeviceSessionTest, AnUploadThatFailsHalfwayTakesNoStepUntilItIsSentAgain) {
  failing_->fail_copies_in = true;
  EXPECT_THAT(session_->Upload(InitialParameters()), StatusIs(absl::StatusCode::kResourceExhausted, "injected"));
  failing_->fail_copies_in = false;
  EXPECT_THAT(Step(1),
              StatusIs(absl::StatusCode::kFailedPrecondition, "an upload failed after it began replacing the state"));
  ASSERT_OK(session_->Upload(InitialParameters()));
  ASSERT_OK(Step(1));
  ExpectRestoreHoldsEveryAcknowledgedStep();
}

// An asynchronous session: rank 1's first push is journaled as global step 2 and its copy to the
// device fails. The record is withdrawn and the push refused alone, so push 1 is still rank 1's next
// one: sent again it is applied (not answered as a resend of a push taken), and a restart finds
// global steps 1 to 3 each applied once.
TEST_F(DurableDeviceSessionTest, AnAsyncPushThatFailsBeforeTheMastersChangeIsWithdrawnAndStillToBeTaken) {
  v1::SessionSpec spec = SmallSpec(2);
  spec.mutable_sync()->set_mode(v1::SYNC_MODE_ASYNC);
  spec.mutable_sync()->set_max_staleness(4);
  ASSERT_OK_AND_ASSIGN(CreateResult created, registry_->CreateOrAttach("a", rpc::SpecToJson(spec)));
  std::shared_ptr<Session> async = created.session;
  ASSERT_OK(async->Upload(InitialParameters()));
  auto push = [&](int step, int rank, int64_t base_step) {
    StepRequest request = Request(step, rank);
    request.session_id = "a";
    request.base_step = base_step;
    return RunStep(*async, request, Gradients(10 * rank + step));
  };
  ASSERT_OK(push(1, 0, 0).status());
  const auto after_one = ParametersOf(*async);
  failing_->fail_copies_in = true;
  EXPECT_THAT(push(1, 1, 0), StatusIs(absl::StatusCode::kResourceExhausted, "injected"));
  failing_->fail_copies_in = false;
  EXPECT_EQ(async->last_step(), 1);
  EXPECT_EQ(ParametersOf(*async), after_one);
  ASSERT_OK_AND_ASSIGN(StepOutcome resent, push(1, 1, 0));
  EXPECT_FALSE(resent.result.replayed) << "the withdrawn push was taken as one already applied";
  EXPECT_TRUE(resent.result.applied);
  EXPECT_EQ(resent.result.global_step, 2);
  ASSERT_OK(push(2, 0, 2).status());
  EXPECT_EQ(async->last_step(), 3);
  const auto after_three = ParametersOf(*async);
  async.reset();
  created.session.reset();
  ExpectRestartRestores("a", spec, 3, after_three);
  EXPECT_EQ(metrics_.withdrawn, 1);
}

// A shard's commit is journaled and its copy to the device fails: the record is withdrawn and the
// commit refused alone; the prepared gradients are spent, so the step is prepared again (a commit
// alone is refused, naming that), then committed, and a restart finds steps 1 and 2 each applied once.
TEST_F(DurableDeviceSessionTest, AShardsCommitThatFailsBeforeTheMastersChangeIsWithdrawnAndPreparedAgain) {
  const v1::SessionSpec spec = OneOfTwoShards(SmallSpec());
  ASSERT_OK_AND_ASSIGN(CreateResult created, registry_->CreateOrAttach("c", rpc::SpecToJson(spec)));
  std::shared_ptr<Session> sharded = created.session;
  ASSERT_OK(sharded->Upload(InitialParameters()));
  auto phase = [&](int step, StepPhase which) {
    StepRequest request = Request(step);
    request.session_id = "c";
    request.phase = which;
    if (which == StepPhase::kCommit) request.decision = ShardDecision{100.0, ""};  // the global norm, no clip
    return RunStep(*sharded, request, which == StepPhase::kPrepare ? Gradients(step) : std::vector<HostTensor>());
  };
  ASSERT_OK(phase(1, StepPhase::kPrepare).status());
  ASSERT_OK(phase(1, StepPhase::kCommit).status());
  const auto after_one = ParametersOf(*sharded);
  ASSERT_OK(phase(2, StepPhase::kPrepare).status());
  failing_->fail_copies_in = true;
  EXPECT_THAT(phase(2, StepPhase::kCommit), StatusIs(absl::StatusCode::kResourceExhausted, "injected"));
  failing_->fail_copies_in = false;
  EXPECT_EQ(sharded->last_step(), 1);
  EXPECT_EQ(ParametersOf(*sharded), after_one);
  EXPECT_THAT(phase(2, StepPhase::kCommit), StatusIs(absl::StatusCode::kFailedPrecondition, "prepare it again"));
  ASSERT_OK(phase(2, StepPhase::kPrepare).status()) << "the refused commit broke the session";
  ASSERT_OK_AND_ASSIGN(StepOutcome committed, phase(2, StepPhase::kCommit));
  EXPECT_FALSE(committed.result.replayed);
  EXPECT_EQ(sharded->last_step(), 2);
  const auto after_two = ParametersOf(*sharded);
  sharded.reset();
  created.session.reset();
  ExpectRestartRestores("c", spec, 2, after_two);
  EXPECT_EQ(metrics_.withdrawn, 1);
}

// Two ranks in lock-step: whichever arrives last applies their mean (or, for a sharded session's
// prepare, prepares it), and that fails before anything changed (the magnitude guard's read). Both
// ranks are refused with that reason, not one of them with only "aborted", nothing is journaled,
// and the step goes through when both send it again.
TEST_F(DurableSessionTest, AGatheredStepRefusedBeforeItsRecordTellsEveryRankWhy) {
  for (const StepPhase phase : {StepPhase::kWhole, StepPhase::kPrepare}) {
    const std::string id = phase == StepPhase::kWhole ? "whole" : "prepared";
    SCOPED_TRACE(id);
    failing_->fail_reads = false;
    const v1::SessionSpec spec = phase == StepPhase::kPrepare ? OneOfTwoShards(SmallSpec(2)) : SmallSpec(2);
    ASSERT_OK_AND_ASSIGN(CreateResult created, registry_->CreateOrAttach(id, rpc::SpecToJson(spec)));
    std::shared_ptr<Session> two = created.session;
    ASSERT_OK(two->Upload(InitialParameters()));
    auto both_ranks = [&](int step, const std::vector<HostTensor>& gradients) {
      std::vector<absl::Status> answers(2);
      std::vector<std::thread> ranks;
      for (int rank = 0; rank < 2; ++rank) {
        ranks.emplace_back([&, rank] {
          StepRequest request = Request(step, rank);
          request.session_id = id;
          request.phase = phase;
          answers[rank] = RunStep(*two, request, gradients).status();
        });
      }
      for (std::thread& t : ranks) t.join();
      return answers;
    };
    if (phase == StepPhase::kWhole) {
      for (const absl::Status& answer : both_ranks(1, Gradients(1))) ASSERT_OK(answer);
    }
    const int step = phase == StepPhase::kWhole ? 2 : 1;
    std::vector<HostTensor> huge = Gradients(step);
    std::vector<float> values = huge[1].values;
    values[0] = 1e22f;
    huge[1] = Tensor(values);
    failing_->fail_reads = true;
    for (const absl::Status& answer : both_ranks(step, huge)) {
      EXPECT_THAT(answer, StatusIs(absl::StatusCode::kInternal, "injected"));
    }
    failing_->fail_reads = false;
    EXPECT_EQ(two->last_step(), step - 1);
    for (const absl::Status& answer : both_ranks(step, Gradients(step))) ASSERT_OK(answer) << "the refusal broke it";
  }
}

// Step 2 fails after its Muon group was updated (and after its journal record): a resend would apply
// that group twice, and a checkpoint would save a state that is no step's. The session refuses both,
// naming the step, until a restart restores the journaled step whole.
TEST_F(DurableSessionTest, AStepThatFailsHalfwayBreaksTheSessionUntilARestartRestoresItWhole) {
  ASSERT_OK(Step(1));
  const auto after_one = ParametersOf(*session_);
  failing_->fail_adamw = true;
  EXPECT_THAT(Step(2), StatusIs(absl::StatusCode::kResourceExhausted, "injected"));
  failing_->fail_adamw = false;
  const auto half = ParametersOf(*session_);
  EXPECT_NE(half[0], after_one[0]) << "the Muon group was not updated before the failure";
  EXPECT_EQ(half[1], after_one[1]);

  const std::string broken = "step 2 failed after it began changing the state";
  EXPECT_THAT(Step(2), StatusIs(absl::StatusCode::kFailedPrecondition, broken));
  EXPECT_EQ(session_->last_step(), 1);
  EXPECT_EQ(ParametersOf(*session_), half) << "a refused resend changed the state";
  EXPECT_THAT(session_->ExportState(), StatusIs(absl::StatusCode::kFailedPrecondition, broken));
  EXPECT_THAT(session_->ReadLatestParameters(), StatusIs(absl::StatusCode::kFailedPrecondition, broken));
  EXPECT_THAT(Step(1), StatusIs(absl::StatusCode::kFailedPrecondition, broken)) << "a replay reads half a step";
  EXPECT_THAT(session_->Checkpoint(), StatusIs(absl::StatusCode::kFailedPrecondition, "restores it through step 2"));

  ASSERT_OK(RunStep(*reference_, Request(2), Gradients(2)).status());
  ExpectRestoreHoldsEveryAcknowledgedStep();  // the journaled step 2, whole
}

// A SetState (load_state_dict of a saved state) mends a broken session: steps go on from it.
TEST_F(DurableSessionTest, ABrokenSessionTakesStepsAgainOnceASetStateReplacesItsState) {
  ASSERT_OK(Step(1));
  ASSERT_OK_AND_ASSIGN(SessionState first, session_->ExportState());
  failing_->fail_adamw = true;
  EXPECT_THAT(Step(2), StatusIs(absl::StatusCode::kResourceExhausted, "injected"));
  failing_->fail_adamw = false;
  ASSERT_OK(session_->ImportState(first));
  ASSERT_OK(Step(2));
  ASSERT_OK(Step(3));
  ExpectRestoreHoldsEveryAcknowledgedStep();
}

}  // namespace
}  // namespace muond::session
