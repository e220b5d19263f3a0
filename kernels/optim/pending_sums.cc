#include "kernels/optim/pending_sums.h"

#include <algorithm>
#include <utility>

#include "common/status_macros.h"

namespace muond::optim {
namespace {

// Doubles per segment: a step's worth in practice (2048 measured chunks, or as many matrices).
constexpr size_t kSegmentDoubles = 4096;

}  // namespace

absl::Status PendingSums::AddSegment(kernels::Backend& backend, size_t capacity) {
  // A double takes two floats of a buffer.
  MUOND_ASSIGN_OR_RETURN(std::unique_ptr<kernels::DeviceBuffer> buffer, backend.Allocate(2 * capacity));
  segments_.push_back(Segment{std::move(buffer), capacity, 0});
  return absl::OkStatus();
}

absl::Status PendingSums::Prepare(kernels::Backend& backend) {
  if (!segments_.empty()) return absl::OkStatus();
  return AddSegment(backend, kSegmentDoubles);
}

absl::StatusOr<double*> PendingSums::Reserve(kernels::Backend& backend, size_t n, Use use) {
  if (segments_.empty() || segments_.back().capacity - segments_.back().used < n) {
    MUOND_RETURN_IF_ERROR(AddSegment(backend, std::max(kSegmentDoubles, n)));
  }
  Segment& segment = segments_.back();
  ranges_.push_back(Range{segments_.size() - 1, segment.used, n, std::move(use)});
  double* at = reinterpret_cast<double*>(segment.buffer->data()) + segment.used;
  segment.used += n;
  return at;
}

absl::Status PendingSums::Collect(kernels::Backend& backend) {
  std::vector<size_t> first(segments_.size());  // where each segment's values start in `values`
  size_t total = 0;
  for (size_t s = 0; s < segments_.size(); ++s) {
    first[s] = total;
    total += segments_[s].used;
  }
  absl::Status status = absl::OkStatus();
  std::vector<double> values(total);
  if (total > 0) {
    std::shared_ptr<kernels::DeviceBuffer> source = segments_.front().buffer;
    if (segments_.size() > 1) {
      // Gathered on the device (nothing waits), so that the host waits once.
      absl::StatusOr<std::unique_ptr<kernels::DeviceBuffer>> gathered = backend.Allocate(2 * total);
      status = gathered.status();
      if (status.ok()) source = std::move(*gathered);
      for (size_t s = 0; status.ok() && s < segments_.size(); ++s) {
        status =
            backend.CopyOnDevice(segments_[s].buffer->data(), source->data() + 2 * first[s], 2 * segments_[s].used);
      }
    }
    if (status.ok()) status = backend.CopyBytes(source->data(), values.data(), total * sizeof(double));
  }
  if (status.ok()) {
    for (const Range& range : ranges_) {
      range.use(std::span<const double>(values.data() + first[range.segment] + range.offset, range.count));
    }
  }
  Clear();
  return status;
}

void PendingSums::Clear() {
  segments_.clear();
  ranges_.clear();
}

}  // namespace muond::optim
