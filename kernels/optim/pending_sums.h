// PendingSums: doubles that a step's kernels write into backend memory and that the step reads back
// once, at its end (Collect), each range handed to the function that reserved it, in the order
// reserved.
//
// Why: on a GPU every read-back stalls the host until the device has caught up, so a step's
// telemetry (the update's sums, Muon's momentum norms, the orthogonality residual) is written on the
// device as the step runs and read with one copy after all its work was enqueued, however many
// tensors it measured.
//
// Ownership: holds segments of backend memory (shared, so a StepTelemetry stays copyable) until
// Collect or Clear; the reserved functions may refer to objects that must outlive Collect.
// Thread-safety: none; one step's.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace muond::optim {

class PendingSums {
 public:
  using Use = std::function<void(std::span<const double>)>;

  // Allocates the first segment, so that a step can fail for lack of memory before it changes any
  // state.
  absl::Status Prepare(kernels::Backend& backend);
  // Backend memory for `n` contiguous doubles; `use` receives their values at Collect.
  absl::StatusOr<double*> Reserve(kernels::Backend& backend, size_t n, Use use);
  // Reads every reserved double back in one copy (several segments are gathered on the device
  // first), hands each range to its function in the order reserved, and clears.
  absl::Status Collect(kernels::Backend& backend);
  // Drops the segments and the reservations unread.
  void Clear();
  bool empty() const { return ranges_.empty(); }

 private:
  struct Segment {
    std::shared_ptr<kernels::DeviceBuffer> buffer;
    size_t capacity = 0;  // doubles
    size_t used = 0;
  };
  struct Range {
    size_t segment = 0, offset = 0, count = 0;
    Use use;
  };
  absl::Status AddSegment(kernels::Backend& backend, size_t capacity);

  std::vector<Segment> segments_;
  std::vector<Range> ranges_;
};

}  // namespace muond::optim
