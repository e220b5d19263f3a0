#include "server/session/step_plan.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"

namespace muond::session {
namespace {

absl::Status ApplyOverride(const GroupOverride& o, const std::string& field, optim::StepHyper& h) {
  if (o.lr.has_value()) {
    if (!std::isfinite(*o.lr) || *o.lr < 0) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".lr: must be finite and >= 0, got ", *o.lr));
    }
    h.lr = *o.lr;
  }
  if (o.momentum.has_value()) {
    if (!(*o.momentum >= 0 && *o.momentum < 1)) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".momentum: must be in [0, 1), got ", *o.momentum));
    }
    h.momentum = *o.momentum;
  }
  if (o.weight_decay.has_value()) {
    if (!std::isfinite(*o.weight_decay) || *o.weight_decay < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".weight_decay: must be finite and >= 0, got ", *o.weight_decay));
    }
    h.weight_decay = *o.weight_decay;
  }
  return absl::OkStatus();
}

absl::Status ResolveQkLogits(const SessionConfig& config, const StepRequest& request, StepPlan& plan) {
  for (size_t i = 0; i < request.qk_logits.size(); ++i) {
    const QkLogits& logits = request.qk_logits[i];
    const std::string field = absl::StrCat("header.qk_logits[", i, "]");
    size_t pair = config.qk_clip.size();
    for (size_t p = 0; p < config.qk_clip.size(); ++p) {
      if (config.parameters[config.qk_clip[p].query].name == logits.query) pair = p;
    }
    if (pair == config.qk_clip.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".query: '", logits.query, "' is not the query of a spec.qk_clip pair"));
    }
    for (const auto& [seen, unused] : plan.qk_logits) {
      if (seen == pair) {
        return absl::InvalidArgumentError(absl::StrCat(field, ".query: '", logits.query, "' given twice"));
      }
    }
    if (static_cast<int>(logits.max_logits.size()) != config.qk_clip[pair].num_heads) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".max_logits: expected ", config.qk_clip[pair].num_heads,
                                                     " values (one per head), got ", logits.max_logits.size()));
    }
    plan.qk_logits.emplace_back(pair, logits.max_logits);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<StepPlan> PlanStep(const SessionConfig& config, const std::vector<optim::StepHyper>& defaults,
                                  StepRequest request) {
  StepPlan plan;
  plan.hyper = defaults;
  for (size_t i = 0; i < request.overrides.size(); ++i) {
    const GroupOverride& o = request.overrides[i];
    const std::string field = absl::StrCat("header.overrides[", i, "]");
    auto it = config.group_index.find(o.group);
    if (it == config.group_index.end()) {
      return absl::NotFoundError(absl::StrCat(field, ".group: unknown group '", o.group, "'"));
    }
    absl::Status applied = ApplyOverride(o, field, plan.hyper[it->second]);
    if (!applied.ok()) return applied;
  }
  absl::Status logits = ResolveQkLogits(config, request, plan);
  if (!logits.ok()) return logits;
  if (request.max_grad_norm.has_value() && !(std::isfinite(*request.max_grad_norm) && *request.max_grad_norm > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.max_grad_norm: must be finite and > 0, got ", *request.max_grad_norm));
  }
  if (request.rank < 0 || request.rank >= config.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.rank: must be in [0, ", config.world_size, "), got ", request.rank));
  }
  plan.request = std::move(request);
  return plan;
}

double ClipCoefficient(const StepPlan& plan, double norm) {
  if (!plan.request.max_grad_norm.has_value()) return 1.0;
  return std::min(1.0, *plan.request.max_grad_norm / (norm + 1e-6));
}

}  // namespace muond::session
