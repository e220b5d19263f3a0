// The checks every transport that names tensors out of band makes before a step begins (shared
// memory, CUDA IPC, NCCL): each reference names a parameter that exists, at most once (for answers:
// every parameter exactly once), in a concrete dtype, with byte_size exactly the parameter's elements
// (the rank's part of a partitioned one) in that dtype — and, for a reference into a region, bytes that lie within it
// (overflow-safe). So a step is never applied and then found to have nowhere to put its answer. Device memory also
// needs offsets aligned to the dtype. Each error names the field ("gradients[2].byte_size", "parameters").
//
// Stateless; the callbacks are called on the caller's thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/repeated_ptr_field.h"
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
  // The rank whose step this is: its parts of partitioned parameters (session/partition.h) are what
  // byte_size counts; -1: whole parameters.
  int rank = -1;
};

// Checks refs[0..count) (`at(i)` gives the i-th) as described above. `region_size(region, field)`
// answers the size of a region the caller may use, or the error naming `field`.
absl::StatusOr<std::vector<TensorRef>> ResolveTensorRefs(
    const session::SessionConfig& config, int count, absl::FunctionRef<RefFields(int)> at, absl::string_view field,
    bool require_all,
    absl::FunctionRef<absl::StatusOr<uint64_t>(const std::string& region, const std::string& field)> region_size);

// ResolveTensorRefs for `SharedTensor`s, whose regions `find(region, field)` looks up (a region the
// caller may use, or the error naming `field`) and `size_of` measures; each checked reference comes
// with its region. `aligned`, `rank`: see RefFields.
template <typename Region>
absl::StatusOr<std::vector<std::pair<TensorRef, std::shared_ptr<Region>>>> ResolveRegionTensors(
    const session::SessionConfig& config, const google::protobuf::RepeatedPtrField<v1::SharedTensor>& refs,
    absl::string_view field, bool require_all, bool aligned, int rank,
    absl::FunctionRef<absl::StatusOr<std::shared_ptr<Region>>(const std::string& region, const std::string& field)>
        find,
    absl::FunctionRef<uint64_t(const Region&)> size_of) {
  std::vector<std::shared_ptr<Region>> found;  // of each ref, in order, as it is checked
  absl::StatusOr<std::vector<TensorRef>> checked = ResolveTensorRefs(
      config, refs.size(),
      [&](int i) {
        const v1::SharedTensor& ref = refs[i];
        RefFields fields{ref.name(), ref.dtype(), ref.byte_size(), &ref.region(), ref.offset()};
        fields.aligned = aligned;
        fields.rank = rank;
        return fields;
      },
      field, require_all,
      [&](const std::string& region, const std::string& at) -> absl::StatusOr<uint64_t> {
        absl::StatusOr<std::shared_ptr<Region>> one = find(region, at);
        if (!one.ok()) return one.status();
        found.push_back(*std::move(one));
        return size_of(*found.back());
      });
  if (!checked.ok()) return checked.status();
  std::vector<std::pair<TensorRef, std::shared_ptr<Region>>> out;
  for (size_t i = 0; i < checked->size(); ++i) out.emplace_back((*checked)[i], std::move(found[i]));
  return out;
}

}  // namespace muond::transport
