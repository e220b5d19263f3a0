#include "kernels/optim/optimizer.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/optim/optimizer_impls.h"
#include "common/status_macros.h"

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
  }
  return absl::InvalidArgumentError("optimizer: unknown kind");
}

StepHyper Optimizer::DefaultHyper() const {
  return StepHyper{.lr = options_.lr, .momentum = options_.momentum,
                   .weight_decay = options_.weight_decay};
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

absl::Status Optimizer::InitState(kernels::Backend& backend, ParamState& param) const {
  MUOND_RETURN_IF_ERROR(CheckParameter(param));
  // Build the new slots aside so a failed allocation leaves the parameter as it was.
  std::vector<StateSlot> slots;
  for (std::string& name : SlotNames()) {
    const size_t numel = SlotNumel(param, name);
    MUOND_ASSIGN_OR_RETURN(auto buffer, backend.Allocate(numel));
    MUOND_RETURN_IF_ERROR(backend.Fill(buffer->data(), numel, 0.0f));
    slots.push_back(StateSlot{std::move(name), std::move(buffer)});
  }
  param.slots = std::move(slots);
  return absl::OkStatus();
}

absl::Status Optimizer::CheckStepInputs(const ParamState& param) const {
  const size_t numel = static_cast<size_t>(param.numel);
  if (param.master == nullptr || param.master->size() < numel) {
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
      if (slot.name == slot_name && slot.buffer != nullptr && slot.buffer->size() >= SlotNumel(param, slot_name)) {
        found = true;
      }
    }
    if (!found) {
      return absl::FailedPreconditionError(absl::StrCat(
          "parameter \"", param.name, "\" has no state slot \"", slot_name, "\" (InitState not run?)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace muond::optim
