// Newton–Schulz orthogonalization (docs/algorithms.md, Muon step 2), written against the Backend
// primitives, and NsWorkspace, the scratch buffers it reuses between calls.
//
// NewtonSchulz maps a batch of rows×cols matrices G_i to O_i ≈ U_i·V_iᵀ (the polar factor of
// G_i = U_i·Σ_i·V_iᵀ) with a fixed number of odd-quintic iterations; same-shape matrices go through
// the backend's strided-batched GEMM together. GramNewtonSchulz computes the same map on the small
// m×m Gram matrix instead of the m×n iterate, which saves GEMM FLOPs when n is well above m.
//
// Ownership: NsWorkspace owns its backend buffers and must not outlive the backend it was used with.
// Thread-safety: a workspace is not thread-safe; concurrent NewtonSchulz calls need one workspace
// each.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/optim/options.h"

namespace muond::optim {

// Backend scratch buffers addressed by slot number, grown on demand and kept between calls so a
// training loop allocates only on its first step. Slots [0, kFirstFreeSlot) are NewtonSchulz's
// (0..3) and GramNewtonSchulz's (0..5); callers (Muon's gather buffers) use the slots from
// kFirstFreeSlot on.
class NsWorkspace {
 public:
  static constexpr int kFirstFreeSlot = 6;

  NsWorkspace() = default;
  NsWorkspace(const NsWorkspace&) = delete;
  NsWorkspace& operator=(const NsWorkspace&) = delete;

  // A buffer of at least `count` floats in `backend`'s memory; its contents are unspecified.
  // Buffers from another backend are dropped first, so one workspace never mixes devices.
  absl::StatusOr<float*> Get(kernels::Backend& backend, int slot, size_t count);

  // Grows NewtonSchulz's slots (GramNewtonSchulz's with `gram`) to what a call with this shape and
  // batch needs, so a caller can fail for lack of memory before it changes any state.
  absl::Status ReserveFor(kernels::Backend& backend, int64_t rows, int64_t cols, int64_t batch, bool gram = false);

  // Floats currently held across all slots.
  size_t held() const;
  void Release();

 private:
  kernels::Backend* backend_ = nullptr;
  std::vector<std::unique_ptr<kernels::DeviceBuffer>> buffers_;
};

// Orthogonalizes `batch` row-major rows×cols matrices stored back to back at `in` (device pointers)
// and writes the results to `out` (same layout; `out` may equal `in`). Per matrix: X ← G, transposed
// when rows > cols so X is wide; X ← X / (norm_safety·‖X‖_F + eps); then for t < steps, with
// (a, b, c) = schedule.At(t): A = X·Xᵀ; B = b·A + c·A·A; X = a·X + B·X; finally transposed back.
// A zero matrix gives a zero result (never NaN), even with eps = 0. With `input_sum_squares` (a host
// array of `batch` values), each input matrix's Σ G² (the sums its normalization reads anyway).
absl::Status NewtonSchulz(kernels::Backend& backend, const NsSchedule& schedule, int steps, double eps,
                          double norm_safety, kernels::MatmulPrecision precision, const float* in, float* out,
                          int64_t rows, int64_t cols, int64_t batch, NsWorkspace& ws,
                          double* input_sum_squares = nullptr);

// Gram Newton–Schulz: the same polynomial map as NewtonSchulz (same normalization, schedule and
// `steps`; same arguments and layout), computed on the m×m Gram matrix R = X·Xᵀ,
// m = min(rows, cols), instead of the m×n iterate. Per matrix, after X is made wide and normalized
// as in NewtonSchulz:
//   R = X·Xᵀ; Q = none
//   for t < steps, with (a, b, c) = schedule.At(t):
//     if t ≠ 0 and t is in restart_iterations: X ← Q·X; R ← X·Xᵀ; Q = none
//     Z = b·R + c·R·R                           (no R·R GEMM when c = 0)
//     Q = a·I + Z if Q is none, else a·Q + Q·Z
//     unless t is the last step or t + 1 restarts: R ← a·RZ + Z·RZ with RZ = a·R + R·Z
//   result Q·X (X itself when steps = 0), transposed back.
// R, Z and Q are polynomials in the Gram matrix of the current X, so they commute and in exact
// arithmetic Q·X is NewtonSchulz's result. In floating point R and Q drift from the iterate they stand for,
// the more so the more steps run on the Gram matrix; a restart re-anchors them on an explicit X (at
// the cost of two m×n-sized GEMMs). Entries of restart_iterations outside [1, steps) have no
// effect.
// Cost in multiply-adds per matrix: 2·m²·n·(1 + restarts) plus at most 4·m³ per step (one m³
// fewer for a cubic tuple), against NewtonSchulz's 2·m²·n + m³ per step, so it pays once n is well
// above 1.5·m. Square matrices save nothing and go to NewtonSchulz unchanged, restart_iterations
// ignored. A zero matrix gives a zero result.
// Workspace: slots 0..5 (ReserveFor with gram = true).
absl::Status GramNewtonSchulz(kernels::Backend& backend, const NsSchedule& schedule, int steps,
                              std::span<const int> restart_iterations, double eps, double norm_safety,
                              kernels::MatmulPrecision precision, const float* in, float* out, int64_t rows,
                              int64_t cols, int64_t batch, NsWorkspace& ws, double* input_sum_squares = nullptr);

// ‖X·Xᵀ − I‖_F/√m of one row-major rows×cols matrix X in backend memory, m = min(rows, cols) (the
// Gram matrix on the smaller side): 0 for orthonormal rows (or columns), the RMS of σᵢ² − 1 over X's
// m singular values. One m×m fp32 GEMM (whatever the group's matmul_precision) and one sum; it
// uses workspace slot 2, so it must not run while a Newton–Schulz call needs that slot.
absl::StatusOr<double> OrthogonalityResidual(kernels::Backend& backend, const float* x, int64_t rows, int64_t cols,
                                             NsWorkspace& ws);

}  // namespace muond::optim
