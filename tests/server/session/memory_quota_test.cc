#include "server/session/memory_quota.h"

#include "gtest/gtest.h"
#include "server/rpc/session_spec_codec.h"
#include "tests/testing/status_matchers.h"

namespace muond::session {
namespace {

using ::muond::rpc::ParseSessionSpec;

using ::muond::testing::StatusIs;

// Two groups (muon, adamw) with one parameter each.
v1::SessionSpec TwoGroupSpec() {
  v1::SessionSpec spec;
  auto* muon = spec.add_groups();
  muon->set_name("m");
  muon->mutable_options()->set_optimizer(v1::OPTIMIZER_MUON);
  auto* adamw = spec.add_groups();
  adamw->set_name("a");
  adamw->mutable_options()->set_optimizer(v1::OPTIMIZER_ADAMW);
  auto* w = spec.add_parameters();
  w->set_name("w");
  w->add_shape(10);
  w->add_shape(20);
  w->set_group("m");
  auto* b = spec.add_parameters();
  b->set_name("b");
  b->add_shape(7);
  b->set_group("a");
  return spec;
}

TEST(MemoryQuotaTest, EstimateCountsMasterGradientAndSlots) {
  // Muon: master, gradient, momentum; AdamW: master, gradient, two moments.
  ASSERT_OK_AND_ASSIGN(SessionConfig config, ParseSessionSpec(TwoGroupSpec(), SpecLimits{}));
  EXPECT_EQ(EstimateSessionBytes(config), 200 * 4 * 3 + 7 * 4 * 4);
}

TEST(MemoryQuotaTest, EstimateCountsSecondMomentsAtTheirSize) {
  v1::SessionSpec spec = TwoGroupSpec();
  spec.mutable_groups(0)->mutable_options()->set_moment2_method("adamuon");
  ASSERT_OK_AND_ASSIGN(SessionConfig adamuon, ParseSessionSpec(spec, SpecLimits{}));
  EXPECT_EQ(EstimateSessionBytes(adamuon), 200 * 4 * 4 + 7 * 4 * 4);
  // NorMuon: one value per line along the longer dimension (w is 10×20: 20 columns).
  spec.mutable_groups(0)->mutable_options()->set_moment2_method("normuon");
  ASSERT_OK_AND_ASSIGN(SessionConfig normuon, ParseSessionSpec(spec, SpecLimits{}));
  EXPECT_EQ(EstimateSessionBytes(normuon), 200 * 4 * 3 + 20 * 4 + 7 * 4 * 4);
}

TEST(MemoryQuotaTest, EstimateCountsTheGradientsARankGatherHolds) {
  // Four lock-step ranks: each rank's whole gradients wait for the step beside the averaged one.
  v1::SessionSpec spec = TwoGroupSpec();
  spec.set_world_size(4);
  ASSERT_OK_AND_ASSIGN(SessionConfig lockstep, ParseSessionSpec(spec, SpecLimits{}));
  EXPECT_EQ(EstimateSessionBytes(lockstep), 200 * 4 * (3 + 4) + 7 * 4 * (4 + 4));
  // A partitioned group: the ranks' parts make one whole gradient; two HSDP replicas, two.
  spec.mutable_groups(0)->mutable_partition()->set_kind(v1::PARTITION_KIND_ROWS);
  ASSERT_OK_AND_ASSIGN(SessionConfig parts, ParseSessionSpec(spec, SpecLimits{}));
  EXPECT_EQ(EstimateSessionBytes(parts), 200 * 4 * (3 + 1) + 7 * 4 * (4 + 4));
  spec.mutable_groups(0)->mutable_partition()->set_replicas(2);
  ASSERT_OK_AND_ASSIGN(SessionConfig hsdp, ParseSessionSpec(spec, SpecLimits{}));
  EXPECT_EQ(EstimateSessionBytes(hsdp), 200 * 4 * (3 + 2) + 7 * 4 * (4 + 4));
  // Asynchronous pushes are applied one by one as they come: nothing is gathered.
  spec = TwoGroupSpec();
  spec.set_world_size(4);
  spec.mutable_sync()->set_mode(v1::SYNC_MODE_ASYNC);
  spec.mutable_sync()->set_max_staleness(2);
  ASSERT_OK_AND_ASSIGN(SessionConfig async, ParseSessionSpec(spec, SpecLimits{}));
  EXPECT_EQ(EstimateSessionBytes(async), 200 * 4 * 3 + 7 * 4 * 4);
}

TEST(MemoryQuotaTest, ChecksBothLimitsAndNamesThem) {
  const MemoryLimits none;
  EXPECT_OK(CheckMemoryQuota("s", int64_t{1} << 40, int64_t{1} << 40, none));
  const MemoryLimits limits{1000, 5000};
  EXPECT_OK(CheckMemoryQuota("s", 1000, 4000, limits));
  EXPECT_THAT(CheckMemoryQuota("s", 1001, 0, limits),
              StatusIs(absl::StatusCode::kResourceExhausted, "needs 1001 bytes of optimizer memory"));
  EXPECT_THAT(CheckMemoryQuota("s", 1001, 0, limits),
              StatusIs(absl::StatusCode::kResourceExhausted, "--max-session-bytes 1000"));
  EXPECT_THAT(CheckMemoryQuota("s", 1000, 4001, limits),
              StatusIs(absl::StatusCode::kResourceExhausted, "holds 4001 bytes already"));
  EXPECT_THAT(CheckMemoryQuota("s", 1000, 4001, limits),
              StatusIs(absl::StatusCode::kResourceExhausted, "--max-total-bytes 5000"));
}

}  // namespace
}  // namespace muond::session
