// The default pipelined transfers of Backend: synchronous copies, for backends whose memory is the
// host's (the CPU backend), where there is nothing to overlap.
#include "kernels/backend.h"

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

}  // namespace muond::kernels
