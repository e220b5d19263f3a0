// PartLoad: ranks of a partitioned session upload their initial parts, or load one state, each its
// own parts; a load of another state while one is under way, and a step before every rank has
// written its parts, are refused.
#include "server/session/part_load.h"

#include <optional>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace muond::session {
namespace {

using ::muond::testing::StatusIs;

TEST(PartLoadTest, NothingUnderWayRefusesNothing) {
  PartLoad load(3);
  EXPECT_OK(load.CheckStep(5));
  EXPECT_OK(load.CheckLoad(1, 4, {4, 4}));
}

TEST(PartLoadTest, ALoadOfAnotherStepIsRefusedUntilEveryRankHasLoaded) {
  PartLoad load(3);
  load.Loaded(0, 2, {2, 1}, 4);
  EXPECT_THAT(load.CheckLoad(1, 3, {3, 2}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       "rank 1's state is of step 3, but rank 0 loaded its parts of a state of step 2"));
  EXPECT_THAT(load.CheckLoad(2, 2, {2, 2}),
              StatusIs(absl::StatusCode::kFailedPrecondition, "with other per-parameter step counts"));
  EXPECT_OK(load.CheckLoad(1, 2, {2, 1}));
  load.Loaded(1, 2, {2, 1}, 2);
  EXPECT_THAT(load.CheckStep(3),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       "step 3: rank 2 sent it without loading its parts of the state of step 2 that ranks "
                       "0, 1 loaded"));
  load.Loaded(2, 2, {2, 1}, 2);
  EXPECT_OK(load.CheckStep(3));
  EXPECT_OK(load.CheckLoad(0, 7, {7, 7}));  // over: any state may be loaded next
}

TEST(PartLoadTest, UnderHsdpOneReplicaOfEachShardWritingIsEnough) {
  // 4 ranks as 2 replicas of 2 shards: ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1.
  PartLoad load(std::vector<int>{0, 1, 0, 1});
  load.Uploaded(0);
  load.Uploaded(2);
  EXPECT_THAT(load.CheckStep(1),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       "step 1: ranks 1, 3 sent it without uploading their parts of the initial parameters, which "
                       "ranks 0, 2 uploaded"));
  load.Uploaded(3);
  EXPECT_OK(load.CheckStep(1));  // rank 1's replica wrote shard 1
  load.Loaded(1, 4, {4, 4}, 4);
  EXPECT_THAT(load.CheckStep(5), StatusIs(absl::StatusCode::kFailedPrecondition, "ranks 0, 2 sent it without"));
  load.Loaded(2, 4, {4, 4}, 4);
  EXPECT_OK(load.CheckStep(5));
}

TEST(PartLoadTest, TheSameStateLoadedAgainBeforeAStepStartsNoNewLoad) {
  PartLoad load(2);
  load.Loaded(0, 2, {2, 2}, 5);
  load.Loaded(1, 2, {2, 2}, 2);
  load.Loaded(1, 2, {2, 2}, 2);  // a retried SetState: the session is still at the loaded step
  EXPECT_OK(load.CheckStep(3));
  load.Loaded(1, 2, {2, 2}, 4);  // after steps, the same state is a new load
  EXPECT_THAT(load.CheckStep(5), StatusIs(absl::StatusCode::kFailedPrecondition, "rank 0 sent it"));
}

TEST(PartLoadTest, TheFirstStepWaitsForEveryRanksUpload) {
  PartLoad load(3);
  load.Uploaded(1);
  EXPECT_OK(load.CheckUpload(0));
  load.Uploaded(0);
  load.Uploaded(0);  // a retried upload
  EXPECT_THAT(load.CheckStep(1), StatusIs(absl::StatusCode::kFailedPrecondition,
                                          "step 1: rank 2 sent it without uploading its parts of the initial "
                                          "parameters, which ranks 0, 1 uploaded: its parts would start from zeros"));
  load.Uploaded(2);
  EXPECT_OK(load.CheckStep(1));
  load.Uploaded(1);  // a rank opening again before the first step: the same upload, nothing under way
  EXPECT_OK(load.CheckStep(1));
}

TEST(PartLoadTest, ALoadReplacesAnUploadUnderWayAndAnUploadWaitsForALoad) {
  PartLoad load(2);
  load.Uploaded(0);
  EXPECT_OK(load.CheckLoad(0, 0, {0, 0}));  // rank 0 loads its checkpoint before rank 1 has opened
  load.Loaded(0, 0, {0, 0}, 0);
  EXPECT_THAT(load.CheckUpload(1),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       "rank 1's upload of its initial parameters comes while rank 0 loaded its parts of a state of "
                       "step 0"));
  EXPECT_THAT(load.CheckStep(1), StatusIs(absl::StatusCode::kFailedPrecondition,
                                          "rank 1 sent it without loading its parts of the state of step 0"));
  load.Loaded(1, 0, {0, 0}, 0);
  EXPECT_OK(load.CheckStep(1));
}

TEST(PartLoadTest, AWholeWriteEndsWhatIsUnderWay) {
  PartLoad load(2);
  load.Loaded(0, 3, {3, 3}, 0);
  load.WroteWhole();
  EXPECT_OK(load.CheckStep(4));
  EXPECT_OK(load.CheckLoad(1, 5, {5, 5}));
}

// The record a checkpoint keeps: restored into a fresh PartLoad (a restarted daemon's), it waits for
// the same ranks and takes the same retries as the one it was taken from.
TEST(PartLoadTest, ARestoredRecordWaitsForTheSameRanks) {
  PartLoad fresh(3);
  EXPECT_EQ(fresh.Record(), std::nullopt);

  PartLoad upload(3);
  upload.Uploaded(2);
  ASSERT_TRUE(upload.Record().has_value());
  EXPECT_EQ(*upload.Record(), (PartsWritten{.upload = true, .ranks = {2}}));
  PartLoad restarted(3);
  ASSERT_OK(restarted.CheckRecord(*upload.Record(), 0, {0, 0}));
  restarted.Restore(*upload.Record());
  EXPECT_THAT(restarted.CheckStep(1), StatusIs(absl::StatusCode::kFailedPrecondition,
                                               "step 1: ranks 0, 1 sent it without uploading their parts of the "
                                               "initial parameters, which rank 2 uploaded"));
  EXPECT_EQ(restarted.Record(), upload.Record());

  PartLoad load(2);
  load.Loaded(1, 4, {4, 3}, 0);
  PartLoad restored(2);
  ASSERT_OK(restored.CheckRecord(*load.Record(), 4, {4, 3}));
  restored.Restore(*load.Record());
  EXPECT_THAT(restored.CheckLoad(0, 5, {5, 5}),
              StatusIs(absl::StatusCode::kFailedPrecondition, "rank 0's state is of step 5, but rank 1 loaded"));
  EXPECT_THAT(restored.CheckStep(5), StatusIs(absl::StatusCode::kFailedPrecondition,
                                              "step 5: rank 0 sent it without loading its parts of the state of "
                                              "step 4 that rank 1 loaded"));
  restored.Loaded(0, 4, {4, 3}, 4);
  EXPECT_OK(restored.CheckStep(5));
  // Over, and restored again: a retried load of that state before any step starts no new one.
  PartLoad again(2);
  ASSERT_OK(again.CheckRecord(*restored.Record(), 4, {4, 3}));
  again.Restore(*restored.Record());
  again.Loaded(1, 4, {4, 3}, 4);
  EXPECT_OK(again.CheckStep(5));
}

// A record that cannot be this session's (a damaged or edited checkpoint) is refused, naming the field.
TEST(PartLoadTest, ARecordThatCannotBeTheSessionsIsRefused) {
  const PartLoad load(3);
  const std::vector<int64_t> counts = {4, 3};
  auto refused = [&](const PartsWritten& record, int64_t last_step, const char* why) {
    EXPECT_THAT(load.CheckRecord(record, last_step, counts), StatusIs(absl::StatusCode::kInvalidArgument, why));
  };
  refused({.upload = true, .ranks = {}}, 0, "parts_written.ranks: no rank has written");
  refused({.upload = true, .ranks = {3}}, 0, "parts_written.ranks: 3 is not a rank of the session's 3");
  refused({.upload = true, .ranks = {-1}}, 0, "parts_written.ranks: -1");
  refused({.upload = true, .ranks = {1, 1}}, 0, "ranks ascend, each once");
  refused({.upload = true, .ranks = {2, 0}}, 0, "ranks ascend, each once");
  refused({.upload = true, .last_step = 2, .ranks = {0}}, 0, "an upload has no last_step");
  refused({.upload = true, .ranks = {0}}, 4, "an upload of initial parameters under way in a state of step 4");
  refused({.last_step = 4, .step_counts = {4}, .ranks = {0}}, 4, "parts_written.step_counts: 1 counts for 2");
  refused({.last_step = 4, .step_counts = {4, 5}, .ranks = {0}}, 4, "a count of 5 in a state of step 4");
  refused({.last_step = 4, .step_counts = {4, 3}, .ranks = {0}}, 6, "step 4, under way, in a state of step 6");
  refused({.last_step = 7, .step_counts = {4, 3}, .ranks = {0, 1, 2}}, 6, "a load of the state of step 7");
  EXPECT_OK(load.CheckRecord({.upload = true, .ranks = {0, 1, 2}}, 4, counts));  // over, then 4 steps
  EXPECT_OK(load.CheckRecord({.last_step = 2, .step_counts = {2, 1}, .ranks = {0, 1, 2}}, 4, counts));
}

}  // namespace
}  // namespace muond::session
