#include "kernels/optim/namo.h"

#include <cmath>
#include <map>
#include <utility>
#include <vector>

#include "common/status_macros.h"
#include "kernels/optim/muon_shapes.h"

namespace muond::optim {

absl::Status NamoLineSums(kernels::Backend& backend, Moment2Method method, const float* x, const NamoBatch& s,
                          float* copy, double* sums) {
  const size_t rows = static_cast<size_t>(s.stored_rows), cols = static_cast<size_t>(s.stored_cols);
  const size_t batch = static_cast<size_t>(s.batch);
  if (method != Moment2Method::kNamoD) return backend.SumSquaresTo(x, rows * cols, batch, sums);
  // A column of its own shape: a stored row of a transposed matrix, else a row of the copy.
  if (s.transposed) return backend.SumSquaresTo(x, cols, rows * batch, sums);
  MUOND_RETURN_IF_ERROR(backend.Transpose2D(x, copy, s.stored_rows, s.stored_cols, s.batch));
  return backend.SumSquaresTo(copy, rows, cols * batch, sums);
}

absl::Status NamoScale(kernels::Backend& backend, Moment2Method method, float* x, const NamoBatch& s, float* copy,
                       const float* scales) {
  const size_t rows = static_cast<size_t>(s.stored_rows), cols = static_cast<size_t>(s.stored_cols);
  const size_t batch = static_cast<size_t>(s.batch);
  if (method != Moment2Method::kNamoD) return backend.ScaleBatchedBy(x, rows * cols, batch, scales);
  if (s.transposed) return backend.ScaleBatchedBy(x, cols, rows * batch, scales);
  MUOND_RETURN_IF_ERROR(backend.Transpose2D(x, copy, s.stored_rows, s.stored_cols, s.batch));
  MUOND_RETURN_IF_ERROR(backend.ScaleBatchedBy(copy, rows, cols * batch, scales));
  return backend.Transpose2D(copy, x, s.stored_cols, s.stored_rows, s.batch);
}

// NAMO follows Emerging-Optimizers (ε outside the root, no bias correction); NAMO-D the authors'
// code (ε inside, Adam's bias corrections of β1 = the momentum and β2 at the parameter's step t).
kernels::NamoArgs NamoArgsOf(const GroupOptions& options, const StepHyper& hyper, const ParamState& param) {
  kernels::NamoArgs args{.weight = static_cast<float>(1.0 - options.beta2), .eps = options.eps};
  if (options.moment2_method == Moment2Method::kNamoD) {
    const double t = static_cast<double>(param.step_count + 1);
    args.eps_in_root = true;
    args.bias = std::sqrt(1.0 - std::pow(options.beta2, t)) / (1.0 - std::pow(hyper.momentum, t));
    args.clamp = options.namo_clamp;
  }
  return args;
}

absl::Status ApplyNamo(kernels::Backend& backend, const GroupOptions& options, const StepHyper& hyper,
                       std::span<const MatrixJob> jobs, float* work, NsWorkspace& ws, const double* grad_sums) {
  const bool transposed = jobs[0].deferred;
  const NamoBatch shape{.stored_rows = jobs[0].rows,
                        .stored_cols = jobs[0].cols,
                        .batch = static_cast<int64_t>(jobs.size()),
                        .transposed = transposed};
  const size_t lines = static_cast<size_t>(shape.Lines(options.moment2_method));
  StepScratch& scratch = backend.Shared<StepScratch>();
  const double* update_sums = reinterpret_cast<const double*>(scratch.namo_update_sums->data());
  float* scales = scratch.namo_scales->data();
  for (size_t i = 0; i < jobs.size(); ++i) {
    // Rounded to the slot's format on the way (exp_avg_sq_dtype); the step sizes use fp32 values.
    MUOND_RETURN_IF_ERROR(backend.NamoScales(NamoArgsOf(options, hyper, *jobs[i].param), grad_sums + i * lines,
                                             update_sums + i * lines, jobs[i].moment2->Ref(jobs[i].moment2_offset),
                                             scales + i * lines, lines));
  }
  float* copy = nullptr;
  if (NamoCopies(options.moment2_method, transposed)) {
    MUOND_ASSIGN_OR_RETURN(
        copy, ws.Get(backend, kNormuonSlot, static_cast<size_t>(shape.stored_rows * shape.stored_cols) * jobs.size()));
  }
  return NamoScale(backend, options.moment2_method, work, shape, copy, scales);
}

// A job's raw gradient lies where its U will: at the same offset of the gradient buffer, or, for a
// column-blocked parameter (worked on transposed), of the gradient's transpose.
absl::Status NamoGradientSums(kernels::Backend& backend, Moment2Method method, std::span<ParamState* const> params,
                              std::span<const std::span<const MatrixJob>> batches, NsWorkspace& ws, double* sums) {
  std::map<const ParamState*, std::vector<std::pair<const MatrixJob*, size_t>>> by_param;
  size_t line = 0;
  for (std::span<const MatrixJob> batch : batches) {
    for (const MatrixJob& job : batch) {
      by_param[job.param].emplace_back(&job, line);
      line += static_cast<size_t>(NamoLines(method, job.deferred ? job.rows : job.cols));
    }
  }
  for (ParamState* p : params) {
    auto it = by_param.find(p);
    if (!p->has_grad || it == by_param.end()) continue;
    const float* g = p->grad->data();
    const float* raw = g;
    if (WorksTransposed(*p)) {
      MUOND_ASSIGN_OR_RETURN(float* t, ws.Get(backend, kTransposeSlot, static_cast<size_t>(p->numel)));
      MUOND_RETURN_IF_ERROR(backend.Transpose2D(g, t, p->shape[0], p->shape[1], 1));
      raw = t;
    }
    for (const auto& [job, at] : it->second) {
      float* copy = nullptr;
      if (NamoCopies(method, job->deferred)) {
        MUOND_ASSIGN_OR_RETURN(copy, ws.Get(backend, kNormuonSlot, static_cast<size_t>(job->rows * job->cols)));
      }
      const NamoBatch shape{
          .stored_rows = job->rows, .stored_cols = job->cols, .batch = 1, .transposed = job->deferred};
      MUOND_RETURN_IF_ERROR(NamoLineSums(backend, method, raw + (job->update - g), shape, copy, sums + at));
    }
  }
  return absl::OkStatus();
}

}  // namespace muond::optim
