// The dynamic loss scaler against Megatron-Core's DynamicGradScaler, step by step, and its ranges.
#include "kernels/optim/loss_scaler.h"

#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace muond::optim {
namespace {

using ::muond::testing::StatusIs;

TEST(LossScalerTest, MegatronDefaults) {
  const LossScalerOptions o;
  EXPECT_EQ(o.initial_scale, 4294967296.0);
  EXPECT_EQ(o.min_scale, 1.0);
  EXPECT_EQ(o.growth_factor, 2.0);
  EXPECT_EQ(o.backoff_factor, 0.5);
  EXPECT_EQ(o.window, 1000);
  EXPECT_EQ(o.hysteresis, 2);
  const LossScalerState s = InitialLossScale(o);
  EXPECT_EQ(s.scale, o.initial_scale);
  EXPECT_EQ(s.growth_tracker, 0);
  EXPECT_EQ(s.hysteresis_tracker, 2);
}

TEST(LossScalerTest, GrowsAfterAWindowAndBacksOffAfterTheHysteresis) {
  LossScalerOptions o;
  o.initial_scale = 1024;
  o.min_scale = 256;
  o.window = 3;
  o.hysteresis = 2;
  LossScalerState s = InitialLossScale(o);
  // Written out from DynamicGradScaler.update: (found_inf, scale, growth, hysteresis) after each.
  struct Expect {
    bool found_inf;
    double scale;
    int64_t growth, hysteresis;
  };
  const std::vector<Expect> steps = {
      {false, 1024, 1, 2}, {false, 1024, 2, 2}, {false, 2048, 0, 2},  // a full window doubles
      {true, 2048, 0, 1},                                             // first overflow: tolerated
      {false, 2048, 1, 1},                                            // a clean step keeps the count
      {true, 1024, 0, 0},                                             // hysteresis used up: halve
      {true, 512, 0, 0},   {true, 256, 0, 0},   {true, 256, 0, 0},    // every further one halves, to min
      {false, 256, 1, 0},  {false, 256, 2, 0},  {false, 512, 0, 2},   // a window restores hysteresis
  };
  for (size_t i = 0; i < steps.size(); ++i) {
    UpdateLossScale(o, steps[i].found_inf, s);
    EXPECT_EQ(s.scale, steps[i].scale) << "after step " << i;
    EXPECT_EQ(s.growth_tracker, steps[i].growth) << "after step " << i;
    EXPECT_EQ(s.hysteresis_tracker, steps[i].hysteresis) << "after step " << i;
  }
}

TEST(LossScalerTest, GrowthStopsAtTheCap) {
  LossScalerOptions o;
  o.initial_scale = kMaxLossScale;
  o.window = 1;
  LossScalerState s = InitialLossScale(o);
  UpdateLossScale(o, false, s);
  EXPECT_EQ(s.scale, kMaxLossScale);
}

TEST(LossScalerTest, RangesNameTheOption) {
  auto bad = [](auto mutate, const char* option) {
    LossScalerOptions o;
    mutate(o);
    EXPECT_THAT(ValidateLossScaler(o), StatusIs(absl::StatusCode::kInvalidArgument, option));
  };
  bad([](LossScalerOptions& o) { o.initial_scale = 0; }, "initial_scale");
  bad([](LossScalerOptions& o) { o.initial_scale = 1e-31; }, "initial_scale");
  bad([](LossScalerOptions& o) { o.initial_scale = 1e31; }, "initial_scale");
  bad([](LossScalerOptions& o) { o.min_scale = 2 * o.initial_scale; }, "min_scale");
  bad([](LossScalerOptions& o) { o.growth_factor = 1; }, "growth_factor");
  bad([](LossScalerOptions& o) { o.backoff_factor = 1; }, "backoff_factor");
  bad([](LossScalerOptions& o) { o.window = 0; }, "window");
  bad([](LossScalerOptions& o) { o.hysteresis = 0; }, "hysteresis");
  EXPECT_OK(ValidateLossScaler(LossScalerOptions{}));

  const LossScalerOptions o;
  EXPECT_OK(ValidateLossScalerState(o, InitialLossScale(o)));
  EXPECT_THAT(ValidateLossScalerState(o, {.scale = 0.5, .growth_tracker = 0, .hysteresis_tracker = 2}),
              StatusIs(absl::StatusCode::kInvalidArgument, "loss_scaler.scale"));
  EXPECT_THAT(ValidateLossScalerState(o, {.scale = 8, .growth_tracker = 1000, .hysteresis_tracker = 2}),
              StatusIs(absl::StatusCode::kInvalidArgument, "loss_scaler.growth_tracker"));
  EXPECT_THAT(ValidateLossScalerState(o, {.scale = 8, .growth_tracker = 0, .hysteresis_tracker = 3}),
              StatusIs(absl::StatusCode::kInvalidArgument, "loss_scaler.hysteresis_tracker"));
  EXPECT_THAT(ValidateLossScalerState(o, {.scale = 8, .growth_tracker = 0, .hysteresis_tracker = -1}),
              StatusIs(absl::StatusCode::kInvalidArgument, "loss_scaler.hysteresis_tracker"));
}

}  // namespace
}  // namespace muond::optim
