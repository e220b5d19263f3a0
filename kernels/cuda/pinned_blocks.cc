#include "kernels/cuda/pinned_blocks.h"

#include <cuda_runtime_api.h>

#include <bit>
#include <utility>

#include "kernels/cuda/cuda_status.h"

namespace muond::kernels::cuda {

PinnedBlocks::Lease::Lease(Lease&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)),
      block_(std::exchange(other.block_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)) {}

PinnedBlocks::Lease& PinnedBlocks::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    if (pool_ != nullptr) pool_->Give(block_, bytes_);
    pool_ = std::exchange(other.pool_, nullptr);
    block_ = std::exchange(other.block_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

PinnedBlocks::Lease::~Lease() {
  if (pool_ != nullptr) pool_->Give(block_, bytes_);
}

void PinnedBlocks::Lease::Discard() {
  if (pool_ == nullptr) return;
  cudaFreeHost(block_);  // waits for the device: nothing can still be copying into it afterwards
  pool_ = nullptr;
  block_ = nullptr;
  bytes_ = 0;
}

PinnedBlocks::~PinnedBlocks() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [bytes, blocks] : idle_) {
    for (void* block : blocks) cudaFreeHost(block);
  }
  idle_.clear();
}

absl::StatusOr<PinnedBlocks::Lease> PinnedBlocks::Take(size_t bytes) {
  const size_t size = std::bit_ceil(bytes < kMinBlockBytes ? kMinBlockBytes : bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = idle_.find(size); it != idle_.end() && !it->second.empty()) {
      void* block = it->second.back();
      it->second.pop_back();
      return Lease(this, block, size);
    }
  }
  MUOND_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  void* block = nullptr;
  if (const cudaError_t error = cudaMallocHost(&block, size); error != cudaSuccess) {
    cudaGetLastError();  // not sticky: keep it from surfacing as a later launch's error
    return CudaStatus(error, "cudaMallocHost");
  }
  return Lease(this, block, size);
}

void PinnedBlocks::Give(void* block, size_t bytes) {
  if (bytes <= kMaxBlockBytes) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<void*>& blocks = idle_[bytes];
    if (blocks.size() < kMaxIdlePerSize) {
      blocks.push_back(block);
      return;
    }
  }
  cudaFreeHost(block);  // without mu_: freeing pinned memory may wait for the device
}

}  // namespace muond::kernels::cuda
