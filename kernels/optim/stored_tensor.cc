#include "kernels/optim/stored_tensor.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace muond::optim {

using kernels::Backend;
using kernels::StorageDtype;

StoredTensor::StoredTensor(std::unique_ptr<kernels::DeviceBuffer> fp32_buffer)
    : numel(fp32_buffer ? fp32_buffer->size() : 0), buffer(std::move(fp32_buffer)) {}

void* StoredTensor::At(size_t offset) {
  return static_cast<char*>(static_cast<void*>(buffer->data())) + offset * kernels::StorageBytes(dtype);
}

const void* StoredTensor::At(size_t offset) const {
  return static_cast<const char*>(static_cast<const void*>(buffer->data())) + offset * kernels::StorageBytes(dtype);
}

absl::StatusOr<StoredTensor> AllocateStored(Backend& backend, StorageDtype dtype, size_t numel) {
  StoredTensor tensor;
  tensor.dtype = dtype;
  tensor.numel = numel;
  // 16-bit values two to an fp32 word; zero bits are +0 in every format.
  const size_t words = dtype == StorageDtype::kFp32 ? numel : (numel + 1) / 2;
  MUOND_ASSIGN_OR_RETURN(tensor.buffer, backend.Allocate(words));
  MUOND_RETURN_IF_ERROR(backend.Fill(tensor.buffer->data(), words, 0.0f));
  return tensor;
}

namespace {

absl::Status CheckRegion(const StoredTensor& tensor, size_t offset, size_t count) {
  if (!tensor.allocated() || offset > tensor.numel || count > tensor.numel - offset) {
    return absl::InternalError(absl::StrCat("region [", offset, ", ", offset + count, ") outside a tensor of ",
                                            tensor.numel, " elements"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ReadStored(Backend& backend, const StoredTensor& tensor, size_t offset, size_t count, float* host) {
  MUOND_RETURN_IF_ERROR(CheckRegion(tensor, offset, count));
  if (tensor.is_fp32()) return backend.CopyToHost(tensor.fp32() + offset, host, count);
  if (backend.HostAddressable()) return backend.Widen(tensor.dtype, tensor.At(offset), host, count);
  MUOND_ASSIGN_OR_RETURN(std::unique_ptr<kernels::DeviceBuffer> wide, backend.Allocate(count));
  MUOND_RETURN_IF_ERROR(backend.Widen(tensor.dtype, tensor.At(offset), wide->data(), count));
  return backend.CopyToHost(wide->data(), host, count);
}

absl::Status WriteStored(Backend& backend, StoredTensor& tensor, size_t offset, size_t count, const float* host) {
  MUOND_RETURN_IF_ERROR(CheckRegion(tensor, offset, count));
  if (tensor.is_fp32()) return backend.CopyToDevice(host, tensor.fp32() + offset, count);
  if (backend.HostAddressable()) return backend.Narrow(tensor.dtype, host, tensor.At(offset), count);
  MUOND_ASSIGN_OR_RETURN(std::unique_ptr<kernels::DeviceBuffer> wide, backend.Allocate(count));
  MUOND_RETURN_IF_ERROR(backend.CopyToDevice(host, wide->data(), count));
  return backend.Narrow(tensor.dtype, wide->data(), tensor.At(offset), count);
}

absl::Status StagingArea::Reserve(Backend& backend, int lane, const StoredTensor& tensor, size_t count) {
  if (tensor.is_fp32()) return absl::OkStatus();
  std::unique_ptr<kernels::DeviceBuffer>& scratch = lanes_.at(static_cast<size_t>(lane));
  if (scratch != nullptr && scratch->size() >= count) return absl::OkStatus();
  scratch.reset();  // the old scratch goes before the larger one comes
  MUOND_ASSIGN_OR_RETURN(scratch, backend.Allocate(count));
  return absl::OkStatus();
}

absl::StatusOr<float*> StagingArea::Load(Backend& backend, int lane, StoredTensor& tensor, size_t offset,
                                         size_t count) {
  MUOND_RETURN_IF_ERROR(CheckRegion(tensor, offset, count));
  if (tensor.is_fp32()) return tensor.fp32() + offset;
  MUOND_RETURN_IF_ERROR(Reserve(backend, lane, tensor, count));
  float* scratch = lanes_[static_cast<size_t>(lane)]->data();
  MUOND_RETURN_IF_ERROR(backend.Widen(tensor.dtype, tensor.At(offset), scratch, count));
  return scratch;
}

absl::Status StagingArea::Store(Backend& backend, int lane, StoredTensor& tensor, size_t offset, size_t count) {
  if (tensor.is_fp32()) return absl::OkStatus();
  MUOND_RETURN_IF_ERROR(CheckRegion(tensor, offset, count));
  const std::unique_ptr<kernels::DeviceBuffer>& scratch = lanes_.at(static_cast<size_t>(lane));
  if (scratch == nullptr || scratch->size() < count) {
    return absl::InternalError(absl::StrCat("staging lane ", lane, " stores ", count, " elements it did not load"));
  }
  return backend.Narrow(tensor.dtype, scratch->data(), tensor.At(offset), count);
}

size_t StagingArea::floats() const {
  size_t total = 0;
  for (const auto& scratch : lanes_) total += scratch ? scratch->size() : 0;
  return total;
}

}  // namespace muond::optim
