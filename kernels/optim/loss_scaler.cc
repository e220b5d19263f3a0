#include "kernels/optim/loss_scaler.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace muond::optim {

absl::Status ValidateLossScaler(const LossScalerOptions& o) {
  auto scale_ok = [](double x) { return std::isfinite(x) && x >= kMinLossScale && x <= kMaxLossScale; };
  if (!scale_ok(o.initial_scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("initial_scale must be in [", kMinLossScale, ", ", kMaxLossScale, "], got ", o.initial_scale));
  }
  if (!scale_ok(o.min_scale) || o.min_scale > o.initial_scale) {
    return absl::InvalidArgumentError(
        absl::StrCat("min_scale must be in [", kMinLossScale, ", initial_scale], got ", o.min_scale));
  }
  if (!std::isfinite(o.growth_factor) || o.growth_factor <= 1 || o.growth_factor > 1000) {
    return absl::InvalidArgumentError(absl::StrCat("growth_factor must be in (1, 1000], got ", o.growth_factor));
  }
  if (!std::isfinite(o.backoff_factor) || o.backoff_factor <= 0 || o.backoff_factor >= 1) {
    return absl::InvalidArgumentError(absl::StrCat("backoff_factor must be in (0, 1), got ", o.backoff_factor));
  }
  if (o.window < 1) return absl::InvalidArgumentError(absl::StrCat("window must be >= 1, got ", o.window));
  if (o.hysteresis < 1) {
    return absl::InvalidArgumentError(absl::StrCat("hysteresis must be >= 1, got ", o.hysteresis));
  }
  return absl::OkStatus();
}

absl::Status ValidateLossScalerState(const LossScalerOptions& o, const LossScalerState& s) {
  if (!std::isfinite(s.scale) || s.scale < o.min_scale || s.scale > kMaxLossScale) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss_scaler.scale must be in [min_scale ", o.min_scale, ", ", kMaxLossScale, "], got ", s.scale));
  }
  if (s.growth_tracker < 0 || s.growth_tracker >= o.window) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss_scaler.growth_tracker must be in [0, window ", o.window, "), got ", s.growth_tracker));
  }
  if (s.hysteresis_tracker < 0 || s.hysteresis_tracker > o.hysteresis) {
    return absl::InvalidArgumentError(absl::StrCat("loss_scaler.hysteresis_tracker must be in [0, hysteresis ",
                                                   o.hysteresis, "], got ", s.hysteresis_tracker));
  }
  return absl::OkStatus();
}

LossScalerState InitialLossScale(const LossScalerOptions& o) {
  return LossScalerState{.scale = o.initial_scale, .growth_tracker = 0, .hysteresis_tracker = o.hysteresis};
}

void UpdateLossScale(const LossScalerOptions& o, bool found_inf, LossScalerState& s) {
  if (found_inf) {
    s.growth_tracker = 0;
    // Megatron-Core lets its tracker go below 0; every overflow from 0 on backs off alike, so it
    // stays at 0 here (a state from SetState cannot count down forever).
    s.hysteresis_tracker = std::max<int64_t>(s.hysteresis_tracker - 1, 0);
    if (s.hysteresis_tracker == 0) s.scale = std::max(s.scale * o.backoff_factor, o.min_scale);
    return;
  }
  s.growth_tracker += 1;
  if (s.growth_tracker == o.window) {
    s.growth_tracker = 0;
    s.hysteresis_tracker = o.hysteresis;
    s.scale = std::min(s.scale * o.growth_factor, kMaxLossScale);
  }
}

}  // namespace muond::optim
