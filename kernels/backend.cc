// Backend's defaults: synchronous pipelined transfers, for backends whose memory is the host's (the
// CPU backend), where there is nothing to overlap; per-tensor sums of squares; normalization with
// the scales computed on the host; byte copies with memcpy. The refusals of the GPU transports are
// PeerPrimitives' (peer_primitives.cc).
#include "kernels/backend.h"

#include <cmath>
#include <cstring>
#include <vector>

namespace muond::kernels {
namespace {

class SynchronousHostToDevice final : public HostToDevice {
 public:
  explicit SynchronousHostToDevice(Backend* backend) : backend_(backend) {}
  absl::Status Enqueue(const float* host, float* device, size_t count) override {
    return backend_->CopyToDevice(host, device, count);
  }
  absl::Status Wait() override { return absl::OkStatus(); }

 private:
  Backend* backend_;
};

class SynchronousDeviceToHost final : public DeviceToHost {
 public:
  explicit SynchronousDeviceToHost(Backend* backend) : backend_(backend) {}
  absl::Status Enqueue(const float* device, float* host, size_t count) override {
    return backend_->CopyToHost(device, host, count);
  }
  absl::Status Wait() override { return absl::OkStatus(); }

 private:
  Backend* backend_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<HostToDevice>> Backend::NewHostToDevice() {
  return std::make_unique<SynchronousHostToDevice>(this);
}

absl::StatusOr<std::unique_ptr<DeviceToHost>> Backend::NewDeviceToHost() {
  return std::make_unique<SynchronousDeviceToHost>(this);
}

absl::Status Backend::SumSquaresEach(std::span<const Slice> tensors, double* sums) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    absl::Status status = SumSquares(tensors[i].data, tensors[i].count, 1, &sums[i]);
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

absl::Status Backend::NormalizeBatched(float* x, size_t count, size_t batch, double eps, double norm_safety,
                                       double* sums) {
  if (batch == 0) return absl::OkStatus();
  std::vector<double> host_sums(batch);
  absl::Status status = SumSquares(x, count, batch, host_sums.data());
  if (!status.ok()) return status;
  std::vector<float> scales(batch);
  for (size_t i = 0; i < batch; ++i) {
    const double denom = norm_safety * std::sqrt(host_sums[i]) + eps;
    scales[i] = denom > 0 ? static_cast<float>(1.0 / denom) : 0.0f;
  }
  status = ScaleBatched(x, count, batch, scales.data());
  if (!status.ok() || sums == nullptr) return status;
  return CopyBytes(host_sums.data(), sums, batch * sizeof(double));
}

absl::Status Backend::CopyBytes(const void* src, void* dst, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

}  // namespace muond::kernels
