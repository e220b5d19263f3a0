#include "tools/muondctl/top_view.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "tools/muondctl/ctl_output.h"

namespace muond::ctl {
namespace {

// U+2581..U+2588, lowest to highest.
constexpr const char* kBlocks[] = {"▁", "▂", "▃", "▄", "▅", "▆", "▇", "█"};

// Columns `line` takes on a terminal: UTF-8 continuation bytes take none.
size_t Columns(const std::string& line) {
  size_t columns = 0;
  for (unsigned char c : line) columns += (c & 0xC0) != 0x80;
  return columns;
}

// `line` cut to `width` columns, never inside a UTF-8 sequence.
std::string Cut(const std::string& line, size_t width) {
  if (Columns(line) <= width) return line;
  size_t columns = 0, i = 0;
  for (; i < line.size(); ++i) {
    if ((static_cast<unsigned char>(line[i]) & 0xC0) != 0x80) {
      if (columns == width) break;
      ++columns;
    }
  }
  return line.substr(0, i);
}

int RanksPresent(const v1::SessionSummary& s) {
  int present = 0;
  for (double idle : s.rank_idle_seconds()) present += idle >= 0 && idle < kRankPresentSeconds;
  return present;
}

}  // namespace

std::string Sparkline(const std::vector<double>& values, size_t width) {
  // More values than columns: each column is the mean of the finite values of its share, in order.
  const size_t columns = std::min(values.size(), width);
  std::vector<double> points(columns, std::nan(""));
  for (size_t c = 0; c < columns; ++c) {
    const size_t begin = c * values.size() / columns, end = (c + 1) * values.size() / columns;
    double sum = 0;
    int finite = 0;
    for (size_t i = begin; i < end; ++i) {
      if (std::isfinite(values[i])) {
        sum += values[i];
        ++finite;
      }
    }
    if (finite > 0) points[c] = sum / finite;
  }
  double lo = INFINITY, hi = -INFINITY;
  for (double p : points) {
    if (!std::isfinite(p)) continue;
    lo = std::min(lo, p);
    hi = std::max(hi, p);
  }
  std::string line;
  for (double p : points) {
    if (!std::isfinite(p)) {
      line += ' ';
      continue;
    }
    const double at = hi > lo ? (p - lo) / (hi - lo) : 0.5;
    line += kBlocks[std::clamp(static_cast<int>(at * 7 + 0.5), 0, 7)];
  }
  return line;
}

std::vector<std::string> RenderTop(const TopFrame& frame, size_t width) {
  std::vector<std::string> lines;
  lines.push_back(absl::StrCat("muond ", frame.endpoint, " - ", frame.sessions.size(),
                               frame.sessions.size() == 1 ? " session" : " sessions", " - ", frame.clock,
                               frame.interactive ? "   (q quits)" : ""));
  if (frame.sessions.empty()) lines.push_back("no sessions");
  for (const TopSession& session : frame.sessions) {
    const v1::SessionSummary& s = session.summary;
    lines.push_back("");
    lines.push_back(
        absl::StrFormat("%-28s %10s %8s %7s %-9s %10s", "SESSION", "STEP", "STEPS/S", "RANKS", "TRANSPORT", "STATE"));
    lines.push_back(absl::StrFormat(
        "%-28s %10d %8.2f %7s %-9s %10s%s", s.session_id(), s.last_step(), session.steps_per_second,
        absl::StrCat(RanksPresent(s), "/", s.world_size()), s.last_transport().empty() ? "-" : s.last_transport(),
        HumanBytes(static_cast<double>(s.state_bytes())), s.initialized() ? "" : "  (awaiting parameters)"));
    if (s.group_telemetry_size() == 0) {
      lines.push_back("  no step applied since the daemon loaded the session");
      continue;
    }
    std::map<std::string, const v1::GroupClip*> clips;
    for (const v1::GroupClip& clip : s.group_clips()) clips[clip.group()] = &clip;
    std::map<std::string, const v1::GroupHistory*> history;
    for (const v1::GroupHistory& h : s.group_history()) history[h.group()] = &h;
    lines.push_back(absl::StrFormat("  %-16s %10s %7s %10s %9s %8s  %-20s %-22s %s", "GROUP", "GRAD NORM", "CLIP",
                                    "UPDATE RMS", "RATIO", "RESIDUAL", "WARNINGS", "grad norm (60 steps)",
                                    "update rms (60 steps)"));
    for (const v1::GroupTelemetry& t : s.group_telemetry()) {
      const v1::GroupClip* clip = clips.count(t.group()) ? clips[t.group()] : nullptr;
      const v1::GroupHistory* h = history.count(t.group()) ? history[t.group()] : nullptr;
      const std::vector<double> norms =
          h ? std::vector<double>(h->grad_norm().begin(), h->grad_norm().end()) : std::vector<double>();
      const std::vector<double> rms =
          h ? std::vector<double>(h->update_rms().begin(), h->update_rms().end()) : std::vector<double>();
      const std::string warnings = t.warnings().empty() ? "-" : absl::StrJoin(t.warnings(), ",");
      std::string norm_line = Sparkline(norms, 20);
      norm_line += std::string(20 - std::min<size_t>(20, Columns(norm_line)), ' ');
      lines.push_back(
          absl::StrFormat("  %-16s %10s %7s %10s %9s %8s  %-20s %s  %s", t.group(),
                          OptionalFigure(clip != nullptr, clip ? clip->grad_norm() : 0, "%.3g"),
                          OptionalFigure(clip != nullptr, clip ? clip->coefficient() : 0, "%.3f"),
                          OptionalFigure(t.has_update_rms(), t.update_rms(), "%.3g"),
                          OptionalFigure(t.has_update_ratio(), t.update_ratio(), "%.3g"),
                          OptionalFigure(t.has_orthogonality_residual(), t.orthogonality_residual(), "%.2f"), warnings,
                          norm_line, Sparkline(rms, 20)));
    }
  }
  for (std::string& line : lines) line = Cut(line, width);
  return lines;
}

}  // namespace muond::ctl
