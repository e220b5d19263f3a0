#include "kernels/optim/newton_schulz.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace muond::optim {

using kernels::Backend;
using kernels::GemmShape;
using kernels::Transpose;

absl::StatusOr<float*> NsWorkspace::Get(Backend& backend, int slot, size_t count) {
  if (slot < 0) return absl::InvalidArgumentError(absl::StrCat("NsWorkspace: bad slot ", slot));
  if (backend_ != &backend) {
    Release();
    backend_ = &backend;
  }
  if (buffers_.size() <= static_cast<size_t>(slot)) buffers_.resize(slot + 1);
  std::unique_ptr<kernels::DeviceBuffer>& buf = buffers_[slot];
  if (buf == nullptr || buf->size() < count) {
    buf.reset();  // free the old buffer first so peak memory is not old + new
    MUOND_ASSIGN_OR_RETURN(buf, backend.Allocate(std::max<size_t>(count, 1)));
  }
  return buf->data();
}

// Slots 0 and 1 hold the iterate X and the next one (batch·rows·cols each), 2 and 3 the Gram matrix
// A and the polynomial B (batch·m² each, m = min(rows, cols)).
absl::Status NsWorkspace::ReserveFor(Backend& backend, int64_t rows, int64_t cols, int64_t batch) {
  const size_t mat = static_cast<size_t>(rows * cols * batch);
  const size_t m = static_cast<size_t>(std::min(rows, cols));
  const size_t gram = m * m * static_cast<size_t>(batch);
  for (int slot : {0, 1}) MUOND_RETURN_IF_ERROR(Get(backend, slot, mat).status());
  for (int slot : {2, 3}) MUOND_RETURN_IF_ERROR(Get(backend, slot, gram).status());
  return absl::OkStatus();
}

size_t NsWorkspace::held() const {
  size_t total = 0;
  for (const auto& buf : buffers_) total += buf ? buf->size() : 0;
  return total;
}

void NsWorkspace::Release() {
  buffers_.clear();
  backend_ = nullptr;
}

absl::Status NewtonSchulz(Backend& backend, const NsSchedule& schedule, int steps, double eps,
                          double norm_safety, kernels::MatmulPrecision precision, const float* in,
                          float* out, int64_t rows, int64_t cols, int64_t batch, NsWorkspace& ws) {
  if (rows < 0 || cols < 0 || batch < 0 || steps < 0) {
    return absl::InvalidArgumentError(absl::StrCat("NewtonSchulz: bad sizes rows=", rows,
                                                   " cols=", cols, " batch=", batch, " steps=", steps));
  }
  if (schedule.tuples.empty()) {
    return absl::InvalidArgumentError("NewtonSchulz: empty coefficient schedule");
  }
  if (rows == 0 || cols == 0 || batch == 0) return absl::OkStatus();

  // Work on the wide orientation: the Gram matrix A is then m×m with m = min(rows, cols), which
  // keeps two of the three GEMMs at the small dimension.
  const bool transposed = rows > cols;
  const int64_t m = std::min(rows, cols), n = std::max(rows, cols);
  const size_t mat = static_cast<size_t>(m * n), gram = static_cast<size_t>(m * m);
  const size_t total = mat * static_cast<size_t>(batch);
  MUOND_RETURN_IF_ERROR(ws.ReserveFor(backend, rows, cols, batch));
  MUOND_ASSIGN_OR_RETURN(float* x, ws.Get(backend, 0, total));
  MUOND_ASSIGN_OR_RETURN(float* x_next, ws.Get(backend, 1, total));
  MUOND_ASSIGN_OR_RETURN(float* a_mat, ws.Get(backend, 2, gram * batch));
  MUOND_ASSIGN_OR_RETURN(float* b_mat, ws.Get(backend, 3, gram * batch));

  if (transposed) {
    MUOND_RETURN_IF_ERROR(backend.Transpose2D(in, x, rows, cols, batch));
  } else {
    MUOND_RETURN_IF_ERROR(backend.CopyOnDevice(in, x, total));
  }

  // X ← X / (s·‖X‖_F + ε), the norm accumulated in fp64. A zero matrix keeps scale 0 rather than
  // 0·(1/0) so that eps = 0 cannot produce NaN.
  std::vector<double> sums(batch);
  MUOND_RETURN_IF_ERROR(backend.SumSquares(x, mat, batch, sums.data()));
  std::vector<float> scales(batch);
  for (int64_t i = 0; i < batch; ++i) {
    const double denom = norm_safety * std::sqrt(sums[i]) + eps;
    scales[i] = denom > 0 ? static_cast<float>(1.0 / denom) : 0.0f;
  }
  MUOND_RETURN_IF_ERROR(backend.ScaleBatched(x, mat, batch, scales.data()));

  // A = X·Xᵀ (m×m): X is m×n row-major, so op(B) = Xᵀ reads the same storage transposed.
  GemmShape gram_shape{.trans_a = Transpose::kNo, .trans_b = Transpose::kYes, .m = m, .n = m, .k = n,
                       .lda = n, .ldb = n, .ldc = m, .stride_a = m * n, .stride_b = m * n,
                       .stride_c = m * m, .batch = batch};
  // B = c·A·A + b·B with B preloaded with A.
  GemmShape square_shape{.m = m, .n = m, .k = m, .lda = m, .ldb = m, .ldc = m, .stride_a = m * m,
                         .stride_b = m * m, .stride_c = m * m, .batch = batch};
  // X' = B·X + a·X' with X' preloaded with X (the GEMM cannot read and write X in place).
  GemmShape update_shape{.m = m, .n = n, .k = m, .lda = m, .ldb = n, .ldc = n, .stride_a = m * m,
                         .stride_b = m * n, .stride_c = m * n, .batch = batch};
  for (int t = 0; t < steps; ++t) {
    const NsCoefficient co = schedule.At(t);
    MUOND_RETURN_IF_ERROR(backend.Gemm(gram_shape, 1.0f, x, x, 0.0f, a_mat, precision));
    if (co.c == 0) {
      // A cubic step (cubic5): X' = b·A·X + a·X, one GEMM fewer (Emerging-Optimizers' cubic path).
      MUOND_RETURN_IF_ERROR(backend.CopyOnDevice(x, x_next, total));
      MUOND_RETURN_IF_ERROR(backend.Gemm(update_shape, static_cast<float>(co.b), a_mat, x,
                                         static_cast<float>(co.a), x_next, precision));
      std::swap(x, x_next);
      continue;
    }
    MUOND_RETURN_IF_ERROR(backend.CopyOnDevice(a_mat, b_mat, gram * batch));
    MUOND_RETURN_IF_ERROR(backend.Gemm(square_shape, static_cast<float>(co.c), a_mat, a_mat,
                                       static_cast<float>(co.b), b_mat, precision));
    MUOND_RETURN_IF_ERROR(backend.CopyOnDevice(x, x_next, total));
    MUOND_RETURN_IF_ERROR(backend.Gemm(update_shape, 1.0f, b_mat, x, static_cast<float>(co.a), x_next,
                                       precision));
    std::swap(x, x_next);
  }

  if (transposed) return backend.Transpose2D(x, out, m, n, batch);
  return backend.CopyOnDevice(x, out, total);
}

}  // namespace muond::optim
