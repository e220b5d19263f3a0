#include "kernels/optim/options.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/echo.h"
#include "common/status_macros.h"
#include "kernels/optim/option_fields.h"
#include "kernels/optim/option_table.h"

namespace muond::optim {
namespace {

// A named set of the option table, with its safety factor folded in as (a/s, b/s³, c/s⁵).
NsSchedule ScheduleOf(const CoefficientSetSpec& set) {
  NsSchedule schedule;
  schedule.name = set.name;
  schedule.tuples.clear();
  const double s = set.safety.value_or(1.0);
  for (const auto& [a, b, c] : set.tuples) {
    schedule.tuples.push_back(s == 1.0 ? NsCoefficient{a, b, c}
                                       : NsCoefficient{a / s, b / std::pow(s, 3), c / std::pow(s, 5)});
  }
  schedule.after = set.after == "cycle" ? CoefficientsAfter::kCycle : CoefficientsAfter::kRepeatLast;
  schedule.gram_restarts = set.gram_restarts;
  return schedule;
}

bool Finite(double x) { return std::isfinite(x); }

}  // namespace

NsCoefficient NsSchedule::At(int step) const {
  if (tuples.empty()) return {};
  const size_t n = tuples.size();
  const size_t t = static_cast<size_t>(std::max(step, 0));
  return after == CoefficientsAfter::kCycle ? tuples[t % n] : tuples[std::min(t, n - 1)];
}

absl::StatusOr<NsSchedule> NamedSchedule(std::string_view name) {
  for (const CoefficientSetSpec& set : GroupOptionTable().coefficient_sets) {
    if (name == set.name) return ScheduleOf(set);
  }
  std::string known;
  for (const std::string& n : NamedScheduleNames()) absl::StrAppend(&known, known.empty() ? "" : ", ", n);
  return absl::InvalidArgumentError(absl::StrCat("ns_coefficients: unknown coefficient set \"",
                                                 Echo(absl::string_view(name.data(), name.size())),
                                                 "\"; known sets are ", known, ", or a list of (a, b, c) tuples"));
}

std::vector<std::string> NamedScheduleNames() {
  std::vector<std::string> names;
  for (const CoefficientSetSpec& set : GroupOptionTable().coefficient_sets) names.emplace_back(set.name);
  return names;
}

namespace {

// A table default into a GroupOptions member.
void SetDefault(std::string_view name, const OptionDefault& value, double& member) { member = *value.number; }
void SetDefault(std::string_view name, const OptionDefault& value, int& member) {
  member = static_cast<int>(*value.number);
}
void SetDefault(std::string_view name, const OptionDefault& value, bool& member) { member = *value.number != 0; }
void SetDefault(std::string_view name, const OptionDefault& value, std::optional<double>& member) {
  member = value.number;
}
template <typename Enum>
requires std::is_enum_v<Enum>
void SetDefault(std::string_view name, const OptionDefault& value, Enum& member) {
  member = static_cast<Enum>(*ChoiceIndex(name, value.name));
}

// A GroupOptions member as the table writes values: a number (bool as 0/1), a choice's name, or
// none (an unset optional).
OptionDefault TableValue(const OptionSpec& spec, double member) { return {member, ""}; }
OptionDefault TableValue(const OptionSpec& spec, int member) { return {static_cast<double>(member), ""}; }
OptionDefault TableValue(const OptionSpec& spec, bool member) { return {member ? 1.0 : 0.0, ""}; }
OptionDefault TableValue(const OptionSpec& spec, const std::optional<double>& member) { return {member, ""}; }
template <typename Enum>
requires std::is_enum_v<Enum> OptionDefault TableValue(const OptionSpec& spec, Enum member) {
  return {std::nullopt, spec.choices[static_cast<size_t>(member)]};
}

bool SameValue(const OptionDefault& a, const OptionDefault& b) { return a.number == b.number && a.name == b.name; }

// How a refusal writes a table value of `spec`: true/false, a number, or a choice's name.
std::string Written(const OptionSpec& spec, const OptionDefault& value) {
  if (!value.name.empty()) return value.name;
  if (!value.number.has_value()) return "none";  // as the Python client writes None
  if (spec.type == OptionType::kBool) return *value.number != 0 ? "true" : "false";
  return absl::StrCat(*value.number);
}

}  // namespace

absl::Status CheckOptionsAreRead(const GroupOptions& o, bool qk_clip_reads) {
  const int index = static_cast<int>(o.optimizer);
  std::vector<std::pair<const OptionSpec*, OptionDefault>> values;  // every one-value option's
  VisitOptionFields(o, [&](std::string_view name, const auto& member) {
    const OptionSpec* spec = FindOption(name);
    values.emplace_back(spec, TableValue(*spec, member));
  });
  const auto value_of = [&](std::string_view name) -> const OptionDefault* {
    for (const auto& [spec, value] : values) {
      if (spec->name == name) return &value;
    }
    return nullptr;
  };
  for (const auto& [spec, value] : values) {
    if (!spec->applies_to[index] || SameValue(value, spec->defaults[index])) continue;  // unread or default
    if (spec->read_for == "qk_clip" && !qk_clip_reads) {
      return absl::InvalidArgumentError(
          absl::StrCat(spec->name,
                       ": only QK-clip reads it, and this session names no QK-clip pair (spec.qk_clip); name the "
                       "query and key weights or leave ",
                       spec->name, " at its default ", Written(*spec, spec->defaults[index])));
    }
    if (spec->read_with.option.empty()) continue;
    const OptionSpec& gate = *FindOption(spec->read_with.option);
    const OptionDefault* gate_value = value_of(gate.name);
    // A row read with the optimizer, which no member holds, would pass the table's reader: a test
    // checks that every row of the embedded table names a member.
    if (gate_value == nullptr) {
      return absl::InternalError(absl::StrCat(spec->name, ": read with ", gate.name, ", which no group holds"));
    }
    const bool read = std::any_of(spec->read_with.values.begin(), spec->read_with.values.end(),
                                  [&](const OptionDefault& v) { return SameValue(v, *gate_value); });
    if (read) continue;
    std::string with;
    for (const OptionDefault& v : spec->read_with.values) {
      absl::StrAppend(&with, with.empty() ? "" : " or ", Written(gate, v));
    }
    return absl::InvalidArgumentError(
        absl::StrCat(spec->name, ": this ", std::string(OptimizerName(o.optimizer)), " group reads it only with ",
                     gate.name, " ", with, ", and has ", gate.name, " ", Written(gate, *gate_value), "; set ",
                     gate.name, " or leave ", spec->name, " at its default ", Written(*spec, spec->defaults[index])));
  }
  return absl::OkStatus();
}

GroupOptions DefaultOptions(OptimizerKind kind) {
  GroupOptions o;
  o.optimizer = kind;
  const int index = static_cast<int>(kind);
  VisitOptionFields(o, [&](std::string_view name, auto& member) {
    const OptionSpec& spec = *FindOption(name);
    const OptionDefault& value = spec.applies_to[index] ? spec.defaults[index] : spec.otherwise;
    if (value.is_set()) SetDefault(name, value, member);
  });
  const OptionDefault& coefficients = FindOption("ns_coefficients")->defaults[index];
  if (coefficients.is_set()) o.ns_schedule = *NamedSchedule(coefficients.name);
  return o;
}

void ApplyChoiceDefaults(GroupOptions& o, absl::FunctionRef<bool(std::string_view)> given) {
  for (const OptionSpec& spec : GroupOptionTable().options) {
    if (spec.choice_defaults.empty()) continue;
    std::string_view chosen;
    VisitOptionFields(o, [&](std::string_view name, const auto& member) {
      using Member = std::decay_t<decltype(member)>;
      if constexpr (std::is_enum_v<Member>) {
        if (name == spec.name) chosen = spec.choices[static_cast<size_t>(member)];
      }
    });
    // A choice's defaults go together (Turbo-Muon's set is tuned for its step count): a group that
    // gives any of them gets none.
    bool any_given = false;
    for (const OptionSpec::ChoiceDefault& d : spec.choice_defaults) any_given |= d.choice == chosen && given(d.option);
    if (any_given) continue;
    for (const OptionSpec::ChoiceDefault& d : spec.choice_defaults) {
      if (d.choice != chosen) continue;
      if (d.option == "ns_coefficients") {
        o.ns_schedule = *NamedSchedule(d.value.name);  // the table's check: a set it names
        continue;
      }
      VisitOptionFields(o, [&](std::string_view name, auto& member) {
        if (name == d.option) SetDefault(name, d.value, member);
      });
    }
  }
}

absl::Status ValidateStepHyper(const GroupOptions& o, double lr, double momentum, double weight_decay) {
  for (const auto& [name, value] :
       {std::pair<std::string_view, double>{"lr", lr}, {"weight_decay", weight_decay}, {"momentum", momentum}}) {
    MUOND_RETURN_IF_ERROR(CheckRange(*FindOption(name), value));
  }
  // The factor the weights are multiplied by each step must stay in [0, 1]: beyond it a step flips
  // the weights' sign and grows them.
  const bool independent = (o.optimizer == OptimizerKind::kMuon || o.optimizer == OptimizerKind::kDion2) &&
                           o.weight_decay_mode == WeightDecayMode::kIndependent;
  // Coupled L2 (muon, adamw) has no decay factor: the fp32 guard bounds what the decay adds.
  const bool coupled = (o.optimizer == OptimizerKind::kMuon || o.optimizer == OptimizerKind::kAdamW) &&
                       o.weight_decay_mode == WeightDecayMode::kL2;
  if (independent && weight_decay > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight_decay must be <= 1 with weight_decay_mode independent (the decay factor 1 - weight_decay "
                     "stays in [0, 1]), got ",
                     weight_decay));
  }
  // At creation and in every step's override: a step with momentum 0 leaves the buffer as it is, and
  // HeLoCo would turn gradients toward a direction training no longer takes.
  if (o.optimizer == OptimizerKind::kSgd && o.heloco && !(momentum > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "momentum: heloco needs momentum > 0 (the correction's reference is the momentum buffer), got ", momentum));
  }
  if (o.optimizer == OptimizerKind::kSgd && o.nesterov_delay > 1 && weight_decay != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weight_decay: nesterov_delay > 1 takes none (delayed Nesterov has no weight decay), got ", weight_decay));
  }
  if (!independent && !coupled && lr * weight_decay > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("lr * weight_decay must be <= 1 (the decay factor 1 - lr * "
                     "weight_decay stays in [0, 1]), got lr ",
                     lr, " and weight_decay ", weight_decay));
  }
  return absl::OkStatus();
}

NsRounding NsRoundingOf(kernels::MatmulPrecision precision) {
  constexpr double kStep = 0x1p-20;
  switch (precision) {
    case kernels::MatmulPrecision::kBf16:
      return {0x1p-7, kStep};
    case kernels::MatmulPrecision::kTf32:
      return {0x1p-10, kStep};
    case kernels::MatmulPrecision::kFp32:
      break;
  }
  return {0x1p-16, kStep};
}

double NsSingularValueBound(const NsSchedule& schedule, int steps, double norm_safety, NsRounding rounding) {
  constexpr int kPoints = 4097;
  const double top = (1 + rounding.input) / norm_safety;
  const double step_rounding = 1 + rounding.step;
  double largest = top;
  for (int i = 0; i < kPoints; ++i) {
    double sigma = top * i / (kPoints - 1);
    for (int t = 0; t < steps; ++t) {
      const NsCoefficient co = schedule.At(t);
      const double s2 = sigma * sigma;
      sigma = sigma * (co.a + s2 * (co.b + s2 * co.c)) * step_rounding;
      if (!Finite(sigma)) return std::numeric_limits<double>::infinity();
      largest = std::max(largest, std::abs(sigma));
    }
  }
  return 2 * largest;
}

double NsSingularValueBound(const GroupOptions& options) {
  return NsSingularValueBound(options.ns_schedule, options.ns_steps, NsInputSafety(options),
                              NsRoundingOf(options.matmul_precision));
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

double UpdateScale(const GroupOptions& options, int64_t rows, int64_t cols) {
  const double m = static_cast<double>(rows), n = static_cast<double>(cols);
  const double k = options.extra_scale_factor;
  switch (options.scale_mode) {
    case ScaleMode::kShapeScaling:
      return k * std::sqrt(std::max(1.0, m / n));
    case ScaleMode::kSpectral:
      return k * std::sqrt(std::max(m, n));
    case ScaleMode::kUnitRmsNorm:
      return k * std::sqrt(m / n);
  }
  return k;
}

double NsInputSafety(const GroupOptions& options) {
  return options.ns_preconditioner == NsPreconditioner::kAol ? 1.0 : options.ns_norm_safety;
}

double ResidualThreshold(const GroupOptions& options) {
  if (options.warn_residual_above.has_value()) return *options.warn_residual_above;
  return NsResidualThreshold(options.ns_schedule, options.ns_steps, NsInputSafety(options));
}

namespace {

// The table's range of every option a group holds a value of (unset optional ones are not checked).
absl::Status CheckRanges(const GroupOptions& o) {
  absl::Status status;
  VisitOptionFields(o, [&](std::string_view name, const auto& member) {
    using Member = std::decay_t<decltype(member)>;
    const OptionSpec& spec = *FindOption(name);
    if (!status.ok() || !spec.range.has_value()) return;
    if constexpr (std::is_same_v<Member, std::optional<double>>) {
      if (member.has_value()) status = CheckRange(spec, *member);
    } else if constexpr (std::is_arithmetic_v<Member> && !std::is_same_v<Member, bool>) {
      status = CheckRange(spec, static_cast<double>(member));
    }
  });
  return status;
}

// What the refusal of a growing iteration suggests: the smallest of a few ns_norm_safety values above
// the group's own that keeps it bounded, if one does (with the Frobenius scaling only; AOL's input
// range is its own).
std::string SafetyHint(const GroupOptions& o) {
  if (o.ns_preconditioner != NsPreconditioner::kFrobenius) return "";
  for (const double safety : {1.001, 1.002, 1.005, 1.01, 1.02, 1.05, 1.1, 1.2, 1.5, 2.0}) {
    if (safety <= o.ns_norm_safety) continue;
    if (NsSingularValueBound(o.ns_schedule, o.ns_steps, safety, NsRoundingOf(o.matmul_precision)) <= kMaxNsGrowth) {
      return absl::StrCat("; ns_norm_safety ", safety, " keeps them bounded");
    }
  }
  return "; no ns_norm_safety up to 2 keeps them bounded";
}

// The rules of Newton–Schulz's coefficients: a set tuned for one step count gets it, a list is
// finite, and the iteration keeps singular values bounded.
absl::Status ValidateSchedule(const GroupOptions& o) {
  for (const CoefficientSetSpec& set : GroupOptionTable().coefficient_sets) {
    if (set.name != o.ns_schedule.name || !set.steps.has_value() || *set.steps == o.ns_steps) continue;
    return absl::InvalidArgumentError(absl::StrCat("ns_steps must be ", *set.steps, " with ns_coefficients ", set.name,
                                                   " (its coefficients are tuned for exactly ", *set.steps,
                                                   " steps), got ", o.ns_steps));
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
  if (o.optimizer != OptimizerKind::kMuon && o.optimizer != OptimizerKind::kDion2) return absl::OkStatus();
  if (o.ns_preconditioner == NsPreconditioner::kAol && o.ns_algorithm == NsAlgorithm::kGram) {
    return absl::InvalidArgumentError(
        "ns_preconditioner aol applies with ns_algorithm standard or auto (its first iteration reuses X·Xᵀ of "
        "the standard iteration)");
  }
  const double growth = NsSingularValueBound(o);
  if (!(growth <= kMaxNsGrowth)) {
    const std::string& precision = (*ChoicesOf("matmul_precision"))[static_cast<int>(o.matmul_precision)];
    return absl::InvalidArgumentError(absl::StrCat(
        "ns_coefficients: with ", o.ns_steps, " steps, ns_norm_safety ", o.ns_norm_safety, " and matmul_precision ",
        precision, " the iteration grows singular values to about ", growth, "; at most ", kMaxNsGrowth,
        " is accepted (Newton-Schulz must keep them near 1, also for inputs that rounding puts up to ",
        NsRoundingOf(o.matmul_precision).input, " above 1/ns_norm_safety)", SafetyHint(o)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateOptions(const GroupOptions& o) {
  MUOND_RETURN_IF_ERROR(CheckRanges(o));
  MUOND_RETURN_IF_ERROR(ValidateStepHyper(o, o.lr, o.momentum, o.weight_decay));
  if (o.max_grad_norm.has_value() && o.clip_scope != ClipScope::kGroup) {
    return absl::InvalidArgumentError("max_grad_norm applies with clip_scope group only (the group's own limit)");
  }
  if (o.optimizer == OptimizerKind::kAdamW &&
      (o.weight_decay_mode == WeightDecayMode::kIndependent || o.weight_decay_mode == WeightDecayMode::kCautious)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weight_decay_mode ", o.weight_decay_mode == WeightDecayMode::kIndependent ? "independent" : "cautious",
        " applies to muon only; adamw takes decoupled (AdamW) or l2 (Adam with coupled L2)"));
  }
  if (o.optimizer == OptimizerKind::kDion2 && o.weight_decay_mode != WeightDecayMode::kDecoupled &&
      o.weight_decay_mode != WeightDecayMode::kIndependent) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight_decay_mode ", o.weight_decay_mode == WeightDecayMode::kL2 ? "l2" : "cautious",
                     " does not apply to dion2, which takes decoupled (dion's) or independent"));
  }
  if (o.optimizer != OptimizerKind::kMuon && o.moment2_method != Moment2Method::kNone) {
    return absl::InvalidArgumentError(
        absl::StrCat("moment2_method applies to muon only, not to ", std::string(OptimizerName(o.optimizer))));
  }
  if (o.optimizer == OptimizerKind::kMuon && o.moment2_method == Moment2Method::kNone &&
      o.exp_avg_sq_dtype != kernels::StorageDtype::kFp32) {
    return absl::InvalidArgumentError(
        "exp_avg_sq_dtype applies to a muon group only with a moment2_method (its second moment)");
  }
  const bool namo = o.moment2_method == Moment2Method::kNamo || o.moment2_method == Moment2Method::kNamoD;
  if (o.optimizer == OptimizerKind::kMuon && namo && o.weight_decay_mode == WeightDecayMode::kL2) {
    // Emerging-Optimizers refuses it too: the second moment would track the decayed gradient.
    return absl::InvalidArgumentError(absl::StrCat("weight_decay_mode l2 cannot be combined with moment2_method ",
                                                   o.moment2_method == Moment2Method::kNamo ? "namo" : "namo_d",
                                                   " (its second moment is of the raw gradient's norm)"));
  }
  if (o.post_normalization != PostNormalization::kNone && o.moment2_method == Moment2Method::kNormuon) {
    return absl::InvalidArgumentError(
        "post_normalization applies without moment2_method normuon (NorMuon rescales the same lines of the "
        "orthogonalized update after Newton-Schulz)");
  }
  if (o.optimizer == OptimizerKind::kSgd && o.nesterov && o.momentum <= 0) {
    return absl::InvalidArgumentError("nesterov needs momentum > 0 (torch.optim.SGD semantics)");
  }
  if (o.optimizer == OptimizerKind::kSgd && o.nesterov_delay > 1) {
    if (!o.nesterov) return absl::InvalidArgumentError("nesterov_delay > 1 needs nesterov (delayed Nesterov)");
  }
  if (o.optimizer == OptimizerKind::kSgd && o.momentum_activation > 0) {
    if (o.nesterov_delay <= 1) return absl::InvalidArgumentError("momentum_activation > 0 needs nesterov_delay > 1");
    if (o.momentum_activation * o.nesterov_delay > 1) {
      return absl::InvalidArgumentError(absl::StrCat("momentum_activation must be at most 1/nesterov_delay (",
                                                     1.0 / o.nesterov_delay, "), got ", o.momentum_activation));
    }
  }
  MUOND_RETURN_IF_ERROR(ValidateSchedule(o));
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
  const std::vector<std::string>& names = GroupOptionTable().optimizers;
  const size_t index = static_cast<size_t>(kind);
  return index < names.size() ? std::string_view(names[index]) : std::string_view("unknown");
}

std::vector<std::string> OptimizerNames() { return GroupOptionTable().optimizers; }

const std::vector<OptionUse>& GroupOptionUses() {
  static const std::vector<OptionUse>* const uses = [] {
    auto* out = new std::vector<OptionUse>;
    for (const OptionSpec& option : GroupOptionTable().options) {
      if (option.carrier != OptionCarrier::kGroup) continue;
      OptionUse use{option.name, {}};
      for (int i = 0; i < kOptimizerCount; ++i) {
        if (option.applies_to[i]) use.applies_to.push_back(static_cast<OptimizerKind>(i));
      }
      out->push_back(std::move(use));
    }
    return out;
  }();
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
  const OptionSpec* spec = FindOption(option);
  const bool second_moment_only = spec != nullptr && spec->muon_needs == "moment2_method";
  if (o.optimizer == OptimizerKind::kMuon && o.moment2_method == Moment2Method::kNone && second_moment_only) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(option), ": applies to a muon group only with a moment2_method"));
  }
  return absl::OkStatus();
}

}  // namespace muond::optim
