// Dynamic loss scaling for fp16 trainers, as Megatron-Core's DynamicGradScaler defines it: the
// trainer multiplies its loss by the current scale, the daemon divides the gradients by it, and the
// scale backs off after steps whose gradients overflowed and grows after a window of clean ones.
//
// Plain value types and pure functions; the owner (a session) serializes updates.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace muond::optim {

// Megatron-Core's defaults (initial_loss_scale 2³², min_loss_scale 1, loss_scale_window 1000,
// hysteresis 2; growth ×2 and back-off ×0.5 as get_megatron_optimizer fixes them).
struct LossScalerOptions {
  double initial_scale = 4294967296.0;
  double min_scale = 1.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t window = 1000;   // clean steps between two growths (Megatron's growth_interval)
  int64_t hysteresis = 2;  // overflowing steps tolerated before the scale backs off
};

// The scaler's state: what checkpoints, GetState and SetState carry.
struct LossScalerState {
  double scale = 0;
  int64_t growth_tracker = 0;      // clean steps since the last growth or overflow
  int64_t hysteresis_tracker = 0;  // overflows still tolerated before backing off (never below 0)
};

// The largest and smallest scales: growth stops at the largest, and within [kMinLossScale,
// kMaxLossScale] both scale and 1/scale are normal fp32 numbers (clip/scale cannot overflow).
inline constexpr double kMaxLossScale = 1e30;
inline constexpr double kMinLossScale = 1e-30;

// Ranges: scales in [kMinLossScale, kMaxLossScale] with min_scale ≤ initial_scale, growth_factor > 1,
// backoff_factor in (0, 1), window and hysteresis ≥ 1. The message names the option.
absl::Status ValidateLossScaler(const LossScalerOptions& options);

// A state that could have come from `options` (scale in [min_scale, kMaxLossScale], trackers in
// range); the message names the field.
absl::Status ValidateLossScalerState(const LossScalerOptions& options, const LossScalerState& state);

LossScalerState InitialLossScale(const LossScalerOptions& options);

// After a step: found_inf (the step was skipped because its gradients overflowed) resets the growth
// tracker and spends one unit of hysteresis, backing off (never below min_scale) once it is used up;
// a clean step counts towards the window, and a full window multiplies the scale by growth_factor
// and restores the hysteresis.
void UpdateLossScale(const LossScalerOptions& options, bool found_inf, LossScalerState& state);

}  // namespace muond::optim
