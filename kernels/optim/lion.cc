// Lion (Chen et al. 2023): sign of an interpolated momentum; formula in kernels::LionElement.
#include <algorithm>
#include <cmath>
#include <utility>

#include "common/status_macros.h"
#include "kernels/optim/optimizer_impls.h"

namespace muond::optim {
namespace {

class Lion final : public Optimizer {
 public:
  explicit Lion(GroupOptions options) : Optimizer(std::move(options)) {}

  std::vector<std::string> SlotNames() const override { return {"exp_avg"}; }

  absl::Status CheckParameter(const ParamState& param) const override { return CheckElementwiseParameter(param); }

  // kernels::LionElement: the update is a sign; m ← β2·m + (1−β2)·g.
  StepBounds BoundStep(const StepHyper& hyper, const ParamState& param, double g) const override {
    const double m = SlotBound(param, "exp_avg");
    StepBounds out;
    const double m_next = (hyper.beta2 * m + (1 - hyper.beta2) * g) * kBoundRounding;
    out.master = (std::abs(1.0 - hyper.lr * hyper.weight_decay) * param.master_bound + hyper.lr) * kBoundRounding;
    out.slots = {m_next};
    out.peak = std::max({out.master, m_next, m + g});
    return out;
  }

  absl::Status Step(kernels::Backend& backend, const StepHyper& hyper, std::span<ParamState* const> params) override {
    for (ParamState* p : params) {
      if (p->has_grad) MUOND_RETURN_IF_ERROR(CheckStepInputs(*p));
    }
    const kernels::LionArgs args{.lr = static_cast<float>(hyper.lr),
                                 .beta1 = static_cast<float>(hyper.beta1),
                                 .beta2 = static_cast<float>(hyper.beta2),
                                 .weight_decay = static_cast<float>(hyper.weight_decay)};
    for (ParamState* p : params) {
      if (!p->has_grad) continue;
      MUOND_RETURN_IF_ERROR(ApplyElementwise(
          backend, *p, [&](const StateRefs& refs, const float* g, size_t n, double* measure) {  // exp_avg
            kernels::LionArgs measured = args;
            measured.measure = measure;
            return backend.Lion(measured, refs.master, g, refs.slots[0], n);
          }));
      ++p->step_count;
    }
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<Optimizer> NewLion(const GroupOptions& options) { return std::make_unique<Lion>(options); }

}  // namespace muond::optim
