// Optimizer: one parameter group's update rule (Muon, AdamW, Lion, SGD), written once against the
// Backend primitives so every backend runs the same math.
//
// An Optimizer is created per group from validated GroupOptions. It may keep scratch workspace
// between steps (Newton–Schulz buffers), so it is not thread-safe: the owning session serializes
// InitState and Step.
#pragma once

#include <array>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/optim/options.h"
#include "kernels/optim/param_state.h"
#include "kernels/optim/step_telemetry.h"

namespace muond::optim {

// Per-step hyperparameters: the group's values unless the client overrode them for this step.
struct StepHyper {
  double lr = 0;
  double momentum = 0;
  double weight_decay = 0;
  // AdamW and Lion: (β1, β2), which a step may override as torch's schedulers change `betas`.
  double beta1 = 0;
  double beta2 = 0;
};

// Upper bounds on magnitudes after one step of one parameter (docs/algorithms.md, Finite steps):
// its master, each slot in SlotNames() order, and the largest value the step computes on the way
// (Adam's g², say), which is at least each of the others.
struct StepBounds {
  double master = 0;
  std::vector<double> slots;
  double peak = 0;
};

// Rounding allowance of one step: every bound is multiplied by it (fp32 ε is 2⁻²⁴; a step rounds a
// handful of times).
inline constexpr double kBoundRounding = 1.0 + 0x1p-20;

class Optimizer {
 public:
  virtual ~Optimizer() = default;

  // options must have passed ValidateOptions.
  static absl::StatusOr<std::unique_ptr<Optimizer>> Create(const GroupOptions& options);

  const GroupOptions& options() const { return options_; }
  StepHyper DefaultHyper() const;

  // INVALID_ARGUMENT when this optimizer cannot handle the parameter's shape (Muon needs ≥ 2 dims,
  // a QKV split must add up to the rows); the message names the problem, the caller names the field.
  virtual absl::Status CheckParameter(const ParamState& param) const = 0;

  // Names of the state slots, e.g. {"momentum"}.
  virtual std::vector<std::string> SlotNames() const = 0;

  // The shape of slot `slot` of `param`: the parameter's own, except for reduced state (NorMuon's
  // per-line second moment). SlotNumel is its element count, the size of the slot's buffer.
  virtual std::vector<int64_t> SlotShape(const ParamState& param, std::string_view slot) const { return param.shape; }
  size_t SlotNumel(const ParamState& param, std::string_view slot) const;

  // The storage format of slot `slot` (the group's momentum_dtype, exp_avg_dtype or
  // exp_avg_sq_dtype, by the slot's role).
  kernels::StorageDtype SlotDtype(std::string_view slot) const;

  // Whether a slot's values must not be negative (Adam's second moment, whose square root a step
  // takes); a state loaded from elsewhere is checked against it.
  virtual bool SlotIsNonNegative(std::string_view slot) const { return false; }

  // Upper bounds on the magnitudes one Step would leave in `param` and compute on the way, from
  // param.master_bound, its slots' bounds and `grad_bound` (≥ every |g|, after clipping). Cheap
  // (no device access) and monotone in every input bound.
  virtual StepBounds BoundStep(const StepHyper& hyper, const ParamState& param, double grad_bound) const = 0;

  // The least Newton–Schulz workspace, in floats, a step of `params` needs on `backend` (every
  // batch cut to one matrix: what a workspace bound must allow), and the parameter that needs the
  // most on its own with its need; the element-wise optimizers need none. Shapes only.
  struct WorkspaceNeed {
    size_t floats = 0;
    const ParamState* largest = nullptr;
    size_t largest_floats = 0;
  };
  virtual WorkspaceNeed LeastWorkspace(const kernels::Backend& /*backend*/,
                                       std::span<const ParamState* const> /*params*/) const {
    return {};
  }

  // Allocates the parameter's slots, in their formats, and zeroes them.
  absl::Status InitState(kernels::Backend& backend, ParamState& param) const;

  // One step over every parameter of the group whose has_grad is set: reads grad (which it may
  // overwrite as scratch), updates master and slots, increments step_count.
  virtual absl::Status Step(kernels::Backend& backend, const StepHyper& hyper, std::span<ParamState* const> params) = 0;

  // Step, measuring it into `telemetry` (step_telemetry.h; telemetry.measure says whether the
  // update and the residual are measured): the same arithmetic, the same results.
  absl::Status StepMeasured(kernels::Backend& backend, const StepHyper& hyper, std::span<ParamState* const> params,
                            StepTelemetry& telemetry);

 protected:
  explicit Optimizer(GroupOptions options) : options_(std::move(options)) {}
  // Common precondition of every Step: a gradient of the parameter's size and every slot, of its
  // SlotNumel, allocated by InitState. FAILED_PRECONDITION naming the parameter otherwise.
  absl::Status CheckStepInputs(const ParamState& param) const;
  // The state of `param` as the element-wise primitives take it: its master and its slots in
  // SlotNames order, each in its storage format.
  struct StateRefs {
    kernels::StoredRef master;
    std::array<kernels::StoredRef, 2> slots;  // no element-wise optimizer has more
  };
  // param.slots are in SlotNames order (InitState made them so); CheckStepInputs has checked them.
  static StateRefs RefsOf(ParamState& param);
  // CheckParameter of the optimizers that treat every element alike: no QKV split.
  static absl::Status CheckElementwiseParameter(const ParamState& param);
  // The bound of `param`'s slot `name`; 0 before InitState made it.
  static double SlotBound(const ParamState& param, std::string_view name);
  // Runs an element-wise update of `param` (apply(refs, gradient, count) on the state from element
  // `offset` of StateRefs on), measured by UpdateMeter during StepMeasured. Every slot must have
  // the parameter's shape. `grad`: the gradient to apply, of the parameter's size, when not
  // param.grad (SGD's HeLoCo-corrected copy).
  // (refs, gradient, count, measure): `measure` goes into the kernel's args (Backend::MeasuresUpdatesInPass).
  using ElementwiseUpdate = absl::FunctionRef<absl::Status(const StateRefs&, const float*, size_t, double*)>;
  absl::Status ApplyElementwise(kernels::Backend& backend, ParamState& param, ElementwiseUpdate apply,
                                const float* grad = nullptr);
  GroupOptions options_;
  // The telemetry of the step in progress when it runs through StepMeasured; null otherwise.
  StepTelemetry* telemetry_ = nullptr;
};

}  // namespace muond::optim
