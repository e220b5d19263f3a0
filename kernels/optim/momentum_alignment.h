// HeLoCo's correction of a gradient against the momentum (Al Asif et al., arXiv 2606.00271), SGD's
// option `heloco` (docs/algorithms.md, SGD, HeLoCo). For asynchronous DiLoCo: a pseudo-gradient
// computed from an old copy of the parameters may point against the direction the outer momentum
// has taken since. Per parameter (one block), with g the incoming gradient, m the momentum buffer
// before this step, c = g·m / (|g||m|) and conf = |g| / (|g| + κ|m| + ε):
//   c ≥ c_ok      kept:        g
//   c < 0         shrunk:      g − β·c·|g|·m/|m|,  β = min(k_s·(−c)·conf, β_max)
//   0 ≤ c < c_ok  reoriented:  |g|·u/|u|,  u = (1 − λ)·g/|g| + λ·m/|m|,  λ = min(k_d·(c_ok − c)·conf, 1)
// Each corrected gradient is a·g + b·m for two scalars, written with the backend's Axpby. A zero g
// keeps g; so does an m with no usable direction: |m| below fp32's smallest normal number, or so
// small against |g| that b is beyond fp32's range (b·m would overflow to ±inf and 0·inf to NaN). Stateless functions;
// the caller owns the gradient and the momentum.
#pragma once

#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/optim/options.h"

namespace muond::optim {

enum class Alignment { kKept, kReoriented, kShrunk };

// The corrected gradient as grad_scale·g + momentum_scale·m, and the case that chose it.
struct AlignmentPlan {
  Alignment kind = Alignment::kKept;
  double cosine = 0;
  double grad_scale = 1, momentum_scale = 0;
};

// The plan from |g|, |m| and g·m (all fp64), with the group's heloco_* options.
AlignmentPlan PlanAlignment(const GroupOptions& options, double grad_norm, double momentum_norm, double dot);

// The gradient a step applies: `data` is `grad` itself when kept, else the corrected copy that
// `buffer` owns (backend memory, `count` floats).
struct AlignedGradient {
  AlignmentPlan plan;
  const float* data = nullptr;
  std::unique_ptr<kernels::DeviceBuffer> buffer;
};

// Measures `grad` against `momentum` (both `count` elements in backend memory; the momentum in its
// stored format) and returns the gradient to apply.
absl::StatusOr<AlignedGradient> AlignWithMomentum(kernels::Backend& backend, const GroupOptions& options,
                                                  const float* grad, kernels::StoredRef momentum, size_t count);

}  // namespace muond::optim
