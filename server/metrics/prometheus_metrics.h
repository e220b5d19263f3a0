// PrometheusMetrics: the Metrics a daemon started with --metrics-listen records into, rendered in
// Prometheus's text exposition format (version 0.0.4) by Render(), which the metrics endpoint
// (metrics_endpoint.h) serves on every scrape.
//
// Names follow Prometheus's rules: the `muond_` prefix, base units (seconds, bytes), counters ending
// in `_total`, and only bounded label sets — method (the service's RPCs), code (gRPC's 17 codes),
// transport (grpc, shm), phase (receive, compute, send), outcome (applied, skipped, replayed,
// prepared); per session only the group telemetry (group_series.h: at most 16 groups of each session
// held). docs/operations.md lists every family with its meaning.
//
// Thread-safe: every report and Render() take one mutex; reports are a few additions each, and
// Render() holds it only to copy the figures. Gauges that
// are read rather than reported (backend memory, the process's own figures) are sampled at render.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/metrics/group_series.h"
#include "server/metrics/metrics.h"

namespace muond::metrics {

// A cumulative histogram with fixed upper bounds (seconds), as Prometheus exposes it.
class Histogram {
 public:
  explicit Histogram(const std::vector<double>* bounds) : bounds_(bounds), counts_(bounds->size() + 1, 0) {}
  void Observe(double value);
  // Appends `name`_bucket{labels,le=...}, `name`_sum and `name`_count lines; `labels` is either empty
  // or `key="value",...` without braces.
  void Render(const std::string& name, const std::string& labels, std::string* out) const;

 private:
  const std::vector<double>* bounds_;  // not owned; static
  std::vector<uint64_t> counts_;       // per bucket, not cumulative; the last is +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

struct PrometheusOptions {
  std::string version;            // the daemon's version, for muond_build_info
  std::string backend;            // "cpu" | "cuda", for muond_build_info
  int max_sessions = 0;           // --max-sessions
  int64_t max_session_bytes = 0;  // --max-session-bytes; 0: none (the limit gauge is left out)
  int64_t max_total_bytes = 0;    // --max-total-bytes; 0: none
  // Samples the backend's memory at render time; may be empty.
  std::function<std::pair<int64_t, int64_t>()> backend_memory;  // (in use, reserved) bytes
  // Samples Newton–Schulz's workspace (part of the backend's memory) at render time; may be empty.
  std::function<std::pair<int64_t, int64_t>()> ns_workspace;  // (held, --ns-workspace-bytes; 0: none) bytes
};

class PrometheusMetrics final : public Metrics {
 public:
  explicit PrometheusMetrics(PrometheusOptions options);

  void CallStarted(std::string_view method) override;
  void CallEnded(std::string_view method, absl::StatusCode code, absl::Duration latency) override;
  void StepAnswered(const StepReport& report) override;
  void SessionsHeld(int sessions, int64_t bytes) override;
  void JournalAppended(absl::Duration latency, bool ok) override;
  void JournalRecordWithdrawn(bool ok) override;
  void CheckpointWritten(absl::Duration latency, bool ok) override;
  void SessionQuarantined() override;
  void SessionOpened(std::string_view session, uint64_t serial, const std::vector<GroupFigures>& last_groups) override;
  void SessionClosed(std::string_view session) override;

  // Every family in the text exposition format, ending with a newline.
  std::string Render() const;

 private:
  // Every step transport's name (GradientSource::transport()), so each has its own series; the
  // GPU transports' stay at 0 on a daemon without them.
  static constexpr std::array<std::string_view, 4> kTransports = {"grpc", "shm", "cuda_ipc", "nccl"};
  static constexpr std::array<std::string_view, 4> kOutcomes = {"applied", "skipped", "replayed", "prepared"};
  static constexpr std::array<std::string_view, 3> kPhases = {"receive", "compute", "send"};

  // Per transport: steps by outcome, each phase's and the whole step's latency, bytes each way.
  struct TransportFigures {
    std::array<uint64_t, kOutcomes.size()> steps = {};
    std::vector<Histogram> phases;  // by kPhases
    Histogram total;
    uint64_t bytes_received = 0;
    uint64_t bytes_sent = 0;
    TransportFigures();
  };
  struct MethodFigures {
    int64_t in_flight = 0;
    std::map<absl::StatusCode, uint64_t> ended;  // by code
    Histogram latency;
    MethodFigures();
  };

  // A kind of durable write: the latency of those that succeeded, the count of those that failed.
  struct DiskWrites {
    Histogram latency;
    uint64_t failures = 0;
    DiskWrites();
    void Record(absl::Duration took, bool ok);
  };

  static size_t TransportIndex(std::string_view transport);
  void RenderProcess(std::string* out) const;

  const PrometheusOptions options_;
  const double start_time_seconds_;  // since the Unix epoch
  // Everything the reports record; Render() copies it under the mutex and formats the copy after,
  // so that a scrape of many sessions' series holds up the steps' reports for a copy only.
  struct Recorded {
    std::array<TransportFigures, kTransports.size()> transports;
    std::map<std::string, MethodFigures, std::less<>> methods;
    int sessions = 0;
    int64_t state_bytes = 0;
    DiskWrites journal;
    DiskWrites checkpoint;
    uint64_t journal_withdrawals = 0;          // records withdrawn
    uint64_t journal_withdrawal_failures = 0;  // withdrawals that failed
    uint64_t quarantined_sessions = 0;
    GroupSeries groups;
  };
  mutable absl::Mutex mu_;
  Recorded recorded_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muond::metrics
