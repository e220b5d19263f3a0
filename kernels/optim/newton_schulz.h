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

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/optim/options.h"

namespace muond::optim {

// What a Newton–Schulz call asks of its workspace beyond its shape (NsSlotFloats).
struct NsUse {
  bool gram = false;      // GramNewtonSchulz (a square shape runs NewtonSchulz)
  bool in_place = false;  // its GEMMs may write an operand (Backend::GemmMayWriteAnOperand)
  bool aol = false;       // NewtonSchulz with AOL preconditioning
};

// Backend scratch buffers addressed by slot number, grown on demand and kept between calls so a
// training loop allocates only on its first step. Slots [0, kFirstFreeSlot) are NewtonSchulz's
// (0..3) and GramNewtonSchulz's (0..5); callers (Muon's gather buffers) use the slots from
// kFirstFreeSlot on. The floats held across all slots may be bounded (set_limit): callers cut their
// batches to fit it; a hard bound makes a Get or Fit that would hold more RESOURCE_EXHAUSTED (holding
// nothing new), a soft one lets it through (one matrix that needs more than the bound still runs).
class NsWorkspace {
 public:
  static constexpr int kFirstFreeSlot = 6;

  NsWorkspace() = default;
  NsWorkspace(const NsWorkspace&) = delete;
  NsWorkspace& operator=(const NsWorkspace&) = delete;

  // A buffer of at least `count` floats in `backend`'s memory; its contents are unspecified.
  // Buffers from another backend are dropped first, so one workspace never mixes devices.
  absl::StatusOr<float*> Get(kernels::Backend& backend, int slot, size_t count);

  // Grows the slots a call with this shape, batch and use (NsSlotFloats) needs to what it needs, so
  // a caller can fail for lack of memory before it changes any state.
  absl::Status ReserveFor(kernels::Backend& backend, int64_t rows, int64_t cols, int64_t batch, const NsUse& use);

  // Makes slot s hold at least need[s] floats for every s < need.size(). When keeping every buffer
  // held now beside them would exceed the limit, the buffers larger than this call needs (and those
  // of slots past need.size()) are freed first. RESOURCE_EXHAUSTED when Σ need exceeds the limit.
  absl::Status Fit(kernels::Backend& backend, std::span<const size_t> need);

  // The most floats held at once; 0 (the default): no bound. `hard`: more is refused; otherwise the
  // bound only guides (batches cut to fit, larger buffers dropped first). Takes effect at the next
  // Get or Fit.
  void set_limit(size_t floats, bool hard = true) {
    hard_.store(hard, std::memory_order_relaxed);
    limit_.store(floats, std::memory_order_relaxed);
  }
  size_t limit() const { return limit_.load(std::memory_order_relaxed); }
  // Whether the bound refuses what exceeds it.
  bool hard() const { return hard_.load(std::memory_order_relaxed); }

  // Floats currently held across all slots. Safe to read from any thread (metrics).
  size_t held() const { return held_.load(std::memory_order_relaxed); }
  void Release();

 private:
  absl::Status Refuse(size_t floats) const;
  void Drop(int slot);

  kernels::Backend* backend_ = nullptr;
  std::vector<std::unique_ptr<kernels::DeviceBuffer>> buffers_;
  std::atomic<size_t> held_{0};
  std::atomic<size_t> limit_{0};
  std::atomic<bool> hard_{true};
};

// What `use` says of a Newton–Schulz call of `options`' precision and preconditioner on `backend`.
NsUse NsUseOf(const kernels::Backend& backend, const GroupOptions& options, bool gram);

// Floats each of the workspace slots needs for a call on `batch` rows×cols matrices (m = min(rows,
// cols)): slot 0 (X) batch·rows·cols and 2 (A, or R) batch·m²; NewtonSchulz's 1 (X') batch·rows·cols
// and 3 (B) batch·m², which in place need only AOL's row scales (batch·m) and transposed A
// (batch·m²), and otherwise one m×m matrix in slot 3 (OrthogonalitySumSquares' second); GramNewtonSchulz's 1
// batch·rows·cols and 3, 4 (Z, Q) batch·m², and 5 batch·m², or m in place (a column of ones). The others 0.
std::array<size_t, NsWorkspace::kFirstFreeSlot> NsSlotFloats(int64_t rows, int64_t cols, int64_t batch,
                                                             const NsUse& use);

// Newton–Schulz's workspace of one backend, shared by all its Muon groups and sessions (holding
// one each would multiply the largest batch's scratch by the number of sessions). `mu` is held for
// the whole Newton–Schulz part of a step, from reserving its scratch to applying its results.
struct SharedNsWorkspace {
  std::mutex mu;
  NsWorkspace ws;
};
inline SharedNsWorkspace& BackendNsWorkspace(kernels::Backend& backend) { return backend.Shared<SharedNsWorkspace>(); }

// The cost rule of ns_algorithm = auto (docs/algorithms.md, Muon step 2): multiply-adds of one
// call per matrix, split into the products that run over the long side n ("wide": X·Xᵀ and M·X,
// m²·n each) and the m×m products ("square": m³ each), m = min(rows, cols), n = max(rows, cols).
struct NsWork {
  double wide = 0, square = 0;
};
NsWork StandardNsWork(int64_t rows, int64_t cols, const NsSchedule& schedule, int steps);
NsWork GramNsWork(int64_t rows, int64_t cols, const NsSchedule& schedule, int steps,
                  std::span<const int> restart_iterations);
// Whether GramNewtonSchulz is expected to take less time than NewtonSchulz on this shape: it is
// when wide + square_weight·square is smaller for it. `square_weight` is a backend's time per
// multiply-add of the square products (and the Gram iteration's m²-sized copies they bring)
// relative to the wide ones. Never for a square shape, which GramNewtonSchulz hands to NewtonSchulz.
bool PreferGram(int64_t rows, int64_t cols, const NsSchedule& schedule, int steps,
                std::span<const int> restart_iterations, double square_weight);
// square_weight per backend: the CPU's fitted to the measured crossovers (bench/ns_choice_bench);
// CUDA's is the plain FLOP count, not measured.
inline constexpr double kCpuSquareWeight = 1.1;
inline constexpr double kCudaSquareWeight = 1.0;

// Orthogonalizes `batch` row-major rows×cols matrices stored back to back at `in` (device pointers)
// and writes the results to `out` (same layout; `out` may equal `in`). Per matrix: X ← G, transposed
// when rows > cols so X is wide; X ← X / (norm_safety·‖X‖_F + eps); then for t < steps, with
// (a, b, c) = schedule.At(t): A = X·Xᵀ; B = b·A + c·A·A; X = a·X + B·X; finally transposed back.
// A zero matrix gives a zero result (never NaN), even with eps = 0. With `input_sum_squares`
// (backend memory for `batch` doubles), each input matrix's Σ G² (the sums its normalization reads
// anyway), written there in order with the backend's work: nothing here waits for a device
// (Backend::NormalizeBatched).
//
// With `preconditioner` kAol (Turbo-Muon, docs/algorithms.md): instead of the Frobenius scaling,
// A = X·Xᵀ, s_i = (max(Σ_j |A_ij|, eps))^(-1/2) (eps 0 taken as 1e-30), X ← diag(s)·X, and the
// first iteration uses diag(s)·A·diag(s) (= the scaled X's X·Xᵀ) rather than computing it again;
// norm_safety is not used. `input_sum_squares` are then the sums of the unscaled input. A is formed
// in fp32 from the unscaled input, so its entries reach n·max|G|² (AolGramBound): the finite-step
// guard skips a step whose input could overflow it rather than let 0·inf give NaN. AOL's scales
// depend on the orientation (unlike the map itself): they go to the rows of the wide orientation,
// and of a square matrix to its rows as the caller's matrix has them — with `stored_transposed`
// (`in` holds each matrix's transpose, as column blocks are stored), to the stored columns.
absl::Status NewtonSchulz(kernels::Backend& backend, const NsSchedule& schedule, int steps, double eps,
                          double norm_safety, kernels::MatmulPrecision precision, const float* in, float* out,
                          int64_t rows, int64_t cols, int64_t batch, NsWorkspace& ws,
                          double* input_sum_squares = nullptr,
                          NsPreconditioner preconditioner = NsPreconditioner::kFrobenius,
                          bool stored_transposed = false);

// The largest magnitude AOL's Gram matrix A = X·Xᵀ can hold for a rows×cols input whose elements
// are at most `input_bound`: a row of the wide X has max(rows, cols) elements, so |A_ij| ≤
// max(rows, cols)·input_bound² (one rounding margin included). For the optimizers' BoundStep.
double AolGramBound(int64_t rows, int64_t cols, double input_bound);

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

// The orthogonality residual of one row-major rows×cols matrix X in backend memory on the directions
// X has (docs/algorithms.md, Telemetry): with G the m×m Gram matrix on the smaller side
// (m = min(rows, cols)) and λᵢ = σᵢ² its eigenvalues, ‖G² − G‖_F / ‖G‖_F = √(Σ λᵢ²(λᵢ − 1)² / Σ λᵢ²),
// the RMS of σᵢ² − 1 weighted by σᵢ⁴: 0 for orthonormal rows (or columns) and for any partial
// isometry (the zero singular values of a rank-deficient X weigh nothing), 0 for X = 0. Two fp32
// GEMMs (m×m×max and m×m×m, whatever the group's matmul_precision) and two sums; it uses workspace
// slots 2 and 3, so it must not run while a Newton–Schulz call needs them. Waits for the device.
absl::StatusOr<double> OrthogonalityResidual(kernels::Backend& backend, const float* x, int64_t rows, int64_t cols,
                                             NsWorkspace& ws);
// The same without waiting: ‖G² − G‖_F² into sums[0] and ‖G‖_F² into sums[1] (backend memory for two
// doubles), in order with the backend's other work; ResidualFromSums gives the residual.
absl::Status OrthogonalitySumSquares(kernels::Backend& backend, const float* x, int64_t rows, int64_t cols,
                                     NsWorkspace& ws, double* sums);
double ResidualFromSums(double gram_minus_square, double gram);

}  // namespace muond::optim
