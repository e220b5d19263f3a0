#include "server/transport/api_codec/api_conversion.h"

namespace muond::transport {

session::StepRequest ToStepRequest(const v1::StepHeader& header) {
  session::StepRequest request;
  request.session_id = header.session_id();
  request.step = header.step();
  request.rank = header.rank();
  for (const v1::GroupOverride& o : header.overrides()) {
    session::GroupOverride out;
    out.group = o.group();
    if (o.has_lr()) out.lr = o.lr();
    if (o.has_momentum()) out.momentum = o.momentum();
    if (o.has_weight_decay()) out.weight_decay = o.weight_decay();
    if (o.has_beta1()) out.beta1 = o.beta1();
    if (o.has_beta2()) out.beta2 = o.beta2();
    request.overrides.push_back(std::move(out));
  }
  if (header.has_max_grad_norm()) request.max_grad_norm = header.max_grad_norm();
  if (header.has_grad_scale()) request.grad_scale = header.grad_scale();
  if (header.has_weight()) request.weight = header.weight();
  if (header.has_base_step()) request.base_step = header.base_step();
  for (const v1::QkClipLogits& logits : header.qk_logits()) {
    request.qk_logits.push_back({logits.query(), {logits.max_logits().begin(), logits.max_logits().end()}});
  }
  // Numbered alike; an unknown value is kept as it is and refused by the session's planning.
  request.phase = static_cast<session::StepPhase>(header.phase());
  request.count_zeros = header.log_num_zeros_in_grad();
  if (header.has_decision()) {
    request.decision = session::ShardDecision{header.decision().grad_norm(), header.decision().skip_reason()};
  }
  return request;
}

v1::GroupOverride ToProto(const session::GroupOverride& o) {
  v1::GroupOverride out;
  out.set_group(o.group);
  if (o.lr.has_value()) out.set_lr(*o.lr);
  if (o.momentum.has_value()) out.set_momentum(*o.momentum);
  if (o.weight_decay.has_value()) out.set_weight_decay(*o.weight_decay);
  if (o.beta1.has_value()) out.set_beta1(*o.beta1);
  if (o.beta2.has_value()) out.set_beta2(*o.beta2);
  return out;
}

session::StepRequest StepOptionsOf(const v1::StepEnd& end) {
  v1::StepHeader options;
  *options.mutable_overrides() = end.overrides();
  if (end.has_max_grad_norm()) options.set_max_grad_norm(end.max_grad_norm());
  *options.mutable_qk_logits() = end.qk_logits();
  if (end.has_grad_scale()) options.set_grad_scale(end.grad_scale());
  if (end.has_weight()) options.set_weight(end.weight());
  return ToStepRequest(options);
}

const char* StreamedOptionInHeader(const v1::StepHeader& header) {
  if (header.overrides_size() > 0) return "overrides";
  if (header.has_max_grad_norm()) return "max_grad_norm";
  if (header.qk_logits_size() > 0) return "qk_logits";
  if (header.has_grad_scale()) return "grad_scale";
  if (header.has_weight()) return "weight";
  return nullptr;
}

v1::GroupClip ToProto(const session::StepResult::GroupClip& clip) {
  v1::GroupClip out;
  out.set_group(clip.group);
  out.set_grad_norm(clip.grad_norm);
  out.set_coefficient(clip.coefficient);
  return out;
}

v1::GroupTelemetry ToProto(const session::StepResult::GroupTelemetry& t) {
  v1::GroupTelemetry out;
  out.set_group(t.group);
  if (t.update_rms.has_value()) out.set_update_rms(*t.update_rms);
  if (t.update_ratio.has_value()) out.set_update_ratio(*t.update_ratio);
  if (t.momentum_norm.has_value()) out.set_momentum_norm(*t.momentum_norm);
  if (t.smallest_momentum_norm.has_value()) out.set_smallest_momentum_norm(*t.smallest_momentum_norm);
  if (t.residual.has_value()) out.set_orthogonality_residual(*t.residual);
  out.set_residual_parameter(t.residual_parameter);
  out.set_stale_parameters(t.stale_parameters);
  for (const std::string& warning : t.warnings) out.add_warnings(warning);
  if (t.heloco.has_value()) {
    v1::HelocoCounts* counts = out.mutable_heloco();
    counts->set_kept(t.heloco->kept);
    counts->set_reoriented(t.heloco->reoriented);
    counts->set_shrunk(t.heloco->shrunk);
  }
  return out;
}

v1::StepResult ToProto(const session::StepResult& result) {
  v1::StepResult out;
  out.set_step(result.step);
  out.set_applied(result.applied);
  if (!result.skip_reason.empty()) out.set_skip_reason(result.skip_reason);
  out.set_grad_norm(result.grad_norm);
  out.set_compute_seconds(result.compute_seconds);
  if (result.replayed) out.set_replayed(true);
  if (result.num_zeros_in_grad != 0) out.set_num_zeros_in_grad(result.num_zeros_in_grad);
  if (result.loss_scale != 0) out.set_loss_scale(result.loss_scale);
  out.mutable_contributors()->Assign(result.contributors.begin(), result.contributors.end());
  out.set_total_weight(result.total_weight);
  out.set_included(result.included);
  for (const session::StepResult::GroupClip& clip : result.group_clips) *out.add_group_clips() = ToProto(clip);
  for (const session::StepResult::GroupTelemetry& t : result.group_telemetry) *out.add_group_telemetry() = ToProto(t);
  if (result.global_step != 0) {
    out.set_global_step(result.global_step);
    out.set_staleness(result.staleness);
  }
  if (result.prepared) {
    out.set_prepared(true);
    out.mutable_sum_squares()->Assign(result.sum_squares.begin(), result.sum_squares.end());
  }
  return out;
}

}  // namespace muond::transport
