// A partitioned session restarted in the middle of its ranks' part-by-part upload or load (its
// checkpoint keeps the record, part_load.h): the restored session still refuses the step that would
// start the missing rank's parts from zeros, or mix two states, and steps once that rank has written
// its parts, to the same values as a session never restarted. A load over before the restart, retried
// after it, starts no new one.
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "gmock/gmock.h"
#include "kernels/cpu/cpu_backend.h"
#include "server/rpc/session_spec_codec.h"
#include "server/session/session_registry.h"
#include "tests/server/session/session_test_util.h"
#include "tests/testing/status_matchers.h"

namespace muond::session {
namespace {

using ::muond::testing::StatusIs;
using namespace ::muond::session::session_testing;

constexpr int kRanks = 2;
constexpr size_t kRowPart = 24;  // 'w' (8×6) by rows over 2 ranks: 4 rows each; 'b' replicated

v1::SessionSpec PartitionedSpec() {
  v1::SessionSpec spec = SmallSpec(kRanks);
  spec.mutable_groups(0)->mutable_partition()->set_kind(v1::PARTITION_KIND_ROWS);
  return spec;
}

// Rank `rank`'s parts of whole tensors (SmallSpec's order: 'w', then 'b').
std::vector<HostTensor> PartsOf(const std::vector<HostTensor>& whole, int rank) {
  const auto begin = whole[0].values.begin() + static_cast<std::ptrdiff_t>(kRowPart * static_cast<size_t>(rank));
  return {Tensor({begin, begin + kRowPart}), Tensor(whole[1].values)};
}

// Rank `rank`'s parts of a whole exported state: 'w''s master and momentum cut, 'b''s slots whole.
SessionState StatePartOf(const SessionState& whole, int rank) {
  SessionState part = whole;
  part.parts_written.reset();
  for (StateTensor& t : part.tensors) {
    if (t.parameter != 0) continue;
    const auto begin = t.values.begin() + static_cast<std::ptrdiff_t>(kRowPart * static_cast<size_t>(rank));
    t.values = {begin, begin + kRowPart};
  }
  return part;
}

// Every rank sends step `step` (its parts of Gradients(step)) at once; their answers.
std::vector<absl::StatusOr<StepOutcome>> StepEveryRank(Session& session, int step) {
  std::vector<absl::StatusOr<StepOutcome>> answers(kRanks, absl::UnknownError("not sent"));
  std::vector<std::thread> ranks;
  for (int r = 0; r < kRanks; ++r) {
    ranks.emplace_back(
        [&, r] { answers[static_cast<size_t>(r)] = RunStep(session, Request(step, r), PartsOf(Gradients(step), r)); });
  }
  for (std::thread& t : ranks) t.join();
  return answers;
}

class PartRestoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/muond-part-restore-XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
    backend_ = kernels::NewCpuBackend(1);
    Open();
    reference_ = NewSession(backend_.get(), PartitionedSpec());
    ASSERT_NE(reference_, nullptr);
  }
  void TearDown() override {
    session_.reset();
    registry_.reset();
    std::filesystem::remove_all(dir_);
  }

  // A registry over the state folder (a new one is a restarted daemon) and its session "s".
  void Open() {
    durability::StateDirOptions options;
    options.state_dir = dir_;
    options.durability = durability::Durability::kJournal;
    options.backend_name = "cpu";
    session_.reset();
    registry_ = std::make_unique<SessionRegistry>(backend_.get(), &codec_, SpecLimits{}, 4);
    ASSERT_OK(registry_->EnablePersistence(options));
    ASSERT_OK_AND_ASSIGN(CreateResult created, registry_->CreateOrAttach("s", rpc::SpecToJson(PartitionedSpec())));
    session_ = created.session;
  }

  // Both sessions' parameters, equal element for element.
  void ExpectTheReferencesParameters() {
    int64_t step = 0;
    int64_t reference_step = 0;
    EXPECT_EQ(CopyValues(*session_->Parameters(&step)), CopyValues(*reference_->Parameters(&reference_step)));
    EXPECT_EQ(step, reference_step);
  }

  std::string dir_;
  rpc::ProtoSpecCodec codec_;
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<SessionRegistry> registry_;
  std::shared_ptr<Session> session_;
  std::unique_ptr<Session> reference_;
};

TEST_F(PartRestoreTest, AnUploadUnderWayAtARestartIsStillWaitedFor) {
  ASSERT_OK(session_->UploadParts(0, PartsOf(InitialParameters(), 0)));
  ASSERT_OK(reference_->UploadParts(0, PartsOf(InitialParameters(), 0)));
  Open();
  for (const absl::StatusOr<StepOutcome>& answer : StepEveryRank(*session_, 1)) {
    EXPECT_THAT(answer.status(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                          "step 1: rank 1 sent it without uploading its parts of the initial "
                                          "parameters, which rank 0 uploaded"));
  }
  EXPECT_EQ(session_->last_step(), 0);
  // Rank 1's values of the replicated 'b' are checked and left out: rank 0's stay, as before the restart.
  std::vector<HostTensor> rank1 = PartsOf(InitialParameters(), 1);
  for (float& v : rank1[1].values) v += 1.0f;
  ASSERT_OK(session_->UploadParts(1, rank1));
  ASSERT_OK(reference_->UploadParts(1, PartsOf(InitialParameters(), 1)));
  for (Session* session : {session_.get(), reference_.get()}) {
    for (const absl::StatusOr<StepOutcome>& answer : StepEveryRank(*session, 1)) ASSERT_OK(answer.status());
  }
  ExpectTheReferencesParameters();
}

TEST_F(PartRestoreTest, ALoadUnderWayAtARestartIsStillWaitedForAndARetryAfterItIsNoNewLoad) {
  for (Session* session : {session_.get(), reference_.get()}) {
    for (int r = 0; r < kRanks; ++r) ASSERT_OK(session->UploadParts(r, PartsOf(InitialParameters(), r)));
    for (int step = 1; step <= 2; ++step) {
      for (const absl::StatusOr<StepOutcome>& answer : StepEveryRank(*session, step)) ASSERT_OK(answer.status());
    }
  }
  // Each rank's state dict of step 1 would be saved here; the reference's state of step 1 stands in.
  std::unique_ptr<Session> at_step1 = NewSession(backend_.get(), PartitionedSpec());
  for (int r = 0; r < kRanks; ++r) ASSERT_OK(at_step1->UploadParts(r, PartsOf(InitialParameters(), r)));
  for (const absl::StatusOr<StepOutcome>& answer : StepEveryRank(*at_step1, 1)) ASSERT_OK(answer.status());
  ASSERT_OK_AND_ASSIGN(const SessionState saved, at_step1->ExportState());

  ASSERT_OK(session_->ImportState(StatePartOf(saved, 0), 0));
  ASSERT_OK(reference_->ImportState(StatePartOf(saved, 0), 0));
  Open();
  EXPECT_EQ(session_->last_step(), 1);
  for (const absl::StatusOr<StepOutcome>& answer : StepEveryRank(*session_, 2)) {
    EXPECT_THAT(answer.status(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                          "step 2: rank 1 sent it without loading its parts of the state of step 1 "
                                          "that rank 0 loaded"));
  }
  ASSERT_OK(session_->ImportState(StatePartOf(saved, 1), 1));
  ASSERT_OK(reference_->ImportState(StatePartOf(saved, 1), 1));
  // The load is over; restarted again, rank 1's retried load starts no new one.
  Open();
  ASSERT_OK(session_->ImportState(StatePartOf(saved, 1), 1));
  for (Session* session : {session_.get(), reference_.get()}) {
    for (const absl::StatusOr<StepOutcome>& answer : StepEveryRank(*session, 2)) ASSERT_OK(answer.status());
  }
  ExpectTheReferencesParameters();
}

}  // namespace
}  // namespace muond::session
