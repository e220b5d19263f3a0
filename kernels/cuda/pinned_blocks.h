// PinnedBlocks: small pinned host blocks that the CUDA backend reads results back into (sums, the
// non-finite flag) and stages small host arrays through.
//
// Why: a copy between the device and pageable host memory is not asynchronous — to pageable memory
// cudaMemcpyAsync returns only once the copy is done — so a primitive that read back into the
// caller's array would wait for the device while holding the backend's lock. Through a pinned
// block the copy is truly queued on the stream; the primitive records an event, releases the lock,
// waits for the event and then copies the few bytes on to the caller.
//
// Ownership: a Lease lends one block to one primitive call and hands it back when destroyed; the
// pool keeps idle blocks (by size class) for the next call and frees them when destroyed, which
// must happen after every lease is gone. A lease whose copy may still be running (its wait failed)
// must be Discard()ed: the block is then freed instead of reused.
// Thread-safety: Take and a lease's return may be called concurrently; pinning (cudaMallocHost,
// which may wait for the device) runs without the pool's lock.
#pragma once

#include <cstddef>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"

namespace muond::kernels::cuda {

class PinnedBlocks {
 public:
  // The largest block kept for reuse (larger ones are pinned for one lease), and the piece size of
  // large staged copies.
  static constexpr size_t kMaxBlockBytes = size_t{1} << 20;

  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept;
    Lease& operator=(Lease&& other) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease();

    void* data() const { return block_; }
    size_t bytes() const { return bytes_; }
    // The block may still be the target of a copy: free it rather than reuse it.
    void Discard();

   private:
    friend class PinnedBlocks;
    Lease(PinnedBlocks* pool, void* block, size_t bytes) : pool_(pool), block_(block), bytes_(bytes) {}
    PinnedBlocks* pool_ = nullptr;
    void* block_ = nullptr;
    size_t bytes_ = 0;
  };

  explicit PinnedBlocks(int device) : device_(device) {}
  ~PinnedBlocks();
  PinnedBlocks(const PinnedBlocks&) = delete;
  PinnedBlocks& operator=(const PinnedBlocks&) = delete;

  // A block of at least `bytes` bytes.
  absl::StatusOr<Lease> Take(size_t bytes);

 private:
  static constexpr size_t kMinBlockBytes = 4096;
  static constexpr size_t kMaxIdlePerSize = 8;
  void Give(void* block, size_t bytes);

  const int device_;
  std::mutex mu_;
  std::unordered_map<size_t, std::vector<void*>> idle_;  // by block size
};

}  // namespace muond::kernels::cuda
