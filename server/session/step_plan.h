// StepPlan: a StepRequest checked against its session's config and resolved into what the optimizer
// step needs — each group's hyperparameters for this step, the QK-clip logits by pair, the clipping
// limit. Planning is the one place a step's request is validated; it happens once, when the step
// begins, before any gradient is read, and the plan travels with the step from then on.
//
// Pure functions of immutable inputs; thread-safe.
#pragma once

#include <cstddef>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/host_tensor.h"
#include "kernels/optim/optimizer.h"
#include "server/session/session_config.h"
#include "server/session/step_types.h"

namespace muond::session {

// The largest header.weight: the weighted sums of 1024 ranks' fp32 gradients (Σ w·g, Σ w, in fp64)
// stay finite below it, so a step of valid weights is never skipped as non-finite. The Python
// client's ranks.MAX_WEIGHT is the same (a test reads this line).
inline constexpr double kMaxStepWeight = 1e30;

struct StepPlan {
  StepRequest request;
  std::vector<optim::StepHyper> hyper;                            // per group
  std::vector<std::pair<size_t, std::vector<double>>> qk_logits;  // (index into config.qk_clip, per head)
};

// `defaults` holds each group's hyperparameters from its options (Optimizer::DefaultHyper).
// Errors name the request's field: "header.overrides[0].lr: …", "header.qk_logits[1].query: …",
// "header.max_grad_norm: …", "header.rank: …" (INVALID_ARGUMENT; an unknown group is NOT_FOUND).
absl::StatusOr<StepPlan> PlanStep(const SessionConfig& config, const std::vector<optim::StepHyper>& defaults,
                                  StepRequest request);

// Applies `overrides` to `hyper` (each group's values, in group order) as a step's are applied;
// errors name `field`[i]: an unknown group (NOT_FOUND), a group given twice, a value out of its
// range or of an optimizer that lacks it (INVALID_ARGUMENT). What PlanStep does with the header's,
// and what a restore checks a checkpoint's record of the last step's with.
absl::Status ApplyOverrides(const SessionConfig& config, const std::vector<GroupOverride>& overrides,
                            absl::string_view field, std::vector<optim::StepHyper>& hyper);

// `overrides` (ApplyOverrides accepted them) in group order, without entries that set nothing: what
// the step ran with beyond the groups' options (Session's record of the last step's, which an
// attach answers).
std::vector<GroupOverride> OverridesByGroup(const SessionConfig& config, const std::vector<GroupOverride>& overrides);

// A journaled request as the daemon that wrote it applied it, in what PlanStep takes now: an
// earlier muond ignored a base_step outside an asynchronous session (dropped here) and applied a
// group's override entries in order, a later value winning field by field (merged here, in place
// of the group's first entry). Records of this muond are left as they are.
void NormalizeJournaledRequest(const SessionConfig& config, StepRequest& request);

// torch.nn.utils.clip_grad_norm_'s coefficient for `norm` under the plan: max_norm / (norm + 1e-6),
// clamped to 1; 1 without a limit.
double ClipCoefficient(const StepPlan& plan, double norm);

// One step's clipping, group by group (docs/algorithms.md, Clipping): the global norm over the
// groups of clip_scope global (or the shards' decided one), each group's own norm, and the
// coefficient each group's gradients are multiplied by — clip_scope global: the global one; group:
// its own norm against its max_grad_norm (or the step's); none: 1 — all times `unscale` (1 over the
// loss scale). Norms are of the unscaled gradients; the sums run in parameter order.
struct StepClipping {
  double global_norm = 0;
  std::vector<double> group_norms;   // by group
  std::vector<double> coefficients;  // by group, unscale included
  std::vector<double> clipped;       // by group, without unscale: what the answer reports
};
StepClipping PlanClipping(const SessionConfig& config, const StepPlan& plan, const std::vector<HostTensor>& gradients,
                          double unscale, std::optional<double> decided_global_norm);

}  // namespace muond::session
