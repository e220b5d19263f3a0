// What `muondctl top` shows of a daemon at one refresh: a header, then per session its step, steps
// per second, ranks present, transport and state size, and per group the gradient norm, clip
// coefficient, update RMS and ratio, orthogonality residual and this step's warnings, with
// sparklines of the gradient norm and update RMS over the group's last 60 applied steps.
// Stateless functions: top_command.h polls the daemon and keeps what the rates need.
#pragma once

#include <string>
#include <vector>

#include "muond/v1/muond.pb.h"

namespace muond::ctl {

// Ranks whose last step arrived within this many seconds count as present.
inline constexpr double kRankPresentSeconds = 60;

struct TopSession {
  v1::SessionSummary summary;
  double steps_per_second = 0;  // over the last refresh; 0 at the first
};

struct TopFrame {
  std::string endpoint;
  std::string clock;  // "HH:MM:SS", local time
  std::vector<TopSession> sessions;
  bool interactive = false;  // on a terminal: says how to quit
};

// `values` (NaN: not measured, a gap) as block characters scaled between their smallest and
// largest: one per value, or, with more values than `width`, one per column, each the mean of its
// share of them.
std::string Sparkline(const std::vector<double>& values, size_t width);

// The frame's lines, each cut to `width` columns (display columns: a sparkline's block is one).
std::vector<std::string> RenderTop(const TopFrame& frame, size_t width);

}  // namespace muond::ctl
