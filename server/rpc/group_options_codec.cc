// muond.v1.GroupOptions → optim::GroupOptions (group_options_codec.h).
#include "server/rpc/group_options_codec.h"

#include <tuple>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/rpc/group_option_table.h"

namespace muond::rpc {
namespace {

using optim::OptimizerKind;

absl::Status Invalid(const std::string& field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

absl::StatusOr<OptimizerKind> ParseOptimizer(v1::OptimizerKind kind, const std::string& field) {
  switch (kind) {
    case v1::OPTIMIZER_UNSPECIFIED:
    case v1::OPTIMIZER_MUON:
      return OptimizerKind::kMuon;
    case v1::OPTIMIZER_ADAMW:
      return OptimizerKind::kAdamW;
    case v1::OPTIMIZER_LION:
      return OptimizerKind::kLion;
    case v1::OPTIMIZER_SGD:
      return OptimizerKind::kSgd;
    default:
      return Invalid(field + ".optimizer", absl::StrCat("unknown optimizer ", static_cast<int>(kind)));
  }
}

// Sets `*target` to the enum value `value` names for `option`, when the request sets it.
template <typename Enum>
absl::Status ParseChoice(bool has, const std::string& value, std::string_view option, const std::string& field,
                         Enum* target) {
  if (!has) return absl::OkStatus();
  absl::StatusOr<int> index = ChoiceIndex(option, value);
  if (!index.ok()) return Invalid(absl::StrCat(field, ".", std::string(option)), index.status().message());
  *target = static_cast<Enum>(*index);
  return absl::OkStatus();
}

// The plain values: copied as they come (ValidateOptions checks them).
void CopyValues(const v1::GroupOptions& in, optim::GroupOptions& out) {
  for (const auto& [has, value, target] : {
           std::tuple{in.has_lr(), in.lr(), &out.lr},
           std::tuple{in.has_weight_decay(), in.weight_decay(), &out.weight_decay},
           std::tuple{in.has_momentum(), in.momentum(), &out.momentum},
           std::tuple{in.has_ns_eps(), in.ns_eps(), &out.ns_eps},
           std::tuple{in.has_ns_norm_safety(), in.ns_norm_safety(), &out.ns_norm_safety},
           std::tuple{in.has_extra_scale_factor(), in.extra_scale_factor(), &out.extra_scale_factor},
           std::tuple{in.has_qk_clip_threshold(), in.qk_clip_threshold(), &out.qk_clip_threshold},
           std::tuple{in.has_qk_clip_alpha(), in.qk_clip_alpha(), &out.qk_clip_alpha},
           std::tuple{in.has_beta1(), in.beta1(), &out.beta1},
           std::tuple{in.has_beta2(), in.beta2(), &out.beta2},
           std::tuple{in.has_eps(), in.eps(), &out.eps},
           std::tuple{in.has_max_grad_norm(), in.max_grad_norm(), &out.max_grad_norm},
           std::tuple{in.has_warn_clip_below(), in.warn_clip_below(), &out.warn_clip_below},
       }) {
    if (has) *target = value;
  }
  if (in.has_nesterov()) out.nesterov = in.nesterov();
  if (in.has_ns_steps()) out.ns_steps = in.ns_steps();
  if (in.has_telemetry()) out.telemetry = in.telemetry();
  if (in.has_warn_clip_steps()) out.warn_clip_steps = in.warn_clip_steps();
  if (in.has_warn_stale_steps()) out.warn_stale_steps = in.warn_stale_steps();
  if (in.has_warn_residual_above()) out.warn_residual_above = in.warn_residual_above();
}

absl::Status ParseNames(const v1::GroupOptions& in, const std::string& field, optim::GroupOptions& out) {
  MUOND_RETURN_IF_ERROR(ParseChoice(in.has_weight_decay_mode(), in.weight_decay_mode(), "weight_decay_mode", field,
                                    &out.weight_decay_mode));
  MUOND_RETURN_IF_ERROR(
      ParseChoice(in.has_momentum_style(), in.momentum_style(), "momentum_style", field, &out.momentum_style));
  MUOND_RETURN_IF_ERROR(ParseChoice(in.has_scale_mode(), in.scale_mode(), "scale_mode", field, &out.scale_mode));
  MUOND_RETURN_IF_ERROR(
      ParseChoice(in.has_ns_algorithm(), in.ns_algorithm(), "ns_algorithm", field, &out.ns_algorithm));
  MUOND_RETURN_IF_ERROR(
      ParseChoice(in.has_moment2_method(), in.moment2_method(), "moment2_method", field, &out.moment2_method));
  MUOND_RETURN_IF_ERROR(
      ParseChoice(in.has_master_dtype(), in.master_dtype(), "master_dtype", field, &out.master_dtype));
  MUOND_RETURN_IF_ERROR(
      ParseChoice(in.has_momentum_dtype(), in.momentum_dtype(), "momentum_dtype", field, &out.momentum_dtype));
  MUOND_RETURN_IF_ERROR(
      ParseChoice(in.has_exp_avg_dtype(), in.exp_avg_dtype(), "exp_avg_dtype", field, &out.exp_avg_dtype));
  MUOND_RETURN_IF_ERROR(
      ParseChoice(in.has_exp_avg_sq_dtype(), in.exp_avg_sq_dtype(), "exp_avg_sq_dtype", field, &out.exp_avg_sq_dtype));
  MUOND_RETURN_IF_ERROR(ParseChoice(in.has_clip_scope(), in.clip_scope(), "clip_scope", field, &out.clip_scope));
  return ParseChoice(in.has_matmul_precision(), in.matmul_precision(), "matmul_precision", field,
                     &out.matmul_precision);
}

// Coefficients: a named set, or a custom list (with its after-the-list rule).
absl::Status ParseCoefficients(const v1::GroupOptions& in, const std::string& field, optim::GroupOptions& out) {
  const bool custom = in.ns_custom_coefficients_size() > 0;
  if (custom && in.has_ns_coefficients() && in.ns_coefficients() != "custom") {
    return Invalid(field + ".ns_coefficients", "give either a named set or ns_custom_coefficients, not both");
  }
  if (!custom) {
    if (in.has_ns_coefficients_after()) {
      return Invalid(field + ".ns_coefficients_after", "applies only to ns_custom_coefficients");
    }
    if (!in.has_ns_coefficients()) return absl::OkStatus();
    if (in.ns_coefficients() == "custom") {
      return Invalid(field + ".ns_coefficients", "'custom' needs ns_custom_coefficients");
    }
    absl::StatusOr<optim::NsSchedule> schedule = optim::NamedSchedule(in.ns_coefficients());
    if (!schedule.ok()) return Invalid(field + ".ns_coefficients", schedule.status().message());
    out.ns_schedule = *std::move(schedule);
    return absl::OkStatus();
  }
  out.ns_schedule.name = "custom";
  out.ns_schedule.tuples.clear();
  for (const v1::NsCoefficients& t : in.ns_custom_coefficients()) {
    out.ns_schedule.tuples.push_back({t.a(), t.b(), t.c()});
  }
  out.ns_schedule.after = optim::CoefficientsAfter::kCycle;
  return ParseChoice(in.has_ns_coefficients_after(), in.ns_coefficients_after(), "ns_coefficients_after", field,
                     &out.ns_schedule.after);
}

// A ValidateOptions error with the wire's path: `field` prefixed; a custom list is
// ns_custom_coefficients on the wire; betas[i] are beta1 and beta2 there.
absl::Status WithWirePath(const absl::Status& status, const std::string& field, bool custom) {
  std::string message(status.message());
  for (const auto& [kernel, wire] : {std::pair{"betas[0]", "beta1 (betas[0])"}, {"betas[1]", "beta2 (betas[1])"}}) {
    if (absl::StartsWith(message, kernel)) message = absl::StrCat(wire, message.substr(std::string(kernel).size()));
  }
  if (custom && absl::StartsWith(message, "ns_coefficients[")) message = absl::StrCat("ns_custom_", message.substr(3));
  return absl::InvalidArgumentError(absl::StrCat(field, ".", message));
}

}  // namespace

absl::StatusOr<optim::GroupOptions> ParseGroupOptions(const v1::GroupOptions& in, const std::string& field) {
  MUOND_ASSIGN_OR_RETURN(OptimizerKind kind, ParseOptimizer(in.optimizer(), field));
  optim::GroupOptions out = optim::DefaultOptions(kind);
  CopyValues(in, out);
  MUOND_RETURN_IF_ERROR(ParseNames(in, field, out));
  MUOND_RETURN_IF_ERROR(ParseCoefficients(in, field, out));
  // Refuse options this group does not read, naming the first one set, rather than ignore them.
  std::vector<const google::protobuf::FieldDescriptor*> set_fields;
  in.GetReflection()->ListFields(in, &set_fields);
  for (const google::protobuf::FieldDescriptor* f : set_fields) {
    if (!optim::IsGroupOption(f->name())) continue;
    if (absl::Status applies = optim::CheckOptionApplies(out, f->name()); !applies.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".", applies.message()));
    }
  }
  absl::Status valid = optim::ValidateOptions(out);
  if (!valid.ok()) return WithWirePath(valid, field, in.ns_custom_coefficients_size() > 0);
  return out;
}

}  // namespace muond::rpc
