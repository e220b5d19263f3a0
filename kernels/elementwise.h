// Element-wise optimizer formulas, written once and compiled for both the CPU loops and the CUDA
// kernels (MUOND_HD expands to __host__ __device__ under nvcc). Each function updates one element.
//
// The formulas follow docs/algorithms.md and torch.optim's order of operations so that results agree
// with torch to fp32 rounding. Scalars that do not depend on the element (bias corrections) are
// computed once on the host and passed in the argument structs.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define MUOND_HD __host__ __device__ __forceinline__
#else
#define MUOND_HD inline
#endif

namespace muond::kernels {

enum class MomentumStyle { kEma, kSum };

// Newton–Schulz's normalization of one matrix (Backend::NormalizeBatched): fp32(1/d) with
// d = norm_safety·√(Σx²) + eps in fp64, or 0 where that is no finite positive fp32 — d ≤ 0 (a zero
// matrix with eps 0), or d below 1/FLT_MAX (every element subnormal in fp32: a momentum decayed
// towards zero with eps 0). Such a matrix counts as zero; never x·inf, nor 0·inf = NaN.
MUOND_HD float InverseNormScale(double sum_squares, double eps, double norm_safety) {
  constexpr double kLargestFloat = 3.4028234663852886e38;
  const double denom = norm_safety * sqrt(sum_squares) + eps;
  return denom > 0 && 1.0 / denom <= kLargestFloat ? static_cast<float>(1.0 / denom) : 0.0f;
}

// Muon momentum: ema  M ← β·M + (1−β)·G;  U ← nesterov ? (1−β)·G + β·M : M
//                sum  M ← β·M + G;        U ← nesterov ? G + β·M : M
struct MomentumArgs {
  float beta = 0.95f;
  MomentumStyle style = MomentumStyle::kEma;
  bool nesterov = true;
};

MUOND_HD void MomentumElement(const MomentumArgs& a, float& m, float g, float& u) {
  if (a.style == MomentumStyle::kEma) {
    m = m + (1.0f - a.beta) * (g - m);          // torch lerp_(g, 1−β)
    u = a.nesterov ? g + a.beta * (m - g) : m;  // torch g.lerp_(m, β)
  } else {
    m = a.beta * m + g;
    u = a.nesterov ? g + a.beta * m : m;
  }
}

// AdaMuon's second moment on the orthogonalized update (Megatron-Core's TensorParallelAdaptiveMuon,
// whose orthogonalization returns the scaled update; moment2_method adamuon): x = scale·O;
// v ← lerp(v, x², 1−β2); O ← x / (√v + ε).
struct AdamuonArgs {
  float scale = 1.0f;             // the Muon scale of the matrix, applied before the moment
  float one_minus_beta2 = 0.05f;  // 1 − β2 rounded from fp64, as torch computes it
  float eps = 1e-8f;
};

MUOND_HD void AdamuonElement(const AdamuonArgs& a, float& v, float& o) {
  const float x = a.scale * o;
  v = v + a.one_minus_beta2 * (x * x - v);  // torch lerp_(x², 1−β2)
  o = x / (sqrtf(v) + a.eps);
}

// NorMuon, per line of an orthogonalized update (Backend::NormuonScales): the second moment
// m ← m + weight·(v̄ − m) in fp32 with v̄ = fp32(sum/count) the line's mean square (torch
// lerp_(v̄, 1−β2)), and the line's scale 1/√max(m, eps) in fp64 from that fp32 m.
MUOND_HD float NormuonMoment(double sum, double count, float weight, float m) {
  const float mean = static_cast<float>(sum / count);
  return m + weight * (mean - m);
}
MUOND_HD double NormuonLineScale(float m, double eps) {
  const double v = static_cast<double>(m);
  return 1.0 / sqrt(v < eps ? eps : v);  // std::max(v, eps), NaN kept
}

// NAMO and NAMO-D, per line of a matrix (Backend::NamoScales): one line is the whole matrix
// (NAMO) or one of its columns (NAMO-D). The second moment v ← v + weight·(s − v) in fp32 with
// s = fp32(Σ G²) over the line of the raw gradient (NormuonMoment with count 1); the line's
// unclamped scale from Σ M̃² over the same line of the momentum Newton–Schulz takes, in fp64:
// √ΣM̃²/(√v + eps) (NAMO, Emerging-Optimizers) or √ΣM̃²/√(v + eps) (NAMO-D, the authors' code),
// times `bias`.
struct NamoArgs {
  float weight = 0;          // 1 − β2
  double eps = 0;            // > 0
  bool eps_in_root = false;  // NAMO-D's placement
  double bias = 1;           // NAMO-D: √(1 − β2ᵗ)/(1 − β1ᵗ); NAMO: 1
  double clamp = 0;          // NAMO-D: each scale kept in [c·mean, mean/c] when 0 < c ≤ 1
};
MUOND_HD double NamoLineScale(const NamoArgs& a, double update_sum, float v) {
  const double root = a.eps_in_root ? sqrt(static_cast<double>(v) + a.eps) : sqrt(static_cast<double>(v)) + a.eps;
  return a.bias * sqrt(update_sum) / root;
}
// The clamp toward the mean of a matrix's line scales (the authors' `col_state_clamp_c`): off
// unless 0 < c ≤ 1 and the mean is finite and positive.
MUOND_HD double NamoClamped(double scale, double mean, double c) {
  if (!(c > 0 && c <= 1) || !(mean > 0 && mean < HUGE_VAL)) return scale;
  const double lo = mean * c, hi = mean / c;
  return scale < lo ? lo : (scale > hi ? hi : scale);
}

// Cautious weight decay (modded-nanogpt, nanochat): the decoupled decay applies only where the
// update u and the weight agree in sign. p ← p − decay·p·[u·p ≥ 0] + alpha·u, with alpha = −η·scale
// (the step along u) and decay = η·λ.
struct CautiousArgs {
  float alpha = 0.0f;
  float decay = 0.0f;
};

MUOND_HD void CautiousUpdateElement(const CautiousArgs& a, float u, float& p) {
  const float mask = static_cast<float>(u * p >= 0.0f);
  p = p - a.decay * mask * p + a.alpha * u;
}

// torch.optim.AdamW (or torch.optim.Adam with l2_weight_decay). bias_correction1 = 1 − β1ᵗ, bias_correction2_sqrt = √(1
// − β2ᵗ).
struct AdamWArgs {
  float lr = 1e-3f;
  float beta1 = 0.9f, beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;
  float bias_correction1 = 1.0f;
  float bias_correction2_sqrt = 1.0f;
  // 1 − β1 and 1 − β2 rounded from fp64 as torch does (it computes them in Python floats): in fp32,
  // 1.0f − 0.999f is off by 1.3e-5 relative, far more than rounding. Must match beta1 / beta2.
  float one_minus_beta1 = 0.1f;
  float one_minus_beta2 = 0.001f;
  // Adam with coupled L2 (torch.optim.Adam's weight_decay, Megatron's decoupled_weight_decay=False):
  // g ← g + λ·p before the moments. Zero for AdamW, whose decay is weight_decay above.
  float l2_weight_decay = 0.0f;
  // Backend::MeasuresUpdatesInPass: where Σ W_before² and Σ ΔW² go (null: not measured).
  double* measure = nullptr;
};

MUOND_HD void AdamWElement(const AdamWArgs& a, float& p, float g, float& m, float& v) {
  g = g + a.l2_weight_decay * p;  // torch grad.add(param, alpha=λ); exact for λ = 0 (p is finite)
  p = p * (1.0f - a.lr * a.weight_decay);
  m = m + a.one_minus_beta1 * (g - m);          // torch lerp_(g, 1−β1)
  v = a.beta2 * v + a.one_minus_beta2 * g * g;  // torch mul_(β2).addcmul_(g, g, 1−β2)
  const float step_size = a.lr / a.bias_correction1;
  const float denom = sqrtf(v) / a.bias_correction2_sqrt + a.eps;
  p = p - step_size * (m / denom);
}

// Lion: u = sign(β1·m + (1−β1)·g); p ← p·(1−η·λ) − η·u; m ← β2·m + (1−β2)·g.
struct LionArgs {
  float lr = 1e-4f;
  float beta1 = 0.9f, beta2 = 0.99f;
  float weight_decay = 0.0f;
  double* measure = nullptr;  // as AdamWArgs::measure
};

MUOND_HD void LionElement(const LionArgs& a, float& p, float g, float& m) {
  const float c = a.beta1 * m + (1.0f - a.beta1) * g;
  // sign(c) without branches (so the CPU loop vectorizes): 1, −1, or 0 for ±0 and NaN.
  const float u = static_cast<float>(c > 0.0f) - static_cast<float>(c < 0.0f);
  p = p * (1.0f - a.lr * a.weight_decay) - a.lr * u;
  m = a.beta2 * m + (1.0f - a.beta2) * g;
}

// torch.optim.SGD (dampening 0): g ← g + λ·p; b ← μ·b + g (b = g on the first step);
// d = nesterov ? g + μ·b : b (μ = 0: d = g); p ← p − η·d.
struct SgdArgs {
  float lr = 1e-2f;
  float momentum = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
  bool first_step = true;
  double* measure = nullptr;  // as AdamWArgs::measure
};

MUOND_HD void SgdElement(const SgdArgs& a, float& p, float g, float& b) {
  g = g + a.weight_decay * p;
  float d = g;
  if (a.momentum != 0.0f) {
    b = a.first_step ? g : a.momentum * b + g;
    d = a.nesterov ? g + a.momentum * b : b;
  }
  p = p - a.lr * d;
}

}  // namespace muond::kernels
