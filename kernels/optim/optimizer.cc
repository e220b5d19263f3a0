#include "kernels/optim/optimizer.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/optim/optimizer_impls.h"

namespace muond::optim {

absl::StatusOr<std::unique_ptr<Optimizer>> Optimizer::Create(const GroupOptions& options) {
  // Re-checked here because a bad option (ns_steps 0, an empty schedule) would otherwise surface
  // much later as a silent no-op or a crash inside a step.
  MUOND_RETURN_IF_ERROR(ValidateOptions(options));
  switch (options.optimizer) {
    case OptimizerKind::kMuon:
      return NewMuon(options);
    case OptimizerKind::kAdamW:
      return NewAdamW(options);
    case OptimizerKind::kLion:
      return NewLion(options);
    case OptimizerKind::kSgd:
      return NewSgd(options);
    case OptimizerKind::kDion2:
      return NewDion2(options);
  }
  return absl::InvalidArgumentError("optimizer: unknown kind");
}

StepHyper Optimizer::DefaultHyper() const {
  return StepHyper{.lr = options_.lr,
                   .momentum = options_.momentum,
                   .weight_decay = options_.weight_decay,
                   .beta1 = options_.beta1,
                   .beta2 = options_.beta2};
}

absl::Status Optimizer::CheckElementwiseParameter(const ParamState& param) {
  if (param.qkv.enabled()) {
    return absl::InvalidArgumentError("qkv_split applies only to parameters of Muon groups");
  }
  if (param.tp.enabled()) {
    return absl::InvalidArgumentError("tp_blocks applies only to parameters of Muon groups");
  }
  return absl::OkStatus();
}

double Optimizer::SlotBound(const ParamState& param, std::string_view name) {
  for (const StateSlot& slot : param.slots) {
    if (slot.name == name) return slot.bound;
  }
  return 0;
}

size_t Optimizer::SlotNumel(const ParamState& param, std::string_view slot) const {
  size_t numel = 1;
  for (int64_t d : SlotShape(param, slot)) numel *= static_cast<size_t>(d);
  return numel;
}

kernels::StorageDtype Optimizer::SlotDtype(std::string_view slot) const {
  if (slot == "momentum" || slot == "momentum_buffer") return options_.momentum_dtype;
  if (slot == "exp_avg") return options_.exp_avg_dtype;
  if (slot == "exp_avg_sq" || slot == "moment2") return options_.exp_avg_sq_dtype;
  return kernels::StorageDtype::kFp32;
}

absl::Status Optimizer::InitState(kernels::Backend& backend, ParamState& param) const {
  MUOND_RETURN_IF_ERROR(CheckParameter(param));
  // Build the new slots aside so a failed allocation leaves the parameter as it was.
  std::vector<StateSlot> slots;
  for (std::string& name : SlotNames()) {
    MUOND_ASSIGN_OR_RETURN(StoredTensor tensor, AllocateStored(backend, SlotDtype(name), SlotNumel(param, name)));
    slots.push_back(StateSlot{std::move(name), std::move(tensor)});
  }
  param.slots = std::move(slots);
  return absl::OkStatus();
}

absl::Status Optimizer::CheckStepInputs(const ParamState& param) const {
  const size_t numel = static_cast<size_t>(param.numel);
  if (!param.master.allocated() || param.master.numel < numel) {
    return absl::FailedPreconditionError(
        absl::StrCat("parameter \"", param.name, "\" has no master of ", numel, " elements"));
  }
  if (param.grad == nullptr || param.grad->size() < numel) {
    return absl::FailedPreconditionError(
        absl::StrCat("parameter \"", param.name, "\" has no gradient of ", numel, " elements"));
  }
  for (const std::string& slot_name : SlotNames()) {
    bool found = false;
    for (const StateSlot& slot : param.slots) {
      if (slot.name == slot_name && slot.tensor.allocated() && slot.tensor.numel >= SlotNumel(param, slot_name)) {
        found = true;
      }
    }
    if (!found) {
      return absl::FailedPreconditionError(
          absl::StrCat("parameter \"", param.name, "\" has no state slot \"", slot_name, "\" (InitState not run?)"));
    }
  }
  return absl::OkStatus();
}

Optimizer::StateRefs Optimizer::RefsOf(ParamState& param) {
  StateRefs refs{param.master.Ref(), {}};
  for (size_t s = 0; s < param.slots.size() && s < refs.slots.size(); ++s) refs.slots[s] = param.slots[s].tensor.Ref();
  return refs;
}

absl::Status Optimizer::StepMeasured(kernels::Backend& backend, const StepHyper& hyper,
                                     std::span<ParamState* const> params, StepTelemetry& telemetry) {
  if (telemetry.measure) MUOND_RETURN_IF_ERROR(UpdateMeter::Reserve(backend, telemetry));
  telemetry_ = &telemetry;
  absl::Status status = Step(backend, hyper, params);
  telemetry_ = nullptr;
  // The step's one wait for what it measured, after all its work was enqueued.
  if (status.ok()) return telemetry.pending.Collect(backend);
  telemetry.pending.Clear();
  return status;
}

absl::Status Optimizer::ApplyElementwise(kernels::Backend& backend, ParamState& param, ElementwiseUpdate apply,
                                         const float* grad) {
  const StateRefs refs = RefsOf(param);
  const float* g = grad != nullptr ? grad : param.grad->data();
  return UpdateMeter::Measure(
      backend, refs.master, static_cast<size_t>(param.numel),
      [&](size_t offset, size_t count, double* measure) {
        if (offset == 0 && count == static_cast<size_t>(param.numel)) return apply(refs, g, count, measure);
        StateRefs part{refs.master.At(offset), {}};
        for (size_t s = 0; s < refs.slots.size(); ++s) {
          if (refs.slots[s].data != nullptr) part.slots[s] = refs.slots[s].At(offset);
        }
        return apply(part, g + offset, count, measure);
      },
      telemetry_, /*in_pass=*/true);
}

}  // namespace muond::optim
