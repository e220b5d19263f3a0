// Backend's defaults: synchronous pipelined transfers, for backends whose memory is the host's (the
// CPU backend), where there is nothing to overlap; per-tensor sums of squares; byte copies with
// memcpy. The refusals of the GPU transports are PeerPrimitives' (peer_primitives.cc).
#include "kernels/backend.h"

#include <cstring>

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

absl::Status Backend::CopyBytes(const void* src, void* dst, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

}  // namespace muond::kernels
