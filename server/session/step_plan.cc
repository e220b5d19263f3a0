#include "server/session/step_plan.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/echo.h"
#include "common/status_macros.h"
#include "server/session/value_rules.h"

namespace muond::session {
namespace {

// Sets `h` to the group's values with `o` applied, refusing an override the group's optimizer does
// not use and values outside optim::ValidateStepHyper's ranges.
absl::Status ApplyOverride(const GroupOverride& o, const std::string& field, const optim::GroupOptions& options,
                           optim::StepHyper& h) {
  const std::pair<const char*, const std::optional<double>*> fields[] = {{"lr", &o.lr},
                                                                         {"momentum", &o.momentum},
                                                                         {"weight_decay", &o.weight_decay},
                                                                         {"beta1", &o.beta1},
                                                                         {"beta2", &o.beta2}};
  // Betas a step may change only where they are AdamW's and Lion's (Muon's beta2 is its second
  // moment's, fixed by the session).
  const bool betas =
      options.optimizer == optim::OptimizerKind::kAdamW || options.optimizer == optim::OptimizerKind::kLion;
  for (const auto& [name, value] : fields) {
    const bool beta = name[0] == 'b';
    if (value->has_value() && (beta ? !betas : !optim::OptionApplies(options.optimizer, name))) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".", name, ": does not apply to optimizer ",
                                                     std::string(optim::OptimizerName(options.optimizer)), " (group '",
                                                     o.group, "')"));
    }
  }
  optim::StepHyper next = h;
  if (o.lr.has_value()) next.lr = *o.lr;
  if (o.momentum.has_value()) next.momentum = *o.momentum;
  if (o.weight_decay.has_value()) next.weight_decay = *o.weight_decay;
  if (o.beta1.has_value()) next.beta1 = *o.beta1;
  if (o.beta2.has_value()) next.beta2 = *o.beta2;
  absl::Status valid = optim::ValidateStepHyper(options, next.lr, next.momentum, next.weight_decay);
  if (!valid.ok()) return absl::InvalidArgumentError(absl::StrCat(field, ".", valid.message()));
  for (const auto& [name, value] : {std::pair{"beta1", next.beta1}, std::pair{"beta2", next.beta2}}) {
    if (!(value >= 0 && value < 1)) {  // NaN too
      return absl::InvalidArgumentError(absl::StrCat(field, ".", name, " must be in [0, 1), got ", value));
    }
  }
  h = next;
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
          absl::StrCat(field, ".query: '", Echo(logits.query), "' is not the query of a spec.qk_clip pair"));
    }
    for (const auto& [seen, unused] : plan.qk_logits) {
      if (seen == pair) {
        return absl::InvalidArgumentError(absl::StrCat(field, ".query: '", Echo(logits.query), "' given twice"));
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

// A shard's steps are prepared and committed; a commit carries a decision that can be applied.
absl::Status CheckPhase(const SessionConfig& config, const StepRequest& request) {
  const int phase = static_cast<int>(request.phase);
  if (phase < 0 || phase > static_cast<int>(StepPhase::kCommit)) {
    return absl::InvalidArgumentError(absl::StrCat("header.phase: unknown phase ", phase));
  }
  if (request.phase == StepPhase::kWhole && config.shard.count > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.phase: this session is shard ", config.shard.index, " of ", config.shard.count,
                     " (spec.shard); its steps are prepared and then committed on every shard (docs/sharding.md)"));
  }
  // Prepare and commit are a sharded session's (spec.shard), which steps in lock-step only (a quorum
  // or asynchronous session is never sharded): on any other a commit would apply held gradients with
  // the norm its header claims.
  if (request.phase != StepPhase::kWhole && config.shard.count == 0) {
    return absl::InvalidArgumentError(
        "header.phase: this session is not sharded (no spec.shard); its steps are whole (prepare and commit are a "
        "sharded session's, docs/sharding.md)");
  }
  if (request.phase != StepPhase::kCommit) {
    if (request.decision.has_value()) {
      return absl::InvalidArgumentError("header.decision: only a commit (header.phase COMMIT) carries a decision");
    }
    return absl::OkStatus();
  }
  if (!request.decision.has_value()) {
    return absl::InvalidArgumentError("header.decision: a commit needs the decision taken over every shard");
  }
  const ShardDecision& decision = *request.decision;
  if (decision.skip_reason.empty() && !(std::isfinite(decision.grad_norm) && decision.grad_norm >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.decision.grad_norm: must be finite and >= 0 for a step that is applied, got ", decision.grad_norm));
  }
  if (decision.skip_reason.size() > 4096) {
    return absl::InvalidArgumentError("header.decision.skip_reason: longer than 4096 characters");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ApplyOverrides(const SessionConfig& config, const std::vector<GroupOverride>& overrides,
                            absl::string_view field, std::vector<optim::StepHyper>& hyper) {
  std::vector<int64_t> entry_of(config.groups.size(), -1);  // a group's entry, once one names it
  for (size_t i = 0; i < overrides.size(); ++i) {
    const GroupOverride& o = overrides[i];
    const std::string entry = absl::StrCat(field, "[", i, "]");
    auto it = config.group_index.find(o.group);
    if (it == config.group_index.end()) {
      return absl::NotFoundError(absl::StrCat(entry, ".group: unknown group '", Echo(o.group), "'"));
    }
    if (entry_of[it->second] >= 0) {
      return absl::InvalidArgumentError(absl::StrCat(entry, ".group: '", Echo(o.group), "' is given twice (also ",
                                                     field, "[", entry_of[it->second], "]); one entry per group"));
    }
    entry_of[it->second] = static_cast<int64_t>(i);
    MUOND_RETURN_IF_ERROR(ApplyOverride(o, entry, config.groups[it->second].options, hyper[it->second]));
  }
  return absl::OkStatus();
}

std::vector<GroupOverride> OverridesByGroup(const SessionConfig& config, const std::vector<GroupOverride>& overrides) {
  std::vector<const GroupOverride*> by_group(config.groups.size(), nullptr);
  for (const GroupOverride& o : overrides) {
    auto it = config.group_index.find(o.group);
    const bool sets = o.lr || o.momentum || o.weight_decay || o.beta1 || o.beta2;
    if (it != config.group_index.end() && sets) by_group[it->second] = &o;  // ApplyOverrides refused others
  }
  std::vector<GroupOverride> out;
  for (const GroupOverride* o : by_group) {
    if (o != nullptr) out.push_back(*o);
  }
  return out;
}

void NormalizeJournaledRequest(const SessionConfig& config, StepRequest& request) {
  if (config.sync.mode != SyncMode::kAsync) request.base_step.reset();
  std::vector<GroupOverride> merged;
  std::map<std::string, size_t, std::less<>> entry_of;  // group name → its entry in `merged`
  for (const GroupOverride& o : request.overrides) {
    auto [it, first] = entry_of.try_emplace(o.group, merged.size());
    if (first) {
      merged.push_back(o);
      continue;
    }
    GroupOverride& into = merged[it->second];
    for (auto field : {&GroupOverride::lr, &GroupOverride::momentum, &GroupOverride::weight_decay,
                       &GroupOverride::beta1, &GroupOverride::beta2}) {
      if ((o.*field).has_value()) into.*field = o.*field;
    }
  }
  request.overrides = std::move(merged);
}

absl::StatusOr<StepPlan> PlanStep(const SessionConfig& config, const std::vector<optim::StepHyper>& defaults,
                                  StepRequest request) {
  MUOND_RETURN_IF_ERROR(CheckStepNumber("header.step", request.step, 1));
  StepPlan plan;
  plan.hyper = defaults;
  MUOND_RETURN_IF_ERROR(ApplyOverrides(config, request.overrides, "header.overrides", plan.hyper));
  absl::Status logits = ResolveQkLogits(config, request, plan);
  if (!logits.ok()) return logits;
  if (request.max_grad_norm.has_value() && !(std::isfinite(*request.max_grad_norm) && *request.max_grad_norm > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.max_grad_norm: must be finite and > 0, got ", *request.max_grad_norm));
  }
  if (request.grad_scale.has_value() &&
      !(std::isfinite(*request.grad_scale) && *request.grad_scale >= optim::kMinLossScale &&
        *request.grad_scale <= optim::kMaxLossScale)) {
    return absl::InvalidArgumentError(absl::StrCat("header.grad_scale: must be in [", optim::kMinLossScale, ", ",
                                                   optim::kMaxLossScale, "], got ", *request.grad_scale));
  }
  if (!(request.weight > 0 && request.weight <= kMaxStepWeight)) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.weight: must be > 0 and at most ", kMaxStepWeight, ", got ", request.weight));
  }
  if (request.rank < 0 || request.rank >= config.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.rank: must be in [0, ", config.world_size, "), got ", request.rank));
  }
  if (request.base_step.has_value() && config.sync.mode != SyncMode::kAsync) {
    // Only an asynchronous push says what it was computed on; anywhere else it would go unread.
    return absl::InvalidArgumentError(
        "header.base_step: applies to spec.sync.mode async only (the global step a push was computed on)");
  }
  absl::Status phase = CheckPhase(config, request);
  if (!phase.ok()) return phase;
  plan.request = std::move(request);
  return plan;
}

double ClipCoefficient(const StepPlan& plan, double norm) {
  if (!plan.request.max_grad_norm.has_value()) return 1.0;
  return std::min(1.0, *plan.request.max_grad_norm / (norm + 1e-6));
}

StepClipping PlanClipping(const SessionConfig& config, const StepPlan& plan, const std::vector<HostTensor>& gradients,
                          double unscale, std::optional<double> decided_global_norm) {
  const size_t groups = config.groups.size();
  std::vector<double> group_squares(groups, 0.0);
  double global_squares = 0;
  for (size_t i = 0; i < gradients.size(); ++i) {
    const size_t g = config.parameters[i].group;
    group_squares[g] += gradients[i].sum_squares;  // 0 for a parameter without a gradient
    if (config.groups[g].options.clip_scope == optim::ClipScope::kGlobal) global_squares += gradients[i].sum_squares;
  }
  StepClipping clipping;
  clipping.global_norm = decided_global_norm.value_or(std::sqrt(global_squares) * unscale);
  const double global = ClipCoefficient(plan, clipping.global_norm);
  for (size_t g = 0; g < groups; ++g) {
    const optim::GroupOptions& options = config.groups[g].options;
    const double norm = std::sqrt(group_squares[g]) * unscale;
    double coefficient = 1.0;
    if (options.clip_scope == optim::ClipScope::kGlobal) {
      coefficient = global;
    } else if (options.clip_scope == optim::ClipScope::kGroup) {
      const std::optional<double> limit =
          options.max_grad_norm.has_value() ? options.max_grad_norm : plan.request.max_grad_norm;
      if (limit.has_value()) coefficient = std::min(1.0, *limit / (norm + 1e-6));
    }
    clipping.group_norms.push_back(norm);
    clipping.clipped.push_back(coefficient);
    clipping.coefficients.push_back(coefficient * unscale);
  }
  return clipping;
}

}  // namespace muond::session
