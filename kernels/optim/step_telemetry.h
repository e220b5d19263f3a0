// StepTelemetry: what one optimizer step of one group measured about itself (docs/algorithms.md,
// Telemetry), and UpdateMeter, which measures how far an element-wise update moves a master.
//
// The optimizer fills a StepTelemetry it is handed (Optimizer::StepMeasured); the owner reads it
// after the step. UpdateMeter works through one scratch buffer per backend (Backend::Shared), held
// under its own mutex for the length of one measured update, so concurrent sessions on a backend
// take turns; its memory is fixed (a chunk) whatever the size of the parameter. Every sum a step
// measures stays in backend memory until the end of the step (`pending`, read back once).
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/optim/pending_sums.h"

namespace muond::optim {

struct StepTelemetry {
  // Input: measure the update (the masters before and after) and, for Muon, the orthogonality
  // residual. The rest is read from sums the step computes anyway.
  bool measure = true;

  // Σ W² of the updated masters before the step, Σ (W_after − W_before)² and their element count.
  double master_sum_squares = 0;
  double update_sum_squares = 0;
  int64_t updated_elements = 0;

  // Muon: Σ U² of the matrices Newton–Schulz received (the momentum, Nesterov's combination
  // included), the smallest Frobenius norm of one of them and the smallest that is not zero among
  // the matrices of parameters whose gradient this step is not all zero (+inf when none; a momentum
  // of exactly zero is a matrix whose gradients have all been zero so far, and one whose gradient is
  // zero now only decays, as an expert no token reached).
  double momentum_sum_squares = 0;
  double smallest_momentum_norm = std::numeric_limits<double>::infinity();
  double smallest_nonzero_momentum_norm = std::numeric_limits<double>::infinity();
  int64_t matrices = 0;

  // Muon, with `measure`: the orthogonality residual of one Newton–Schulz output X on the directions
  // it has (OrthogonalityResidual), a different matrix each step in turn, and the parameter it
  // belongs to.
  std::optional<double> residual;
  std::string residual_parameter;
  size_t residual_offset = 0;  // where the measured matrix starts in its parameter's elements

  // SGD with heloco: the parameters whose gradient HeLoCo kept, reoriented and shrunk this step
  // (momentum_alignment.h).
  int64_t heloco_kept = 0, heloco_reoriented = 0, heloco_shrunk = 0;

  // The sums above as the step's kernels write them (backend memory), until the step reads them
  // back once at its end (Optimizer::StepMeasured) and adds them in.
  PendingSums pending;

  // Adds Newton–Schulz's inputs as read back: `values` holds each matrix's Σ U² (idle[i]: the
  // matrix's gradient is all zero this step, its momentum only decays), then, with `residual`, the
  // two sums of OrthogonalitySumSquares. Muon's and Dion2's.
  void AddNsInputs(std::span<const double> values, const std::vector<bool>& idle, bool with_residual);
};

class UpdateMeter {
 public:
  // Chunks measured per master and step: the measuring costs a fixed amount per tensor, however
  // large, beside the update's own pass over it.
  static constexpr size_t kMeasuredChunks = 4;
  // Elements of one chunk: the scratch each backend keeps for measuring.
  static size_t ChunkElements(const kernels::Backend& backend);
  // Allocates the backend's scratch and the first segment of `telemetry`'s pending sums, so that a
  // step can fail for lack of memory before it changes any state.
  static absl::Status Reserve(kernels::Backend& backend, StepTelemetry& telemetry);
  // Runs apply(offset, count, measure) over [0, count) of a master (`master` its first element). When
  // telemetry.measure, the master's Σ W² before and Σ ΔW² go into `telemetry.pending` (nothing waits
  // for a device; read back, they add into master_sum_squares and update_sum_squares):
  //  - with `in_pass`, on a backend that MeasuresUpdatesInPass and an fp32 master: one call whose
  //    `measure` (two doubles of backend memory) the update writes its own exact sums to;
  //  - otherwise (measure null): up to kMeasuredChunks chunks, evenly spaced, updated one by one with
  //    their sums computed around them, and the ranges between them in one call each; a master of at
  //    most kMeasuredChunks chunks is measured whole, a larger one by that sample, its sums scaled to
  //    the whole (an estimate; docs/algorithms.md, Telemetry).
  // `apply` must update elements [offset, offset + count) only.
  static absl::Status Measure(kernels::Backend& backend, kernels::StoredRef master, size_t count,
                              absl::FunctionRef<absl::Status(size_t offset, size_t count, double* measure)> apply,
                              StepTelemetry* telemetry, bool in_pass);
};

}  // namespace muond::optim
