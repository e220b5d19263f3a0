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

// 'w' (8×6) by rows over 2 shards: 4 rows each; 'b' replicated. Without replicas 2 ranks hold the
// 2 shards; with 2 replicas, 4 ranks (rank r holds shard r mod 2).
constexpr int kShards = 2;
constexpr size_t kRowPart = 24;

v1::SessionSpec PartitionedSpec(int replicas = 1) {
  v1::SessionSpec spec = SmallSpec(kShards * replicas);
  spec.mutable_groups(0)->mutable_partition()->set_kind(v1::PARTITION_KIND_ROWS);
  if (replicas > 1) spec.mutable_groups(0)->mutable_partition()->set_replicas(replicas);
  return spec;
}

std::vector<float> RowsOf(const std::vector<float>& whole, int rank) {
  const auto begin = whole.begin() + static_cast<std::ptrdiff_t>(kRowPart * static_cast<size_t>(rank % kShards));
  return {begin, begin + kRowPart};
}

// Rank `rank`'s parts of whole tensors (SmallSpec's order: 'w', then 'b').
std::vector<HostTensor> PartsOf(const std::vector<HostTensor>& whole, int rank) {
  return {Tensor(RowsOf(whole[0].values, rank)), Tensor(whole[1].values)};
}

// Rank `rank`'s parts of a whole exported state: 'w''s master and momentum cut, 'b''s slots whole.
SessionState StatePartOf(const SessionState& whole, int rank) {
  SessionState part = whole;
  part.parts_written.reset();
  for (StateTensor& t : part.tensors) {
    if (t.parameter == 0) t.values = RowsOf(t.values, rank);
  }
  return part;
}

// Every rank sends step `step` (its parts of Gradients(step)) at once; their answers.
std::vector<absl::StatusOr<StepOutcome>> StepEveryRank(Session& session, int step) {
  const int world = session.config().world_size;
  std::vector<absl::StatusOr<StepOutcome>> answers(static_cast<size_t>(world), absl::UnknownError("not sent"));
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back(
        [&, r] { answers[static_cast<size_t>(r)] = RunStep(session, Request(step, r), PartsOf(Gradients(step), r)); });
  }
  for (std::thread& t : ranks) t.join();
  return answers;
}

// Every rank uploads its parts of InitialParameters(), then every rank sends steps 1 … `steps`.
void UploadAndStep(Session& session, int steps) {
  for (int r = 0; r < session.config().world_size; ++r) {
    ASSERT_OK(session.UploadParts(r, PartsOf(InitialParameters(), r)));
  }
  for (int step = 1; step <= steps; ++step) {
    for (const absl::StatusOr<StepOutcome>& answer : StepEveryRank(session, step)) ASSERT_OK(answer.status());
  }
}

class PartRestoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/muond-part-restore-XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
    backend_ = kernels::NewCpuBackend(1);
  }
  // The session "s" with `replicas` of the partition, and the reference, never restarted.
  void Start(int replicas = 1) {
    spec_ = PartitionedSpec(replicas);
    Open();
    reference_ = NewSession(backend_.get(), spec_);
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
    ASSERT_OK_AND_ASSIGN(CreateResult created, registry_->CreateOrAttach("s", rpc::SpecToJson(spec_)));
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
  v1::SessionSpec spec_;
  rpc::ProtoSpecCodec codec_;
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<SessionRegistry> registry_;
  std::shared_ptr<Session> session_;
  std::unique_ptr<Session> reference_;
};

TEST_F(PartRestoreTest, AnUploadUnderWayAtARestartIsStillWaitedFor) {
  Start();
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
  Start();
  UploadAndStep(*session_, 2);
  UploadAndStep(*reference_, 2);
  // Each rank's state dict of step 1 would be saved here; a session of one step stands in.
  std::unique_ptr<Session> at_step1 = NewSession(backend_.get(), PartitionedSpec());
  UploadAndStep(*at_step1, 1);
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

// HSDP, 2 replicas of 2 shards: rank 0 uploaded shard 0 before the restart. After it, rank 2's
// other values of shard 0 are left out (rank 0's came first), and rank 1's of shard 1, which no
// replica had uploaded, are written: the restored record knows which ranks uploaded.
TEST_F(PartRestoreTest, UnderHsdpTheRanksThatUploadedAreKnownAfterARestart) {
  Start(/*replicas=*/2);
  ASSERT_OK(session_->UploadParts(0, PartsOf(InitialParameters(), 0)));
  Open();
  std::vector<HostTensor> rank2 = PartsOf(InitialParameters(), 2);
  for (float& v : rank2[0].values) v += 1.0f;
  ASSERT_OK(session_->UploadParts(2, rank2));
  ASSERT_OK(session_->UploadParts(1, PartsOf(InitialParameters(), 1)));
  ASSERT_OK_AND_ASSIGN(const SessionState state, session_->ExportState());
  EXPECT_EQ(state.tensors[0].values, InitialParameters()[0].values);
  for (const absl::StatusOr<StepOutcome>& answer : StepEveryRank(*session_, 1)) ASSERT_OK(answer.status());
}

// HSDP, 2 replicas of 2 shards: rank 2 holds what rank 0 holds. A rank whose part differs from its
// replica's, or whose replicated parameter differs from another rank's, in the same load is refused
// and changes nothing; the same values load; once the load is over, another state of the same step
// is a new load.
TEST(PartsAgreeTest, RanksHoldingTheSameElementsLoadTheSameValues) {
  auto backend = kernels::NewCpuBackend(1);
  std::unique_ptr<Session> session = NewSession(backend.get(), PartitionedSpec(/*replicas=*/2));
  ASSERT_NE(session, nullptr);
  UploadAndStep(*session, 2);
  std::unique_ptr<Session> at_step1 = NewSession(backend.get(), PartitionedSpec(2));
  UploadAndStep(*at_step1, 1);
  ASSERT_OK_AND_ASSIGN(const SessionState saved, at_step1->ExportState());
  ASSERT_OK_AND_ASSIGN(const SessionState before, session->ExportState());

  ASSERT_OK(session->ImportState(StatePartOf(saved, 0), 0));
  SessionState other_replica = StatePartOf(saved, 2);
  other_replica.tensors[0].values[5] += 0.25f;  // 'w''s master: element 5 of shard 0
  EXPECT_THAT(session->ImportState(other_replica, 2),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       "chunk.data: rank 2's w/master differs from what rank 0, which holds the same elements, loaded "
                       "of a state of step 1 (element 5: "));
  SessionState replicated = StatePartOf(saved, 1);
  for (StateTensor& t : replicated.tensors) {
    if (t.parameter == 1 && t.slot == "exp_avg") t.values[3] = -t.values[3] + 1.0f;
  }
  EXPECT_THAT(session->ImportState(replicated, 1),
              StatusIs(absl::StatusCode::kFailedPrecondition, "rank 1's b/exp_avg differs from what rank 0"));
  // Nothing of the refused loads was written: rank 1's part of 'w' is still the state before.
  ASSERT_OK_AND_ASSIGN(const SessionState now, session->ExportState());
  EXPECT_EQ(RowsOf(now.tensors[0].values, 1), RowsOf(before.tensors[0].values, 1));
  EXPECT_EQ(RowsOf(now.tensors[0].values, 0), RowsOf(saved.tensors[0].values, 0));

  for (int r = 1; r < 4; ++r) ASSERT_OK(session->ImportState(StatePartOf(saved, r), r));
  ASSERT_OK_AND_ASSIGN(const SessionState loaded, session->ExportState());
  for (size_t i = 0; i < saved.tensors.size(); ++i) EXPECT_EQ(loaded.tensors[i].values, saved.tensors[i].values);
  // Over, another state of the same step and counts (other values) is a new load, not a retry: its
  // first rank is taken, the next step waits for the others, and a rank loading the old one now is
  // refused.
  SessionState another = saved;
  for (StateTensor& t : another.tensors) {
    if (t.slot == kMasterSlot) {
      for (float& v : t.values) v += 0.5f;
    }
  }
  ASSERT_OK(session->ImportState(StatePartOf(another, 2), 2));
  EXPECT_THAT(session->ImportState(StatePartOf(saved, 0), 0),
              StatusIs(absl::StatusCode::kFailedPrecondition, "rank 0's w/master differs from what rank 2"));
  for (const absl::StatusOr<StepOutcome>& answer : StepEveryRank(*session, 2)) {
    EXPECT_THAT(answer.status(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                          "step 2: ranks 1, 3 sent it without loading their parts"));
  }
  for (int r : {0, 1, 3}) ASSERT_OK(session->ImportState(StatePartOf(another, r), r));
  for (const absl::StatusOr<StepOutcome>& answer : StepEveryRank(*session, 2)) ASSERT_OK(answer.status());
}

}  // namespace
}  // namespace muond::session
