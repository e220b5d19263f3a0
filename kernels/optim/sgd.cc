// SGD with torch.optim.SGD semantics (dampening 0); formula in kernels::SgdElement.
#include <algorithm>
#include <utility>

#include "common/status_macros.h"
#include "kernels/optim/optimizer_impls.h"

namespace muond::optim {
namespace {

class Sgd final : public Optimizer {
 public:
  explicit Sgd(GroupOptions options) : Optimizer(std::move(options)) {}

  // Allocated even without momentum so a per-step momentum override finds its buffer.
  std::vector<std::string> SlotNames() const override { return {"momentum_buffer"}; }

  absl::Status CheckParameter(const ParamState& param) const override { return CheckElementwiseParameter(param); }

  // kernels::SgdElement: g ← g + λ·p; b ← μ·b + g; d = nesterov ? g + μ·b : b (μ = 0: d = g);
  // p ← p − η·d.
  StepBounds BoundStep(const StepHyper& hyper, const ParamState& param, double g) const override {
    const double b = SlotBound(param, "momentum_buffer");
    const double mu = hyper.momentum;
    const double g_decayed = (g + hyper.weight_decay * param.master_bound) * kBoundRounding;
    double b_next = b, d = g_decayed;
    if (mu != 0) {
      b_next = (mu * b + g_decayed) * kBoundRounding;
      d = options_.nesterov ? (g_decayed + mu * b_next) * kBoundRounding : b_next;
    }
    StepBounds out;
    out.master = (param.master_bound + hyper.lr * d) * kBoundRounding;
    out.slots = {b_next};
    out.peak = std::max({out.master, b_next, d, g_decayed});
    return out;
  }

  absl::Status Step(kernels::Backend& backend, const StepHyper& hyper, std::span<ParamState* const> params) override {
    for (ParamState* p : params) {
      if (p->has_grad) MUOND_RETURN_IF_ERROR(CheckStepInputs(*p));
    }
    for (ParamState* p : params) {
      if (!p->has_grad) continue;
      // torch creates the buffer as a copy of the first gradient; step_count == 0 marks that step.
      const kernels::SgdArgs args{.lr = static_cast<float>(hyper.lr),
                                  .momentum = static_cast<float>(hyper.momentum),
                                  .weight_decay = static_cast<float>(hyper.weight_decay),
                                  .nesterov = options_.nesterov,
                                  .first_step = p->step_count == 0};
      MUOND_RETURN_IF_ERROR(ApplyElementwise(
          backend, *p, [&](const StateRefs& refs, const float* g, size_t n, double* measure) {  // momentum_buffer
            kernels::SgdArgs measured = args;
            measured.measure = measure;
            return backend.Sgd(measured, refs.master, g, refs.slots[0], n);
          }));
      ++p->step_count;
    }
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<Optimizer> NewSgd(const GroupOptions& options) { return std::make_unique<Sgd>(options); }

}  // namespace muond::optim
