// RankGather: the step being gathered from the ranks of a multi-rank session (world size N > 1).
// Each rank's plan and gradients are kept until the step is taken: by lock-step sessions once all
// N have arrived, by quorum sessions also once Q have and the grace time has passed (Session
// decides; this class records when each count of ranks was reached). The gradients are then
// averaged with the ranks' weights — per parameter, sum(w_r * g_r) / sum(w_r) over the ranks that
// sent it, summed in rank order in fp64 and rounded once to fp32, so the result does not depend on
// arrival order (with every weight 1 it is the plain mean) — and the step is applied once with the
// plan of the lowest rank that arrived, its QK-clip logits the largest finite each head had on any
// of them (each rank saw its own tokens). Each rank's gradients carry its own loss scale s_r; they
// enter the average multiplied by s_low / s_r, so the average carries the scale of the lowest
// rank's plan, which the step divides out (a factor of exactly 1 when the scales agree: the sum is
// then the one without scales, bit for bit). Parameters of partitioned groups are assembled from
// each rank's part instead (a part held by several replicas, HSDP, averaged among them by the same
// rule). A rank that resends while it waits replaces its part: each send has a number (last_send),
// and Superseded says whether a send's part was replaced in a gathering that was taken, so its
// waiter is not told its gradients were used.
//
// The generation changes whenever a gathering ends (applied or aborted), so waiting ranks can tell
// an abort from a spurious wake-up. Owned by its session and used under the session's lock; not
// thread-safe by itself.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/host_tensor.h"
#include "server/session/session_config.h"
#include "server/session/step_plan.h"

namespace muond::session {

class RankGather {
 public:
  explicit RankGather(int world_size) : world_size_(world_size) {}

  // Adds `rank`'s part of step plan.request.step, arrived at `now` (starting a new gathering when
  // the step differs from the one being gathered), its gradients multiplied by `grad_scale` (its
  // header's, the session loss scaler's, or 1); returns the generation of the gathering it joined.
  uint64_t Add(StepPlan plan, std::vector<HostTensor> gradients, double grad_scale, absl::Time now);
  bool complete() const { return arrived() == world_size_; }
  int arrived() const { return static_cast<int>(arrival_times_.size()); }
  // When the n-th distinct rank arrived (1-based); InfiniteFuture while fewer have.
  absl::Time reached(int n) const;
  uint64_t generation() const { return generation_; }
  // The number of the send Add took last (each Add gets the next).
  uint64_t last_send() const { return sends_made_; }
  // Whether `rank`'s send `send` in gathering `generation` is not the one its part came from: the
  // rank sent again while it waited. False for a gathering still under way or long gone (the last 16
  // taken are remembered), and for one aborted.
  bool Superseded(uint64_t generation, int rank, uint64_t send) const;
  // The step being gathered; 0 when none is.
  int64_t step() const { return step_; }

  // Ends the gathering with what arrived: the lowest arrived rank's plan (with contributors and
  // total_weight set) and the weighted average of the gradients — of a partitioned parameter, the
  // whole gradient assembled from the ranks' parts instead (session/partition.h).
  std::pair<StepPlan, std::vector<HostTensor>> TakeAverage(const SessionConfig& config);
  // Whether the arrived ranks' parts of each partitioned parameter agree (CheckPartsAgree): every
  // holder sent its part, or none did.
  absl::Status CheckParts(const SessionConfig& config) const;
  // Whether the arrived ranks hold every part of every partitioned parameter (PartsCovered).
  bool CoversParts(const SessionConfig& config) const;
  // The ranks not yet arrived; then ends the gathering (an abort).
  std::vector<int> Abort();

 private:
  void End();
  // Each rank's gradients (null for a rank not arrived).
  std::vector<const std::vector<HostTensor>*> ByRank() const;

  const int world_size_;
  int64_t step_ = 0;  // 0: none
  uint64_t generation_ = 0;
  uint64_t sends_made_ = 0;
  std::vector<uint64_t> sends_;                            // per rank, the send its part is from (0: none)
  std::map<uint64_t, std::vector<uint64_t>> taken_sends_;  // generation → sends_, of the last taken
  std::vector<absl::Time> arrival_times_;                  // of each distinct rank, in arrival order
  std::vector<std::optional<std::pair<StepPlan, std::vector<HostTensor>>>> ranks_;
  std::vector<double> grad_scales_;  // of each arrived rank's gradients, by rank
};

}  // namespace muond::session
