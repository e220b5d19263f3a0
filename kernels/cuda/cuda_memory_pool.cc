#include "kernels/cuda/cuda_memory_pool.h"

#include <cuda_runtime_api.h>

#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"

namespace muond::kernels::cuda {

namespace {
constexpr size_t kMiB = size_t{1} << 20;
}  // namespace

size_t CudaMemoryPool::RoundUp(size_t bytes) {
  const size_t granule = bytes <= kMiB ? 512 : bytes <= 64 * kMiB ? 64 * 1024 : 2 * kMiB;
  if (bytes == 0) return granule;
  return (bytes + granule - 1) / granule * granule;
}

CudaMemoryPool::~CudaMemoryPool() {
  std::lock_guard<std::mutex> lock(mu_);
  // Destruction cannot report errors; the owning backend has synchronized its stream already.
  cudaSetDevice(device_);
  EmptyCacheLocked();
  for (const auto& [block, size] : in_use_) cudaFree(block);
  in_use_.clear();
}

absl::StatusOr<void*> CudaMemoryPool::Acquire(size_t bytes) {
  // Leave room for the rounding so it cannot wrap around.
  if (bytes > std::numeric_limits<size_t>::max() - 2 * kMiB) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes"));
  }
  const size_t size = RoundUp(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  void* block = nullptr;
  if (auto it = free_.find(size); it != free_.end() && !it->second.empty()) {
    block = it->second.back();
    it->second.pop_back();
  } else {
    MUOND_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    cudaError_t error = cudaMalloc(&block, size);
    if (error == cudaErrorMemoryAllocation) {
      // Cached blocks of other size classes may be what stands in the way: give them back to the
      // driver and try once more. cudaGetLastError clears the error the failed call left behind.
      cudaGetLastError();
      EmptyCacheLocked();
      error = cudaMalloc(&block, size);
    }
    if (error != cudaSuccess) {
      cudaGetLastError();
      return CudaStatus(
          error, absl::StrCat("cudaMalloc of ", size, " bytes (", bytes_reserved_, " bytes already held by the pool)"));
    }
    bytes_reserved_ += size;
    ++device_allocations_;
  }
  in_use_.emplace(block, size);
  bytes_in_use_ += size;
  return block;
}

void CudaMemoryPool::Release(void* block) {
  if (block == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = in_use_.find(block);
  if (it == in_use_.end()) return;
  const size_t size = it->second;
  in_use_.erase(it);
  bytes_in_use_ -= size;
  free_[size].push_back(block);
}

void CudaMemoryPool::EmptyCacheLocked() {
  if (free_.empty()) return;
  // A cached block may still be read or written by work pending on the owner's stream; wait for
  // it explicitly rather than relying on cudaFree's implicit synchronization.
  cudaDeviceSynchronize();
  for (auto& [size, blocks] : free_) {
    for (void* block : blocks) {
      cudaFree(block);
      bytes_reserved_ -= size;
    }
  }
  free_.clear();
}

size_t CudaMemoryPool::bytes_reserved() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_reserved_;
}

size_t CudaMemoryPool::bytes_in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_in_use_;
}

size_t CudaMemoryPool::device_allocations() const {
  std::lock_guard<std::mutex> lock(mu_);
  return device_allocations_;
}

}  // namespace muond::kernels::cuda
