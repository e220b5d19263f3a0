// The checks every transport that names tensors out of band makes before a step begins (shared
// memory, CUDA IPC, NCCL): each reference names a parameter that exists, at most once (for answers:
// every parameter exactly once), in a concrete dtype, with byte_size exactly the parameter's elements
// in that dtype — and, for a reference into a region, bytes that lie within it (overflow-safe). So a step is never applied and then found to have nowhere to put its
// answer. Device memory also needs offsets aligned to the dtype. Each error names the field ("gradients[2].byte_size", "parameters").
//
// Stateless; the callbacks are called on the caller's thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "muond/v1/muond.pb.h"
#include "server/session/session_config.h"

namespace muond::transport {

// A checked reference: parameter `index`'s `bytes` bytes in `dtype`, at `offset` of its region
// (0 for a transport without regions).
struct TensorRef {
  size_t index = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  v1::DType dtype = v1::DTYPE_FP32;
};

// What a reference says, whatever message carries it.
struct RefFields {
  const std::string& name;
  v1::DType dtype;
  uint64_t byte_size;
  const std::string* region = nullptr;  // null: the transport has no regions
  uint64_t offset = 0;
  bool aligned = false;  // the offset must be a multiple of the element size (device memory)
};

// Checks refs[0..count) (`at(i)` gives the i-th) as described above. `region_size(region, field)`
// answers the size of a region the caller may use, or the error naming `field`.
absl::StatusOr<std::vector<TensorRef>> ResolveTensorRefs(
    const session::SessionConfig& config, int count, absl::FunctionRef<RefFields(int)> at, absl::string_view field,
    bool require_all,
    absl::FunctionRef<absl::StatusOr<uint64_t>(const std::string& region, const std::string& field)> region_size);

}  // namespace muond::transport
