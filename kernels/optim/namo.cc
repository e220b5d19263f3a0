#include "kernels/optim/namo.h"

#include "common/status_macros.h"

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

}  // namespace muond::optim
