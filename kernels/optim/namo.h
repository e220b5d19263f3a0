// NAMO's and NAMO-D's lines of a batch of matrices (docs/algorithms.md, NAMO and NAMO-D): a line is
// a whole matrix (NAMO) or one column of its own shape (NAMO-D). The per-line sums of squares their
// second moment and step sizes are made of, and the scaling of the orthogonalized update by the
// step sizes, through the backend (on the device on the CUDA backend); and the two passes a Muon
// step makes for them (NamoGradientSums before the momentum, ApplyNamo after Newton–Schulz).
// Stateless functions; the caller (muon.cc) owns the matrices, the workspace and the scratch.
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/optim/muon_jobs.h"
#include "kernels/optim/optimizer.h"
#include "kernels/optim/options.h"

namespace muond::optim {

inline bool IsNamo(Moment2Method method) { return method == Moment2Method::kNamo || method == Moment2Method::kNamoD; }

// Lines of a matrix of `cols` columns (its own shape): 1 (NAMO) or cols (NAMO-D).
inline int64_t NamoLines(Moment2Method method, int64_t cols) { return method == Moment2Method::kNamoD ? cols : 1; }

// Whether NamoLineSums and NamoScale go through a transposed copy of the batch: NAMO-D's columns of
// a matrix stored as its own shape.
inline bool NamoCopies(Moment2Method method, bool transposed) { return method == Moment2Method::kNamoD && !transposed; }

// A batch of `batch` matrices lying at `x` as row-major stored_rows × stored_cols, each its own
// shape or (`transposed`) its transpose.
struct NamoBatch {
  int64_t stored_rows = 0, stored_cols = 0, batch = 0;
  bool transposed = false;
  int64_t Lines(Moment2Method method) const { return NamoLines(method, transposed ? stored_rows : stored_cols); }
};

// sums (backend memory, batch·Lines doubles, matrix by matrix) = Σ x² over each line. `copy`:
// batch·rows·cols floats of workspace when NamoCopies, else unused.
absl::Status NamoLineSums(kernels::Backend& backend, Moment2Method method, const float* x, const NamoBatch& shape,
                          float* copy, double* sums);

// x's lines scaled by `scales` (backend memory, batch·Lines floats), with the same `copy`.
absl::Status NamoScale(kernels::Backend& backend, Moment2Method method, float* x, const NamoBatch& shape, float* copy,
                       const float* scales);

// The step sizes' arguments of `param` in a group with `options` at this step (NamoScales).
kernels::NamoArgs NamoArgsOf(const GroupOptions& options, const StepHyper& hyper, const ParamState& param);

// Muon's NAMO pass before the momentum overwrites the gradients: each job's raw-gradient Σ G² per
// line into `sums` (backend memory, the step's lines in batch order).
absl::Status NamoGradientSums(kernels::Backend& backend, Moment2Method method, std::span<ParamState* const> params,
                              std::span<const std::span<const MatrixJob>> batches, NsWorkspace& ws, double* sums);

// Muon's NAMO pass after Newton–Schulz: the batch's step sizes from `grad_sums` (its lines) and the
// Σ M̃² in StepScratch::namo_update_sums (advancing each job's second moment), and `work`'s O scaled
// by them.
absl::Status ApplyNamo(kernels::Backend& backend, const GroupOptions& options, const StepHyper& hyper,
                       std::span<const MatrixJob> jobs, float* work, NsWorkspace& ws, const double* grad_sums);

}  // namespace muond::optim
