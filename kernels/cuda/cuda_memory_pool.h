// CudaMemoryPool: a caching allocator of device memory for one CUDA device and one stream.
//
// Why: cudaMalloc and cudaFree synchronize the device and cost tens of microseconds, so a training
// loop must not call them per step. The pool hands out blocks rounded up to a size class and keeps
// every released block on a free list of its size class; the next request of that class reuses it
// without touching the driver. The pool therefore grows while a workload warms up (first step,
// first batch of a new shape) and stays flat afterwards. Memory is returned to the driver only when
// a cudaMalloc fails (all cached blocks are freed and the allocation retried once) and on
// destruction.
//
// Stream ordering makes reuse safe without events: every user of the pool's memory enqueues its
// work on the single stream of the owning backend, so work on a released block that is still
// pending runs before anything the next owner enqueues.
//
// Ownership: the pool owns every block it ever allocated; callers borrow blocks between Acquire
// and Release. Blocks still borrowed when the pool is destroyed are freed with it, so the pool must
// outlive its users. Thread-safety: Acquire, Release and the counters may be called concurrently.
#pragma once

#include <cstddef>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"

namespace muond::kernels::cuda {

class CudaMemoryPool {
 public:
  explicit CudaMemoryPool(int device) : device_(device) {}
  ~CudaMemoryPool();
  CudaMemoryPool(const CudaMemoryPool&) = delete;
  CudaMemoryPool& operator=(const CudaMemoryPool&) = delete;

  // A block of at least `bytes` bytes (at least one size class even for 0), aligned to 256 bytes
  // as cudaMalloc returns them. RESOURCE_EXHAUSTED when the device is out of memory even after the
  // cache was emptied.
  absl::StatusOr<void*> Acquire(size_t bytes);

  // Gives a block obtained from Acquire back to its free list. A pointer the pool did not hand out
  // is ignored rather than put on a free list where it could corrupt a later owner's memory.
  void Release(void* block);

  // Bytes currently obtained from cudaMalloc (borrowed + cached) and currently borrowed.
  size_t bytes_reserved() const;
  size_t bytes_in_use() const;
  // How many times Acquire had to call cudaMalloc; flat in a steady-state loop.
  size_t device_allocations() const;

  // The size class of a request: multiples of 512 bytes up to 1 MiB, of 64 KiB up to 64 MiB, of
  // 2 MiB above, so that nearly equal requests (a tensor and its neighbour with one more row) share
  // blocks while a block wastes at most ~6% of its size (beyond the 512-byte minimum).
  static size_t RoundUp(size_t bytes);

 private:
  // Frees every cached (not borrowed) block after waiting for the device; takes mu_ only to move
  // the blocks off the free lists and to count them, never while it waits.
  void EmptyCache();

  const int device_;
  mutable std::mutex mu_;
  std::unordered_map<void*, size_t> in_use_;             // borrowed block → size class
  std::unordered_map<size_t, std::vector<void*>> free_;  // size class → cached blocks
  size_t bytes_reserved_ = 0;
  size_t bytes_in_use_ = 0;
  size_t device_allocations_ = 0;
};

}  // namespace muond::kernels::cuda
