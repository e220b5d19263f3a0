// RankGather: the step being gathered from the ranks of a multi-rank session (world size N > 1).
// Each rank's plan and gradients are kept until all N have arrived; then the gradients are averaged
// — per parameter, over the ranks that sent it, summed in rank order in fp64 so the result does not
// depend on arrival order — and the step is applied once with rank 0's plan. A rank that resends
// while it waits replaces its part.
//
// The generation changes whenever a gathering ends (applied or aborted), so waiting ranks can tell
// an abort from a spurious wake-up. Owned by its session and used under the session's lock; not
// thread-safe by itself.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "common/host_tensor.h"
#include "server/session/step_plan.h"

namespace muond::session {

class RankGather {
 public:
  explicit RankGather(int world_size) : world_size_(world_size) {}

  // Adds `rank`'s part of step plan.request.step (starting a new gathering when the step differs
  // from the one being gathered); returns the generation of the gathering it joined.
  uint64_t Add(StepPlan plan, std::vector<HostTensor> gradients);
  bool complete() const { return arrived_ == world_size_; }
  int arrived() const { return arrived_; }
  uint64_t generation() const { return generation_; }

  // When complete: rank 0's plan and the averaged gradients; the gathering ends.
  std::pair<StepPlan, std::vector<HostTensor>> TakeAverage(size_t num_parameters);
  // The ranks not yet arrived; then ends the gathering (an abort).
  std::vector<int> Abort();

 private:
  void End();

  const int world_size_;
  int64_t step_ = 0;  // 0: none
  uint64_t generation_ = 0;
  int arrived_ = 0;
  std::vector<std::optional<std::pair<StepPlan, std::vector<HostTensor>>>> ranks_;
};

}  // namespace muond::session
