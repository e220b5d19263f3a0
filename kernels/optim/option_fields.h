// The GroupOptions member behind each row of the option table (option_table.h) that is one value:
// VisitOptionFields calls f(name, member) for each, so that defaults, ranges and the wire's plain
// values are applied by name in one loop each. The optimizer and Newton–Schulz's schedule
// (ns_coefficients, ns_custom_coefficients, ns_coefficients_after) are not among them. A function template over a plain
// value type; no state.
#pragma once

#include <string_view>

#include "kernels/optim/options.h"

namespace muond::optim {

// `Options` is GroupOptions or const GroupOptions; f(std::string_view name, Member& member) with
// Member one of double, int, bool, std::optional<double> or an enum whose values are the row's
// choices in order.
template <typename Options, typename F>
void VisitOptionFields(Options& o, F&& f) {
  f(std::string_view("lr"), o.lr);
  f(std::string_view("weight_decay"), o.weight_decay);
  f(std::string_view("weight_decay_mode"), o.weight_decay_mode);
  f(std::string_view("momentum"), o.momentum);
  f(std::string_view("nesterov"), o.nesterov);
  f(std::string_view("nesterov_delay"), o.nesterov_delay);
  f(std::string_view("momentum_activation"), o.momentum_activation);
  f(std::string_view("heloco"), o.heloco);
  f(std::string_view("heloco_keep_cosine"), o.heloco_keep_cosine);
  f(std::string_view("heloco_shrink"), o.heloco_shrink);
  f(std::string_view("heloco_shrink_max"), o.heloco_shrink_max);
  f(std::string_view("heloco_reorient"), o.heloco_reorient);
  f(std::string_view("heloco_kappa"), o.heloco_kappa);
  f(std::string_view("momentum_style"), o.momentum_style);
  f(std::string_view("ns_steps"), o.ns_steps);
  f(std::string_view("ns_algorithm"), o.ns_algorithm);
  f(std::string_view("ns_preconditioner"), o.ns_preconditioner);
  f(std::string_view("ns_eps"), o.ns_eps);
  f(std::string_view("ns_norm_safety"), o.ns_norm_safety);
  f(std::string_view("scale_mode"), o.scale_mode);
  f(std::string_view("extra_scale_factor"), o.extra_scale_factor);
  f(std::string_view("matmul_precision"), o.matmul_precision);
  f(std::string_view("qk_clip_threshold"), o.qk_clip_threshold);
  f(std::string_view("qk_clip_alpha"), o.qk_clip_alpha);
  f(std::string_view("moment2_method"), o.moment2_method);
  f(std::string_view("namo_clamp"), o.namo_clamp);
  f(std::string_view("dion2_fraction"), o.dion2_fraction);
  f(std::string_view("dion2_select"), o.dion2_select);
  f(std::string_view("dion2_ef_decay"), o.dion2_ef_decay);
  f(std::string_view("momentum_normalization"), o.momentum_normalization);
  f(std::string_view("post_normalization"), o.post_normalization);
  f(std::string_view("num_heads"), o.num_heads);
  f(std::string_view("beta1"), o.beta1);
  f(std::string_view("beta2"), o.beta2);
  f(std::string_view("eps"), o.eps);
  f(std::string_view("master_dtype"), o.master_dtype);
  f(std::string_view("momentum_dtype"), o.momentum_dtype);
  f(std::string_view("exp_avg_dtype"), o.exp_avg_dtype);
  f(std::string_view("exp_avg_sq_dtype"), o.exp_avg_sq_dtype);
  f(std::string_view("clip_scope"), o.clip_scope);
  f(std::string_view("max_grad_norm"), o.max_grad_norm);
  f(std::string_view("telemetry"), o.telemetry);
  f(std::string_view("warn_clip_below"), o.warn_clip_below);
  f(std::string_view("warn_clip_steps"), o.warn_clip_steps);
  f(std::string_view("warn_stale_steps"), o.warn_stale_steps);
  f(std::string_view("warn_residual_above"), o.warn_residual_above);
}

}  // namespace muond::optim
