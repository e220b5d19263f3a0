// StoredTensor: a master or a state slot as a session keeps it in backend memory, in its storage
// format (kernels::StorageDtype): fp32, or bf16 / fp16 to halve its memory (the precision-aware
// optimizer). A 16-bit tensor of n elements lives in a DeviceBuffer of ⌈n/2⌉ fp32 words, so the
// backends allocate, account and free it as any other buffer.
//
// The optimizers compute in fp32 whatever the storage: the backend's element-wise primitives take
// the state as StoredRefs (Ref()), load 16-bit elements as fp32 and round what they store — load,
// compute, round on store. For the few operations written for fp32 buffers only (QK-clip's row
// scaling), StagingArea widens a 16-bit tensor into fp32 scratch and rounds the result back. The
// host-side functions (ReadStored, WriteStored) serve the session's reads and writes (answers,
// GetState/SetState, checkpoints).
//
// Ownership: a StoredTensor owns its buffer; a StagingArea owns its scratch. Neither is thread-safe:
// their owner (a session, through its optimizers) serializes their use.
#pragma once

#include <array>
#include <cstddef>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace muond::optim {

struct StoredTensor {
  StoredTensor() = default;
  // fp32 storage over `buffer` (all its elements).
  StoredTensor(std::unique_ptr<kernels::DeviceBuffer> fp32_buffer);  // NOLINT: implicit by design

  kernels::StorageDtype dtype = kernels::StorageDtype::kFp32;
  size_t numel = 0;
  std::unique_ptr<kernels::DeviceBuffer> buffer;

  bool allocated() const { return buffer != nullptr; }
  bool is_fp32() const { return dtype == kernels::StorageDtype::kFp32; }
  // The values of fp32 storage; null for a 16-bit tensor (read those through ReadStored or a
  // StagingArea).
  float* fp32() { return is_fp32() && buffer ? buffer->data() : nullptr; }
  const float* fp32() const { return is_fp32() && buffer ? buffer->data() : nullptr; }
  // The tensor from element `offset` on, as the backend's primitives take it (Ref(i).data is
  // element i in the storage format).
  kernels::StoredRef Ref(size_t offset = 0) const;
  // Bytes the values take (not counting a 16-bit tensor's pad to a whole fp32 word).
  size_t bytes() const { return numel * kernels::StorageBytes(dtype); }
};

// The fp32 words of backend memory a tensor of `numel` elements of `dtype` takes.
size_t StoredWords(kernels::StorageDtype dtype, size_t numel);

// A zeroed tensor of `numel` elements of `dtype`.
absl::StatusOr<StoredTensor> AllocateStored(kernels::Backend& backend, kernels::StorageDtype dtype, size_t numel);

// host[0, count) = tensor[offset, offset + count), widened to fp32 (exactly).
absl::Status ReadStored(kernels::Backend& backend, const StoredTensor& tensor, size_t offset, size_t count,
                        float* host);
// tensor[offset, offset + count) = host[0, count), rounded to the tensor's format.
absl::Status WriteStored(kernels::Backend& backend, StoredTensor& tensor, size_t offset, size_t count,
                         const float* host);

// fp32 scratch through which an fp32-only operation (QK-clip's row scaling) works on 16-bit
// tensors, in lanes (one per tensor it touches at once). fp32 tensors are worked on in place and
// need no lane.
class StagingArea {
 public:
  static constexpr int kLanes = 2;

  // Makes sure `lane` can hold `count` elements of `tensor` (nothing for an fp32 tensor). Steps call
  // it for every region they will stage before they change anything, so that running out of memory
  // rejects a step cleanly.
  absl::Status Reserve(kernels::Backend& backend, int lane, const StoredTensor& tensor, size_t count);
  // An fp32 view of tensor[offset, offset + count): the storage itself for fp32, else `lane`'s
  // scratch holding the widened values.
  absl::StatusOr<float*> Load(kernels::Backend& backend, int lane, StoredTensor& tensor, size_t offset, size_t count);
  // Rounds what Load gave back into tensor[offset, offset + count); nothing for fp32.
  absl::Status Store(kernels::Backend& backend, int lane, StoredTensor& tensor, size_t offset, size_t count);
  // fp32 elements held.
  size_t floats() const;

 private:
  std::array<std::unique_ptr<kernels::DeviceBuffer>, kLanes> lanes_;
};

}  // namespace muond::optim
