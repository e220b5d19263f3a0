// HeLoCo's correction against the momentum (momentum_alignment.h).
#include "kernels/optim/momentum_alignment.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "common/status_macros.h"

namespace muond::optim {
namespace {

constexpr double kEpsilon = 1e-12;  // the ε of the confidence and of |u|

// Whether b·m can be formed in fp32: b must be a finite fp32 (b·m_i is then at most b·|m|, which
// the plans keep within |g|).
bool Fp32Scale(double b) { return std::abs(b) <= std::numeric_limits<float>::max(); }

}  // namespace

AlignmentPlan PlanAlignment(const GroupOptions& options, double grad_norm, double momentum_norm, double dot) {
  AlignmentPlan plan;
  // A momentum below fp32's smallest normal number has no reliable direction (a decayed buffer of
  // subnormals): no momentum, as a zero one.
  if (!(grad_norm > 0) || !(momentum_norm >= std::numeric_limits<float>::min())) return plan;
  const double c = std::clamp(dot / (grad_norm * momentum_norm), -1.0, 1.0);
  plan.cosine = c;
  if (c >= options.heloco_keep_cosine) return plan;
  const double confidence = grad_norm / (grad_norm + options.heloco_kappa * momentum_norm + kEpsilon);
  if (c < 0) {
    const double beta = std::min(options.heloco_shrink * -c * confidence, options.heloco_shrink_max);
    const double momentum_scale = -beta * c * grad_norm / momentum_norm;
    if (!Fp32Scale(momentum_scale)) return plan;  // |m| negligible against |g|: kept
    plan.kind = Alignment::kShrunk;
    plan.momentum_scale = momentum_scale;
    return plan;
  }
  const double lambda = std::min(options.heloco_reorient * (options.heloco_keep_cosine - c) * confidence, 1.0);
  // |u|² = (1 − λ)² + λ² + 2λ(1 − λ)c for the two unit vectors.
  const double u_norm =
      std::max(std::sqrt((1 - lambda) * (1 - lambda) + lambda * lambda + 2 * lambda * (1 - lambda) * c), kEpsilon);
  const double momentum_scale = lambda * grad_norm / (momentum_norm * u_norm);
  if (!Fp32Scale(momentum_scale)) return plan;  // |m| negligible against |g|: kept
  plan.kind = Alignment::kReoriented;
  plan.grad_scale = (1 - lambda) / u_norm;
  plan.momentum_scale = momentum_scale;
  return plan;
}

absl::StatusOr<AlignedGradient> AlignWithMomentum(kernels::Backend& backend, const GroupOptions& options,
                                                  const float* grad, kernels::StoredRef momentum, size_t count) {
  AlignedGradient out;
  out.data = grad;
  if (count == 0) return out;
  // The momentum in fp32: its own memory, or a widened copy that later holds the result.
  const float* m = momentum.is_fp32() ? momentum.fp32() : nullptr;
  if (m == nullptr) {
    MUOND_ASSIGN_OR_RETURN(out.buffer, backend.Allocate(count));
    MUOND_RETURN_IF_ERROR(backend.Widen(momentum.dtype, momentum.data, out.buffer->data(), count));
    m = out.buffer->data();
  }
  double grad_squares = 0, momentum_squares = 0, dot = 0;
  MUOND_RETURN_IF_ERROR(backend.SumSquares(grad, count, 1, &grad_squares));
  MUOND_RETURN_IF_ERROR(backend.SumSquares(m, count, 1, &momentum_squares));
  MUOND_RETURN_IF_ERROR(backend.Dot(grad, m, count, &dot));
  out.plan = PlanAlignment(options, std::sqrt(grad_squares), std::sqrt(momentum_squares), dot);
  if (out.plan.kind == Alignment::kKept) {
    out.buffer.reset();
    return out;
  }
  if (out.buffer == nullptr) {
    MUOND_ASSIGN_OR_RETURN(out.buffer, backend.Allocate(count));
    MUOND_RETURN_IF_ERROR(backend.CopyOnDevice(m, out.buffer->data(), count));
  }
  // buffer ← a·g + b·m (it holds m).
  MUOND_RETURN_IF_ERROR(backend.Axpby(static_cast<float>(out.plan.grad_scale), grad,
                                      static_cast<float>(out.plan.momentum_scale), out.buffer->data(), count));
  out.data = out.buffer->data();
  return out;
}

}  // namespace muond::optim
