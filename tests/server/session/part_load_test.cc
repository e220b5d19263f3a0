// PartLoad: ranks of a partitioned session upload their initial parts, or load one state, each its
// own parts; a load of another state while one is under way, and a step before every rank has
// written its parts, are refused.
#include "server/session/part_load.h"

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

}  // namespace
}  // namespace muond::session
