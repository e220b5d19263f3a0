// UpdateMeter (step_telemetry.h): Σ W² and Σ ΔW² of an update, chunk by chunk, through one scratch
// buffer per backend.
#include <algorithm>
#include <memory>
#include <mutex>

#include "common/status_macros.h"
#include "kernels/optim/step_telemetry.h"

namespace muond::optim {
namespace {

// The backend's scratch for measuring: one chunk of fp32, held by one measurement at a time.
struct MeterScratch {
  std::mutex mu;
  std::unique_ptr<kernels::DeviceBuffer> buffer;
};

absl::StatusOr<float*> ScratchOf(kernels::Backend& backend, MeterScratch& scratch) {
  const size_t chunk = UpdateMeter::ChunkElements(backend);
  if (scratch.buffer == nullptr || scratch.buffer->size() < chunk) {
    MUOND_ASSIGN_OR_RETURN(scratch.buffer, backend.Allocate(chunk));
  }
  return scratch.buffer->data();
}

}  // namespace

// Small chunks stay in a CPU's cache between reading the master before and after; a device pays a
// wait for each chunk's sums, so it takes fewer, larger ones. Even, so 16-bit offsets stay aligned.
size_t UpdateMeter::ChunkElements(const kernels::Backend& backend) {
  return backend.HostAddressable() ? size_t{1} << 16 : size_t{1} << 22;
}

absl::Status UpdateMeter::Reserve(kernels::Backend& backend) {
  MeterScratch& scratch = backend.Shared<MeterScratch>();
  std::lock_guard<std::mutex> lock(scratch.mu);
  return ScratchOf(backend, scratch).status();
}

absl::Status UpdateMeter::Measure(kernels::Backend& backend, kernels::StoredRef master, size_t count,
                                  absl::FunctionRef<absl::Status(size_t, size_t)> apply, StepTelemetry* telemetry) {
  if (telemetry == nullptr || !telemetry->measure) return apply(0, count);
  MeterScratch& scratch = backend.Shared<MeterScratch>();
  std::lock_guard<std::mutex> lock(scratch.mu);
  MUOND_ASSIGN_OR_RETURN(float* before, ScratchOf(backend, scratch));
  const size_t chunk = ChunkElements(backend);
  for (size_t offset = 0; offset < count; offset += chunk) {
    const size_t n = std::min(chunk, count - offset);
    const kernels::StoredRef w = master.At(offset);
    MUOND_RETURN_IF_ERROR(backend.Widen(w.dtype, w.data, before, n));
    double sums[2] = {0, 0};
    MUOND_RETURN_IF_ERROR(backend.SumSquares(before, n, 1, &sums[0]));
    MUOND_RETURN_IF_ERROR(apply(offset, n));
    // before ← W_before − W_after: −ΔW, the same sum of squares.
    MUOND_RETURN_IF_ERROR(backend.Axpby(-1.0f, w, 1.0f, before, n));
    MUOND_RETURN_IF_ERROR(backend.SumSquares(before, n, 1, &sums[1]));
    telemetry->master_sum_squares += sums[0];
    telemetry->update_sum_squares += sums[1];
  }
  telemetry->updated_elements += static_cast<int64_t>(count);
  return absl::OkStatus();
}

}  // namespace muond::optim
