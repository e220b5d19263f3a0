// HealthWatch: a session's watch over its groups from one applied step to the next — the telemetry
// of each group (docs/algorithms.md, Telemetry) assembled from the step's clipping and what each
// optimizer measured, and the health warnings of the known silent failures (docs/operations.md,
// Warnings): a Muon group whose clip coefficient stays under warn_clip_below for warn_clip_steps
// steps, a Muon or Dion2 matrix whose non-zero momentum (Dion2: its chosen lines) falls under
// Newton–Schulz's eps, a parameter without
// a gradient for warn_stale_steps steps, an orthogonality residual above warn_residual_above (or
// the bound the group's Newton–Schulz derives, optim::ResidualThreshold).
//
// A warning is raised when its condition starts (again), not on every step it lasts; a residual's
// condition is the group's, lasting while any of its matrices was last measured above the bound. The counters
// live in memory: a restarted daemon starts them afresh. Owned by the session; not thread-safe (the
// session's lock guards it).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/optim/step_telemetry.h"
#include "server/metrics/metrics.h"
#include "server/session/session_config.h"
#include "server/session/step_plan.h"
#include "server/session/step_types.h"

namespace muond::session {

// The kinds of health warning, as the step answer, the log events and the metric name them.
inline constexpr std::array<std::string_view, 4> kHealthWarningKinds = {"clip_stall", "momentum_below_eps",
                                                                        "parameter_stale", "residual_high"};

// A step's groups as the metrics report them (muond_group_*): each group's clipping and telemetry,
// in spec order. Views into `clips` and `telemetry`, which must outlive the result.
std::vector<metrics::GroupFigures> GroupFiguresOf(const std::vector<StepResult::GroupClip>& clips,
                                                  const std::vector<StepResult::GroupTelemetry>& telemetry);

class HealthWatch {
 public:
  // One applied step: fills result.group_telemetry and result.warnings from the step's clipping,
  // which parameters had a gradient and each group's optimizer telemetry (by group).
  void Observe(const SessionConfig& config, const StepClipping& clipping, const std::vector<bool>& has_gradient,
               const std::vector<optim::StepTelemetry>& telemetry, StepResult& result);

  // Steps a group's history holds.
  static constexpr size_t kHistorySteps = 60;
  // One group's gradient norm and update RMS (NaN where not measured) in its last kHistorySteps
  // applied steps, oldest first.
  struct GroupHistory {
    std::vector<double> grad_norm;
    std::vector<double> update_rms;
  };
  // The last applied step observed: its step (0: none yet), every group's clipping and telemetry in
  // it, and every group's history.
  struct Latest {
    int64_t step = 0;
    std::vector<StepResult::GroupClip> clips;
    std::vector<StepResult::GroupTelemetry> telemetry;
    std::vector<GroupHistory> history;
  };
  const Latest& latest() const { return latest_; }

 private:
  struct GroupState {
    int64_t clip_low_steps = 0;        // applied steps in a row with the coefficient under the threshold
    bool momentum_low = false;         // the last step had a matrix whose update shrank with its momentum
    std::optional<double> lift_floor;  // NsLiftFloor of the group, once known
    // The matrices (parameter, offset) whose last measured residual was above the bound.
    std::set<std::pair<std::string, size_t>> residual_high;
    std::optional<double> residual_threshold;  // optim::ResidualThreshold of the group, once known
  };
  std::vector<int64_t> steps_without_gradient_;  // by parameter
  std::vector<GroupState> groups_;
  std::vector<GroupHistory> history_;  // by group
  Latest latest_;
};

}  // namespace muond::session
