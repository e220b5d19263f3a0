// AdamW with torch.optim.AdamW semantics, or with weight_decay_mode l2 torch.optim.Adam's coupled L2
// (Megatron-Core's decoupled_weight_decay=False); the element-wise formula is kernels::AdamWElement.
#include <algorithm>
#include <cmath>
#include <utility>

#include "common/status_macros.h"
#include "kernels/optim/optimizer_impls.h"

namespace muond::optim {
namespace {

class AdamW final : public Optimizer {
 public:
  explicit AdamW(GroupOptions options) : Optimizer(std::move(options)) {}

  std::vector<std::string> SlotNames() const override { return {"exp_avg", "exp_avg_sq"}; }

  // Element-wise: any shape, scalars included.
  absl::Status CheckParameter(const ParamState& param) const override { return CheckElementwiseParameter(param); }

  bool SlotIsNonNegative(std::string_view slot) const override { return slot == "exp_avg_sq"; }

  // kernels::AdamWElement: (coupled L2: g ← g + λ·p); m ← m + (1−β1)(g − m); v ← β2·v + (1−β2)·g²;
  // p ← p·(1 − η·λ) − (η/bc1)·m / (√v/√bc2 + ε) (no decoupled factor with coupled L2), where the
  // quotient is at most m/ε.
  StepBounds BoundStep(const StepHyper& hyper, const ParamState& param, double g) const override {
    const double m = SlotBound(param, "exp_avg"), v = SlotBound(param, "exp_avg_sq");
    const bool coupled = Coupled();
    if (coupled) g = (g + hyper.weight_decay * param.master_bound) * kBoundRounding;
    const double decay = coupled ? 1.0 : std::abs(1.0 - hyper.lr * hyper.weight_decay);
    const double b1 = hyper.beta1, b2 = hyper.beta2;
    const double bc1 = 1.0 - std::pow(b1, static_cast<double>(param.step_count + 1));
    StepBounds out;
    const double m_next = (b1 * m + (1 - b1) * g) * kBoundRounding;
    const double v_next = (b2 * v + (1 - b2) * g * g) * kBoundRounding;
    const double quotient = m_next / options_.eps;
    out.master = (decay * param.master_bound + hyper.lr / bc1 * quotient) * kBoundRounding;
    out.slots = {m_next, v_next};
    out.peak = std::max({out.master, m_next, v_next, g * g, g + m, quotient});
    return out;
  }

  absl::Status Step(kernels::Backend& backend, const StepHyper& hyper, std::span<ParamState* const> params) override {
    for (ParamState* p : params) {
      if (p->has_grad) MUOND_RETURN_IF_ERROR(CheckStepInputs(*p));
    }
    for (ParamState* p : params) {
      if (!p->has_grad) continue;
      // Bias corrections from the parameter's own step t (torch keeps a per-parameter step), in fp64
      // on the host as torch computes them in Python floats.
      const double t = static_cast<double>(p->step_count + 1);
      const kernels::AdamWArgs args{
          .lr = static_cast<float>(hyper.lr),
          .beta1 = static_cast<float>(hyper.beta1),
          .beta2 = static_cast<float>(hyper.beta2),
          .eps = static_cast<float>(options_.eps),
          .weight_decay = Coupled() ? 0.0f : static_cast<float>(hyper.weight_decay),
          .bias_correction1 = static_cast<float>(1.0 - std::pow(hyper.beta1, t)),
          .bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(hyper.beta2, t))),
          .one_minus_beta1 = static_cast<float>(1.0 - hyper.beta1),
          .one_minus_beta2 = static_cast<float>(1.0 - hyper.beta2),
          .l2_weight_decay = Coupled() ? static_cast<float>(hyper.weight_decay) : 0.0f,
      };
      MUOND_RETURN_IF_ERROR(ApplyElementwise(
          backend, *p, [&](const StateRefs& refs, const float* g, size_t n, double* measure) {  // exp_avg, exp_avg_sq
            kernels::AdamWArgs measured = args;
            measured.measure = measure;
            return backend.AdamW(measured, refs.master, g, refs.slots[0], refs.slots[1], n);
          }));
      ++p->step_count;
    }
    return absl::OkStatus();
  }

 private:
  // weight_decay_mode l2: Adam with coupled L2 instead of AdamW's decoupled decay.
  bool Coupled() const { return options_.weight_decay_mode == WeightDecayMode::kL2; }
};

}  // namespace

std::unique_ptr<Optimizer> NewAdamW(const GroupOptions& options) { return std::make_unique<AdamW>(options); }

}  // namespace muond::optim
