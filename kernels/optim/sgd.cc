// SGD with torch.optim.SGD semantics (dampening 0); formula in kernels::SgdElement. With
// nesterov_delay N > 1, delayed Nesterov (Liu et al., arXiv 2401.09135, the outer optimizer of
// asynchronous DiLoCo), written with the backend's Axpby (docs/algorithms.md, SGD). With `heloco`,
// each gradient is first corrected against the momentum (momentum_alignment.h).
#include <algorithm>
#include <cmath>
#include <utility>

#include "common/status_macros.h"
#include "kernels/optim/momentum_alignment.h"
#include "kernels/optim/optimizer_impls.h"
#include "kernels/optim/step_telemetry.h"

namespace muond::optim {
namespace {

class Sgd final : public Optimizer {
 public:
  explicit Sgd(GroupOptions options) : Optimizer(std::move(options)) {}

  // Allocated even without momentum so a per-step momentum override finds its buffer; delayed
  // Nesterov also keeps the sum of the gradients since its last momentum update.
  std::vector<std::string> SlotNames() const override {
    if (Delayed()) return {"momentum_buffer", "delay_buffer"};
    return {"momentum_buffer"};
  }

  absl::Status CheckParameter(const ParamState& param) const override { return CheckElementwiseParameter(param); }

  // kernels::SgdElement: g ← g + λ·p; b ← μ·b + g; d = nesterov ? g + μ·b : b (μ = 0: d = g);
  // p ← p − η·d.
  StepBounds BoundStep(const StepHyper& hyper, const ParamState& param, double g) const override {
    // HeLoCo's correction keeps |g|₂ ≤ √n·bound (reoriented) or adds at most β_max·|g|₂ ≤ √n·bound
    // along the unit momentum (shrunk): each element stays within (1 + √n)·bound either way.
    if (options_.heloco) g *= (1 + std::sqrt(static_cast<double>(param.numel))) * kBoundRounding;
    if (Delayed()) return BoundDelayed(hyper, param, g);
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
    if (Delayed()) return StepDelayed(backend, hyper, params);
    for (ParamState* p : params) {
      if (!p->has_grad) continue;
      MUOND_ASSIGN_OR_RETURN(const AlignedGradient grad, Aligned(backend, *p));
      // torch creates the buffer as a copy of the first gradient; step_count == 0 marks that step.
      const kernels::SgdArgs args{.lr = static_cast<float>(hyper.lr),
                                  .momentum = static_cast<float>(hyper.momentum),
                                  .weight_decay = static_cast<float>(hyper.weight_decay),
                                  .nesterov = options_.nesterov,
                                  .first_step = p->step_count == 0};
      MUOND_RETURN_IF_ERROR(ApplyElementwise(
          backend, *p,
          [&](const StateRefs& refs, const float* g, size_t n, double* measure) {  // momentum_buffer
            kernels::SgdArgs measured = args;
            measured.measure = measure;
            return backend.Sgd(measured, refs.master, g, refs.slots[0], n);
          },
          grad.data));
      ++p->step_count;
    }
    return absl::OkStatus();
  }

 private:
  bool Delayed() const { return options_.nesterov_delay > 1; }

  // The gradient the step applies: p.grad, or with `heloco` its correction against the momentum
  // buffer as it stands before the step (slot 0), counted in the step's telemetry.
  absl::StatusOr<AlignedGradient> Aligned(kernels::Backend& backend, ParamState& p) {
    const float* g = p.grad->data();
    if (!options_.heloco) {
      AlignedGradient unchanged;
      unchanged.data = g;
      return unchanged;
    }
    MUOND_ASSIGN_OR_RETURN(AlignedGradient aligned,
                           AlignWithMomentum(backend, options_, g, RefsOf(p).slots[0], static_cast<size_t>(p.numel)));
    if (telemetry_ != nullptr) {
      switch (aligned.plan.kind) {
        case Alignment::kKept:
          ++telemetry_->heloco_kept;
          break;
        case Alignment::kReoriented:
          ++telemetry_->heloco_reoriented;
          break;
        case Alignment::kShrunk:
          ++telemetry_->heloco_shrunk;
          break;
      }
    }
    return aligned;
  }

  // Delayed Nesterov, per parameter, its step t counted from 0 (step_count), N = nesterov_delay,
  // β = momentum, c = momentum_activation, η = lr:
  //   D ← D + g
  //   when (t + 1) mod N = 0:  m ← β·m + D/N;  p ← p − η(1 − cN + c)β·m − (η/N)·g;  D ← 0
  //   otherwise:               p ← p − ηcβ·m − (η/N)·g
  // Each line is Axpby's y ← α·x + β·y, every product and sum rounded to fp32 once.
  absl::Status StepDelayed(kernels::Backend& backend, const StepHyper& hyper, std::span<ParamState* const> params) {
    // ValidateStepHyper refused a weight decay (delayed Nesterov has none) before the step began.
    const int n = options_.nesterov_delay;
    const double beta = hyper.momentum, c = options_.momentum_activation, lr = hyper.lr;
    const float grad_factor = static_cast<float>(-lr / n);
    const float boundary_factor = static_cast<float>(-lr * (1.0 - c * n + c) * beta);
    const float between_factor = static_cast<float>(-lr * c * beta);
    for (ParamState* p : params) {
      if (!p->has_grad) continue;
      const bool boundary = (p->step_count + 1) % n == 0;
      const StateRefs refs = RefsOf(*p);
      MUOND_ASSIGN_OR_RETURN(const AlignedGradient grad, Aligned(backend, *p));
      const float* g = grad.data;
      const kernels::StoredRef m = refs.slots[0], sum = refs.slots[1];
      auto apply = [&](size_t offset, size_t count, double*) -> absl::Status {
        const kernels::StoredRef w = refs.master.At(offset), mo = m.At(offset), d = sum.At(offset);
        MUOND_RETURN_IF_ERROR(backend.Axpby(1.0f, g + offset, 1.0f, d, count));
        if (boundary) {
          MUOND_RETURN_IF_ERROR(backend.Axpby(static_cast<float>(1.0 / n), d, static_cast<float>(beta), mo, count));
          MUOND_RETURN_IF_ERROR(backend.Axpby(boundary_factor, mo, 1.0f, w, count));
        } else if (between_factor != 0) {
          MUOND_RETURN_IF_ERROR(backend.Axpby(between_factor, mo, 1.0f, w, count));
        }
        MUOND_RETURN_IF_ERROR(backend.Axpby(grad_factor, g + offset, 1.0f, w, count));
        if (boundary) MUOND_RETURN_IF_ERROR(backend.Fill(d.fp32(), count, 0.0f));  // fp32 (SlotDtype)
        return absl::OkStatus();
      };
      MUOND_RETURN_IF_ERROR(UpdateMeter::Measure(backend, refs.master, static_cast<size_t>(p->numel), apply, telemetry_,
                                                 /*in_pass=*/false));
      ++p->step_count;
    }
    return absl::OkStatus();
  }

  StepBounds BoundDelayed(const StepHyper& hyper, const ParamState& param, double g) const {
    const int n = options_.nesterov_delay;
    const double beta = hyper.momentum, c = options_.momentum_activation;
    const double sum = (SlotBound(param, "delay_buffer") + g) * kBoundRounding;
    const double m = (beta * SlotBound(param, "momentum_buffer") + sum / n) * kBoundRounding;
    const double step = hyper.lr * (std::max(1.0 - c * n + c, c) * beta * m + g / n) * kBoundRounding;
    StepBounds out;
    out.master = (param.master_bound + step) * kBoundRounding;
    out.slots = {m, sum};
    out.peak = std::max({out.master, m, sum, g});
    return out;
  }
};

}  // namespace

std::unique_ptr<Optimizer> NewSgd(const GroupOptions& options) { return std::make_unique<Sgd>(options); }

}  // namespace muond::optim
