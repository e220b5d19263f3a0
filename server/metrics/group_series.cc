#include "server/metrics/group_series.h"

#include <algorithm>
#include <functional>
#include <optional>

#include "server/metrics/exposition.h"

namespace muond::metrics {

void GroupSeries::Open(std::string_view session, uint64_t serial, const std::vector<GroupFigures>& last_groups) {
  sessions_.insert_or_assign(std::string(session), OpenSession{serial, LatestOf(last_groups)});
}

std::vector<GroupSeries::Latest> GroupSeries::LatestOf(const std::vector<GroupFigures>& groups) {
  std::vector<Latest> latest;
  for (const GroupFigures& g : groups) {
    if (latest.size() == kMaxGroupsPerSession) break;
    latest.push_back({std::string(g.group), g.grad_norm, g.clip_coefficient, g.update_rms, g.update_ratio,
                      g.momentum_norm, g.residual, g.stale_parameters, g.heloco});
  }
  return latest;
}

void GroupSeries::Record(const StepReport& report) {
  for (std::string_view kind : report.warnings) {
    const auto it = std::find(kWarningKinds.begin(), kWarningKinds.end(), kind);
    if (it != kWarningKinds.end()) ++warnings_[static_cast<size_t>(it - kWarningKinds.begin())];
  }
  if (report.groups.empty()) return;
  const auto it = sessions_.find(report.session);
  if (it == sessions_.end() || it->second.serial != report.session_serial) return;  // closed (or never opened)
  it->second.groups = LatestOf(report.groups);
}

void GroupSeries::Drop(std::string_view session) {
  const auto it = sessions_.find(session);
  if (it != sessions_.end()) sessions_.erase(it);
}

void GroupSeries::Render(std::string* out) const {
  struct Gauge {
    std::string_view name, help;
    std::function<std::optional<double>(const Latest&)> value;
  };
  const Gauge gauges[] = {
      {"muond_group_grad_norm", "L2 norm of the group's gradients in its last step, before clipping.",
       [](const Latest& l) { return std::optional<double>(l.grad_norm); }},
      {"muond_group_clip_coefficient", "What the group's gradients were multiplied by in its last step (1: none).",
       [](const Latest& l) { return std::optional<double>(l.clip_coefficient); }},
      {"muond_group_update_rms", "RMS of the change of the group's masters in its last applied step.",
       [](const Latest& l) { return l.update_rms; }},
      {"muond_group_update_ratio", "Norm of that change over the masters' norm before the step.",
       [](const Latest& l) { return l.update_ratio; }},
      {"muond_group_momentum_norm", "Muon and Dion2: norm of the momentum Newton-Schulz received in the last step.",
       [](const Latest& l) { return l.momentum_norm; }},
      {"muond_group_orthogonality_residual",
       "Muon and Dion2: ||G^2 - G||_F / ||G||_F (G = X X^T) of the Newton-Schulz output measured in the last step.",
       [](const Latest& l) { return l.residual; }},
      {"muond_group_stale_parameters", "Parameters of the group without a gradient for warn_stale_steps steps or more.",
       [](const Latest& l) { return std::optional<double>(static_cast<double>(l.stale_parameters)); }},
  };
  for (const Gauge& gauge : gauges) {
    Family(out, gauge.name, "gauge", gauge.help);
    for (const auto& [session, open] : sessions_) {
      for (const Latest& l : open.groups) {
        const std::optional<double> value = gauge.value(l);
        if (value.has_value())
          Sample(out, gauge.name, Label("session", session) + "," + Label("group", l.group), *value);
      }
    }
  }
  static constexpr std::string_view kHelocoCases[] = {"kept", "reoriented", "shrunk"};
  Family(out, "muond_group_heloco_parameters", "gauge",
         "SGD with heloco: parameters whose gradient HeLoCo kept, reoriented or shrunk in the last step.");
  for (const auto& [session, open] : sessions_) {
    for (const Latest& l : open.groups) {
      if (!l.heloco.has_value()) continue;
      for (size_t c = 0; c < 3; ++c) {
        Sample(out, "muond_group_heloco_parameters",
               Label("session", session) + "," + Label("group", l.group) + "," + Label("case", kHelocoCases[c]),
               static_cast<double>((*l.heloco)[c]));
      }
    }
  }
  Family(out, "muond_health_warnings_total", "counter",
         "Health warnings raised, by kind (docs/operations.md, Warnings).");
  for (size_t k = 0; k < kWarningKinds.size(); ++k) {
    Sample(out, "muond_health_warnings_total", Label("kind", kWarningKinds[k]), static_cast<double>(warnings_[k]));
  }
}

}  // namespace muond::metrics
