// Session::AggregateLocked: gathering one step from every rank of a multi-rank session (world size
// N > 1), averaging the gradients and applying the step once for all of them.
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "kernels/status_macros.h"
#include "server/logging.h"
#include "server/session.h"

namespace muond::server {
namespace {

// Per parameter, the mean over the ranks that sent it, summed in rank order in fp64.
std::vector<AssembledTensor> Average(
    const std::vector<std::optional<std::pair<v1::StepHeader, std::vector<AssembledTensor>>>>& ranks,
    size_t num_parameters) {
  std::vector<AssembledTensor> mean(num_parameters);
  for (size_t p = 0; p < num_parameters; ++p) {
    std::vector<double> sum;
    int count = 0;
    for (const auto& rank : ranks) {
      const AssembledTensor& g = rank->second[p];
      if (!g.present()) continue;
      if (sum.empty()) sum.assign(g.values.size(), 0.0);
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += g.values[i];
      ++count;
    }
    if (count == 0) continue;
    AssembledTensor& out = mean[p];
    out.values.resize(sum.size());
    for (size_t i = 0; i < sum.size(); ++i) {
      out.values[i] = static_cast<float>(sum[i] / count);
      out.sum_squares += static_cast<double>(out.values[i]) * out.values[i];
    }
    out.received = static_cast<int64_t>(sum.size());
  }
  return mean;
}

}  // namespace

absl::StatusOr<StepOutcome> Session::AggregateLocked(const v1::StepHeader& header,
                                                     std::vector<AssembledTensor> gradients) {
  const int64_t step = header.step();
  if (pending_.step != step) {
    pending_.step = step;
    pending_.arrived = 0;
    pending_.ranks.assign(config_.world_size, std::nullopt);
    ++pending_.generation;
  }
  auto& slot = pending_.ranks[header.rank()];
  if (!slot) ++pending_.arrived;
  slot.emplace(header, std::move(gradients));  // a rank resending while it waits replaces its part
  const uint64_t generation = pending_.generation;

  if (pending_.arrived == config_.world_size) {
    std::vector<AssembledTensor> mean = Average(pending_.ranks, config_.parameters.size());
    v1::StepHeader applied_header = pending_.ranks[0]->first;
    pending_ = PendingStep{0, generation + 1, 0, {}};
    return ApplyStepLocked(applied_header, std::move(mean));
  }

  MUOND_LOG(debug, "session {}: step {} has {} of {} ranks; rank {} waits up to {} s for the rest", id_, step,
            pending_.arrived, config_.world_size, header.rank(), config_.straggler_timeout_seconds);
  const int64_t last_step_before = last_step_;
  auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return last_step_ != last_step_before || pending_.generation != generation;
  };
  const bool finished = mu_.AwaitWithTimeout(absl::Condition(&done), absl::Seconds(config_.straggler_timeout_seconds));
  if (last_step_ >= step) return StepOutcome{last_result_, snapshot_};
  if (finished) {
    return absl::AbortedError(absl::StrCat("step ", step, " was aborted for every rank; no update was applied"));
  }
  // This rank timed out first: abort the step for everyone.
  std::vector<int> missing;
  for (int r = 0; r < config_.world_size; ++r) {
    if (!pending_.ranks[r]) missing.push_back(r);
  }
  MUOND_LOG(warn, "session {}: step {} aborted, ranks {} did not arrive within {} s", id_, step,
            absl::StrJoin(missing, ", "), config_.straggler_timeout_seconds);
  pending_ = PendingStep{0, generation + 1, 0, {}};
  return absl::AbortedError(absl::StrCat("step ", step, ": ranks ", absl::StrJoin(missing, ", "),
                                         " did not arrive within ", config_.straggler_timeout_seconds,
                                         " s (--straggler-timeout); no update was applied, send the step again"));
}

}  // namespace muond::server
