#include "server/metrics/metrics.h"

namespace muond::metrics {
namespace {

class NoopMetrics final : public Metrics {
 public:
  void CallEnded(std::string_view, absl::StatusCode, absl::Duration) override {}
  void CallStarted(std::string_view) override {}
  void StepAnswered(const StepReport&) override {}
  void SessionsHeld(int, int64_t) override {}
  void JournalAppended(absl::Duration, bool) override {}
  void CheckpointWritten(absl::Duration, bool) override {}
};

}  // namespace

Metrics* NoMetrics() {
  static NoopMetrics* const metrics = new NoopMetrics();
  return metrics;
}

}  // namespace muond::metrics
