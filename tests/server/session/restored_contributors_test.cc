// Who took part in a session's last steps survives a restore from a checkpoint alone: a quorum rank
// that contributed and resends is told its gradients were used, one that was left out is told they
// were not, each with the step's contributors and total weight; a lock-step session answers them too.
// A checkpoint whose record does not fit the session is refused naming it, and a SetState's state,
// another history, leaves them unknown.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>

#include "gmock/gmock.h"
#include "kernels/cpu/cpu_backend.h"
#include "nlohmann/json.hpp"
#include "server/durability/file_util.h"
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
using namespace ::muond::session::session_testing;

// Three ranks; a step is taken once two have sent it (no grace), so ranks 0 and 1 take it alone.
v1::SessionSpec QuorumSpec() {
  v1::SessionSpec spec = SmallSpec(/*world_size=*/3);
  spec.mutable_sync()->set_mode(v1::SYNC_MODE_QUORUM);
  spec.mutable_sync()->set_min_ranks(2);
  spec.mutable_sync()->set_grace_seconds(0);
  return spec;
}

StepRequest RankRequest(int64_t step, int rank, double weight) {
  StepRequest request = Request(step, rank);
  request.session_id = "q";
  request.weight = weight;
  return request;
}

class RestoredContributorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/muond-contributors-XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    root_ = pattern;
    backend_ = kernels::NewCpuBackend(1);
  }
  void TearDown() override {
    registry_.reset();
    fs::remove_all(root_);
  }
  durability::StateDirOptions Options() const {
    durability::StateDirOptions options;
    options.state_dir = root_;
    options.durability = durability::Durability::kJournal;
    options.backend_name = "cpu";
    return options;
  }
  absl::Status Restore() {
    registry_ = std::make_unique<SessionRegistry>(backend_.get(), &codec_, SpecLimits{}, 4);
    return registry_->EnablePersistence(Options());
  }
  // Session "q" of `spec`: step 1 taken by ranks 0 (weight 1) and 1 (weight 0.5), then checkpointed,
  // which empties the journal: a restart restores from the checkpoint alone.
  void StepAndCheckpoint(const v1::SessionSpec& spec, int ranks) {
    ASSERT_OK(Restore());
    ASSERT_OK_AND_ASSIGN(CreateResult created, registry_->CreateOrAttach("q", rpc::SpecToJson(spec)));
    ASSERT_OK(created.session->Upload(InitialParameters()));
    std::vector<absl::StatusOr<StepOutcome>> answers(static_cast<size_t>(ranks));
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r) {
      threads.emplace_back(
          [&, r] { answers[r] = RunStep(*created.session, RankRequest(1, r, r == 1 ? 0.5 : 1.0), Gradients(1 + r)); });
    }
    for (std::thread& t : threads) t.join();
    for (const auto& answer : answers) {
      ASSERT_OK(answer.status());
      EXPECT_TRUE(answer->result.included);
    }
    ASSERT_OK_AND_ASSIGN(const int64_t checkpointed, created.session->Checkpoint());
    ASSERT_EQ(checkpointed, 1);
    created.session.reset();
    registry_.reset();
  }
  nlohmann::json Metadata() const {
    std::ifstream in(root_ + "/q/checkpoint.json");
    return nlohmann::json::parse(in);
  }
  // Rewrites the checkpoint's metadata through `edit`, with a digest that matches again.
  void EditCheckpoint(const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json metadata = Metadata();
    edit(metadata);
    metadata.erase("metadata_sha256");
    metadata["metadata_sha256"] = durability::Sha256Hex(metadata.dump());
    std::ofstream(root_ + "/q/checkpoint.json", std::ios::trunc) << metadata.dump();
  }

  std::string root_;
  rpc::ProtoSpecCodec codec_;
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<SessionRegistry> registry_;
};

TEST_F(RestoredContributorsTest, AQuorumResendAfterACheckpointRestoreIsToldWhetherItWasUsed) {
  StepAndCheckpoint(QuorumSpec(), /*ranks=*/2);
  EXPECT_EQ(Metadata()["contributors"], nlohmann::json::parse("[[1, 1.5, [0, 1]]]"));
  ASSERT_OK(Restore());
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Session> restored, registry_->Find("q"));
  ASSERT_EQ(restored->last_step(), 1);

  // Rank 1 lost its answer: the replay says its gradients were used, and by whom.
  ASSERT_OK_AND_ASSIGN(StepOutcome resent, RunStep(*restored, RankRequest(1, 1, 0.5), Gradients(2)));
  EXPECT_TRUE(resent.result.replayed);
  EXPECT_TRUE(resent.result.included);
  EXPECT_THAT(resent.result.contributors, ElementsAre(0, 1));
  EXPECT_EQ(resent.result.total_weight, 1.5);
  // Rank 2 arrives late: left out, with the same account.
  ASSERT_OK_AND_ASSIGN(StepOutcome late, RunStep(*restored, RankRequest(1, 2, 1.0), Gradients(3)));
  EXPECT_FALSE(late.result.included);
  EXPECT_THAT(late.result.contributors, ElementsAre(0, 1));
  EXPECT_EQ(restored->last_step(), 1);

  // The record goes on into the next checkpoint, step 2's added.
  std::vector<std::thread> threads;
  for (int r : {1, 2}) {
    threads.emplace_back([&, r] { ASSERT_OK(RunStep(*restored, RankRequest(2, r, 1.0), Gradients(4)).status()); });
  }
  for (std::thread& t : threads) t.join();
  ASSERT_OK(restored->Checkpoint().status());
  EXPECT_EQ(Metadata()["contributors"], nlohmann::json::parse("[[1, 1.5, [0, 1]], [2, 2.0, [1, 2]]]"));

  // A SetState's state is another history: who took part in its steps is not known.
  ASSERT_OK_AND_ASSIGN(SessionState state, restored->ExportState());
  state.contributors.reset();
  ASSERT_OK(restored->ImportState(std::move(state)));
  ASSERT_OK_AND_ASSIGN(StepOutcome after_set, RunStep(*restored, RankRequest(2, 1, 1.0), Gradients(4)));
  EXPECT_FALSE(after_set.result.included);
  EXPECT_TRUE(after_set.result.contributors.empty());
}

TEST_F(RestoredContributorsTest, ALockStepReplayAfterACheckpointRestoreNamesItsContributors) {
  StepAndCheckpoint(SmallSpec(/*world_size=*/2), /*ranks=*/2);
  ASSERT_OK(Restore());
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Session> restored, registry_->Find("q"));
  ASSERT_OK_AND_ASSIGN(StepOutcome resent, RunStep(*restored, RankRequest(1, 0, 1.0), Gradients(1)));
  EXPECT_TRUE(resent.result.replayed);
  EXPECT_TRUE(resent.result.included);
  EXPECT_THAT(resent.result.contributors, ElementsAre(0, 1));
  EXPECT_EQ(resent.result.total_weight, 1.5);
}

TEST_F(RestoredContributorsTest, AOneRankQuorumReplayAfterACheckpointRestoreIsIncluded) {
  v1::SessionSpec spec = QuorumSpec();
  spec.set_world_size(1);
  spec.mutable_sync()->set_min_ranks(1);
  StepAndCheckpoint(spec, /*ranks=*/1);
  EXPECT_FALSE(Metadata().contains("contributors")) << "one rank takes every step alone";
  ASSERT_OK(Restore());
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Session> restored, registry_->Find("q"));
  ASSERT_OK_AND_ASSIGN(StepOutcome resent, RunStep(*restored, RankRequest(1, 0, 1.0), Gradients(1)));
  EXPECT_TRUE(resent.result.replayed);
  EXPECT_TRUE(resent.result.included);
}

TEST_F(RestoredContributorsTest, ARecordThatDoesNotFitTheSessionIsRefusedNamingIt) {
  StepAndCheckpoint(QuorumSpec(), /*ranks=*/2);
  const std::pair<const char*, const char*> refused[] = {
      {"[[1, 1.5, [0, 3]]]", "contributors: the record of step 1 (2 ranks, total weight 1.5) does not fit"},
      {"[[1, 1.5, [0, 1]], [2, 1.0, [1]]]", "contributors names step 2; its steps must ascend"}};
  for (const auto& entry : refused) {
    const char* record = entry.first;  // named: a lambda below uses it
    const char* why = entry.second;
    SCOPED_TRACE(record);
    EditCheckpoint([&](nlohmann::json& m) { m["contributors"] = nlohmann::json::parse(record); });
    EXPECT_THAT(LoadSession(Options(), root_ + "/q", backend_.get(), codec_, SpecLimits{}),
                StatusIs(absl::StatusCode::kDataLoss, why));
  }
  // Nor does a one-rank session's checkpoint carry one.
  EditCheckpoint([](nlohmann::json& m) {
    m["contributors"] = nlohmann::json::parse("[[1, 1.0, [0]]]");
    m["spec"]["world_size"] = 1;
    m["spec"].erase("sync");
  });
  EXPECT_THAT(LoadSession(Options(), root_ + "/q", backend_.get(), codec_, SpecLimits{}),
              StatusIs(absl::StatusCode::kDataLoss, "contributors: the session's steps are not gathered"));
}

}  // namespace
}  // namespace muond::session
