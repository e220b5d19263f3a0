#include "kernels/optim/line_normalization.h"

#include "common/status_macros.h"

namespace muond::optim {
namespace {

using kernels::Backend;

LineOrder Swapped(LineOrder order) {
  switch (order) {
    case LineOrder::kRows:
      return LineOrder::kCols;
    case LineOrder::kCols:
      return LineOrder::kRows;
    case LineOrder::kRowsThenCols:
      return LineOrder::kColsThenRows;
    case LineOrder::kColsThenRows:
      return LineOrder::kRowsThenCols;
    default:
      return order;
  }
}

// The scales of `lines` contiguous lines of `length` elements into scales[0, lines).
absl::Status LineScales(Backend& backend, const float* x, size_t length, size_t lines, double eps,
                        const LineScratch& s) {
  MUOND_RETURN_IF_ERROR(backend.SumSquaresTo(x, length, lines, s.sums));
  return backend.InverseRootScales(s.sums, s.scales, lines, eps);
}

absl::Status ScaleRows(Backend& backend, float* x, int64_t rows, int64_t cols, int64_t batch, double eps,
                       const LineScratch& s) {
  const size_t lines = static_cast<size_t>(rows * batch);
  MUOND_RETURN_IF_ERROR(LineScales(backend, x, static_cast<size_t>(cols), lines, eps, s));
  return backend.ScaleBatchedBy(x, static_cast<size_t>(cols), lines, s.scales);
}

// The columns: scaled as the rows of the transposed copy, then copied back transposed.
absl::Status ScaleCols(Backend& backend, float* x, int64_t rows, int64_t cols, int64_t batch, double eps,
                       const LineScratch& s) {
  MUOND_RETURN_IF_ERROR(backend.Transpose2D(x, s.copy, rows, cols, batch));
  MUOND_RETURN_IF_ERROR(ScaleRows(backend, s.copy, cols, rows, batch, eps, s));
  return backend.Transpose2D(s.copy, x, cols, rows, batch);
}

// Both scales from x as it is, then applied: rows first, columns second (each product rounded once,
// in that order).
absl::Status ScaleRowsAndCols(Backend& backend, float* x, int64_t rows, int64_t cols, int64_t batch, double eps,
                              const LineScratch& s) {
  const size_t row_lines = static_cast<size_t>(rows * batch), col_lines = static_cast<size_t>(cols * batch);
  MUOND_RETURN_IF_ERROR(LineScales(backend, x, static_cast<size_t>(cols), row_lines, eps, s));
  MUOND_RETURN_IF_ERROR(backend.Transpose2D(x, s.copy, rows, cols, batch));
  const LineScratch cols_part{.sums = s.sums + row_lines, .scales = s.scales + row_lines, .copy = s.copy};
  MUOND_RETURN_IF_ERROR(LineScales(backend, s.copy, static_cast<size_t>(rows), col_lines, eps, cols_part));
  MUOND_RETURN_IF_ERROR(backend.ScaleBatchedBy(x, static_cast<size_t>(cols), row_lines, s.scales));
  MUOND_RETURN_IF_ERROR(backend.Transpose2D(x, s.copy, rows, cols, batch));
  MUOND_RETURN_IF_ERROR(backend.ScaleBatchedBy(s.copy, static_cast<size_t>(rows), col_lines, cols_part.scales));
  return backend.Transpose2D(s.copy, x, cols, rows, batch);
}

}  // namespace

LineOrder OrderOf(MomentumNormalization mode, bool transposed) {
  LineOrder order = LineOrder::kNone;
  switch (mode) {
    case MomentumNormalization::kNone:
      break;
    case MomentumNormalization::kRow:
      order = LineOrder::kRows;
      break;
    case MomentumNormalization::kCol:
      order = LineOrder::kCols;
      break;
    case MomentumNormalization::kRowCol:
      order = LineOrder::kRowsAndCols;
      break;
  }
  return transposed ? Swapped(order) : order;
}

LineOrder OrderOf(PostNormalization mode, bool transposed) {
  LineOrder order = LineOrder::kNone;
  switch (mode) {
    case PostNormalization::kNone:
      break;
    case PostNormalization::kRow:
      order = LineOrder::kRows;
      break;
    case PostNormalization::kCol:
      order = LineOrder::kCols;
      break;
    case PostNormalization::kMuonPlus:
    case PostNormalization::kRowCol:
      order = LineOrder::kRowsThenCols;
      break;
    case PostNormalization::kColRow:
      order = LineOrder::kColsThenRows;
      break;
  }
  return transposed ? Swapped(order) : order;
}

size_t LineCount(int64_t rows, int64_t cols, int64_t batch) { return static_cast<size_t>((rows + cols) * batch); }

bool ScalesColumns(LineOrder order) { return order != LineOrder::kNone && order != LineOrder::kRows; }

absl::Status NormalizeLines(Backend& backend, LineOrder order, double eps, float* x, int64_t rows, int64_t cols,
                            int64_t batch, const LineScratch& scratch) {
  switch (order) {
    case LineOrder::kNone:
      return absl::OkStatus();
    case LineOrder::kRows:
      return ScaleRows(backend, x, rows, cols, batch, eps, scratch);
    case LineOrder::kCols:
      return ScaleCols(backend, x, rows, cols, batch, eps, scratch);
    case LineOrder::kRowsAndCols:
      return ScaleRowsAndCols(backend, x, rows, cols, batch, eps, scratch);
    case LineOrder::kRowsThenCols:
      MUOND_RETURN_IF_ERROR(ScaleRows(backend, x, rows, cols, batch, eps, scratch));
      return ScaleCols(backend, x, rows, cols, batch, eps, scratch);
    case LineOrder::kColsThenRows:
      MUOND_RETURN_IF_ERROR(ScaleCols(backend, x, rows, cols, batch, eps, scratch));
      return ScaleRows(backend, x, rows, cols, batch, eps, scratch);
  }
  return absl::OkStatus();
}

}  // namespace muond::optim
