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
  // Destruction cannot report errors; the owning backend has synchronized its stream already.
  EmptyCache();
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [block, size] : in_use_) cudaFree(block);
  in_use_.clear();
}

absl::StatusOr<void*> CudaMemoryPool::Acquire(size_t bytes) {
  // Leave room for the rounding so it cannot wrap around.
  if (bytes > std::numeric_limits<size_t>::max() - 2 * kMiB) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes"));
  }
  const size_t size = RoundUp(bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = free_.find(size); it != free_.end() && !it->second.empty()) {
      void* block = it->second.back();
      it->second.pop_back();
      in_use_.emplace(block, size);
      bytes_in_use_ += size;
      return block;
    }
  }
  // The driver is called without mu_: cudaMalloc may wait for the device, and so does emptying
  // the cache, and neither should hold up a Release or a metrics read meanwhile.
  MUOND_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  void* block = nullptr;
  cudaError_t error = cudaMalloc(&block, size);
  if (error == cudaErrorMemoryAllocation) {
    // Cached blocks of other size classes may be what stands in the way: give them back to the
    // driver and try once more. cudaGetLastError clears the error the failed call left behind.
    cudaGetLastError();
    EmptyCache();
    error = cudaMalloc(&block, size);
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (error != cudaSuccess) {
    cudaGetLastError();
    return CudaStatus(
        error, absl::StrCat("cudaMalloc of ", size, " bytes (", bytes_reserved_, " bytes already held by the pool)"));
  }
  bytes_reserved_ += size;
  ++device_allocations_;
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

void CudaMemoryPool::EmptyCache() {
  std::unordered_map<size_t, std::vector<void*>> cached;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cached.swap(free_);
  }
  if (cached.empty()) return;
  // A cached block may still be read or written by work pending on the owner's stream; wait for
  // it explicitly rather than relying on cudaFree's implicit synchronization. The blocks are off
  // the free lists already, so no one can take them meanwhile, and mu_ is not held while waiting.
  cudaSetDevice(device_);
  cudaDeviceSynchronize();
  size_t freed = 0;
  for (auto& [size, blocks] : cached) {
    for (void* block : blocks) {
      cudaFree(block);
      freed += size;
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  bytes_reserved_ -= freed;
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
