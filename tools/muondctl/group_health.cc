#include "tools/muondctl/group_health.h"

#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "tools/muondctl/ctl_output.h"

namespace muond::ctl {
namespace {

using nlohmann::ordered_json;

struct Row {
  std::string group;
  std::optional<v1::GroupClip> clip;
  v1::GroupTelemetry telemetry;
};

std::vector<Row> Rows(const v1::SessionSummary& s) {
  std::map<std::string, v1::GroupClip> clips;
  for (const v1::GroupClip& clip : s.group_clips()) clips[clip.group()] = clip;
  std::vector<Row> rows;
  for (const v1::GroupTelemetry& t : s.group_telemetry()) {
    const auto it = clips.find(t.group());
    rows.push_back({t.group(), it == clips.end() ? std::nullopt : std::optional<v1::GroupClip>(it->second), t});
  }
  return rows;
}

ordered_json Value(bool has, double value) { return has ? ordered_json(value) : ordered_json(nullptr); }

}  // namespace

ordered_json GroupHealthJson(const v1::SessionSummary& s) {
  ordered_json groups = ordered_json::array();
  for (const Row& row : Rows(s)) {
    const v1::GroupTelemetry& t = row.telemetry;
    groups.push_back({{"group", row.group},
                      {"grad_norm", Value(row.clip.has_value(), row.clip ? row.clip->grad_norm() : 0)},
                      {"clip_coefficient", Value(row.clip.has_value(), row.clip ? row.clip->coefficient() : 0)},
                      {"update_rms", Value(t.has_update_rms(), t.update_rms())},
                      {"update_ratio", Value(t.has_update_ratio(), t.update_ratio())},
                      {"momentum_norm", Value(t.has_momentum_norm(), t.momentum_norm())},
                      {"smallest_momentum_norm", Value(t.has_smallest_momentum_norm(), t.smallest_momentum_norm())},
                      {"orthogonality_residual", Value(t.has_orthogonality_residual(), t.orthogonality_residual())},
                      {"residual_parameter", t.residual_parameter()},
                      {"stale_parameters", t.stale_parameters()},
                      {"warnings", std::vector<std::string>(t.warnings().begin(), t.warnings().end())},
                      {"heloco", t.has_heloco() ? ordered_json{{"kept", t.heloco().kept()},
                                                               {"reoriented", t.heloco().reoriented()},
                                                               {"shrunk", t.heloco().shrunk()}}
                                                : ordered_json(nullptr)}});
  }
  return {{"step", s.telemetry_step()}, {"groups", std::move(groups)}};
}

std::string GroupHealthText(const v1::SessionSummary& s) {
  if (s.telemetry_step() == 0) return "telemetry     none yet (no step applied since the daemon loaded the session)\n";
  std::string out = absl::StrCat("telemetry     of step ", s.telemetry_step(), "\n");
  absl::StrAppend(&out, absl::StrFormat("  %-16s %10s %10s %10s %10s %10s %10s %6s  %s\n", "GROUP", "GRAD_NORM", "CLIP",
                                        "UPD_RMS", "UPD_RATIO", "MOMENTUM", "RESIDUAL", "STALE", "WARNINGS"));
  for (const Row& row : Rows(s)) {
    const v1::GroupTelemetry& t = row.telemetry;
    absl::StrAppend(
        &out, absl::StrFormat("  %-16s %10s %10s %10s %10s %10s %10s %6d  %s\n", row.group,
                              OptionalFigure(row.clip.has_value(), row.clip ? row.clip->grad_norm() : 0),
                              OptionalFigure(row.clip.has_value(), row.clip ? row.clip->coefficient() : 0),
                              OptionalFigure(t.has_update_rms(), t.update_rms()),
                              OptionalFigure(t.has_update_ratio(), t.update_ratio()),
                              OptionalFigure(t.has_momentum_norm(), t.momentum_norm()),
                              OptionalFigure(t.has_orthogonality_residual(), t.orthogonality_residual()),
                              t.stale_parameters(), t.warnings().empty() ? "-" : absl::StrJoin(t.warnings(), ",")));
  }
  return out;
}

}  // namespace muond::ctl
