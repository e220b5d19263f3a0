// SGD with torch.optim.SGD semantics (dampening 0); formula in kernels::SgdElement.
#include <utility>

#include "kernels/optim/optimizer_impls.h"
#include "common/status_macros.h"

namespace muond::optim {
namespace {

class Sgd final : public Optimizer {
 public:
  explicit Sgd(GroupOptions options) : Optimizer(std::move(options)) {}

  // Allocated even without momentum so a per-step momentum override finds its buffer.
  std::vector<std::string> SlotNames() const override { return {"momentum_buffer"}; }

  absl::Status CheckParameter(const ParamState& param) const override { return absl::OkStatus(); }

  absl::Status Step(kernels::Backend& backend, const StepHyper& hyper,
                    std::span<ParamState* const> params) override {
    const std::string slots[] = {"momentum_buffer"};
    for (ParamState* p : params) {
      if (p->has_grad) MUOND_RETURN_IF_ERROR(CheckStepInputs(*p, slots));
    }
    for (ParamState* p : params) {
      if (!p->has_grad) continue;
      // torch creates the buffer as a copy of the first gradient; step_count == 0 marks that step.
      const kernels::SgdArgs args{.lr = static_cast<float>(hyper.lr),
                                  .momentum = static_cast<float>(hyper.momentum),
                                  .weight_decay = static_cast<float>(hyper.weight_decay),
                                  .nesterov = options_.nesterov,
                                  .first_step = p->step_count == 0};
      MUOND_RETURN_IF_ERROR(backend.Sgd(args, p->master->data(), p->grad->data(),
                                        p->Slot("momentum_buffer")->data(),
                                        static_cast<size_t>(p->numel)));
      ++p->step_count;
    }
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<Optimizer> NewSgd(const GroupOptions& options) {
  return std::make_unique<Sgd>(options);
}

}  // namespace muond::optim
