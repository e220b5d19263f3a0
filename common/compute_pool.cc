#include "common/compute_pool.h"

#include <algorithm>

namespace muond {

ComputePool::ComputePool(int threads) {
  for (int i = 1; i < std::max(threads, 1); ++i) workers_.emplace_back([this, i] { Work(static_cast<size_t>(i)); });
}

ComputePool::~ComputePool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  start_.notify_all();
  for (std::thread& worker : workers_) worker.join();
}

void ComputePool::Run(size_t count, const std::function<void(size_t, size_t)>& body) {
  std::lock_guard<std::mutex> gate(gate_);
  const size_t parts = std::min<size_t>(threads(), std::max<size_t>(1, count / kMinRangeElements));
  if (parts <= 1) {
    if (count > 0) body(0, count);
    return;
  }
  // Equal ranges, each a multiple of 16 elements (64 bytes) except the last; ranges_ keeps its
  // capacity, so a warm pool allocates nothing per call.
  const size_t per = ((count + parts - 1) / parts + 15) / 16 * 16;
  {
    std::lock_guard<std::mutex> lock(mu_);
    body_ = &body;
    ranges_.clear();
    for (size_t begin = 0; begin < count; begin += per) ranges_.emplace_back(begin, std::min(count, begin + per));
    pending_ = ranges_.size() - 1;
    ++generation_;
  }
  start_.notify_all();
  body(ranges_[0].first, ranges_[0].second);
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [&] { return pending_ == 0; });
  body_ = nullptr;
}

void ComputePool::Work(size_t index) {
  unsigned long seen = 0;
  for (;;) {
    std::pair<size_t, size_t> range;
    const std::function<void(size_t, size_t)>* body;
    {
      std::unique_lock<std::mutex> lock(mu_);
      start_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      if (index >= ranges_.size()) continue;  // fewer ranges than threads this time
      range = ranges_[index];
      body = body_;
    }
    (*body)(range.first, range.second);
    std::lock_guard<std::mutex> lock(mu_);
    if (--pending_ == 0) done_.notify_one();
  }
}

}  // namespace muond
