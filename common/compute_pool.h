// ComputePool: worker threads for host work split into ranges — the CPU backend's element-wise work,
// whose pool is also the one gate all of a daemon's compute passes through, and the shared-memory
// transport's copies (on that same pool in the daemon). Here, below both, so neither reaches into
// the other.
//
// Run(count, body) splits [0, count) into one contiguous range per thread (ranges of at least
// kMinRangeElements, rounded to 16 elements so threads never share a cache line of the output) and
// calls body(begin, end) on each, the calling thread taking the first range; it returns when all are
// done. Element-wise work gives the same bits whatever the split. Exclusive() is the gate: one
// compute call at a time holds it (element-wise work through Run, and OpenBLAS's GEMMs), so N
// sessions stepping at once share `threads` cores instead of oversubscribing them.
//
// Ownership: the pool owns its threads and joins them on destruction. Thread-safety: Run and
// Exclusive may be called from any thread; Run serializes itself behind the gate.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace muond {

class ComputePool {
 public:
  static constexpr size_t kMinRangeElements = size_t{1} << 15;  // below this, threads cost more than they save

  // `threads` >= 1 in all, the caller's included.
  explicit ComputePool(int threads);
  ~ComputePool();
  ComputePool(const ComputePool&) = delete;
  ComputePool& operator=(const ComputePool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs body over [0, count) in ranges, holding the gate.
  void Run(size_t count, const std::function<void(size_t, size_t)>& body);

  // The gate, for compute that brings its own threads (OpenBLAS): hold the lock while it runs.
  std::unique_lock<std::mutex> Exclusive() { return std::unique_lock<std::mutex>(gate_); }

 private:
  void Work(size_t index);

  std::mutex gate_;  // one compute call at a time
  std::mutex mu_;    // guards the job fields below
  std::condition_variable start_, done_;
  const std::function<void(size_t, size_t)>* body_ = nullptr;
  std::vector<std::pair<size_t, size_t>> ranges_;  // [0] is the caller's
  size_t pending_ = 0;
  unsigned long generation_ = 0;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace muond
