// Pipelined host↔device copies of the CUDA backend: the HostToDevice and DeviceToHost of
// kernels/backend.h, staged through a PinnedRing.
//
// A PinnedRing is kSlots pinned host buffers of kSlotBytes each, one event per slot and a
// non-blocking copy stream. Host→device: a piece is copied into the next free slot and an
// asynchronous copy from the slot to the device is enqueued, so the DMA of one piece overlaps the
// caller receiving and decoding the next; a slot is reused once its event says the DMA has left it.
// Device→host: the DMA of a piece into a slot overlaps the copy of an earlier slot on to its
// destination.
//
// Ordering: a transfer's copy stream first waits for an event recorded on the backend's compute
// stream when the transfer was created, so it reads and overwrites memory only after every
// primitive enqueued before then. Its destructor waits for its copies, so the memory they touch may
// be released right after it. Rings are kept by the backend (RingCache) for the next transfer, so
// steady-state steps neither pin memory nor create streams.
//
// Ownership: a transfer borrows a ring from the cache and gives it back when destroyed; the cache
// owns idle rings and frees them (pinned memory, events, stream) when destroyed, which must happen
// after every transfer is gone. Thread-safety: the cache is thread-safe; a transfer is used by one
// thread at a time.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace muond::kernels::cuda {

struct PinnedRing {
  static constexpr size_t kSlots = 4;
  static constexpr size_t kSlotBytes = size_t{4} << 20;  // the daemon's default chunk limit

  struct Slot {
    float* host = nullptr;         // pinned, kSlotBytes
    cudaEvent_t done = nullptr;    // recorded after the slot's last copy
    bool in_flight = false;        // a copy from or into the slot may still be running
    float* destination = nullptr;  // device→host: where the slot's values go next
    size_t count = 0;
  };

  PinnedRing() = default;
  PinnedRing(const PinnedRing&) = delete;
  PinnedRing& operator=(const PinnedRing&) = delete;
  ~PinnedRing();

  // Pins the slots and creates the events and the stream on `device`.
  static absl::StatusOr<std::unique_ptr<PinnedRing>> Create(int device);

  int device = 0;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr;  // recorded on the compute stream; the copy stream waits for it
  std::array<Slot, kSlots> slots;
  size_t next = 0;  // the slot the next piece goes through
};

class RingCache {
 public:
  explicit RingCache(int device) : device_(device) {}
  // An idle ring, or a new one.
  absl::StatusOr<std::unique_ptr<PinnedRing>> Take();
  // Keeps `ring` for a later Take (at most a few; the rest are freed).
  void Give(std::unique_ptr<PinnedRing> ring);

 private:
  static constexpr size_t kMaxIdle = 4;
  const int device_;
  std::mutex mu_;
  std::vector<std::unique_ptr<PinnedRing>> idle_;
};

// Transfers through `ring` (taken from `cache`, to which they give it back), ordered after the
// work enqueued on `compute` so far (see the header comment). The ring is taken beforehand, apart
// from this, because a new one pins memory, which may wait for the device: the caller takes it
// without its stream's lock and creates the transfer under it.
absl::StatusOr<std::unique_ptr<HostToDevice>> NewPinnedHostToDevice(RingCache* cache, std::unique_ptr<PinnedRing> ring,
                                                                    cudaStream_t compute);
absl::StatusOr<std::unique_ptr<DeviceToHost>> NewPinnedDeviceToHost(RingCache* cache, std::unique_ptr<PinnedRing> ring,
                                                                    cudaStream_t compute);

}  // namespace muond::kernels::cuda
