// AdamW with torch.optim.AdamW semantics; the element-wise formula is kernels::AdamWElement.
#include <cmath>
#include <utility>

#include "kernels/optim/optimizer_impls.h"
#include "common/status_macros.h"

namespace muond::optim {
namespace {

class AdamW final : public Optimizer {
 public:
  explicit AdamW(GroupOptions options) : Optimizer(std::move(options)) {}

  std::vector<std::string> SlotNames() const override { return {"exp_avg", "exp_avg_sq"}; }

  // Element-wise: any shape, scalars included.
  absl::Status CheckParameter(const ParamState& param) const override { return absl::OkStatus(); }

  absl::Status Step(kernels::Backend& backend, const StepHyper& hyper,
                    std::span<ParamState* const> params) override {
    const std::string slots[] = {"exp_avg", "exp_avg_sq"};
    for (ParamState* p : params) {
      if (p->has_grad) MUOND_RETURN_IF_ERROR(CheckStepInputs(*p, slots));
    }
    for (ParamState* p : params) {
      if (!p->has_grad) continue;
      // Bias corrections from the parameter's own step t (torch keeps a per-parameter step), in fp64
      // on the host as torch computes them in Python floats.
      const double t = static_cast<double>(p->step_count + 1);
      const kernels::AdamWArgs args{
          .lr = static_cast<float>(hyper.lr),
          .beta1 = static_cast<float>(options_.beta1),
          .beta2 = static_cast<float>(options_.beta2),
          .eps = static_cast<float>(options_.eps),
          .weight_decay = static_cast<float>(hyper.weight_decay),
          .bias_correction1 = static_cast<float>(1.0 - std::pow(options_.beta1, t)),
          .bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(options_.beta2, t))),
          .one_minus_beta1 = static_cast<float>(1.0 - options_.beta1),
          .one_minus_beta2 = static_cast<float>(1.0 - options_.beta2),
      };
      MUOND_RETURN_IF_ERROR(backend.AdamW(args, p->master->data(), p->grad->data(),
                                          p->Slot("exp_avg")->data(), p->Slot("exp_avg_sq")->data(),
                                          static_cast<size_t>(p->numel)));
      ++p->step_count;
    }
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<Optimizer> NewAdamW(const GroupOptions& options) {
  return std::make_unique<AdamW>(options);
}

}  // namespace muond::optim
