// Newton–Schulz orthogonalization (docs/algorithms.md, Muon step 2), written against the Backend
// primitives, and NsWorkspace, the scratch buffers it reuses between calls.
//
// NewtonSchulz maps a batch of rows×cols matrices G_i to O_i ≈ U_i·V_iᵀ (the polar factor of
// G_i = U_i·Σ_i·V_iᵀ) with a fixed number of odd-quintic iterations; same-shape matrices go through
// the backend's strided-batched GEMM together.
//
// Ownership: NsWorkspace owns its backend buffers and must not outlive the backend it was used with.
// Thread-safety: a workspace is not thread-safe; concurrent NewtonSchulz calls need one workspace
// each.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/optim/options.h"

namespace muond::optim {

// Backend scratch buffers addressed by slot number, grown on demand and kept between calls so a
// training loop allocates only on its first step. Slots [0, kFirstFreeSlot) are NewtonSchulz's;
// callers (Muon's gather buffers) use the slots from kFirstFreeSlot on.
class NsWorkspace {
 public:
  static constexpr int kFirstFreeSlot = 4;

  NsWorkspace() = default;
  NsWorkspace(const NsWorkspace&) = delete;
  NsWorkspace& operator=(const NsWorkspace&) = delete;

  // A buffer of at least `count` floats in `backend`'s memory; its contents are unspecified.
  // Buffers from another backend are dropped first, so one workspace never mixes devices.
  absl::StatusOr<float*> Get(kernels::Backend& backend, int slot, size_t count);

  // Grows NewtonSchulz's slots to what a call with this shape and batch needs, so a caller can fail
  // for lack of memory before it changes any state.
  absl::Status ReserveFor(kernels::Backend& backend, int64_t rows, int64_t cols, int64_t batch);

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
// A zero matrix gives a zero result (never NaN), even with eps = 0.
absl::Status NewtonSchulz(kernels::Backend& backend, const NsSchedule& schedule, int steps, double eps,
                          double norm_safety, kernels::MatmulPrecision precision, const float* in,
                          float* out, int64_t rows, int64_t cols, int64_t batch, NsWorkspace& ws);

}  // namespace muond::optim
