// GroupSeries: the per-group telemetry families of the Prometheus exporter (muond_group_*) and the
// health warnings counter (muond_health_warnings_total{kind}); docs/operations.md lists them.
//
// Label cardinality is bounded: a group's series carry session and group labels, for at most
// kMaxGroupsPerSession groups of a session (the first in spec order) and the sessions the daemon
// holds (--max-sessions): a step reports only about a session opened and not closed since, so a
// closed session's series go and a step answered after its close brings none back. Warning kinds are
// a fixed set.
//
// Not thread-safe: PrometheusMetrics calls it under its own mutex.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "server/metrics/metrics.h"

namespace muond::metrics {

class GroupSeries {
 public:
  static constexpr size_t kMaxGroupsPerSession = 16;
  static constexpr std::array<std::string_view, 4> kWarningKinds = {"clip_stall", "momentum_below_eps",
                                                                    "parameter_stale", "residual_high"};

  // A session opened, with its last step's figures where a restore has them (Metrics::SessionOpened).
  void Open(std::string_view session, uint64_t serial, const std::vector<GroupFigures>& last_groups);
  void Record(const StepReport& report);
  void Drop(std::string_view session);
  void Render(std::string* out) const;

 private:
  struct Latest {
    std::string group;
    double grad_norm = 0, clip_coefficient = 1;
    std::optional<double> update_rms, update_ratio, momentum_norm, residual;
    int64_t stale_parameters = 0;
    std::optional<std::array<int64_t, 3>> heloco;
  };
  static std::vector<Latest> LatestOf(const std::vector<GroupFigures>& groups);

  struct OpenSession {
    uint64_t serial = 0;  // Session::serial: a step of a closed session of the same id is not its
    std::vector<Latest> groups;
  };
  // By session id, every open session (no series until its first step, or a restore's replayed one).
  std::map<std::string, OpenSession, std::less<>> sessions_;
  std::array<uint64_t, kWarningKinds.size()> warnings_ = {};
};

}  // namespace muond::metrics
