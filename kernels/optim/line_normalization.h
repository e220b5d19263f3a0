// Rows and columns of a batch of matrices brought to unit L2 norm, through the backend: MuonEq's
// normalization of the momentum before Newton–Schulz and Muon+'s of the orthogonalized update after
// it (docs/algorithms.md, MuonEq and Muon+). Each line x is scaled by fp32(1/√(Σ x² + eps)), the sum
// accumulated as Backend::SumSquaresTo does; every step stays on the device on the CUDA backend.
// Stateless functions; the caller owns the matrices and the scratch.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/optim/options.h"

namespace muond::optim {

// Which lines, in which order, of a matrix as it lies in memory (row-major).
enum class LineOrder {
  kNone,
  kRows,
  kCols,
  kRowsAndCols,   // both scales from the same matrix, then applied (MuonEq's rowcol)
  kRowsThenCols,  // columns scaled after the rows were (Muon+'s row_col)
  kColsThenRows,  // rows scaled after the columns were (Muon+'s col_row)
};

// The orders of the options, for a matrix stored as its own shape or, when `transposed`, as its
// transpose (a column block of a tensor-parallel weight): its rows are then the stored columns.
LineOrder OrderOf(MomentumNormalization mode, bool transposed);
LineOrder OrderOf(PostNormalization mode, bool transposed);

// The epsilons of the references: MuonEq's rowcol_eps, and the 1e-7 Muon+ adds under its root.
inline constexpr double kMomentumNormalizationEps = 1e-8;
inline constexpr double kPostNormalizationEps = 1e-7;

// Scratch NormalizeLines needs for `batch` rows × cols matrices: doubles and floats for one value
// per line (rows + cols per matrix), and, when `order` scales columns, a copy of the batch.
struct LineScratch {
  double* sums = nullptr;   // (rows + cols)·batch doubles
  float* scales = nullptr;  // (rows + cols)·batch floats
  float* copy = nullptr;    // rows·cols·batch floats, for column orders
};
size_t LineCount(int64_t rows, int64_t cols, int64_t batch);
bool ScalesColumns(LineOrder order);

// Scales the lines of `batch` row-major rows × cols matrices at `x` in `order`, in place.
absl::Status NormalizeLines(kernels::Backend& backend, LineOrder order, double eps, float* x, int64_t rows,
                            int64_t cols, int64_t batch, const LineScratch& scratch);

}  // namespace muond::optim
