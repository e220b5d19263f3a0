#include "server/metrics/prometheus_metrics.h"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <optional>
#include <sstream>

#include "absl/time/clock.h"
#include "server/metrics/exposition.h"

namespace muond::metrics {
namespace {

// Upper bounds, seconds. Steps and their phases span a small tensor over shared memory (well under a
// millisecond) to a large model over the network (tens of seconds).
const std::vector<double> kStepBounds = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                         0.1,    0.25,    0.5,    1,     2.5,    5,     10,   30,    60};
// Calls include long streams (uploads, state transfers) and multi-rank waits.
const std::vector<double> kCallBounds = {0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300};
// fsyncs and checkpoint writes: a page-cache write to a large state on a slow disk.
const std::vector<double> kDiskBounds = {0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                         0.1,    0.25,   0.5,   1,      2.5,   5,    10,    30};

double Seconds(absl::Duration d) { return absl::FDivDuration(d, absl::Seconds(1)); }

double Now() { return Seconds(absl::Now() - absl::UnixEpoch()); }

}  // namespace

void Histogram::Observe(double value) {
  size_t bucket = 0;
  while (bucket < bounds_->size() && value > (*bounds_)[bucket]) ++bucket;
  ++counts_[bucket];
  sum_ += value;
  ++count_;
}

void Histogram::Render(const std::string& name, const std::string& labels, std::string* out) const {
  const std::string prefix = labels.empty() ? "" : labels + ",";
  uint64_t cumulative = 0;
  for (size_t i = 0; i <= bounds_->size(); ++i) {
    cumulative += counts_[i];
    const double bound = i < bounds_->size() ? (*bounds_)[i] : INFINITY;
    Sample(out, name + "_bucket", prefix + Label("le", Number(bound)), static_cast<double>(cumulative));
  }
  Sample(out, name + "_sum", labels, sum_);
  Sample(out, name + "_count", labels, static_cast<double>(count_));
}

PrometheusMetrics::TransportFigures::TransportFigures() : total(&kStepBounds) {
  for (size_t i = 0; i < kPhases.size(); ++i) phases.emplace_back(&kStepBounds);
}

PrometheusMetrics::MethodFigures::MethodFigures() : latency(&kCallBounds) {}

PrometheusMetrics::PrometheusMetrics(PrometheusOptions options)
    : options_(std::move(options)), start_time_seconds_(Now()) {}

PrometheusMetrics::DiskWrites::DiskWrites() : latency(&kDiskBounds) {}

void PrometheusMetrics::DiskWrites::Record(absl::Duration took, bool ok) {
  if (ok) {
    latency.Observe(Seconds(took));
  } else {
    ++failures;
  }
}

size_t PrometheusMetrics::TransportIndex(std::string_view transport) {
  for (size_t i = 0; i < kTransports.size(); ++i) {
    if (kTransports[i] == transport) return i;
  }
  return 0;  // an unknown name counts as gRPC: the set stays bounded
}

void PrometheusMetrics::CallStarted(std::string_view method) {
  absl::MutexLock lock(&mu_);
  auto it = recorded_.methods.find(method);
  if (it == recorded_.methods.end()) it = recorded_.methods.emplace(std::string(method), MethodFigures()).first;
  ++it->second.in_flight;
}

void PrometheusMetrics::CallEnded(std::string_view method, absl::StatusCode code, absl::Duration latency) {
  absl::MutexLock lock(&mu_);
  auto it = recorded_.methods.find(method);
  if (it == recorded_.methods.end()) it = recorded_.methods.emplace(std::string(method), MethodFigures()).first;
  --it->second.in_flight;
  ++it->second.ended[code];
  it->second.latency.Observe(Seconds(latency));
}

void PrometheusMetrics::StepAnswered(const StepReport& report) {
  absl::MutexLock lock(&mu_);
  TransportFigures& figures = recorded_.transports[TransportIndex(report.transport)];
  const size_t outcome = report.prepared ? 3 : report.replayed ? 2 : report.applied ? 0 : 1;
  ++figures.steps[outcome];
  figures.phases[0].Observe(report.receive_seconds);
  figures.phases[1].Observe(report.compute_seconds);
  figures.phases[2].Observe(report.send_seconds);
  figures.total.Observe(report.receive_seconds + report.compute_seconds + report.send_seconds);
  figures.bytes_received += static_cast<uint64_t>(report.bytes_received);
  figures.bytes_sent += static_cast<uint64_t>(report.bytes_sent);
  recorded_.groups.Record(report);
}

void PrometheusMetrics::SessionOpened(std::string_view session, uint64_t serial,
                                      const std::vector<GroupFigures>& last_groups) {
  absl::MutexLock lock(&mu_);
  recorded_.groups.Open(session, serial, last_groups);
}

void PrometheusMetrics::SessionClosed(std::string_view session) {
  absl::MutexLock lock(&mu_);
  recorded_.groups.Drop(session);
}

void PrometheusMetrics::SessionsHeld(int sessions, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  recorded_.sessions = sessions;
  recorded_.state_bytes = bytes;
}

void PrometheusMetrics::JournalAppended(absl::Duration latency, bool ok) {
  absl::MutexLock lock(&mu_);
  recorded_.journal.Record(latency, ok);
}

void PrometheusMetrics::JournalRecordWithdrawn(bool ok) {
  absl::MutexLock lock(&mu_);
  ++(ok ? recorded_.journal_withdrawals : recorded_.journal_withdrawal_failures);
}

void PrometheusMetrics::CheckpointWritten(absl::Duration latency, bool ok) {
  absl::MutexLock lock(&mu_);
  recorded_.checkpoint.Record(latency, ok);
}

void PrometheusMetrics::SessionQuarantined() {
  absl::MutexLock lock(&mu_);
  ++recorded_.quarantined_sessions;
}

std::string PrometheusMetrics::Render() const {
  // Readings that take other locks (the CUDA pool's) or read files are made before taking ours, so a
  // scrape never holds up the handlers' reports.
  std::optional<std::pair<int64_t, int64_t>> backend_memory;
  if (options_.backend_memory) backend_memory = options_.backend_memory();
  std::optional<std::pair<int64_t, int64_t>> ns_workspace;
  if (options_.ns_workspace) ns_workspace = options_.ns_workspace();
  std::string process;
  RenderProcess(&process);
  std::string out;
  Family(&out, "muond_build_info", "gauge", "Always 1; the daemon's version and compute backend as labels.");
  Sample(&out, "muond_build_info", Label("version", options_.version) + "," + Label("backend", options_.backend), 1);

  const Recorded r = [this] {
    absl::MutexLock lock(&mu_);
    return recorded_;
  }();
  Family(&out, "muond_steps_total", "counter",
         "Steps answered, by outcome (applied, skipped for a non-finite gradient or the fp32 guard, replayed "
         "for a retry, prepared for the first phase of a sharded step) and transport.");
  for (size_t t = 0; t < kTransports.size(); ++t) {
    for (size_t o = 0; o < kOutcomes.size(); ++o) {
      Sample(&out, "muond_steps_total", Label("outcome", kOutcomes[o]) + "," + Label("transport", kTransports[t]),
             static_cast<double>(r.transports[t].steps[o]));
    }
  }
  Family(&out, "muond_step_duration_seconds", "histogram",
         "Time of an answered step from its first gradient to its last answer byte, by transport.");
  for (size_t t = 0; t < kTransports.size(); ++t) {
    r.transports[t].total.Render("muond_step_duration_seconds", Label("transport", kTransports[t]), &out);
  }
  Family(&out, "muond_step_phase_duration_seconds", "histogram",
         "Time of each phase of an answered step, by transport: receive (reading the gradients), compute (from "
         "the last gradient to the answer being ready: rank gathering, journal, optimizer), send (the answer).");
  for (size_t t = 0; t < kTransports.size(); ++t) {
    for (size_t p = 0; p < kPhases.size(); ++p) {
      r.transports[t].phases[p].Render("muond_step_phase_duration_seconds",
                                       Label("phase", kPhases[p]) + "," + Label("transport", kTransports[t]), &out);
    }
  }
  Family(&out, "muond_step_received_bytes_total", "counter",
         "Bytes of gradients (payload and framing) taken in by answered steps, by transport.");
  for (size_t t = 0; t < kTransports.size(); ++t) {
    Sample(&out, "muond_step_received_bytes_total", Label("transport", kTransports[t]),
           static_cast<double>(r.transports[t].bytes_received));
  }
  Family(&out, "muond_step_sent_bytes_total", "counter",
         "Bytes of answers (payload and framing) sent by answered steps, by transport.");
  for (size_t t = 0; t < kTransports.size(); ++t) {
    Sample(&out, "muond_step_sent_bytes_total", Label("transport", kTransports[t]),
           static_cast<double>(r.transports[t].bytes_sent));
  }

  Family(&out, "muond_calls_total", "counter", "RPCs ended, by method and gRPC status code.");
  for (const auto& [method, figures] : r.methods) {
    for (const auto& [code, count] : figures.ended) {
      Sample(&out, "muond_calls_total", Label("method", method) + "," + Label("code", absl::StatusCodeToString(code)),
             static_cast<double>(count));
    }
  }
  Family(&out, "muond_calls_in_flight", "gauge", "RPCs running now, by method.");
  for (const auto& [method, figures] : r.methods) {
    Sample(&out, "muond_calls_in_flight", Label("method", method), static_cast<double>(figures.in_flight));
  }
  Family(&out, "muond_call_duration_seconds", "histogram", "Time of ended RPCs, by method.");
  for (const auto& [method, figures] : r.methods) {
    figures.latency.Render("muond_call_duration_seconds", Label("method", method), &out);
  }

  Family(&out, "muond_sessions", "gauge", "Sessions held.");
  Sample(&out, "muond_sessions", "", r.sessions);
  Family(&out, "muond_sessions_limit", "gauge", "Most sessions held at once (--max-sessions).");
  Sample(&out, "muond_sessions_limit", "", options_.max_sessions);
  Family(&out, "muond_state_bytes", "gauge",
         "Optimizer memory the held sessions are estimated to take (masters, gradients, slots), as the quotas "
         "count it.");
  Sample(&out, "muond_state_bytes", "", static_cast<double>(r.state_bytes));
  if (options_.max_session_bytes > 0 || options_.max_total_bytes > 0) {
    Family(&out, "muond_state_bytes_limit", "gauge",
           "Memory quotas: per session (--max-session-bytes) and for all sessions (--max-total-bytes).");
    if (options_.max_session_bytes > 0) {
      Sample(&out, "muond_state_bytes_limit", Label("scope", "session"),
             static_cast<double>(options_.max_session_bytes));
    }
    if (options_.max_total_bytes > 0) {
      Sample(&out, "muond_state_bytes_limit", Label("scope", "total"), static_cast<double>(options_.max_total_bytes));
    }
  }

  Family(&out, "muond_journal_append_duration_seconds", "histogram",
         "Time to append a step to a session's journal and fsync it (journal durability).");
  r.journal.latency.Render("muond_journal_append_duration_seconds", "", &out);
  Family(&out, "muond_journal_append_failures_total", "counter", "Journal appends that failed (the step was refused).");
  Sample(&out, "muond_journal_append_failures_total", "", static_cast<double>(r.journal.failures));
  Family(&out, "muond_journal_withdrawals_total", "counter",
         "Journal records withdrawn: their steps failed before they changed the state (the step was refused).");
  Sample(&out, "muond_journal_withdrawals_total", "", static_cast<double>(r.journal_withdrawals));
  Family(&out, "muond_journal_withdrawal_failures_total", "counter",
         "Journal records that could not be withdrawn (the session was broken).");
  Sample(&out, "muond_journal_withdrawal_failures_total", "", static_cast<double>(r.journal_withdrawal_failures));
  Family(&out, "muond_checkpoint_duration_seconds", "histogram",
         "Time to write a session's checkpoint (files written, fsynced and renamed into place).");
  r.checkpoint.latency.Render("muond_checkpoint_duration_seconds", "", &out);
  Family(&out, "muond_checkpoint_failures_total", "counter", "Checkpoints that could not be written.");
  Sample(&out, "muond_checkpoint_failures_total", "", static_cast<double>(r.checkpoint.failures));
  Family(&out, "muond_quarantined_sessions_total", "counter",
         "Session folders that could not be restored at start-up and were moved into the quarantine.");
  Sample(&out, "muond_quarantined_sessions_total", "", static_cast<double>(r.quarantined_sessions));

  r.groups.Render(&out);

  if (backend_memory.has_value()) {
    const auto [in_use, reserved] = *backend_memory;
    Family(&out, "muond_backend_memory_bytes", "gauge",
           "Memory of the compute backend's buffers: in use, and reserved (in use plus cached for reuse).");
    Sample(&out, "muond_backend_memory_bytes", Label("state", "in_use"), static_cast<double>(in_use));
    Sample(&out, "muond_backend_memory_bytes", Label("state", "reserved"), static_cast<double>(reserved));
  }
  if (ns_workspace.has_value()) {
    const auto [held, limit] = *ns_workspace;
    Family(&out, "muond_newton_schulz_workspace_bytes", "gauge",
           "Newton-Schulz's scratch (part of the backend's memory, shared by every session): held, and its bound "
           "(--ns-workspace-bytes; left out when unbounded).");
    Sample(&out, "muond_newton_schulz_workspace_bytes", Label("state", "held"), static_cast<double>(held));
    if (limit > 0)
      Sample(&out, "muond_newton_schulz_workspace_bytes", Label("state", "limit"), static_cast<double>(limit));
  }
  out += process;
  return out;
}

// The standard process_* families every Prometheus client library exports, from /proc.
void PrometheusMetrics::RenderProcess(std::string* out) const {
  std::ifstream stat_file("/proc/self/stat");
  std::string stat((std::istreambuf_iterator<char>(stat_file)), std::istreambuf_iterator<char>());
  // Fields after the command name, which is in parentheses and may hold spaces.
  const size_t close = stat.rfind(')');
  if (close != std::string::npos) {
    std::istringstream fields(stat.substr(close + 2));
    std::vector<std::string> f((std::istream_iterator<std::string>(fields)), std::istream_iterator<std::string>());
    // f[0] is field 3 (state): utime is field 14, stime 15, vsize 23, rss 24.
    if (f.size() > 21) {
      const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
      Family(out, "process_cpu_seconds_total", "counter", "Total user and system CPU time spent in seconds.");
      Sample(out, "process_cpu_seconds_total", "", (std::stod(f[11]) + std::stod(f[12])) / ticks);
      Family(out, "process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.");
      Sample(out, "process_virtual_memory_bytes", "", std::stod(f[20]));
      Family(out, "process_resident_memory_bytes", "gauge", "Resident memory size in bytes.");
      Sample(out, "process_resident_memory_bytes", "", std::stod(f[21]) * static_cast<double>(sysconf(_SC_PAGESIZE)));
    }
  }
  int open_fds = 0;
  if (DIR* dir = opendir("/proc/self/fd")) {
    while (const dirent* entry = readdir(dir)) open_fds += entry->d_name[0] != '.';
    closedir(dir);
    --open_fds;  // the directory's own descriptor
  }
  Family(out, "process_open_fds", "gauge", "Number of open file descriptors.");
  Sample(out, "process_open_fds", "", open_fds);
  rlimit limit = {};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0) {
    Family(out, "process_max_fds", "gauge", "Maximum number of open file descriptors.");
    Sample(out, "process_max_fds", "", static_cast<double>(limit.rlim_cur));
  }
  Family(out, "process_start_time_seconds", "gauge", "Start time of the process since unix epoch in seconds.");
  Sample(out, "process_start_time_seconds", "", start_time_seconds_);
}

}  // namespace muond::metrics
