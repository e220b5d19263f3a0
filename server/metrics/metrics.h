// Metrics: what the daemon reports about itself while it serves — every call (method, status code,
// latency), every step (its phases, bytes, applied or skipped, the transport it came by), the
// sessions it holds, and the durable writes (journal appends, checkpoints).
//
// An interface, so the layers that measure (rpc handlers, the step pipeline, the registry, the
// state directory) do not depend on an exporter. The default, NoMetrics(), records nothing; the
// Prometheus exporter (prometheus_metrics.h) is the one a daemon started with --metrics-listen uses.
// Implementations must be thread-safe: every handler thread reports concurrently. The daemon owns its
// Metrics object and keeps it alive until every call has ended.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace muond::metrics {

// One group's figures after an applied step (docs/algorithms.md, Telemetry); unset: not measured.
struct GroupFigures {
  std::string_view group;
  double grad_norm = 0;
  double clip_coefficient = 1;
  std::optional<double> update_rms, update_ratio, momentum_norm, residual;
  int64_t stale_parameters = 0;
  // SGD with heloco: its parameters whose gradient was kept, reoriented, shrunk (in that order).
  std::optional<std::array<int64_t, 3>> heloco;
};

// One answered step of a session, as it went through the transport seam.
struct StepReport {
  std::string_view transport = "grpc";  // "grpc", "shm", "cuda_ipc", "nccl": how the step travelled
  bool applied = true;                  // false: skipped (a non-finite gradient, the fp32 guard)
  bool replayed = false;                // a retry answered from the last result; nothing was computed
  bool prepared = false;                // the first phase of a sharded step: nothing was applied
  double receive_seconds = 0;           // reading the gradients
  double compute_seconds = 0;           // the optimizer's time, under the session's lock
  double send_seconds = 0;              // sending the result and the parameters
  int64_t bytes_received = 0;           // gradient payload and framing taken in
  int64_t bytes_sent = 0;               // answer payload and framing sent out
  double grad_norm = 0;
  int64_t elements = 0;  // parameters of the session
  int world_size = 1;
  std::string_view session;
  uint64_t session_serial = 0;  // Session::serial: which session of that id
  // An applied step's groups (spec order) and the kinds of health warning it raised
  // (docs/operations.md, Warnings); empty otherwise.
  std::vector<GroupFigures> groups;
  std::vector<std::string_view> warnings;
};

class Metrics {
 public:
  virtual ~Metrics() = default;

  // A call to `method` (the RPC's name) ended with `code` after `latency`.
  virtual void CallEnded(std::string_view method, absl::StatusCode code, absl::Duration latency) = 0;
  // A call to `method` started; calls in flight are started minus ended.
  virtual void CallStarted(std::string_view method) = 0;
  // A step was answered.
  virtual void StepAnswered(const StepReport& report) = 0;
  // The registry changed: it now holds `sessions` sessions estimated at `bytes` of backend memory.
  virtual void SessionsHeld(int sessions, int64_t bytes) = 0;
  // A step was appended to a session's journal and fsynced (ok), or the append failed.
  virtual void JournalAppended(absl::Duration latency, bool ok) = 0;
  // A session's checkpoint was written (ok), or writing it failed.
  virtual void CheckpointWritten(absl::Duration latency, bool ok) = 0;
  // A journaled step failed before it changed the state and its record was withdrawn (ok), or the
  // withdrawal failed (the session is broken). Not pure: most implementations have nothing to do.
  virtual void JournalRecordWithdrawn(bool ok) {}
  // At start-up, a session folder that could not be restored was moved into the state directory's
  // quarantine. Not pure: most implementations have nothing to do with it.
  virtual void SessionQuarantined() {}
  // A session was created or restored (`serial`: Session::serial): steps of it may report about it
  // from now on. `last_groups`: the figures of its last applied step where a restore replayed it from
  // the journal (shown until its next step), empty otherwise. Not pure either.
  virtual void SessionOpened(std::string_view session, uint64_t serial, const std::vector<GroupFigures>& last_groups) {}
  // A session was closed: what was reported about it alone goes, and a step answered after this (a
  // call that held the session) adds nothing about it. Not pure either.
  virtual void SessionClosed(std::string_view session) {}
};

// Records nothing; never null, lives for the whole process.
Metrics* NoMetrics();

}  // namespace muond::metrics
