#include "kernels/optim/options.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace muond::optim {
namespace {

// The coefficient sets of docs/algorithms.md (Muon step 2, Coefficient sets), tuple for tuple.
struct NamedSet {
  const char* name;
  std::vector<NsCoefficient> tuples;
  CoefficientsAfter after;
  std::vector<int> gram_restarts = {};
};

// The Polar Express paper's first five tuples with safety factor 1.05 folded in as
// (a/1.05, b/1.05³, c/1.05⁵), Dao-AILab gram-newton-schulz's coefficients.py.
std::vector<NsCoefficient> GramPolarExpress() {
  const NsCoefficient paper[] = {{8.28721201814563, -23.595886519098837, 17.300387312530933},
                                 {4.107059111542203, -2.9478499167379106, 0.5448431082926601},
                                 {3.9486908534822946, -2.908902115962949, 0.5518191394370137},
                                 {3.3184196573706015, -2.488488024314874, 0.51004894012372},
                                 {2.300652019954817, -1.6689039845747493, 0.4188073119525673}};
  constexpr double kSafety = 1.05;
  std::vector<NsCoefficient> tuples;
  for (const NsCoefficient& t : paper) {
    tuples.push_back({t.a / kSafety, t.b / std::pow(kSafety, 3), t.c / std::pow(kSafety, 5)});
  }
  return tuples;
}

const std::vector<NamedSet>& NamedSets() {
  static const auto* sets = new std::vector<NamedSet>{
      {"simple", {{3.4445, -4.7750, 2.0315}}, CoefficientsAfter::kCycle},
      {"quintic",
       {{4.0848, -6.8946, 2.9270},
        {3.9505, -6.3029, 2.6377},
        {3.7418, -5.5913, 2.3037},
        {2.8769, -3.1427, 1.2046},
        {2.8366, -3.0525, 1.2012}},
       CoefficientsAfter::kCycle},
      {"polar_express",
       {{8.2051, -22.9019, 16.4607},
        {4.0664, -2.8612, 0.5184},
        {3.9096, -2.8234, 0.5250},
        {3.2856, -2.4153, 0.4853},
        {2.2779, -1.6198, 0.3985},
        {1.8726, -1.2307, 0.3585},
        {1.8564, -1.2132, 0.3568},
        {1.8750, -1.2500, 0.3750}},
       CoefficientsAfter::kRepeatLast},
      {"cans",
       {{8.4703, -25.1081, 18.6293},
        {4.1828, -3.1087, 0.5806},
        {3.9619, -2.9541, 0.5630},
        {3.2866, -2.4647, 0.5074},
        {2.2737, -1.6447, 0.4162}},
       CoefficientsAfter::kRepeatLast},
      {"aol",
       {{4.0098, -7.0585, 2.4635}, {3.4585, -5.5479, 2.5959}, {2.7573, -3.2939, 1.4254}, {2.7215, -3.0494, 1.3169}},
       CoefficientsAfter::kCycle},
      // Keller Jordan's tuple 8 times, then two steps of (2, −1.5, 0.5) that pull the singular values
      // onto 1 (Emerging-Optimizers' deepseekv4; meant for ns_steps 10).
      {"deepseekv4",
       {{3.4445, -4.7750, 2.0315},
        {3.4445, -4.7750, 2.0315},
        {3.4445, -4.7750, 2.0315},
        {3.4445, -4.7750, 2.0315},
        {3.4445, -4.7750, 2.0315},
        {3.4445, -4.7750, 2.0315},
        {3.4445, -4.7750, 2.0315},
        {3.4445, -4.7750, 2.0315},
        {2.0, -1.5, 0.5},
        {2.0, -1.5, 0.5}},
       CoefficientsAfter::kRepeatLast},
      // Cubic steps (c = 0: X ← a·X + b·(X·Xᵀ)·X), tuned for exactly 5 steps (arXiv 2606.00371,
      // Emerging-Optimizers' cubic5); ValidateOptions refuses other step counts.
      {"cubic5",
       {{3.3656576, -3.3420992, 0.0},
        {2.5744352, -1.4957376, 0.0},
        {2.5368962, -1.4312570, 0.0},
        {2.4418906, -1.2764040, 0.0},
        {2.2230472, -0.9630650, 0.0}},
       CoefficientsAfter::kRepeatLast},
      // For ns_algorithm gram: restarts before iteration 2 (any algorithm may use the tuples).
      {"gram_polar_express", GramPolarExpress(), CoefficientsAfter::kRepeatLast, {2}},
  };
  return *sets;
}

bool Finite(double x) { return std::isfinite(x); }

absl::Status CheckPositive(std::string_view option, double value) {
  if (!Finite(value) || value <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(option), " must be > 0, got ", value));
  }
  return absl::OkStatus();
}

// [0, 1): a factor of 1 would never forget, and beyond it state grows without bound.
absl::Status CheckUnitInterval(std::string_view option, double value) {
  if (!Finite(value) || value < 0 || value >= 1) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(option), " must be in [0, 1), got ", value));
  }
  return absl::OkStatus();
}

}  // namespace

NsCoefficient NsSchedule::At(int step) const {
  if (tuples.empty()) return {};
  const size_t n = tuples.size();
  const size_t t = static_cast<size_t>(std::max(step, 0));
  return after == CoefficientsAfter::kCycle ? tuples[t % n] : tuples[std::min(t, n - 1)];
}

absl::StatusOr<NsSchedule> NamedSchedule(std::string_view name) {
  for (const NamedSet& set : NamedSets()) {
    if (name == set.name) return NsSchedule{set.name, set.tuples, set.after, set.gram_restarts};
  }
  std::string known;
  for (const std::string& n : NamedScheduleNames()) absl::StrAppend(&known, known.empty() ? "" : ", ", n);
  return absl::InvalidArgumentError(absl::StrCat("ns_coefficients: unknown coefficient set \"", std::string(name),
                                                 "\"; known sets are ", known, ", or a list of (a, b, c) tuples"));
}

std::vector<std::string> NamedScheduleNames() {
  std::vector<std::string> names;
  for (const NamedSet& set : NamedSets()) names.emplace_back(set.name);
  return names;
}

GroupOptions DefaultOptions(OptimizerKind kind) {
  GroupOptions o;
  o.optimizer = kind;
  switch (kind) {
    case OptimizerKind::kMuon:
      o.lr = 0.02;
      o.weight_decay = 0.0;
      o.momentum = 0.95;
      o.nesterov = true;
      o.beta2 = 0.95;  // Megatron-Core's TensorParallelAdaptiveMuon
      o.eps = 1e-8;
      break;
    case OptimizerKind::kAdamW:
      o.lr = 1e-3;
      o.weight_decay = 0.01;
      o.momentum = 0.0;
      o.nesterov = false;
      o.beta1 = 0.9;
      o.beta2 = 0.999;
      o.eps = 1e-8;
      break;
    case OptimizerKind::kLion:
      o.lr = 1e-4;
      o.weight_decay = 0.0;
      o.momentum = 0.0;
      o.nesterov = false;
      o.beta1 = 0.9;
      o.beta2 = 0.99;
      break;
    case OptimizerKind::kSgd:
      o.lr = 1e-2;
      o.weight_decay = 0.0;
      o.momentum = 0.0;
      o.nesterov = false;
      break;
  }
  return o;
}

absl::Status ValidateStepHyper(const GroupOptions& o, double lr, double momentum, double weight_decay) {
  if (!Finite(lr) || lr < 0 || lr > kMaxLr) {
    return absl::InvalidArgumentError(absl::StrCat("lr must be in [0, ", kMaxLr, "], got ", lr));
  }
  if (!Finite(weight_decay) || weight_decay < 0 || weight_decay > kMaxWeightDecay) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight_decay must be in [0, ", kMaxWeightDecay, "], got ", weight_decay));
  }
  MUOND_RETURN_IF_ERROR(CheckUnitInterval("momentum", momentum));
  // The factor the weights are multiplied by each step must stay in [0, 1]: beyond it a step flips
  // the weights' sign and grows them.
  const bool independent = o.optimizer == OptimizerKind::kMuon && o.weight_decay_mode == WeightDecayMode::kIndependent;
  // Coupled L2 (muon, adamw) has no decay factor: the fp32 guard bounds what the decay adds.
  const bool coupled = (o.optimizer == OptimizerKind::kMuon || o.optimizer == OptimizerKind::kAdamW) &&
                       o.weight_decay_mode == WeightDecayMode::kL2;
  if (independent && weight_decay > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight_decay must be <= 1 with weight_decay_mode independent (the decay factor 1 - weight_decay "
                     "stays in [0, 1]), got ",
                     weight_decay));
  }
  if (!independent && !coupled && lr * weight_decay > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("lr * weight_decay must be <= 1 (the decay factor 1 - lr * "
                     "weight_decay stays in [0, 1]), got lr ",
                     lr, " and weight_decay ", weight_decay));
  }
  return absl::OkStatus();
}

double NsSingularValueBound(const NsSchedule& schedule, int steps, double norm_safety) {
  constexpr int kPoints = 4097;
  const double top = 1.0 / norm_safety;
  double largest = top;
  for (int i = 0; i < kPoints; ++i) {
    double sigma = top * i / (kPoints - 1);
    for (int t = 0; t < steps; ++t) {
      const NsCoefficient co = schedule.At(t);
      const double s2 = sigma * sigma;
      sigma = sigma * (co.a + s2 * (co.b + s2 * co.c));
      if (!Finite(sigma)) return std::numeric_limits<double>::infinity();
      largest = std::max(largest, std::abs(sigma));
    }
  }
  return 2 * largest;
}

NsBand NsOutputBand(const NsSchedule& schedule, int steps, double norm_safety) {
  constexpr int kPoints = 4097;
  constexpr double kLowest = 1.0 / 128;
  NsBand band{std::numeric_limits<double>::infinity(), 0};
  for (int i = 0; i < kPoints; ++i) {
    double sigma = std::pow(kLowest, 1.0 - static_cast<double>(i) / (kPoints - 1)) / norm_safety;
    for (int t = 0; t < steps && Finite(sigma); ++t) {
      const NsCoefficient co = schedule.At(t);
      const double s2 = sigma * sigma;
      sigma = sigma * (co.a + s2 * (co.b + s2 * co.c));
    }
    if (!Finite(sigma)) return {0, std::numeric_limits<double>::infinity()};
    band.lo = std::min(band.lo, std::abs(sigma));
    band.hi = std::max(band.hi, std::abs(sigma));
  }
  return band;
}

double NsResidualThreshold(const NsSchedule& schedule, int steps, double norm_safety) {
  const NsBand band = NsOutputBand(schedule, steps, norm_safety);
  const double worst = std::max(1 - band.lo * band.lo, band.hi * band.hi - 1);
  return std::min((worst + 1) / 2, kMaxResidualThreshold);
}

double ResidualThreshold(const GroupOptions& options) {
  if (options.warn_residual_above.has_value()) return *options.warn_residual_above;
  return NsResidualThreshold(options.ns_schedule, options.ns_steps, options.ns_norm_safety);
}

namespace {

// The thresholds of the health warnings (docs/operations.md, Warnings).
absl::Status ValidateHealthOptions(const GroupOptions& o) {
  constexpr int kMaxWarnSteps = 1000000;
  if (!Finite(o.warn_clip_below) || o.warn_clip_below < 0 || o.warn_clip_below > 1) {
    return absl::InvalidArgumentError(absl::StrCat("warn_clip_below must be in [0, 1], got ", o.warn_clip_below));
  }
  for (const auto& [name, value] :
       {std::pair{"warn_clip_steps", o.warn_clip_steps}, std::pair{"warn_stale_steps", o.warn_stale_steps}}) {
    if (value < 1 || value > kMaxWarnSteps) {
      return absl::InvalidArgumentError(absl::StrCat(name, " must be in [1, ", kMaxWarnSteps, "], got ", value));
    }
  }
  if (!o.warn_residual_above.has_value()) return absl::OkStatus();
  return CheckPositive("warn_residual_above", *o.warn_residual_above);
}

}  // namespace

absl::Status ValidateOptions(const GroupOptions& o) {
  MUOND_RETURN_IF_ERROR(ValidateStepHyper(o, o.lr, o.momentum, o.weight_decay));
  if (o.max_grad_norm != 0) {
    MUOND_RETURN_IF_ERROR(CheckPositive("max_grad_norm", o.max_grad_norm));
    if (o.clip_scope != ClipScope::kGroup) {
      return absl::InvalidArgumentError("max_grad_norm applies with clip_scope group only (the group's own limit)");
    }
  }
  MUOND_RETURN_IF_ERROR(ValidateHealthOptions(o));
  if (o.optimizer == OptimizerKind::kAdamW &&
      (o.weight_decay_mode == WeightDecayMode::kIndependent || o.weight_decay_mode == WeightDecayMode::kCautious)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weight_decay_mode ", o.weight_decay_mode == WeightDecayMode::kIndependent ? "independent" : "cautious",
        " applies to muon only; adamw takes decoupled (AdamW) or l2 (Adam with coupled L2)"));
  }
  if (o.optimizer != OptimizerKind::kMuon && o.moment2_method != Moment2Method::kNone) {
    return absl::InvalidArgumentError(
        absl::StrCat("moment2_method applies to muon only, not to ", std::string(OptimizerName(o.optimizer))));
  }
  if (o.optimizer == OptimizerKind::kMuon && o.moment2_method == Moment2Method::kNone &&
      o.exp_avg_sq_dtype != kernels::StorageDtype::kFp32) {
    return absl::InvalidArgumentError(
        "exp_avg_sq_dtype applies to a muon group only with moment2_method adamuon or normuon (its second moment)");
  }
  if (o.optimizer == OptimizerKind::kSgd && o.nesterov && o.momentum <= 0) {
    return absl::InvalidArgumentError("nesterov needs momentum > 0 (torch.optim.SGD semantics)");
  }
  if (o.ns_steps < 1) {
    return absl::InvalidArgumentError(absl::StrCat("ns_steps must be >= 1, got ", o.ns_steps));
  }
  // Each step costs a few GEMMs per matrix; a bound keeps a client from stalling the daemon.
  constexpr int kMaxNsSteps = 100;
  if (o.ns_steps > kMaxNsSteps) {
    return absl::InvalidArgumentError(absl::StrCat("ns_steps must be <= ", kMaxNsSteps, ", got ", o.ns_steps));
  }
  if (o.ns_schedule.name == "cubic5" && o.ns_steps != 5) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ns_steps must be 5 with ns_coefficients cubic5 (its coefficients are tuned for exactly 5 steps), got ",
        o.ns_steps));
  }
  if (o.ns_schedule.tuples.empty()) {
    return absl::InvalidArgumentError("ns_coefficients must hold at least one (a, b, c) tuple");
  }
  for (size_t i = 0; i < o.ns_schedule.tuples.size(); ++i) {
    const NsCoefficient& t = o.ns_schedule.tuples[i];
    if (!Finite(t.a) || !Finite(t.b) || !Finite(t.c)) {
      return absl::InvalidArgumentError(
          absl::StrCat("ns_coefficients[", i, "] must be finite, got (", t.a, ", ", t.b, ", ", t.c, ")"));
    }
  }
  if (!Finite(o.ns_eps) || o.ns_eps < 0 || o.ns_eps > 1) {
    return absl::InvalidArgumentError(absl::StrCat("ns_eps must be in [0, 1], got ", o.ns_eps));
  }
  if (!Finite(o.ns_norm_safety) || o.ns_norm_safety <= 0 || o.ns_norm_safety > kMaxNormSafety) {
    return absl::InvalidArgumentError(
        absl::StrCat("ns_norm_safety must be in (0, ", kMaxNormSafety, "], got ", o.ns_norm_safety));
  }
  if (!Finite(o.extra_scale_factor) || o.extra_scale_factor <= 0 || o.extra_scale_factor > kMaxScaleFactor) {
    return absl::InvalidArgumentError(
        absl::StrCat("extra_scale_factor must be in (0, ", kMaxScaleFactor, "], got ", o.extra_scale_factor));
  }
  if (o.optimizer == OptimizerKind::kMuon) {
    const double growth = NsSingularValueBound(o.ns_schedule, o.ns_steps, o.ns_norm_safety);
    if (!(growth <= kMaxNsGrowth)) {
      return absl::InvalidArgumentError(absl::StrCat("ns_coefficients: with ", o.ns_steps, " steps and ns_norm_safety ",
                                                     o.ns_norm_safety, " the iteration grows singular values to about ",
                                                     growth, "; at most ", kMaxNsGrowth,
                                                     " is accepted (Newton-Schulz must keep them near 1)"));
    }
  }
  MUOND_RETURN_IF_ERROR(CheckPositive("qk_clip_threshold", o.qk_clip_threshold));
  if (!Finite(o.qk_clip_alpha) || o.qk_clip_alpha < 0 || o.qk_clip_alpha > 1) {
    return absl::InvalidArgumentError(absl::StrCat("qk_clip_alpha must be in [0, 1], got ", o.qk_clip_alpha));
  }
  MUOND_RETURN_IF_ERROR(CheckUnitInterval("betas[0]", o.beta1));
  MUOND_RETURN_IF_ERROR(CheckUnitInterval("betas[1]", o.beta2));
  // eps > 0: Adam divides by √v̂ + eps, and v̂ is 0 wherever the gradient has always been 0.
  if (!Finite(o.eps) || o.eps <= 0 || o.eps > 1) {
    return absl::InvalidArgumentError(absl::StrCat("eps must be in (0, 1], got ", o.eps));
  }
  // Muon's second moment divides by √max(V, ε) or √V + ε in fp32: ε must stay a normal fp32 number.
  if (o.optimizer == OptimizerKind::kMuon && o.moment2_method != Moment2Method::kNone && o.eps < 1e-30) {
    return absl::InvalidArgumentError(
        absl::StrCat("eps must be in [1e-30, 1] with a moment2_method (a normal fp32 number), got ", o.eps));
  }
  return absl::OkStatus();
}

std::vector<std::string> PrecisionCaveats(const GroupOptions& o) {
  using kernels::StorageDtype;
  std::vector<std::string> out;
  // A moment m ← β·m + (1−β)·x stored with unit roundoff u cannot move by a relative (1−β) < u.
  auto decay = [&](std::string_view option, StorageDtype dtype, double beta) {
    if (dtype == StorageDtype::kFp32 || beta <= 0) return;
    const double u = kernels::StorageRoundoff(dtype);
    if (1.0 - beta < u) {
      out.push_back(absl::StrCat(std::string(option), " ", std::string(kernels::StorageDtypeName(dtype)),
                                 " with a decay of ", beta,
                                 ": a step changes the moment by less than its rounding (1 - beta < ", u,
                                 "), so it cannot decay; use fp32 or beta <= ", 1.0 - 2 * u));
    }
  };
  const bool adam = o.optimizer == OptimizerKind::kAdamW;
  const bool adaptive_muon = o.optimizer == OptimizerKind::kMuon && o.moment2_method != Moment2Method::kNone;
  if (o.optimizer == OptimizerKind::kMuon || o.optimizer == OptimizerKind::kSgd) {
    decay("momentum_dtype", o.momentum_dtype, o.momentum);
  }
  if (adam || o.optimizer == OptimizerKind::kLion) {
    decay("exp_avg_dtype", o.exp_avg_dtype, o.optimizer == OptimizerKind::kLion ? o.beta2 : o.beta1);
  }
  if (adam || adaptive_muon) {
    decay("exp_avg_sq_dtype", o.exp_avg_sq_dtype, o.beta2);
    if (o.exp_avg_sq_dtype == StorageDtype::kFp16) {
      // fp16's smallest subnormal is 2^-24; (1−β2)·g² below half of it rounds to 0.
      const double g_min = std::sqrt(0x1p-25 / (1.0 - o.beta2));
      out.push_back(absl::StrCat("exp_avg_sq_dtype fp16: (1 - beta2)·g² rounds to 0 for |g| below about ", g_min,
                                 ", where the update then divides by eps alone; prefer fp32 or bf16"));
    }
  }
  return out;
}

std::string_view OptimizerName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kMuon:
      return "muon";
    case OptimizerKind::kAdamW:
      return "adamw";
    case OptimizerKind::kLion:
      return "lion";
    case OptimizerKind::kSgd:
      return "sgd";
  }
  return "unknown";
}

std::vector<std::string> OptimizerNames() {
  std::vector<std::string> names;
  using K = OptimizerKind;
  for (K kind : {K::kMuon, K::kAdamW, K::kLion, K::kSgd}) names.emplace_back(OptimizerName(kind));
  return names;
}

const std::vector<OptionUse>& GroupOptionUses() {
  using K = OptimizerKind;
  const std::vector<K> all = {K::kMuon, K::kAdamW, K::kLion, K::kSgd};
  const std::vector<K> muon = {K::kMuon};
  static const std::vector<OptionUse>* const uses = new std::vector<OptionUse>{
      {"optimizer", all},
      {"lr", all},
      {"weight_decay", all},
      {"weight_decay_mode", {K::kMuon, K::kAdamW}},  // adamw: decoupled or l2 only
      {"momentum", {K::kMuon, K::kSgd}},
      {"nesterov", {K::kMuon, K::kSgd}},
      {"momentum_style", muon},
      {"ns_steps", muon},
      {"ns_coefficients", muon},
      {"ns_custom_coefficients", muon},
      {"ns_coefficients_after", muon},
      {"ns_algorithm", muon},
      {"ns_eps", muon},
      {"ns_norm_safety", muon},
      {"scale_mode", muon},
      {"extra_scale_factor", muon},
      {"matmul_precision", muon},
      {"qk_clip_threshold", muon},
      {"qk_clip_alpha", muon},
      {"moment2_method", muon},
      {"beta1", {K::kAdamW, K::kLion}},
      {"beta2", {K::kMuon, K::kAdamW, K::kLion}},  // muon: with a moment2_method only
      {"eps", {K::kMuon, K::kAdamW}},              // muon: with a moment2_method only
      {"master_dtype", all},
      {"momentum_dtype", {K::kMuon, K::kSgd}},
      {"exp_avg_dtype", {K::kAdamW, K::kLion}},
      {"exp_avg_sq_dtype", {K::kMuon, K::kAdamW}},  // muon: with a moment2_method only
      {"clip_scope", all},
      {"max_grad_norm", all},  // with clip_scope group only
      {"telemetry", all},
      {"warn_clip_below", muon},
      {"warn_clip_steps", muon},
      {"warn_stale_steps", all},
      {"warn_residual_above", muon},
  };
  return *uses;
}

bool IsGroupOption(std::string_view option) {
  const auto& uses = GroupOptionUses();
  return std::any_of(uses.begin(), uses.end(), [&](const OptionUse& use) { return use.name == option; });
}

bool OptionApplies(OptimizerKind kind, std::string_view option) {
  for (const OptionUse& use : GroupOptionUses()) {
    if (use.name != option) continue;
    return std::find(use.applies_to.begin(), use.applies_to.end(), kind) != use.applies_to.end();
  }
  return false;
}

absl::Status CheckOptionApplies(const GroupOptions& o, std::string_view option) {
  if (!OptionApplies(o.optimizer, option)) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(option), ": does not apply to optimizer ", std::string(OptimizerName(o.optimizer))));
  }
  // Muon reads these only with a second moment: without one they would be ignored.
  const bool second_moment_only = option == "beta2" || option == "eps" || option == "exp_avg_sq_dtype";
  if (o.optimizer == OptimizerKind::kMuon && o.moment2_method == Moment2Method::kNone && second_moment_only) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(option), ": applies to a muon group only with moment2_method adamuon or normuon"));
  }
  return absl::OkStatus();
}

}  // namespace muond::optim
