#include "kernels/optim/newton_schulz.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

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
    const size_t size = std::max<size_t>(count, 1);
    const size_t others = held() - (buf ? buf->size() : 0);
    if (hard() && limit() > 0 && others + size > limit()) return Refuse(others + size);
    Drop(slot);  // free the old buffer first so peak memory is not old + new
    MUOND_ASSIGN_OR_RETURN(buf, backend.Allocate(size));
    held_.fetch_add(size, std::memory_order_relaxed);
  }
  return buf->data();
}

NsUse NsUseOf(const Backend& backend, const GroupOptions& options, bool gram) {
  return NsUse{.gram = gram,
               .in_place = backend.GemmMayWriteAnOperand(options.matmul_precision),
               .aol = options.ns_preconditioner == NsPreconditioner::kAol};
}

std::array<size_t, NsWorkspace::kFirstFreeSlot> NsSlotFloats(int64_t rows, int64_t cols, int64_t batch,
                                                             const NsUse& use) {
  const size_t mat = static_cast<size_t>(rows * cols * batch);
  const size_t m = static_cast<size_t>(std::min(rows, cols));
  const size_t gram_size = m * m * static_cast<size_t>(batch);
  if (use.gram && rows != cols) return {mat, mat, gram_size, gram_size, gram_size, use.in_place ? m : gram_size};
  if (!use.in_place) return {mat, mat, gram_size, gram_size, 0, 0};
  // In place, slot 3 keeps one m×m matrix for OrthogonalitySumSquares, which runs in slots 2 and 3
  // after the call when telemetry measures the residual.
  return {mat, use.aol ? m * static_cast<size_t>(batch) : 0, gram_size, use.aol ? gram_size : m * m, 0, 0};
}

// Slots 0 and 1 hold the iterate X and the next one (batch·rows·cols each), 2 and 3 the Gram matrix
// A and the polynomial B (batch·m² each, m = min(rows, cols)). GramNewtonSchulz uses 2 and 3 for
// its R and Z, and 4 and 5 (batch·m² each) for Q and its scratch; square shapes go to NewtonSchulz
// and need no more than it does. In place (NsUse), less: see NsSlotFloats.
absl::Status NsWorkspace::ReserveFor(Backend& backend, int64_t rows, int64_t cols, int64_t batch, const NsUse& use) {
  const std::array<size_t, kFirstFreeSlot> need = NsSlotFloats(rows, cols, batch, use);
  for (int slot = 0; slot < kFirstFreeSlot; ++slot) {
    if (need[slot] > 0) MUOND_RETURN_IF_ERROR(Get(backend, slot, need[slot]).status());
  }
  return absl::OkStatus();
}

absl::Status NsWorkspace::Fit(Backend& backend, std::span<const size_t> need) {
  if (backend_ != &backend) {
    Release();
    backend_ = &backend;
  }
  size_t needed = 0, grown = 0;
  for (size_t n : need) needed += n;
  if (hard() && limit() > 0 && needed > limit()) return Refuse(needed);
  for (size_t s = 0; s < std::max(buffers_.size(), need.size()); ++s) {
    const size_t have = s < buffers_.size() && buffers_[s] ? buffers_[s]->size() : 0;
    grown += std::max(have, s < need.size() ? need[s] : 0);
  }
  if (limit() > 0 && grown > limit()) {
    for (size_t s = 0; s < buffers_.size(); ++s) {
      if (buffers_[s] && buffers_[s]->size() > (s < need.size() ? need[s] : 0)) Drop(static_cast<int>(s));
    }
  }
  for (size_t s = 0; s < need.size(); ++s) {
    if (need[s] > 0) MUOND_RETURN_IF_ERROR(Get(backend, static_cast<int>(s), need[s]).status());
  }
  return absl::OkStatus();
}

absl::Status NsWorkspace::Refuse(size_t floats) const {
  return absl::ResourceExhaustedError(absl::StrCat(
      "Newton-Schulz needs ", 4 * floats, " bytes of workspace, more than --ns-workspace-bytes ", 4 * limit()));
}

void NsWorkspace::Drop(int slot) {
  std::unique_ptr<kernels::DeviceBuffer>& buf = buffers_[static_cast<size_t>(slot)];
  if (buf == nullptr) return;
  held_.fetch_sub(buf->size(), std::memory_order_relaxed);
  buf.reset();
}

void NsWorkspace::Release() {
  buffers_.clear();
  held_.store(0, std::memory_order_relaxed);
  backend_ = nullptr;
}

namespace {

absl::Status CheckNsArguments(const char* who, const NsSchedule& schedule, int steps, int64_t rows, int64_t cols,
                              int64_t batch) {
  if (rows < 0 || cols < 0 || batch < 0 || steps < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": bad sizes rows=", rows, " cols=", cols, " batch=", batch, " steps=", steps));
  }
  if (schedule.tuples.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": empty coefficient schedule"));
  }
  return absl::OkStatus();
}

// x ← the wide orientation of `in` (m×n per matrix, transposed when rows > cols), each matrix
// scaled by 1/(s·‖X‖_F + ε) with the norm accumulated in fp64 (Backend::NormalizeBatched: a zero
// matrix keeps scale 0, so eps = 0 cannot produce NaN). Without `input_sum_squares` the norms stay
// on the backend's device: nothing here waits for the GPU.
absl::Status LoadNormalized(Backend& backend, const float* in, float* x, int64_t rows, int64_t cols, int64_t batch,
                            double eps, double norm_safety, double* input_sum_squares) {
  const size_t mat = static_cast<size_t>(rows * cols);
  if (rows > cols) {
    MUOND_RETURN_IF_ERROR(backend.Transpose2D(in, x, rows, cols, batch));
  } else {
    MUOND_RETURN_IF_ERROR(backend.CopyOnDevice(in, x, mat * static_cast<size_t>(batch)));
  }
  return backend.NormalizeBatched(x, mat, static_cast<size_t>(batch), eps, norm_safety, input_sum_squares);
}

// The batched GEMM shapes of both iterations on a wide m×n X (row-major): gram, X·Xᵀ (op(B) = Xᵀ
// reads X's storage transposed); square, a product of two m×m matrices; apply, an m×m matrix times X.
struct NsGemmShapes {
  GemmShape gram, square, apply;
};
NsGemmShapes GemmShapesFor(int64_t m, int64_t n, int64_t batch) {
  return NsGemmShapes{
      .gram = {.trans_a = Transpose::kNo,
               .trans_b = Transpose::kYes,
               .m = m,
               .n = m,
               .k = n,
               .lda = n,
               .ldb = n,
               .ldc = m,
               .stride_a = m * n,
               .stride_b = m * n,
               .stride_c = m * m,
               .batch = batch},
      .square = {.m = m,
                 .n = m,
                 .k = m,
                 .lda = m,
                 .ldb = m,
                 .ldc = m,
                 .stride_a = m * m,
                 .stride_b = m * m,
                 .stride_c = m * m,
                 .batch = batch},
      .apply = {.m = m,
                .n = n,
                .k = m,
                .lda = m,
                .ldb = n,
                .ldc = n,
                .stride_a = m * m,
                .stride_b = m * n,
                .stride_c = m * n,
                .batch = batch},
  };
}

}  // namespace

double AolGramBound(int64_t rows, int64_t cols, double input_bound) {
  // n products each below input_bound², summed in fp32: n·(1 + n·2⁻²⁴) bounds the rounding; the
  // factor 2 covers it for any n below 2²⁴.
  return 2.0 * static_cast<double>(std::max(rows, cols)) * input_bound * input_bound;
}

absl::Status NewtonSchulz(Backend& backend, const NsSchedule& schedule, int steps, double eps, double norm_safety,
                          kernels::MatmulPrecision precision, const float* in, float* out, int64_t rows, int64_t cols,
                          int64_t batch, NsWorkspace& ws, double* input_sum_squares, NsPreconditioner preconditioner,
                          bool stored_transposed) {
  MUOND_RETURN_IF_ERROR(CheckNsArguments("NewtonSchulz", schedule, steps, rows, cols, batch));
  if (rows == 0 || cols == 0 || batch == 0) return absl::OkStatus();

  // Work on the wide orientation: the Gram matrix A is then m×m with m = min(rows, cols), which
  // keeps two of the three GEMMs at the small dimension. AOL scales the rows of a square matrix as
  // the caller's matrix has them (the reference transposes only a tall one), so a stored transpose
  // is turned back.
  const bool aol = preconditioner == NsPreconditioner::kAol;
  const bool transposed = rows > cols || (aol && rows == cols && stored_transposed);
  const int64_t m = std::min(rows, cols), n = std::max(rows, cols);
  const size_t mat = static_cast<size_t>(m * n), gram = static_cast<size_t>(m * m);
  const size_t total = mat * static_cast<size_t>(batch);
  const size_t lines = static_cast<size_t>(m * batch);
  // A = X·Xᵀ; B = c·A·A + b·B with B preloaded with A; X' = B·X + a·X' with X' preloaded with X, or,
  // where the backend's GEMM reads its operands from copies (bf16), B and X' in place of A and X:
  // the same products, without the two copies an iteration, and without X' and B (but for AOL's
  // row scales in X' and transposed A in B).
  const bool in_place = backend.GemmMayWriteAnOperand(precision);
  MUOND_RETURN_IF_ERROR(ws.ReserveFor(backend, rows, cols, batch, NsUse{.in_place = in_place, .aol = aol}));
  MUOND_ASSIGN_OR_RETURN(float* x, ws.Get(backend, 0, total));
  float* x_next = nullptr;
  float* b_mat = nullptr;
  if (!in_place || aol) {
    MUOND_ASSIGN_OR_RETURN(x_next, ws.Get(backend, 1, in_place ? lines : total));
    MUOND_ASSIGN_OR_RETURN(b_mat, ws.Get(backend, 3, gram * batch));
  }
  MUOND_ASSIGN_OR_RETURN(float* a_mat, ws.Get(backend, 2, gram * batch));
  const NsGemmShapes shapes = GemmShapesFor(m, n, batch);
  const GemmShape& gram_shape = shapes.gram;
  const GemmShape& square_shape = shapes.square;
  const GemmShape& update_shape = shapes.apply;
  if (!aol) {
    MUOND_RETURN_IF_ERROR(LoadNormalized(backend, in, x, rows, cols, batch, eps, norm_safety, input_sum_squares));
  } else {
    if (transposed) {
      MUOND_RETURN_IF_ERROR(backend.Transpose2D(in, x, rows, cols, batch));
    } else {
      MUOND_RETURN_IF_ERROR(backend.CopyOnDevice(in, x, total));
    }
    if (input_sum_squares != nullptr) {
      MUOND_RETURN_IF_ERROR(backend.SumSquaresTo(x, mat, static_cast<size_t>(batch), input_sum_squares));
    }
    // The row scales go through X' (free until the first iteration); A becomes diag(s)·A·diag(s),
    // rows first (as the reference multiplies), the columns as rows of its transpose (A is symmetric).
    float* scales = x_next;
    MUOND_RETURN_IF_ERROR(backend.Gemm(gram_shape, 1.0f, x, x, 0.0f, a_mat, precision));
    MUOND_RETURN_IF_ERROR(backend.AolScales(a_mat, m, batch, eps > 0 ? eps : 1e-30, scales));
    MUOND_RETURN_IF_ERROR(backend.ScaleBatchedBy(x, static_cast<size_t>(n), lines, scales));
    MUOND_RETURN_IF_ERROR(backend.ScaleBatchedBy(a_mat, static_cast<size_t>(m), lines, scales));
    MUOND_RETURN_IF_ERROR(backend.Transpose2D(a_mat, b_mat, m, m, batch));
    MUOND_RETURN_IF_ERROR(backend.ScaleBatchedBy(b_mat, static_cast<size_t>(m), lines, scales));
    MUOND_RETURN_IF_ERROR(backend.CopyOnDevice(b_mat, a_mat, gram * batch));
  }
  for (int t = 0; t < steps; ++t) {
    const NsCoefficient co = schedule.At(t);
    if (!(aol && t == 0)) MUOND_RETURN_IF_ERROR(backend.Gemm(gram_shape, 1.0f, x, x, 0.0f, a_mat, precision));
    // X' = alpha·P·X + a·X, P the polynomial of A.
    const auto update = [&](float alpha, const float* p) -> absl::Status {
      if (in_place) return backend.Gemm(update_shape, alpha, p, x, static_cast<float>(co.a), x, precision);
      MUOND_RETURN_IF_ERROR(backend.CopyOnDevice(x, x_next, total));
      MUOND_RETURN_IF_ERROR(backend.Gemm(update_shape, alpha, p, x, static_cast<float>(co.a), x_next, precision));
      std::swap(x, x_next);
      return absl::OkStatus();
    };
    if (co.c == 0) {
      // A cubic step (cubic5): X' = b·A·X + a·X, one GEMM fewer (Emerging-Optimizers' cubic path).
      MUOND_RETURN_IF_ERROR(update(static_cast<float>(co.b), a_mat));
      continue;
    }
    float* poly = in_place ? a_mat : b_mat;
    if (!in_place) MUOND_RETURN_IF_ERROR(backend.CopyOnDevice(a_mat, b_mat, gram * batch));
    MUOND_RETURN_IF_ERROR(
        backend.Gemm(square_shape, static_cast<float>(co.c), a_mat, a_mat, static_cast<float>(co.b), poly, precision));
    MUOND_RETURN_IF_ERROR(update(1.0f, poly));
  }

  if (transposed) return backend.Transpose2D(x, out, m, n, batch);
  return backend.CopyOnDevice(x, out, total);
}

absl::Status GramNewtonSchulz(Backend& backend, const NsSchedule& schedule, int steps,
                              std::span<const int> restart_iterations, double eps, double norm_safety,
                              kernels::MatmulPrecision precision, const float* in, float* out, int64_t rows,
                              int64_t cols, int64_t batch, NsWorkspace& ws, double* input_sum_squares) {
  MUOND_RETURN_IF_ERROR(CheckNsArguments("GramNewtonSchulz", schedule, steps, rows, cols, batch));
  if (rows == 0 || cols == 0 || batch == 0) return absl::OkStatus();
  // Square: X·Xᵀ is as large as X, so working on it saves nothing (torch.optim.Muon does the same).
  if (rows == cols) {
    return NewtonSchulz(backend, schedule, steps, eps, norm_safety, precision, in, out, rows, cols, batch, ws,
                        input_sum_squares);
  }

  const bool transposed = rows > cols;
  const int64_t m = std::min(rows, cols), n = std::max(rows, cols);
  const size_t total = static_cast<size_t>(m * n) * static_cast<size_t>(batch);
  const size_t gram_total = static_cast<size_t>(m * m) * static_cast<size_t>(batch);
  // Where the backend's GEMM reads its operands from copies (bf16), the products below that add to
  // one of their operands (Q·Z + a·Q, R·Z + a·R, Z·RZ + a·RZ) write it in place, without the copy.
  const bool in_place = backend.GemmMayWriteAnOperand(precision);
  MUOND_RETURN_IF_ERROR(ws.ReserveFor(backend, rows, cols, batch, NsUse{.gram = true, .in_place = in_place}));
  MUOND_ASSIGN_OR_RETURN(float* x, ws.Get(backend, 0, total));
  MUOND_ASSIGN_OR_RETURN(float* x_next, ws.Get(backend, 1, total));
  MUOND_ASSIGN_OR_RETURN(float* r, ws.Get(backend, 2, gram_total));
  MUOND_ASSIGN_OR_RETURN(float* z, ws.Get(backend, 3, gram_total));
  MUOND_ASSIGN_OR_RETURN(float* q, ws.Get(backend, 4, gram_total));
  // Scratch for the next Q, then (once Q has moved there and the old one is dead) RZ; also the
  // column of ones that writes a·I, all it holds in place.
  MUOND_ASSIGN_OR_RETURN(float* scratch, ws.Get(backend, 5, in_place ? static_cast<size_t>(m) : gram_total));
  MUOND_RETURN_IF_ERROR(LoadNormalized(backend, in, x, rows, cols, batch, eps, norm_safety, input_sum_squares));

  // R = X·Xᵀ (m×m), as NewtonSchulz's A; products of two m×m polynomials (R·R, Q·Z, R·Z, Z·RZ);
  // Q·X (m×m times m×n), only at a restart and at the end.
  const NsGemmShapes shapes = GemmShapesFor(m, n, batch);
  const GemmShape& gram_shape = shapes.gram;
  const GemmShape& square_shape = shapes.square;
  const GemmShape& apply_shape = shapes.apply;
  // C += alpha·I with no identity matrix and no Backend primitive beyond Gemm: an m×1 column of
  // ones times a 1×1 one, written with ldc = m + 1 so that row i of the result lands on C(i, i).
  // The ones are read with zero strides by every matrix of the batch. Always fp32: the product is
  // exact and its cost (m multiply-adds per matrix) is nothing.
  GemmShape diagonal_shape{.m = m,
                           .n = 1,
                           .k = 1,
                           .lda = 1,
                           .ldb = 1,
                           .ldc = m + 1,
                           .stride_a = 0,
                           .stride_b = 0,
                           .stride_c = m * m,
                           .batch = batch};

  const auto restarts_at = [&](int t) {
    return std::find(restart_iterations.begin(), restart_iterations.end(), t) != restart_iterations.end();
  };
  MUOND_RETURN_IF_ERROR(backend.Gemm(gram_shape, 1.0f, x, x, 0.0f, r, precision));
  bool have_q = false;
  for (int t = 0; t < steps; ++t) {
    const NsCoefficient co = schedule.At(t);
    const float a = static_cast<float>(co.a);
    if (t != 0 && restarts_at(t)) {
      // Re-anchor on an explicit iterate: the R and Q built up so far carry the rounding of every
      // step since the last anchor, which the next steps would otherwise amplify.
      MUOND_RETURN_IF_ERROR(backend.Gemm(apply_shape, 1.0f, q, x, 0.0f, x_next, precision));
      std::swap(x, x_next);
      MUOND_RETURN_IF_ERROR(backend.Gemm(gram_shape, 1.0f, x, x, 0.0f, r, precision));
      have_q = false;
    }

    // Z = b·R + c·R·R; a cubic tuple (c = 0) skips the R·R GEMM.
    MUOND_RETURN_IF_ERROR(backend.CopyOnDevice(r, z, gram_total));
    if (co.c == 0) {
      const float b = static_cast<float>(co.b);
      MUOND_RETURN_IF_ERROR(backend.ScaleBatched(z, gram_total, 1, &b));
    } else {
      MUOND_RETURN_IF_ERROR(
          backend.Gemm(square_shape, static_cast<float>(co.c), r, r, static_cast<float>(co.b), z, precision));
    }

    if (!have_q) {
      // Q = a·I + Z.
      MUOND_RETURN_IF_ERROR(backend.CopyOnDevice(z, q, gram_total));
      MUOND_RETURN_IF_ERROR(backend.Fill(scratch, static_cast<size_t>(m), 1.0f));
      MUOND_RETURN_IF_ERROR(
          backend.Gemm(diagonal_shape, a, scratch, scratch, 1.0f, q, kernels::MatmulPrecision::kFp32));
      have_q = true;
    } else if (in_place) {
      MUOND_RETURN_IF_ERROR(backend.Gemm(square_shape, 1.0f, q, z, a, q, precision));  // Q ← a·Q + Q·Z
    } else {
      // Q ← a·Q + Q·Z, into the scratch preloaded with Q (the GEMM cannot read and write Q in
      // place); the old Q's buffer becomes the scratch.
      MUOND_RETURN_IF_ERROR(backend.CopyOnDevice(q, scratch, gram_total));
      MUOND_RETURN_IF_ERROR(backend.Gemm(square_shape, 1.0f, q, z, a, scratch, precision));
      std::swap(q, scratch);
    }

    // Advance R to the Gram matrix of the iterate NewtonSchulz would now hold, X' = (a·I + Z)·X:
    // R' = (a·I + Z)·R·(a·I + Z) = a·RZ + Z·RZ with RZ = a·R + R·Z (Z is symmetric). Not needed
    // after the last step, nor before a restart, which recomputes R from the explicit iterate.
    if (t + 1 < steps && !restarts_at(t + 1)) {
      // In place, RZ goes over R; otherwise it goes through the scratch and back.
      float* rz = in_place ? r : scratch;
      if (!in_place) MUOND_RETURN_IF_ERROR(backend.CopyOnDevice(r, rz, gram_total));
      MUOND_RETURN_IF_ERROR(backend.Gemm(square_shape, 1.0f, r, z, a, rz, precision));
      if (!in_place) MUOND_RETURN_IF_ERROR(backend.CopyOnDevice(rz, r, gram_total));
      MUOND_RETURN_IF_ERROR(backend.Gemm(square_shape, 1.0f, z, rz, a, r, precision));
    }
  }

  // out = Q·X, transposed back to rows×cols when the input was tall. With no step run Q is the
  // identity and the result is the normalized input, as in NewtonSchulz.
  if (!have_q) {
    if (transposed) return backend.Transpose2D(x, out, m, n, batch);
    return backend.CopyOnDevice(x, out, total);
  }
  if (transposed) {
    MUOND_RETURN_IF_ERROR(backend.Gemm(apply_shape, 1.0f, q, x, 0.0f, x_next, precision));
    return backend.Transpose2D(x_next, out, m, n, batch);
  }
  // `out` is the caller's buffer and x the workspace's, so the GEMM may write it directly even when
  // out == in.
  return backend.Gemm(apply_shape, 1.0f, q, x, 0.0f, out, precision);
}

absl::Status OrthogonalitySumSquares(Backend& backend, const float* x, int64_t rows, int64_t cols, NsWorkspace& ws,
                                     double* sums) {
  if (rows <= 0 || cols <= 0) return absl::InvalidArgumentError("OrthogonalityResidual: an empty matrix");
  const int64_t m = std::min(rows, cols);
  const size_t gram = static_cast<size_t>(m * m);
  MUOND_ASSIGN_OR_RETURN(float* a, ws.Get(backend, 2, gram));
  MUOND_ASSIGN_OR_RETURN(float* b, ws.Get(backend, 3, gram));
  // Wide: X·Xᵀ (op(B) reads X transposed); tall: Xᵀ·X (op(A) does). Either way the m×m Gram
  // matrix G, then G·G − G (G copied into the product's output, beta −1): nothing waits.
  const bool wide = rows <= cols;
  const GemmShape shape{.trans_a = wide ? Transpose::kNo : Transpose::kYes,
                        .trans_b = wide ? Transpose::kYes : Transpose::kNo,
                        .m = m,
                        .n = m,
                        .k = std::max(rows, cols),
                        .lda = cols,
                        .ldb = cols,
                        .ldc = m,
                        .stride_a = 0,
                        .stride_b = 0,
                        .stride_c = 0,
                        .batch = 1};
  MUOND_RETURN_IF_ERROR(backend.Gemm(shape, 1.0f, x, x, 0.0f, a, kernels::MatmulPrecision::kFp32));
  MUOND_RETURN_IF_ERROR(backend.SumSquaresTo(a, gram, 1, sums + 1));
  MUOND_RETURN_IF_ERROR(backend.CopyOnDevice(a, b, gram));
  const GemmShape square{.trans_a = Transpose::kNo,
                         .trans_b = Transpose::kNo,
                         .m = m,
                         .n = m,
                         .k = m,
                         .lda = m,
                         .ldb = m,
                         .ldc = m,
                         .stride_a = 0,
                         .stride_b = 0,
                         .stride_c = 0,
                         .batch = 1};
  MUOND_RETURN_IF_ERROR(backend.Gemm(square, 1.0f, a, a, -1.0f, b, kernels::MatmulPrecision::kFp32));
  return backend.SumSquaresTo(b, gram, 1, sums);
}

double ResidualFromSums(double gram_minus_square, double gram) {
  return gram > 0 ? std::sqrt(gram_minus_square / gram) : 0.0;
}

absl::StatusOr<double> OrthogonalityResidual(Backend& backend, const float* x, int64_t rows, int64_t cols,
                                             NsWorkspace& ws) {
  if (rows <= 0 || cols <= 0) return absl::InvalidArgumentError("OrthogonalityResidual: an empty matrix");
  MUOND_ASSIGN_OR_RETURN(std::unique_ptr<kernels::DeviceBuffer> device_sums, backend.Allocate(4));  // two doubles
  double* sums = reinterpret_cast<double*>(device_sums->data());
  MUOND_RETURN_IF_ERROR(OrthogonalitySumSquares(backend, x, rows, cols, ws, sums));
  double host_sums[2] = {0, 0};
  MUOND_RETURN_IF_ERROR(backend.CopyBytes(sums, host_sums, sizeof(host_sums)));
  return ResidualFromSums(host_sums[0], host_sums[1]);
}

NsWork StandardNsWork(int64_t rows, int64_t cols, const NsSchedule& schedule, int steps) {
  const double m = static_cast<double>(std::min(rows, cols)), n = static_cast<double>(std::max(rows, cols));
  NsWork w;
  for (int t = 0; t < steps; ++t) {
    w.wide += 2 * m * m * n;                           // A = X·Xᵀ and B·X (or A·X)
    if (schedule.At(t).c != 0) w.square += m * m * m;  // A·A
  }
  return w;
}

// Counts the products GramNewtonSchulz issues, step by step as it issues them.
NsWork GramNsWork(int64_t rows, int64_t cols, const NsSchedule& schedule, int steps,
                  std::span<const int> restart_iterations) {
  if (rows == cols) return StandardNsWork(rows, cols, schedule, steps);
  const double m = static_cast<double>(std::min(rows, cols)), n = static_cast<double>(std::max(rows, cols));
  const auto restarts_at = [&](int t) {
    return std::find(restart_iterations.begin(), restart_iterations.end(), t) != restart_iterations.end();
  };
  NsWork w{.wide = m * m * n};  // R = X·Xᵀ
  bool have_q = false;
  for (int t = 0; t < steps; ++t) {
    if (t != 0 && restarts_at(t)) {
      w.wide += 2 * m * m * n;  // X ← Q·X; R = X·Xᵀ
      have_q = false;
    }
    if (schedule.At(t).c != 0) w.square += m * m * m;  // R·R
    if (have_q) w.square += m * m * m;                 // Q·Z
    have_q = true;
    if (t + 1 < steps && !restarts_at(t + 1)) w.square += 2 * m * m * m;  // R·Z, Z·RZ
  }
  if (have_q) w.wide += m * m * n;  // Q·X
  return w;
}

bool PreferGram(int64_t rows, int64_t cols, const NsSchedule& schedule, int steps,
                std::span<const int> restart_iterations, double square_weight) {
  if (rows == cols || rows <= 0 || cols <= 0) return false;
  const NsWork standard = StandardNsWork(rows, cols, schedule, steps);
  const NsWork gram = GramNsWork(rows, cols, schedule, steps, restart_iterations);
  return gram.wide + square_weight * gram.square < standard.wide + square_weight * standard.square;
}

}  // namespace muond::optim
