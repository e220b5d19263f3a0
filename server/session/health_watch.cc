#include "server/session/health_watch.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/optim/options.h"

namespace muond::session {

std::vector<metrics::GroupFigures> GroupFiguresOf(const std::vector<StepResult::GroupClip>& clips,
                                                  const std::vector<StepResult::GroupTelemetry>& telemetry) {
  std::vector<metrics::GroupFigures> figures;
  for (size_t g = 0; g < telemetry.size() && g < clips.size(); ++g) {
    const StepResult::GroupTelemetry& t = telemetry[g];
    std::optional<std::array<int64_t, 3>> heloco;
    if (t.heloco.has_value()) heloco = std::array<int64_t, 3>{t.heloco->kept, t.heloco->reoriented, t.heloco->shrunk};
    figures.push_back({t.group, clips[g].grad_norm, clips[g].coefficient, t.update_rms, t.update_ratio, t.momentum_norm,
                       t.residual, t.stale_parameters, heloco});
  }
  return figures;
}

namespace {

void Raise(std::string_view kind, const std::string& group, std::string detail, StepResult::GroupTelemetry& out,
           StepResult& result) {
  out.warnings.emplace_back(kind);
  result.warnings.push_back({std::string(kind), group, std::move(detail)});
}

// The smallest scale of Newton–Schulz's input (its Frobenius norm, which bounds its largest singular
// value) that the group's iteration still lifts to half, on 4097 log-spaced points of [2⁻⁴⁰, 1]:
// under it every singular direction of the update stays small, shrinking with the momentum. Above
// it the iteration restores at least the largest (the orthogonality residual tells the rest).
double NsLiftFloor(const optim::GroupOptions& options) {
  constexpr int kPoints = 4097;
  constexpr double kLowestLog2 = -40;
  for (int i = 0; i < kPoints; ++i) {
    const double start = std::exp2(kLowestLog2 - kLowestLog2 * i / (kPoints - 1));
    double x = start;
    for (int t = 0; t < options.ns_steps; ++t) {
      const optim::NsCoefficient co = options.ns_schedule.At(t);
      const double x2 = x * x;
      x = co.a * x + co.b * x * x2 + co.c * x * x2 * x2;
    }
    if (std::abs(x) >= 0.5) return start;
  }
  return 1.0;
}

}  // namespace

void HealthWatch::Observe(const SessionConfig& config, const StepClipping& clipping,
                          const std::vector<bool>& has_gradient, const std::vector<optim::StepTelemetry>& telemetry,
                          StepResult& result) {
  const size_t groups = config.groups.size();
  groups_.resize(groups);
  steps_without_gradient_.resize(config.parameters.size(), 0);
  result.group_telemetry.assign(groups, {});
  for (size_t g = 0; g < groups; ++g) result.group_telemetry[g].group = config.groups[g].name;

  for (size_t i = 0; i < config.parameters.size(); ++i) {
    const ParameterConfig& pc = config.parameters[i];
    const optim::GroupOptions& options = config.groups[pc.group].options;
    StepResult::GroupTelemetry& out = result.group_telemetry[pc.group];
    int64_t& missing = steps_without_gradient_[i];
    missing = i < has_gradient.size() && has_gradient[i] ? 0 : missing + 1;
    if (missing >= options.warn_stale_steps) ++out.stale_parameters;
    if (missing == options.warn_stale_steps) {
      Raise(kHealthWarningKinds[2], out.group,
            absl::StrCat("parameter '", pc.name, "' has had no gradient for ", missing, " steps"), out, result);
    }
  }

  for (size_t g = 0; g < groups; ++g) {
    const optim::GroupOptions& options = config.groups[g].options;
    const optim::StepTelemetry& t = telemetry[g];
    StepResult::GroupTelemetry& out = result.group_telemetry[g];
    GroupState& state = groups_[g];
    if (options.telemetry && t.updated_elements > 0) {
      out.update_rms = std::sqrt(t.update_sum_squares / static_cast<double>(t.updated_elements));
      out.update_ratio = t.master_sum_squares > 0   ? std::sqrt(t.update_sum_squares / t.master_sum_squares)
                         : t.update_sum_squares > 0 ? HUGE_VAL
                                                    : 0.0;
    }
    if (options.optimizer == optim::OptimizerKind::kSgd && options.heloco) {
      out.heloco = StepResult::GroupTelemetry::HelocoCounts{t.heloco_kept, t.heloco_reoriented, t.heloco_shrunk};
    }
    // Newton–Schulz's groups: Muon's, and Dion2's on its chosen lines (the same telemetry).
    if (options.optimizer != optim::OptimizerKind::kMuon && options.optimizer != optim::OptimizerKind::kDion2) {
      continue;
    }

    if (options.optimizer == optim::OptimizerKind::kMuon) {
      const double coefficient = clipping.clipped[g];
      state.clip_low_steps = coefficient < options.warn_clip_below ? state.clip_low_steps + 1 : 0;
      if (state.clip_low_steps == options.warn_clip_steps) {
        Raise(kHealthWarningKinds[0], out.group,
              absl::StrCat("clip coefficient ", coefficient, " under ", options.warn_clip_below, " for ",
                           state.clip_low_steps, " steps (gradient norm ", clipping.group_norms[g], ")"),
              out, result);
      }
    }

    if (t.matrices > 0) {
      out.momentum_norm = std::sqrt(t.momentum_sum_squares);
      out.smallest_momentum_norm = t.smallest_momentum_norm;
      // Newton–Schulz divides by norm_safety·‖U‖ + eps, so its input has the norm
      // ‖U‖/(norm_safety·‖U‖ + eps): about 1/norm_safety, and ‖U‖/eps once ‖U‖ falls under eps.
      // Turbo-Muon's AOL divides each row by the root of its row sum of |U·Uᵀ| (of the order of
      // ‖U‖²) floored at eps: an input of about ‖U‖/√eps once ‖U‖² falls under eps. The iteration
      // lifts small inputs (by its slope at 0, the product of the a's): the update shrinks with the
      // momentum only when even that input's largest singular value stays under what the group's
      // iteration lifts to half (NsLiftFloor). A momentum of exactly zero is a matrix whose
      // gradients have all been zero so far (a zero-initialized layer's inputs at the start): its
      // update is rightly zero, and nothing fell; nor did a momentum whose gradient is all zero
      // this step (not counted).
      const double norm = t.smallest_nonzero_momentum_norm;
      const bool aol = options.ns_preconditioner == optim::NsPreconditioner::kAol;
      const double input = aol ? norm / std::sqrt(std::max(norm * norm, options.ns_eps))
                               : norm / (options.ns_norm_safety * norm + options.ns_eps);
      if (!state.lift_floor.has_value()) state.lift_floor = NsLiftFloor(options);
      const bool low = input < *state.lift_floor;
      if (low && !state.momentum_low) {
        Raise(kHealthWarningKinds[1], out.group,
              absl::StrCat("a momentum norm of ", norm, " makes Newton–Schulz's input ", input,
                           aol ? " (AOL's row sums floor at ns_eps " : " (it divides by ‖U‖ + ns_eps ", options.ns_eps,
                           "), under the ", *state.lift_floor, " its ", options.ns_steps,
                           " steps lift to half: the update shrinks with the momentum"),
              out, result);
      }
      state.momentum_low = low;
    }

    if (t.residual.has_value()) {
      out.residual = t.residual;
      out.residual_parameter = t.residual_parameter;
      if (!state.residual_threshold.has_value()) state.residual_threshold = optim::ResidualThreshold(options);
      // One matrix is measured per step, in turn: the group's condition lasts while any matrix
      // measured high has not been measured low since, and is raised when it starts.
      const bool high = *t.residual > *state.residual_threshold;
      // A matrix of a parameter without a gradient this step is not measured in turn: its last
      // measurement no longer stands.
      std::erase_if(state.residual_high, [&](const std::pair<std::string, size_t>& m) {
        const auto index = config.parameter_index.find(m.first);
        return index != config.parameter_index.end() && index->second < has_gradient.size() &&
               !has_gradient[index->second];
      });
      const bool was_high = !state.residual_high.empty();
      const std::pair<std::string, size_t> matrix{t.residual_parameter, t.residual_offset};
      if (high) {
        state.residual_high.insert(matrix);
      } else {
        state.residual_high.erase(matrix);
      }
      if (high && !was_high) {
        Raise(kHealthWarningKinds[3], out.group,
              absl::StrCat("orthogonality residual ", *t.residual, " of '", t.residual_parameter, "' above ",
                           *state.residual_threshold,
                           options.warn_residual_above.has_value() ? "" : " (this Newton-Schulz's own bound)"),
              out, result);
      }
    }
  }
  history_.resize(groups);
  for (size_t g = 0; g < groups; ++g) {
    GroupHistory& h = history_[g];
    if (h.grad_norm.size() == kHistorySteps) {
      h.grad_norm.erase(h.grad_norm.begin());
      h.update_rms.erase(h.update_rms.begin());
    }
    h.grad_norm.push_back(g < clipping.group_norms.size() ? clipping.group_norms[g] : std::nan(""));
    h.update_rms.push_back(result.group_telemetry[g].update_rms.value_or(std::nan("")));
  }
  latest_ = {result.step, result.group_clips, result.group_telemetry, history_};
}

}  // namespace muond::session
