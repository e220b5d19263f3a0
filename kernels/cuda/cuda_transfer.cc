#include "kernels/cuda/cuda_transfer.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "common/status_macros.h"
#include "kernels/cuda/cuda_status.h"

namespace muond::kernels::cuda {
namespace {

constexpr size_t kSlotFloats = PinnedRing::kSlotBytes / sizeof(float);

// The ring's copy stream waits for an event recorded on `compute` now.
absl::Status StartOn(PinnedRing& ring, cudaStream_t compute) {
  MUOND_CUDA_RETURN_IF_ERROR(cudaSetDevice(ring.device));
  MUOND_CUDA_RETURN_IF_ERROR(cudaEventRecord(ring.start, compute));
  MUOND_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(ring.stream, ring.start, 0));
  return absl::OkStatus();
}

// Makes the ring's copy stream wait for the work enqueued on `compute` so far; on failure the
// ring goes back to `cache` (it was not used).
absl::StatusOr<std::unique_ptr<PinnedRing>> StartRing(RingCache* cache, std::unique_ptr<PinnedRing> ring,
                                                      cudaStream_t compute) {
  absl::Status status = StartOn(*ring, compute);
  if (!status.ok()) {
    cache->Give(std::move(ring));
    return status;
  }
  return ring;
}

// Waits for the ring's copies and hands it back; a ring whose copies failed is not reused.
void FinishRing(RingCache* cache, std::unique_ptr<PinnedRing> ring) {
  if (ring == nullptr) return;
  cudaSetDevice(ring->device);
  if (cudaStreamSynchronize(ring->stream) != cudaSuccess) {
    cudaGetLastError();
    return;  // freed here: its stream is in an unknown state
  }
  for (PinnedRing::Slot& slot : ring->slots) slot = PinnedRing::Slot{slot.host, slot.done};
  ring->next = 0;
  cache->Give(std::move(ring));
}

// A transfer's borrowed ring, waited for and handed back when the transfer is destroyed.
class RingLease {
 public:
  RingLease(RingCache* cache, std::unique_ptr<PinnedRing> ring) : cache_(cache), ring_(std::move(ring)) {}
  ~RingLease() { FinishRing(cache_, std::move(ring_)); }
  RingLease(const RingLease&) = delete;
  RingLease& operator=(const RingLease&) = delete;

 protected:
  RingCache* cache_;
  std::unique_ptr<PinnedRing> ring_;
};

class PinnedHostToDevice final : public HostToDevice, private RingLease {
 public:
  using RingLease::RingLease;

  absl::Status Enqueue(const float* host, float* device, size_t count) override {
    MUOND_CUDA_RETURN_IF_ERROR(cudaSetDevice(ring_->device));
    while (count > 0) {
      PinnedRing::Slot& slot = ring_->slots[ring_->next];
      ring_->next = (ring_->next + 1) % PinnedRing::kSlots;
      if (slot.in_flight) MUOND_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(slot.done));
      slot.in_flight = false;
      const size_t n = std::min(count, kSlotFloats);
      std::memcpy(slot.host, host, n * sizeof(float));
      MUOND_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(device, slot.host, n * sizeof(float), cudaMemcpyHostToDevice, ring_->stream));
      MUOND_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.done, ring_->stream));
      slot.in_flight = true;
      host += n;
      device += n;
      count -= n;
    }
    return absl::OkStatus();
  }

  absl::Status Wait() override {
    MUOND_CUDA_RETURN_IF_ERROR(cudaSetDevice(ring_->device));
    MUOND_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ring_->stream));
    for (PinnedRing::Slot& slot : ring_->slots) slot.in_flight = false;
    return absl::OkStatus();
  }
};

class PinnedDeviceToHost final : public DeviceToHost, private RingLease {
 public:
  using RingLease::RingLease;

  absl::Status Enqueue(const float* device, float* host, size_t count) override {
    MUOND_CUDA_RETURN_IF_ERROR(cudaSetDevice(ring_->device));
    while (count > 0) {
      PinnedRing::Slot& slot = ring_->slots[ring_->next];
      ring_->next = (ring_->next + 1) % PinnedRing::kSlots;
      MUOND_RETURN_IF_ERROR(Drain(slot));
      const size_t n = std::min(count, kSlotFloats);
      MUOND_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(slot.host, device, n * sizeof(float), cudaMemcpyDeviceToHost, ring_->stream));
      MUOND_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.done, ring_->stream));
      slot.in_flight = true;
      slot.destination = host;
      slot.count = n;
      host += n;
      device += n;
      count -= n;
    }
    return absl::OkStatus();
  }

  absl::Status Wait() override {
    MUOND_CUDA_RETURN_IF_ERROR(cudaSetDevice(ring_->device));
    // Oldest first, so that the copies out of the slots follow the DMA order.
    for (size_t i = 0; i < PinnedRing::kSlots; ++i) {
      MUOND_RETURN_IF_ERROR(Drain(ring_->slots[(ring_->next + i) % PinnedRing::kSlots]));
    }
    return absl::OkStatus();
  }

 private:
  // Waits for the slot's DMA and copies its values on to their destination.
  static absl::Status Drain(PinnedRing::Slot& slot) {
    if (!slot.in_flight) return absl::OkStatus();
    MUOND_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(slot.done));
    std::memcpy(slot.destination, slot.host, slot.count * sizeof(float));
    slot.in_flight = false;
    return absl::OkStatus();
  }
};

}  // namespace

PinnedRing::~PinnedRing() {
  cudaSetDevice(device);
  if (stream != nullptr) cudaStreamSynchronize(stream);
  for (Slot& slot : slots) {
    if (slot.host != nullptr) cudaFreeHost(slot.host);
    if (slot.done != nullptr) cudaEventDestroy(slot.done);
  }
  if (start != nullptr) cudaEventDestroy(start);
  if (stream != nullptr) cudaStreamDestroy(stream);
}

absl::StatusOr<std::unique_ptr<PinnedRing>> PinnedRing::Create(int device) {
  auto ring = std::make_unique<PinnedRing>();  // its destructor frees whatever was made before a failure
  ring->device = device;
  MUOND_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  MUOND_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&ring->stream, cudaStreamNonBlocking));
  MUOND_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&ring->start, cudaEventDisableTiming));
  for (Slot& slot : ring->slots) {
    void* host = nullptr;
    MUOND_CUDA_RETURN_IF_ERROR(cudaMallocHost(&host, kSlotBytes));
    slot.host = static_cast<float*>(host);
    MUOND_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&slot.done, cudaEventDisableTiming));
  }
  return ring;
}

absl::StatusOr<std::unique_ptr<PinnedRing>> RingCache::Take() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!idle_.empty()) {
      std::unique_ptr<PinnedRing> ring = std::move(idle_.back());
      idle_.pop_back();
      return ring;
    }
  }
  return PinnedRing::Create(device_);
}

void RingCache::Give(std::unique_ptr<PinnedRing> ring) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (idle_.size() < kMaxIdle) {
      idle_.push_back(std::move(ring));
      return;
    }
  }
  ring.reset();  // here, without mu_: the ring's destructor waits for its stream
}

absl::StatusOr<std::unique_ptr<HostToDevice>> NewPinnedHostToDevice(RingCache* cache, std::unique_ptr<PinnedRing> ring,
                                                                    cudaStream_t compute) {
  MUOND_ASSIGN_OR_RETURN(ring, StartRing(cache, std::move(ring), compute));
  return std::unique_ptr<HostToDevice>(new PinnedHostToDevice(cache, std::move(ring)));
}

absl::StatusOr<std::unique_ptr<DeviceToHost>> NewPinnedDeviceToHost(RingCache* cache, std::unique_ptr<PinnedRing> ring,
                                                                    cudaStream_t compute) {
  MUOND_ASSIGN_OR_RETURN(ring, StartRing(cache, std::move(ring), compute));
  return std::unique_ptr<DeviceToHost>(new PinnedDeviceToHost(cache, std::move(ring)));
}

}  // namespace muond::kernels::cuda
