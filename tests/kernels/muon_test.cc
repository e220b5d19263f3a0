// Muon against an fp64 reference written from the formulas of docs/algorithms.md (momentum,
// Newton–Schulz, scale, weight decay, update), over several steps and every option that changes the
// math.
#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/optim/optimizer.h"
#include "tests/kernels/reference.h"
#include "tests/testing/error_bounds.h"
#include "tests/testing/status_matchers.h"

namespace muond::optim {
namespace {

using ::muond::testing::Mat;
using ::muond::testing::StatusIs;

struct ParamSpec {
  std::vector<int64_t> shape;
  QkvSplit qkv = {};
  TpBlocks tp = {};
};

// The reference's own reading of docs/algorithms.md, Shapes: per matrix, element (i, j) is at
// offset + i·ld + j of the parameter (ld = cols unless it is a column block).
struct Block {
  int64_t offset, rows, cols, ld = 0;
  int64_t At(int64_t i, int64_t j) const { return offset + i * (ld ? ld : cols) + j; }
};
// With `heads` (num_heads) > 1: every q, k and v block of a fused QKV weight, or the plain matrix,
// cut into heads of the query heads' rows.
std::vector<Block> Blocks(const ParamSpec& p, int64_t heads = 1) {
  int64_t numel = 1;
  for (int64_t d : p.shape) numel *= d;
  std::vector<Block> blocks;
  if (heads > 1) {
    const int64_t n = p.shape[1];
    const int64_t head = p.qkv.enabled() ? p.qkv.q / (heads / p.qkv.num_query_groups) : p.shape[0] / heads;
    std::vector<int64_t> sizes;
    for (int64_t g = 0; g < (p.qkv.enabled() ? p.qkv.num_query_groups : 1); ++g) {
      for (int64_t rows :
           p.qkv.enabled() ? std::vector<int64_t>{p.qkv.q, p.qkv.k, p.qkv.v} : std::vector<int64_t>{p.shape[0]}) {
        for (int64_t r = 0; r < rows; r += head) sizes.push_back(head);
      }
    }
    int64_t row = 0;
    for (int64_t rows : sizes) {
      blocks.push_back({row * n, rows, n});
      row += rows;
    }
    return blocks;
  }
  if (p.tp.enabled()) {
    const int64_t m = p.shape[0], n = p.shape[1], t = p.tp.blocks;
    for (int64_t b = 0; b < t; ++b) {
      if (p.tp.dim == 0)
        blocks.push_back({b * (m / t) * n, m / t, n});
      else
        blocks.push_back({b * (n / t), m, n / t, n});
    }
  } else if (p.qkv.enabled()) {
    const int64_t n = p.shape[1];
    int64_t row = 0;
    for (int64_t g = 0; g < p.qkv.num_query_groups; ++g) {
      blocks.push_back({row * n, p.qkv.q, n});
      blocks.push_back({(row + p.qkv.q) * n, p.qkv.k, n});
      blocks.push_back({(row + p.qkv.q + p.qkv.k) * n, p.qkv.v, n});
      row += p.qkv.q + p.qkv.k + p.qkv.v;
    }
  } else if (p.shape.size() == 3) {
    for (int64_t e = 0; e < p.shape[0]; ++e) blocks.push_back({e * p.shape[1] * p.shape[2], p.shape[1], p.shape[2]});
  } else {
    blocks.push_back({0, p.shape[0], numel / p.shape[0]});
  }
  return blocks;
}

double RefScale(const GroupOptions& o, double m, double n) {
  switch (o.scale_mode) {
    case ScaleMode::kShapeScaling:
      return o.extra_scale_factor * std::sqrt(std::max(1.0, m / n));
    case ScaleMode::kSpectral:
      return o.extra_scale_factor * std::sqrt(std::max(m, n));
    case ScaleMode::kUnitRmsNorm:
      return o.extra_scale_factor * std::sqrt(m / n);
  }
  return 0;
}

// The update of one block after Newton–Schulz, and the step η·k it is applied with: scale·O for
// plain Muon; AdaMuon's x/(√v + ε) with x = scale·O (step η); NorMuon's O·s·‖O‖/‖O·s‖ with
// s = 1/√max(v, ε) per row (rows ≥ cols) or column (step η·scale). m2 holds the block's moment.
std::vector<double> RefAdaptive(const GroupOptions& o, const Block& b, const Mat& out, double scale, double* m2,
                                double& step_scale) {
  const int64_t rows = b.rows, cols = b.cols;
  std::vector<double> upd(out.v);
  step_scale = scale;
  if (o.moment2_method == Moment2Method::kAdamuon) {
    for (size_t i = 0; i < upd.size(); ++i) {
      const double x = scale * out.v[i];
      m2[i] += (1 - o.beta2) * (x * x - m2[i]);
      upd[i] = x / (std::sqrt(m2[i]) + o.eps);
    }
    step_scale = 1;
  } else if (o.moment2_method == Moment2Method::kNormuon) {
    const bool per_row = rows >= cols;
    const int64_t lines = per_row ? rows : cols, count = per_row ? cols : rows;
    auto at = [&](int64_t line, int64_t k) { return per_row ? line * cols + k : k * cols + line; };
    double norm2 = 0, scaled2 = 0;
    std::vector<double> s(lines);
    for (int64_t l = 0; l < lines; ++l) {
      double sum = 0;
      for (int64_t k = 0; k < count; ++k) sum += out.v[at(l, k)] * out.v[at(l, k)];
      m2[l] += (1 - o.beta2) * (sum / count - m2[l]);
      s[l] = 1 / std::sqrt(std::max(m2[l], o.eps));
      norm2 += sum;
      scaled2 += s[l] * s[l] * sum;
    }
    const double ratio = scaled2 > 0 ? std::sqrt(norm2 / scaled2) : 0;
    for (int64_t l = 0; l < lines; ++l) {
      for (int64_t k = 0; k < count; ++k) upd[at(l, k)] = out.v[at(l, k)] * s[l] * ratio;
    }
  }
  return upd;
}

// NAMO (Emerging-Optimizers) and NAMO-D (the NAMO authors' code) on one block, after
// Newton–Schulz: per line (the block, or each of its columns) v ← v + (1−β2)(Σ g² − v) over the raw
// gradient; NAMO α = ‖M̃‖/(√v + ε); NAMO-D d = bias·‖M̃_col‖/√(v + ε) with bias = √(1−β2ᵗ)/(1−β1ᵗ),
// clamped to [c·mean, mean/c]; out scaled by them. `u` is the block's M̃ before any normalization.
void RefNamo(const GroupOptions& o, double beta1, int64_t t, const Block& b, const std::vector<double>& g,
             const std::vector<double>& u, Mat& out, double* m2) {
  const bool diagonal = o.moment2_method == Moment2Method::kNamoD;
  const int64_t lines = diagonal ? b.cols : 1;
  std::vector<double> gs(lines, 0.0), us(lines, 0.0), d(lines);
  for (int64_t i = 0; i < b.rows; ++i) {
    for (int64_t j = 0; j < b.cols; ++j) {
      const int64_t l = diagonal ? j : 0;
      gs[l] += g[b.At(i, j)] * g[b.At(i, j)];
      us[l] += u[b.At(i, j)] * u[b.At(i, j)];
    }
  }
  double mean = 0;
  for (int64_t l = 0; l < lines; ++l) {
    m2[l] += (1 - o.beta2) * (gs[l] - m2[l]);
    if (diagonal) {
      const double bias = std::sqrt(1 - std::pow(o.beta2, t)) / (1 - std::pow(beta1, t));
      d[l] = bias * std::sqrt(us[l]) / std::sqrt(m2[l] + o.eps);
    } else {
      d[l] = std::sqrt(us[l]) / (std::sqrt(m2[l]) + o.eps);
    }
    mean += d[l] / static_cast<double>(lines);
  }
  const double c = o.namo_clamp;
  for (int64_t l = 0; l < lines; ++l) {
    if (diagonal && c > 0 && c <= 1 && mean > 0) d[l] = std::clamp(d[l], c * mean, mean / c);
  }
  for (int64_t i = 0; i < b.rows; ++i) {
    for (int64_t j = 0; j < b.cols; ++j) out.v[i * b.cols + j] *= d[diagonal ? j : 0];
  }
}

// Each row (rows) or column of x scaled by (Σ x² + eps)^(-1/2), from the sums of x as given.
std::vector<double> LineScales(const Mat& x, bool rows, double eps) {
  const int64_t lines = rows ? x.rows : x.cols, count = rows ? x.cols : x.rows;
  std::vector<double> scales(lines);
  for (int64_t l = 0; l < lines; ++l) {
    double sum = 0;
    for (int64_t k = 0; k < count; ++k) {
      const double v = rows ? x.v[l * x.cols + k] : x.v[k * x.cols + l];
      sum += v * v;
    }
    scales[l] = 1 / std::sqrt(sum + eps);
  }
  return scales;
}
void ScaleLines(Mat& x, const std::vector<double>& scales, bool rows) {
  for (int64_t i = 0; i < x.rows; ++i) {
    for (int64_t j = 0; j < x.cols; ++j) x.v[i * x.cols + j] *= scales[rows ? i : j];
  }
}

// MuonEq (MaeChd/muon-eq, llm-opt-baseline-npu/llama2_pretrain/optimizers/muon_variants/muoneq.py
// at 99b6c8b, _row_normalize/_col_normalize/_rowcol_normalize with the default exponent −1/2):
// U·diag-scaled by (Σ u² + 1e-8)^(-1/2) per row, column, or both, both scales from the same U.
void RefMomentumNormalization(MomentumNormalization mode, Mat& x) {
  constexpr double kEps = 1e-8;
  const bool rows = mode == MomentumNormalization::kRow || mode == MomentumNormalization::kRowCol;
  const bool cols = mode == MomentumNormalization::kCol || mode == MomentumNormalization::kRowCol;
  const std::vector<double> row_scales = LineScales(x, true, kEps), col_scales = LineScales(x, false, kEps);
  if (rows) ScaleLines(x, row_scales, true);
  if (cols) ScaleLines(x, col_scales, false);
}

// Muon+ (K1seki221/MuonPlus as in MaeChd/muon-eq's muon_plus.py at 99b6c8b, apply_post_polar_norm):
// each row and/or column divided by √(Σ u² + 1e-7), one after the other.
void RefPostNormalization(PostNormalization mode, Mat& x) {
  constexpr double kEps = 1e-7;
  std::vector<bool> order;  // true: rows
  switch (mode) {
    case PostNormalization::kNone:
      break;
    case PostNormalization::kRow:
      order = {true};
      break;
    case PostNormalization::kCol:
      order = {false};
      break;
    case PostNormalization::kMuonPlus:
    case PostNormalization::kRowCol:
      order = {true, false};
      break;
    case PostNormalization::kColRow:
      order = {false, true};
      break;
  }
  for (bool rows : order) ScaleLines(x, LineScales(x, rows, kEps), rows);
}

// One Muon step in fp64 on host vectors w (master), mom (momentum) and m2 (the second moment, when
// the options have one).
void RefStep(const GroupOptions& o, const StepHyper& h, const ParamSpec& p, std::vector<double> g,
             std::vector<double>& w, std::vector<double>& mom, std::vector<double>& m2, int64_t t = 1) {
  const double beta = h.momentum, lr = h.lr, wd = h.weight_decay;
  const size_t n = w.size();
  if (o.weight_decay_mode == WeightDecayMode::kL2) {
    for (size_t i = 0; i < n; ++i) g[i] += wd * w[i];
  }
  std::vector<double> u(n);
  for (size_t i = 0; i < n; ++i) {
    if (o.momentum_style == kernels::MomentumStyle::kEma) {
      mom[i] = beta * mom[i] + (1 - beta) * g[i];
      u[i] = o.nesterov ? (1 - beta) * g[i] + beta * mom[i] : mom[i];
    } else {
      mom[i] = beta * mom[i] + g[i];
      u[i] = o.nesterov ? g[i] + beta * mom[i] : mom[i];
    }
  }
  const std::vector<double> w_before = w;
  for (size_t i = 0; i < n; ++i) {
    if (o.weight_decay_mode == WeightDecayMode::kDecoupled) w[i] -= lr * wd * w_before[i];
    if (o.weight_decay_mode == WeightDecayMode::kIndependent) w[i] -= wd * w_before[i];
  }
  int64_t line = 0;  // NorMuon's lines of earlier blocks
  for (const Block& b : Blocks(p, o.num_heads)) {
    Mat x(b.rows, b.cols);
    for (int64_t i = 0; i < b.rows; ++i) {
      for (int64_t j = 0; j < b.cols; ++j) x.v[i * b.cols + j] = u[b.At(i, j)];
    }
    RefMomentumNormalization(o.momentum_normalization, x);
    Mat out = o.ns_preconditioner == NsPreconditioner::kAol
                  ? testing::ReferenceAolNs(x, o.ns_schedule, o.ns_steps, o.ns_eps)
                  : testing::ReferenceNs(x, o.ns_schedule, o.ns_steps, o.ns_eps, o.ns_norm_safety);
    RefPostNormalization(o.post_normalization, out);
    if (o.moment2_method == Moment2Method::kNamo || o.moment2_method == Moment2Method::kNamoD) {
      RefNamo(o, beta, t, b, g, u, out, m2.data() + line);
      line += o.moment2_method == Moment2Method::kNamoD ? b.cols : 1;
    }
    std::vector<double> block_adamuon;  // AdaMuon's moment of the block, gathered and put back
    double* block_m2 = nullptr;
    if (o.moment2_method == Moment2Method::kAdamuon) {
      for (int64_t i = 0; i < b.rows; ++i) {
        for (int64_t j = 0; j < b.cols; ++j) block_adamuon.push_back(m2[b.At(i, j)]);
      }
      block_m2 = block_adamuon.data();
    }
    if (o.moment2_method == Moment2Method::kNormuon) {
      block_m2 = m2.data() + line;
      line += std::max(b.rows, b.cols);
    }
    double k = 0;
    const std::vector<double> upd = RefAdaptive(o, b, out, RefScale(o, b.rows, b.cols), block_m2, k);
    for (int64_t i = 0; i < b.rows * b.cols; ++i) {
      const int64_t j = b.At(i / b.cols, i % b.cols);
      if (!block_adamuon.empty()) m2[j] = block_adamuon[i];
      if (o.weight_decay_mode == WeightDecayMode::kCautious && upd[i] * w_before[j] >= 0) {
        w[j] -= lr * wd * w_before[j];  // modded-nanogpt: decay only where update and weight agree
      }
      w[j] -= lr * k * upd[i];
    }
  }
}

struct MuonCase {
  std::string name;
  GroupOptions options;
  std::vector<ParamSpec> params;
};
// Readable test names in ctest instead of a byte dump.
void PrintTo(const MuonCase& c, std::ostream* os) { *os << c.name; }

GroupOptions Opts(kernels::MomentumStyle style, bool nesterov, WeightDecayMode wd_mode, ScaleMode scale_mode,
                  double weight_decay = 0.1, double k = 1.0) {
  GroupOptions o = DefaultOptions(OptimizerKind::kMuon);
  o.lr = 0.05;  // large enough that each step's update dominates fp32 rounding of W
  o.momentum_style = style;
  o.nesterov = nesterov;
  o.weight_decay_mode = wd_mode;
  o.weight_decay = weight_decay;
  o.scale_mode = scale_mode;
  o.extra_scale_factor = k;
  return o;
}

// Adaptive Muon with a β2 far from 1 and a large decay, so the moment and the mask matter at once.
GroupOptions Adaptive(Moment2Method method, WeightDecayMode wd_mode, ScaleMode scale_mode = ScaleMode::kShapeScaling) {
  GroupOptions o = Opts(kernels::MomentumStyle::kEma, true, wd_mode, scale_mode, 0.5);
  o.lr = 0.01;
  o.moment2_method = method;
  o.beta2 = 0.9;
  return o;
}

// MuonEq's and Muon+'s normalizations, over `base`.
GroupOptions Normalized(GroupOptions base, MomentumNormalization before, PostNormalization after) {
  base.momentum_normalization = before;
  base.post_normalization = after;
  return base;
}

// Gram Newton–Schulz computes the standard iteration's map: the reference is the standard one.
GroupOptions Gram(const std::string& set) {
  GroupOptions o = Opts(kernels::MomentumStyle::kEma, true, WeightDecayMode::kDecoupled, ScaleMode::kShapeScaling);
  o.ns_algorithm = NsAlgorithm::kGram;
  o.ns_schedule = *NamedSchedule(set);
  return o;
}

class MuonReferenceTest : public ::testing::TestWithParam<MuonCase> {};

TEST_P(MuonReferenceTest, MatchesFp64ReferenceOverSteps) {
  const MuonCase& c = GetParam();
  auto backend = kernels::NewCpuBackend(1);
  ASSERT_OK_AND_ASSIGN(auto opt, Optimizer::Create(c.options));
  std::mt19937 rng(42);
  std::normal_distribution<double> normal(0.0, 1.0);

  std::vector<ParamState> states(c.params.size());
  std::vector<std::vector<double>> ref_w(c.params.size()), ref_m(c.params.size()), ref_m2(c.params.size());
  for (size_t i = 0; i < c.params.size(); ++i) {
    ParamState& s = states[i];
    s.name = "p" + std::to_string(i);
    s.shape = c.params[i].shape;
    s.qkv = c.params[i].qkv;
    s.tp = c.params[i].tp;
    s.numel = 1;
    for (int64_t d : s.shape) s.numel *= d;
    std::vector<float> w(s.numel);
    for (float& x : w) x = static_cast<float>(normal(rng));
    ref_w[i] = testing::ToDouble(w);
    ref_m[i].assign(s.numel, 0.0);
    s.master = testing::Upload(*backend, w);
    ASSERT_OK_AND_ASSIGN(s.grad, backend->Allocate(s.numel));
    ASSERT_OK(opt->InitState(*backend, s));
    ref_m2[i].assign(opt->SlotNumel(s, "moment2"), 0.0);
  }
  std::vector<ParamState*> ptrs;
  for (ParamState& s : states) ptrs.push_back(&s);

  const StepHyper hyper = opt->DefaultHyper();
  for (int step = 0; step < 6; ++step) {
    for (size_t i = 0; i < states.size(); ++i) {
      std::vector<float> g(states[i].numel);
      for (float& x : g) x = static_cast<float>(normal(rng));
      ASSERT_OK(backend->CopyToDevice(g.data(), states[i].grad->data(), g.size()));
      states[i].has_grad = true;
      RefStep(c.options, hyper, c.params[i], testing::ToDouble(g), ref_w[i], ref_m[i], ref_m2[i], step + 1);
    }
    ASSERT_OK(opt->Step(*backend, hyper, ptrs));
    for (size_t i = 0; i < states.size(); ++i) {
      const auto w = testing::Download(*backend, states[i].master.fp32(), states[i].numel);
      const auto m = testing::Download(*backend, states[i].Slot("momentum")->fp32(), states[i].numel);
      double dw = 0, dm = 0;
      for (int64_t j = 0; j < states[i].numel; ++j) {
        dw = std::max(dw, std::abs(w[j] - ref_w[i][j]));
        dm = std::max(dm, std::abs(m[j] - ref_m[i][j]) / (1 + std::abs(ref_m[i][j])));
      }
      // W is O(1) and moves by lr·scale·|O| ≈ 1e-2 per step. fp32 rounding of W (6e-8 per update)
      // plus lr·scale times the NS drift (≤ 4e-6, newton_schulz_test) stays below ~5e-7 per step;
      // 5e-6 after 6 steps has margin, while a wrong scale, decay mode, momentum form or block
      // split moves W by ≥ 1e-4 in the first step. Derived: each step rounds W twice (decay and
      // update), ≤ 2·2⁻²⁴·|W| ≤ 5e-7 for |W| ≤ 4, so 3e-6 over 6 steps, plus lr·scale (≤ 0.08)
      // times the NS rounding (≤ 1e-5 under every OpenBLAS kernel, newton_schulz_test) per step,
      // 5e-6 in all. Worst seen over the kernels: 1.2e-6.
      EXPECT_TRUE(testing::WithinBound("muon.weights_vs_fp64", dw, 5e-6))
          << c.name << " param " << i << " step " << step;
      // Momentum is element-wise fp32 arithmetic: a few ulps of its magnitude.
      EXPECT_TRUE(testing::WithinBound("muon.momentum_vs_fp64", dm, 1e-6))
          << c.name << " param " << i << " step " << step;
      if (c.options.moment2_method != Moment2Method::kNone) {
        const auto m2 = testing::Download(*backend, states[i].Slot("moment2")->fp32(), ref_m2[i].size());
        double dm2 = 0, largest = 0;
        for (size_t j = 0; j < m2.size(); ++j) {
          dm2 = std::max(dm2, std::abs(m2[j] - ref_m2[i][j]));
          largest = std::max(largest, std::abs(ref_m2[i][j]));
        }
        // The moment is an EMA of squares of O (or of line means): its error relative to its largest
        // value follows O's drift (≤ 4e-6 of ‖O‖, newton_schulz_test) and fp32 rounding.
        EXPECT_TRUE(testing::WithinBound("muon.moment2_vs_fp64", dm2 / largest, 1e-4))
            << c.name << " param " << i << " step " << step;
      }
      EXPECT_EQ(states[i].step_count, step + 1);
    }
  }
}

using kernels::MomentumStyle;
const ParamSpec k2d{{16, 24}};
const ParamSpec kTall{{24, 16}};

INSTANTIATE_TEST_SUITE_P(
    Variants, MuonReferenceTest,
    ::testing::Values(
        MuonCase{"ema_nesterov",
                 Opts(MomentumStyle::kEma, true, WeightDecayMode::kDecoupled, ScaleMode::kShapeScaling, 0.0),
                 {k2d, kTall}},
        MuonCase{"ema_plain",
                 Opts(MomentumStyle::kEma, false, WeightDecayMode::kDecoupled, ScaleMode::kShapeScaling),
                 {k2d, kTall}},
        MuonCase{"sum_nesterov",
                 Opts(MomentumStyle::kSum, true, WeightDecayMode::kDecoupled, ScaleMode::kShapeScaling),
                 {k2d, kTall}},
        MuonCase{"sum_plain",
                 Opts(MomentumStyle::kSum, false, WeightDecayMode::kDecoupled, ScaleMode::kShapeScaling),
                 {k2d, kTall}},
        MuonCase{"decay_independent",
                 Opts(MomentumStyle::kEma, true, WeightDecayMode::kIndependent, ScaleMode::kShapeScaling, 0.02),
                 {k2d, kTall}},
        MuonCase{"decay_l2",
                 Opts(MomentumStyle::kEma, true, WeightDecayMode::kL2, ScaleMode::kShapeScaling, 0.5),
                 {k2d, kTall}},
        MuonCase{"spectral",
                 Opts(MomentumStyle::kEma, true, WeightDecayMode::kDecoupled, ScaleMode::kSpectral, 0.1, 0.2),
                 {k2d, kTall}},
        MuonCase{"unit_rms_norm",
                 Opts(MomentumStyle::kEma, true, WeightDecayMode::kDecoupled, ScaleMode::kUnitRmsNorm, 0.1, 1.5),
                 {k2d, kTall}},
        MuonCase{"conv4d",
                 Opts(MomentumStyle::kEma, true, WeightDecayMode::kDecoupled, ScaleMode::kShapeScaling),
                 {ParamSpec{{32, 3, 3, 3}}, ParamSpec{{6, 4, 3, 3}}}},
        MuonCase{"experts3d",
                 Opts(MomentumStyle::kEma, true, WeightDecayMode::kDecoupled, ScaleMode::kShapeScaling),
                 {ParamSpec{{3, 12, 20}}, ParamSpec{{2, 20, 12}}}},
        MuonCase{"qkv",
                 Opts(MomentumStyle::kSum, true, WeightDecayMode::kDecoupled, ScaleMode::kSpectral, 0.1, 0.2),
                 {ParamSpec{{48, 16}, QkvSplit{.q = 16, .k = 4, .v = 4, .num_query_groups = 2}}}},
        // Shapes shared across parameters (16×24 from a 2-D, two experts and a QKV block) go through
        // one gathered batch; the reference does them one at a time.
        MuonCase{"adamuon", Adaptive(Moment2Method::kAdamuon, WeightDecayMode::kDecoupled), {k2d, kTall}},
        MuonCase{"adamuon_spectral_experts",
                 Adaptive(Moment2Method::kAdamuon, WeightDecayMode::kDecoupled, ScaleMode::kSpectral),
                 {ParamSpec{{3, 12, 20}}, k2d}},
        MuonCase{"normuon",
                 Adaptive(Moment2Method::kNormuon, WeightDecayMode::kDecoupled),
                 {k2d, kTall, ParamSpec{{16, 16}}}},
        MuonCase{"normuon_qkv_conv_experts",
                 Adaptive(Moment2Method::kNormuon, WeightDecayMode::kCautious),
                 {ParamSpec{{40, 24}, QkvSplit{.q = 16, .k = 2, .v = 2, .num_query_groups = 2}},
                  ParamSpec{{6, 4, 3, 3}}, ParamSpec{{2, 20, 12}}, k2d}},
        // NAMO and NAMO-D: the raw gradient's lines are taken before the momentum overwrites it, in
        // each layout (experts, flattened filters, QKV blocks, column blocks worked on transposed).
        MuonCase{"namo", Adaptive(Moment2Method::kNamo, WeightDecayMode::kDecoupled), {k2d, kTall}},
        MuonCase{"namo_qkv_conv_experts",
                 Adaptive(Moment2Method::kNamo, WeightDecayMode::kCautious, ScaleMode::kSpectral),
                 {ParamSpec{{40, 24}, QkvSplit{.q = 16, .k = 2, .v = 2, .num_query_groups = 2}},
                  ParamSpec{{6, 4, 3, 3}}, ParamSpec{{2, 20, 12}}, k2d}},
        MuonCase{"namo_d", Adaptive(Moment2Method::kNamoD, WeightDecayMode::kDecoupled), {k2d, kTall, ParamSpec{{16, 16}}}},
        MuonCase{"namo_d_unclamped_momentum_normalized",
                 [] {
                   GroupOptions o = Normalized(Adaptive(Moment2Method::kNamoD, WeightDecayMode::kDecoupled),
                                               MomentumNormalization::kRow, PostNormalization::kMuonPlus);
                   o.namo_clamp = 0;
                   return o;
                 }(),
                 {k2d, kTall}},
        MuonCase{"namo_d_qkv_conv_experts_tp",
                 Adaptive(Moment2Method::kNamoD, WeightDecayMode::kIndependent, ScaleMode::kSpectral),
                 {ParamSpec{{40, 24}, QkvSplit{.q = 16, .k = 2, .v = 2, .num_query_groups = 2}},
                  ParamSpec{{6, 4, 3, 3}}, ParamSpec{{2, 20, 12}}, ParamSpec{{16, 24}, {}, TpBlocks{.blocks = 2, .dim = 1}},
                  ParamSpec{{16, 24}, {}, TpBlocks{.blocks = 2, .dim = 0}}}},
        MuonCase{"cautious",
                 Opts(MomentumStyle::kEma, true, WeightDecayMode::kCautious, ScaleMode::kShapeScaling, 0.5),
                 {k2d, kTall}},
        MuonCase{"gram", Gram("simple"), {k2d, kTall, ParamSpec{{2, 16, 24}}, ParamSpec{{16, 16}}}},
        MuonCase{"gram_polar_express", Gram("gram_polar_express"), {k2d, kTall, ParamSpec{{3, 12, 20}}}},
        // Tensor-parallel blockwise: row blocks (column-parallel) and column blocks (row-parallel),
        // batched with same-shape matrices of other parameters (12×20 twice from the row blocks).
        MuonCase{"tp_blocks",
                 Opts(MomentumStyle::kEma, true, WeightDecayMode::kDecoupled, ScaleMode::kShapeScaling),
                 {ParamSpec{{24, 20}, {}, TpBlocks{.blocks = 2, .dim = 0}},
                  ParamSpec{{12, 40}, {}, TpBlocks{.blocks = 4, .dim = 1}}, ParamSpec{{12, 20}},
                  ParamSpec{{16, 16}, {}, TpBlocks{.blocks = 2, .dim = 1}}}},
        MuonCase{"tp_blocks_adaptive",
                 Adaptive(Moment2Method::kAdamuon, WeightDecayMode::kCautious),
                 {ParamSpec{{12, 40}, {}, TpBlocks{.blocks = 4, .dim = 1}},
                  ParamSpec{{24, 20}, {}, TpBlocks{.blocks = 2, .dim = 0}}}},
        MuonCase{"tp_blocks_normuon",
                 Adaptive(Moment2Method::kNormuon, WeightDecayMode::kDecoupled, ScaleMode::kSpectral),
                 {ParamSpec{{12, 40}, {}, TpBlocks{.blocks = 4, .dim = 1}},
                  ParamSpec{{16, 16}, {}, TpBlocks{.blocks = 2, .dim = 1}},
                  ParamSpec{{8, 24}, {}, TpBlocks{.blocks = 3, .dim = 1}}}},
        // MuonEq and Muon+ on square, tall, wide, expert, conv, QKV and tensor-parallel blocks (the
        // column blocks are stored transposed: their rows are the stored columns).
        MuonCase{
            "muoneq_row",
            Normalized(Opts(MomentumStyle::kSum, true, WeightDecayMode::kDecoupled, ScaleMode::kSpectral, 0.1, 0.2),
                       MomentumNormalization::kRow, PostNormalization::kNone),
            {k2d, kTall, ParamSpec{{16, 16}}, ParamSpec{{3, 12, 20}}, ParamSpec{{6, 4, 3, 3}}}},
        MuonCase{"muoneq_col",
                 Normalized(Opts(MomentumStyle::kEma, true, WeightDecayMode::kDecoupled, ScaleMode::kShapeScaling),
                            MomentumNormalization::kCol, PostNormalization::kNone),
                 {k2d, kTall, ParamSpec{{12, 40}, {}, TpBlocks{.blocks = 4, .dim = 1}}}},
        MuonCase{"muoneq_rowcol",
                 Normalized(Opts(MomentumStyle::kEma, false, WeightDecayMode::kCautious, ScaleMode::kShapeScaling, 0.5),
                            MomentumNormalization::kRowCol, PostNormalization::kNone),
                 {k2d, kTall, ParamSpec{{40, 24}, QkvSplit{.q = 16, .k = 2, .v = 2, .num_query_groups = 2}},
                  ParamSpec{{16, 16}, {}, TpBlocks{.blocks = 2, .dim = 1}}, ParamSpec{{2, 20, 12}}}},
        MuonCase{"muon_plus",
                 Normalized(Opts(MomentumStyle::kSum, true, WeightDecayMode::kDecoupled, ScaleMode::kShapeScaling),
                            MomentumNormalization::kNone, PostNormalization::kMuonPlus),
                 {k2d, kTall, ParamSpec{{16, 16}}, ParamSpec{{3, 12, 20}}, ParamSpec{{6, 4, 3, 3}},
                  ParamSpec{{12, 40}, {}, TpBlocks{.blocks = 4, .dim = 1}}}},
        MuonCase{"post_col_row",
                 Normalized(Opts(MomentumStyle::kEma, true, WeightDecayMode::kDecoupled, ScaleMode::kUnitRmsNorm),
                            MomentumNormalization::kNone, PostNormalization::kColRow),
                 {k2d, kTall, ParamSpec{{24, 20}, {}, TpBlocks{.blocks = 2, .dim = 0}}}},
        MuonCase{"post_row",
                 Normalized(Opts(MomentumStyle::kEma, true, WeightDecayMode::kDecoupled, ScaleMode::kShapeScaling),
                            MomentumNormalization::kNone, PostNormalization::kRow),
                 {k2d, kTall, ParamSpec{{16, 16}, {}, TpBlocks{.blocks = 2, .dim = 1}}}},
        MuonCase{"post_col",
                 Normalized(Opts(MomentumStyle::kEma, true, WeightDecayMode::kL2, ScaleMode::kShapeScaling, 0.5),
                            MomentumNormalization::kNone, PostNormalization::kCol),
                 {k2d, kTall, ParamSpec{{2, 16, 24}}}},
        MuonCase{"muoneq_muon_plus_adamuon",
                 Normalized(Adaptive(Moment2Method::kAdamuon, WeightDecayMode::kDecoupled),
                            MomentumNormalization::kRowCol, PostNormalization::kRowCol),
                 {k2d, kTall, ParamSpec{{3, 12, 20}}}},
        MuonCase{"muoneq_normuon",
                 Normalized(Adaptive(Moment2Method::kNormuon, WeightDecayMode::kDecoupled), MomentumNormalization::kRow,
                            PostNormalization::kNone),
                 {k2d, kTall, ParamSpec{{12, 40}, {}, TpBlocks{.blocks = 4, .dim = 1}}}},
        MuonCase{"muoneq_muon_plus_gram",
                 Normalized(Gram("gram_polar_express"), MomentumNormalization::kRow, PostNormalization::kMuonPlus),
                 {k2d, kTall, ParamSpec{{3, 12, 20}}}},
        // Per-head Newton–Schulz: plain matrices, and a fused QKV weight of 2 query groups with 4
        // query heads of 4 rows in all (2 per group; k and v one head each), batched with same-shape heads.
        MuonCase{"heads",
                 [] {
                   GroupOptions o = Opts(MomentumStyle::kEma, true, WeightDecayMode::kDecoupled, ScaleMode::kShapeScaling);
                   o.num_heads = 4;
                   return o;
                 }(),
                 {ParamSpec{{16, 24}}, ParamSpec{{32, 8}},
                  ParamSpec{{32, 16}, QkvSplit{.q = 8, .k = 4, .v = 4, .num_query_groups = 2}}}},
        MuonCase{"heads_normuon_muon_plus",
                 [] {
                   GroupOptions o = Normalized(Adaptive(Moment2Method::kNormuon, WeightDecayMode::kCautious),
                                               MomentumNormalization::kRowCol, PostNormalization::kNone);
                   o.num_heads = 2;
                   return o;
                 }(),
                 {ParamSpec{{16, 24}}, ParamSpec{{24, 12}}}},
        // Turbo-Muon: AOL preconditioning, the aol set, 4 steps; with MuonEq and on every shape.
        MuonCase{"turbo_muon",
                 [] {
                   GroupOptions o = Opts(MomentumStyle::kEma, true, WeightDecayMode::kDecoupled, ScaleMode::kShapeScaling);
                   o.ns_preconditioner = NsPreconditioner::kAol;
                   o.ns_schedule = *NamedSchedule("aol");
                   o.ns_steps = 4;
                   return o;
                 }(),
                 {k2d, kTall, ParamSpec{{16, 16}}, ParamSpec{{3, 12, 20}}, ParamSpec{{6, 4, 3, 3}},
                  ParamSpec{{12, 40}, {}, TpBlocks{.blocks = 4, .dim = 1}}}},
        MuonCase{"turbo_muon_muoneq_normuon",
                 [] {
                   GroupOptions o = Normalized(Adaptive(Moment2Method::kNormuon, WeightDecayMode::kDecoupled),
                                               MomentumNormalization::kRow, PostNormalization::kNone);
                   o.ns_preconditioner = NsPreconditioner::kAol;
                   o.ns_schedule = *NamedSchedule("aol");
                   o.ns_steps = 4;
                   return o;
                 }(),
                 {k2d, kTall, ParamSpec{{40, 24}, QkvSplit{.q = 16, .k = 2, .v = 2, .num_query_groups = 2}}}},
        MuonCase{"mixed_batch",
                 Opts(MomentumStyle::kEma, false, WeightDecayMode::kDecoupled, ScaleMode::kShapeScaling),
                 {k2d, kTall, ParamSpec{{2, 16, 24}}, ParamSpec{{16, 4, 2, 3}},
                  ParamSpec{{40, 24}, QkvSplit{.q = 16, .k = 2, .v = 2, .num_query_groups = 2}}, k2d}}),
    [](const auto& param_info) { return param_info.param.name; });

// One step of an 8×12 parameter of 0.5s with a zero gradient, from freshly initialized state.
void ZeroGradientStep(kernels::Backend& backend, Optimizer& opt, ParamState& p) {
  p.shape = {8, 12};
  p.numel = 96;
  p.master = testing::Upload(backend, std::vector<float>(96, 0.5f));
  p.grad = testing::Upload(backend, std::vector<float>(96, 0.0f));
  p.has_grad = true;
  ASSERT_OK(opt.InitState(backend, p));
  std::vector<ParamState*> ptrs = {&p};
  ASSERT_OK(opt.Step(backend, opt.DefaultHyper(), ptrs));
}

class MuonTest : public ::testing::Test {
 protected:
  std::unique_ptr<Optimizer> Muon() { return *Optimizer::Create(DefaultOptions(OptimizerKind::kMuon)); }
};

TEST_F(MuonTest, CheckParameterRejectsVectors) {
  ParamState p;
  p.shape = {32};
  p.numel = 32;
  EXPECT_THAT(Muon()->CheckParameter(p),
              StatusIs(absl::StatusCode::kInvalidArgument, "at least 2 dimensions, got shape [32]"));
  p.shape = {4, 8};
  EXPECT_OK(Muon()->CheckParameter(p));
}

TEST_F(MuonTest, CheckParameterRejectsBadQkvSplit) {
  ParamState p;
  p.shape = {40, 16};
  p.numel = 640;
  p.qkv = QkvSplit{.q = 16, .k = 2, .v = 2, .num_query_groups = 3};  // 60 rows ≠ 40
  EXPECT_THAT(Muon()->CheckParameter(p), StatusIs(absl::StatusCode::kInvalidArgument, "qkv_split"));
  p.qkv.num_query_groups = 2;
  EXPECT_OK(Muon()->CheckParameter(p));
  p.shape = {40, 4, 4};
  EXPECT_THAT(Muon()->CheckParameter(p), StatusIs(absl::StatusCode::kInvalidArgument, "qkv_split"));
}

TEST_F(MuonTest, CheckParameterRefusesHeadsThatDoNotFit) {
  GroupOptions o = DefaultOptions(OptimizerKind::kMuon);
  o.num_heads = 4;
  ASSERT_OK_AND_ASSIGN(auto opt, Optimizer::Create(o));
  ParamState p;
  p.shape = {12, 8};
  EXPECT_OK(opt->CheckParameter(p));
  p.shape = {10, 8};
  EXPECT_THAT(opt->CheckParameter(p),
              StatusIs(absl::StatusCode::kInvalidArgument, "num_heads 4 does not divide the 10 rows"));
  p.shape = {2, 4, 8};
  EXPECT_THAT(opt->CheckParameter(p), StatusIs(absl::StatusCode::kInvalidArgument, "num_heads needs 2-D parameters"));
  p.shape = {12, 8};
  p.tp = TpBlocks{.blocks = 2, .dim = 0};
  EXPECT_THAT(opt->CheckParameter(p), StatusIs(absl::StatusCode::kInvalidArgument, "num_heads and tp_blocks"));
  p.tp = {};
  p.shape = {24, 16};
  p.qkv = QkvSplit{.q = 8, .k = 2, .v = 2, .num_query_groups = 2};
  EXPECT_THAT(opt->CheckParameter(p),
              StatusIs(absl::StatusCode::kInvalidArgument, "which do not divide qkv_split's k 2"));
  p.qkv.num_query_groups = 3;
  p.shape = {36, 16};
  EXPECT_THAT(opt->CheckParameter(p), StatusIs(absl::StatusCode::kInvalidArgument, "num_heads / num_query_groups"));
}

TEST_F(MuonTest, CheckParameterRefusesTpBlocksThatDoNotFit) {
  ParamState p;
  p.shape = {12, 40};
  p.numel = 480;
  p.tp = TpBlocks{.blocks = 3, .dim = 1};  // 40 columns are not 3 blocks
  EXPECT_THAT(Muon()->CheckParameter(p), StatusIs(absl::StatusCode::kInvalidArgument, "tp_blocks 3 does not divide"));
  p.tp.dim = 0;
  EXPECT_OK(Muon()->CheckParameter(p));
  p.tp.dim = 2;
  EXPECT_THAT(Muon()->CheckParameter(p), StatusIs(absl::StatusCode::kInvalidArgument, "tp_block_dim"));
  p.tp.dim = 0;
  p.qkv = QkvSplit{.q = 4, .k = 4, .v = 4, .num_query_groups = 1};
  EXPECT_THAT(Muon()->CheckParameter(p), StatusIs(absl::StatusCode::kInvalidArgument, "cannot be combined"));
  ParamState conv;
  conv.shape = {6, 4, 3, 3};
  conv.numel = 216;
  conv.tp = TpBlocks{.blocks = 2, .dim = 0};
  EXPECT_THAT(Muon()->CheckParameter(conv), StatusIs(absl::StatusCode::kInvalidArgument, "2-D parameter"));
  ASSERT_OK_AND_ASSIGN(auto adamw, Optimizer::Create(DefaultOptions(OptimizerKind::kAdamW)));
  ParamState vec;
  vec.shape = {8, 8};
  vec.numel = 64;
  vec.tp = TpBlocks{.blocks = 2, .dim = 0};
  EXPECT_THAT(adamw->CheckParameter(vec), StatusIs(absl::StatusCode::kInvalidArgument, "Muon groups"));
}

TEST_F(MuonTest, SlotsAndZeroGradient) {
  auto opt = Muon();
  EXPECT_EQ(opt->SlotNames(), std::vector<std::string>{"momentum"});
  auto backend = kernels::NewCpuBackend(1);
  ParamState p;
  ASSERT_NO_FATAL_FAILURE(ZeroGradientStep(*backend, *opt, p));
  // A zero gradient orthogonalizes to zero (no NaN), so with wd = 0 the weights stay put.
  for (float x : testing::Download(*backend, p.master.fp32(), 96)) ASSERT_EQ(x, 0.5f);
  EXPECT_EQ(p.step_count, 1);
}

TEST_F(MuonTest, AdaptiveSlotsAndZeroGradientGuard) {
  auto backend = kernels::NewCpuBackend(1);
  for (Moment2Method method : {Moment2Method::kAdamuon, Moment2Method::kNormuon}) {
    GroupOptions o = DefaultOptions(OptimizerKind::kMuon);
    o.moment2_method = method;
    o.weight_decay_mode = WeightDecayMode::kCautious;
    ASSERT_OK_AND_ASSIGN(auto opt, Optimizer::Create(o));
    EXPECT_EQ(opt->SlotNames(), (std::vector<std::string>{"momentum", "moment2"}));
    EXPECT_TRUE(opt->SlotIsNonNegative("moment2"));
    ParamState p;
    p.shape = {8, 12};
    p.numel = 96;
    // AdaMuon's moment is element-wise; NorMuon's one value per column of a wide matrix, per row of
    // a tall one, in torch's keepdim shape; reduced shapes of other parameters are flat.
    EXPECT_EQ(opt->SlotShape(p, "moment2"),
              (method == Moment2Method::kAdamuon ? std::vector<int64_t>{8, 12} : std::vector<int64_t>{1, 12}));
    ParamState tall;
    tall.shape = {12, 8};
    tall.numel = 96;
    if (method == Moment2Method::kNormuon) {
      EXPECT_EQ(opt->SlotShape(tall, "moment2"), (std::vector<int64_t>{12, 1}));
      ParamState experts;
      experts.shape = {3, 4, 6};
      experts.numel = 72;
      EXPECT_EQ(opt->SlotShape(experts, "moment2"), (std::vector<int64_t>{18}));
    }
    EXPECT_EQ(opt->SlotShape(p, "momentum"), p.shape);
    ASSERT_NO_FATAL_FAILURE(ZeroGradientStep(*backend, *opt, p));
    // An all-zero update stays zero: NorMuon's norm ratio would be 0/0 and AdaMuon's 0/(0 + ε).
    for (float x : testing::Download(*backend, p.master.fp32(), 96)) ASSERT_EQ(x, 0.5f);
    for (float x : testing::Download(*backend, p.Slot("moment2")->fp32(), opt->SlotNumel(p, "moment2"))) {
      ASSERT_EQ(x, 0.0f);
    }
  }
}

TEST_F(MuonTest, ParameterWithoutGradientIsLeftAlone) {
  auto opt = Muon();
  auto backend = kernels::NewCpuBackend(1);
  std::mt19937 rng(5);
  ParamState with, without;
  for (ParamState* p : {&with, &without}) {
    p->shape = {6, 6};
    p->numel = 36;
    p->master = testing::Upload(*backend, std::vector<float>(36, 1.0f));
    p->grad = testing::Upload(*backend, testing::ToFloat(testing::RandomMat(rng, 6, 6).v));
    ASSERT_OK(opt->InitState(*backend, *p));
  }
  with.has_grad = true;
  without.has_grad = false;  // torch's grad = None: no momentum update, no decay, no step
  std::vector<ParamState*> ptrs = {&with, &without};
  ASSERT_OK(opt->Step(*backend, StepHyper{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.1}, ptrs));
  EXPECT_EQ(with.step_count, 1);
  EXPECT_EQ(without.step_count, 0);
  for (float x : testing::Download(*backend, without.master.fp32(), 36)) ASSERT_EQ(x, 1.0f);
  for (float x : testing::Download(*backend, without.Slot("momentum")->fp32(), 36)) ASSERT_EQ(x, 0.0f);
  EXPECT_NE(testing::Download(*backend, with.master.fp32(), 36), std::vector<float>(36, 1.0f));
}

TEST_F(MuonTest, StepWithoutStateIsRejectedAndChangesNothing) {
  auto opt = Muon();
  auto backend = kernels::NewCpuBackend(1);
  ParamState good, bad;
  for (ParamState* p : {&good, &bad}) {
    p->shape = {4, 4};
    p->numel = 16;
    p->master = testing::Upload(*backend, std::vector<float>(16, 1.0f));
    p->grad = testing::Upload(*backend, std::vector<float>(16, 1.0f));
    p->has_grad = true;
  }
  ASSERT_OK(opt->InitState(*backend, good));
  std::vector<ParamState*> ptrs = {&good, &bad};
  EXPECT_THAT(opt->Step(*backend, opt->DefaultHyper(), ptrs),
              StatusIs(absl::StatusCode::kFailedPrecondition, "momentum"));
  for (float x : testing::Download(*backend, good.master.fp32(), 16)) ASSERT_EQ(x, 1.0f);
  EXPECT_EQ(good.step_count, 0);
}

}  // namespace
}  // namespace muond::optim
