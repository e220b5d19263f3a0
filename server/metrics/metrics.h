// Metrics: what the daemon reports about itself while it serves — every call (method, status code,
// latency), every step (compute time, applied or skipped, gradient norm) and the sessions it holds.
//
// An interface, so the layers that measure (rpc handlers, the step pipeline, the registry) do not
// depend on an exporter. The default, NoMetrics(), records nothing. Implementations must be
// thread-safe: every handler thread reports concurrently. The daemon owns its Metrics object and
// keeps it alive until every call has ended.
#pragma once

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace muond::metrics {

// One applied or skipped step of a session.
struct StepReport {
  double compute_seconds = 0;  // the optimizer's time, under the session's lock
  bool applied = true;         // false: skipped for a non-finite gradient
  bool replayed = false;       // a retry answered from the last result; nothing was computed
  double grad_norm = 0;
  int64_t elements = 0;        // parameters of the session
  int world_size = 1;
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
};

// Records nothing; never null, lives for the whole process.
Metrics* NoMetrics();

}  // namespace muond::metrics
