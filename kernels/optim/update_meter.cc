// UpdateMeter (step_telemetry.h): Σ W² and Σ ΔW² of an update into the step's pending sums (backend
// memory): by the update itself where the backend measures in its own pass, else chunk by chunk
// through one scratch buffer per backend; and StepTelemetry::AddNsInputs.
#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <vector>

#include "common/status_macros.h"
#include "kernels/optim/newton_schulz.h"
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

// Σ before² and Σ (before − after)² of n host floats, in fp64, eight partial sums each: one pass.
void HostSums(const float* before, const float* after, size_t n, double* sums) {
  double w[8] = {}, d[8] = {};
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (size_t k = 0; k < 8; ++k) {
      const double b = before[i + k];
      const double delta = b - static_cast<double>(after[i + k]);
      w[k] += b * b;
      d[k] += delta * delta;
    }
  }
  for (; i < n; ++i) {
    const double b = before[i];
    const double delta = b - static_cast<double>(after[i]);
    w[0] += b * b;
    d[0] += delta * delta;
  }
  sums[0] = ((w[0] + w[1]) + (w[2] + w[3])) + ((w[4] + w[5]) + (w[6] + w[7]));
  sums[1] = ((d[0] + d[1]) + (d[2] + d[3])) + ((d[4] + d[5]) + (d[6] + d[7]));
}

}  // namespace

// Small chunks stay in a CPU's cache between reading the master before and after; a device pays
// kernel launches for each chunk's sums, so it takes fewer, larger ones. Even, so 16-bit offsets
// stay aligned.
size_t UpdateMeter::ChunkElements(const kernels::Backend& backend) {
  return backend.HostAddressable() ? size_t{1} << 16 : size_t{1} << 22;
}

absl::Status UpdateMeter::Reserve(kernels::Backend& backend, StepTelemetry& telemetry) {
  MUOND_RETURN_IF_ERROR(telemetry.pending.Prepare(backend));
  MeterScratch& scratch = backend.Shared<MeterScratch>();
  std::lock_guard<std::mutex> lock(scratch.mu);
  return ScratchOf(backend, scratch).status();
}

absl::Status UpdateMeter::Measure(kernels::Backend& backend, kernels::StoredRef master, size_t count,
                                  absl::FunctionRef<absl::Status(size_t, size_t, double*)> apply,
                                  StepTelemetry* telemetry, bool in_pass) {
  if (telemetry == nullptr || !telemetry->measure) return apply(0, count, nullptr);
  if (in_pass && backend.MeasuresUpdatesInPass() && master.dtype == kernels::StorageDtype::kFp32) {
    // The update measures itself, every element, in its own pass: nothing sampled, no extra pass.
    MUOND_ASSIGN_OR_RETURN(double* sums, telemetry->pending.Reserve(backend, 2, [telemetry](std::span<const double> s) {
      telemetry->master_sum_squares += s[0];
      telemetry->update_sum_squares += s[1];
    }));
    MUOND_RETURN_IF_ERROR(apply(0, count, sums));
    telemetry->updated_elements += static_cast<int64_t>(count);
    return absl::OkStatus();
  }
  MeterScratch& scratch = backend.Shared<MeterScratch>();
  std::lock_guard<std::mutex> lock(scratch.mu);
  MUOND_ASSIGN_OR_RETURN(float* before, ScratchOf(backend, scratch));
  const size_t chunk = ChunkElements(backend);
  const size_t chunks = (count + chunk - 1) / chunk;
  const size_t measured = std::min(chunks, kMeasuredChunks);
  // The measured chunks, evenly spaced (each in the middle of its share of the chunks); what they
  // hold, over the whole, is the weight of their sums.
  std::vector<size_t> picked(measured);
  size_t measured_elements = 0;
  for (size_t i = 0; i < measured; ++i) {
    picked[i] = (2 * i + 1) * chunks / (2 * measured);
    measured_elements += std::min(chunk, count - picked[i] * chunk);
  }
  const double weight = measured_elements > 0 ? static_cast<double>(count) / measured_elements : 1.0;
  const bool host_fp32 = backend.HostAddressable() && master.dtype == kernels::StorageDtype::kFp32;
  size_t done = 0;
  for (size_t c : picked) {
    const size_t offset = c * chunk;
    const size_t n = std::min(chunk, count - offset);
    if (offset > done) MUOND_RETURN_IF_ERROR(apply(done, offset - done, nullptr));
    const kernels::StoredRef w = master.At(offset);
    // Σ W² before and Σ ΔW², scaled to the whole master.
    MUOND_ASSIGN_OR_RETURN(double* sums,
                           telemetry->pending.Reserve(backend, 2, [telemetry, weight](std::span<const double> s) {
                             telemetry->master_sum_squares += s[0] * weight;
                             telemetry->update_sum_squares += s[1] * weight;
                           }));
    MUOND_RETURN_IF_ERROR(backend.Widen(w.dtype, w.data, before, n));
    if (host_fp32) {
      // Host memory: both sums in one pass after the update, from the copy and the master itself.
      MUOND_RETURN_IF_ERROR(apply(offset, n, nullptr));
      HostSums(before, static_cast<const float*>(w.data), n, sums);
    } else {
      MUOND_RETURN_IF_ERROR(backend.SumSquaresTo(before, n, 1, &sums[0]));
      MUOND_RETURN_IF_ERROR(apply(offset, n, nullptr));
      // before ← W_before − W_after: −ΔW, the same sum of squares. The backend orders this after
      // the first sum's kernels, and the next measurement's Widen after this one's: `before` is
      // reused only in the backend's own order.
      MUOND_RETURN_IF_ERROR(backend.Axpby(-1.0f, w, 1.0f, before, n));
      MUOND_RETURN_IF_ERROR(backend.SumSquaresTo(before, n, 1, &sums[1]));
    }
    done = offset + n;
  }
  if (done < count) MUOND_RETURN_IF_ERROR(apply(done, count - done, nullptr));
  telemetry->updated_elements += static_cast<int64_t>(count);
  return absl::OkStatus();
}

void StepTelemetry::AddNsInputs(std::span<const double> values, const std::vector<bool>& idle, bool with_residual) {
  const size_t count = idle.size();
  for (size_t i = 0; i < count; ++i) {
    momentum_sum_squares += values[i];
    ++matrices;
    const double norm = std::sqrt(values[i]);
    smallest_momentum_norm = std::min(smallest_momentum_norm, norm);
    // A momentum of exactly zero never had a non-zero gradient, and one without a gradient this
    // step only decays: not a norm that fell (docs/operations.md, Warnings).
    if (norm > 0 && !idle[i]) smallest_nonzero_momentum_norm = std::min(smallest_nonzero_momentum_norm, norm);
  }
  if (with_residual) residual = ResidualFromSums(values[count], values[count + 1]);
}

}  // namespace muond::optim
