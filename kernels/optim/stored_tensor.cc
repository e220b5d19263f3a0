#include "kernels/optim/stored_tensor.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/half_ranges.h"
#include "common/status_macros.h"

namespace muond::optim {

using kernels::Backend;
using kernels::StorageDtype;

StoredTensor::StoredTensor(std::unique_ptr<kernels::DeviceBuffer> fp32_buffer)
    : numel(fp32_buffer ? fp32_buffer->size() : 0), buffer(std::move(fp32_buffer)) {}

kernels::StoredRef StoredTensor::Ref(size_t offset) const {
  return kernels::StoredRef(buffer->data(), dtype).At(offset);
}

size_t StoredWords(StorageDtype dtype, size_t numel) {
  return dtype == StorageDtype::kFp32 ? numel : (numel + 1) / 2;  // 16-bit values two to a word
}

absl::StatusOr<StoredTensor> AllocateStored(Backend& backend, StorageDtype dtype, size_t numel) {
  StoredTensor tensor;
  tensor.dtype = dtype;
  tensor.numel = numel;
  const size_t words = StoredWords(dtype, numel);  // zero bits are +0 in every format
  MUOND_ASSIGN_OR_RETURN(tensor.buffer, backend.Allocate(words));
  MUOND_RETURN_IF_ERROR(backend.Fill(tensor.buffer->data(), words, 0.0f));
  return tensor;
}

namespace {

absl::Status CheckRegion(const StoredTensor& tensor, size_t offset, size_t count) {
  if (!tensor.allocated() || offset > tensor.numel || count > tensor.numel - offset) {
    return absl::InternalError(
        absl::StrCat("region [", offset, ", ", offset + count, ") outside a tensor of ", tensor.numel, " elements"));
  }
  return absl::OkStatus();
}

// A 16-bit region of device memory travels as the fp32 words that hold it, [first, last), and is
// converted on the host (with the conversions the kernels use), so that reading or writing state
// never allocates device memory: the session reads and writes state after a step has begun.
struct WordSpan {
  size_t first = 0, last = 0;  // words
  size_t skip = 0;             // 16-bit elements of word `first` before the region (0 or 1)
};

WordSpan WordsOf(size_t offset, size_t count) { return WordSpan{offset / 2, (offset + count + 1) / 2, offset % 2}; }

HalfFormat HalfFormatOf(StorageDtype dtype) {
  return dtype == StorageDtype::kBf16 ? HalfFormat::kBf16 : HalfFormat::kFp16;
}

// The bytes of element `index` among the 16-bit halves of `words`.
char* HalfBytes(std::vector<float>& words, size_t index) { return reinterpret_cast<char*>(words.data()) + 2 * index; }

}  // namespace

absl::Status ReadStored(Backend& backend, const StoredTensor& tensor, size_t offset, size_t count, float* host) {
  MUOND_RETURN_IF_ERROR(CheckRegion(tensor, offset, count));
  if (tensor.is_fp32()) return backend.CopyToHost(tensor.fp32() + offset, host, count);
  if (backend.HostAddressable()) return backend.Widen(tensor.dtype, tensor.Ref(offset).data, host, count);
  if (count == 0) return absl::OkStatus();
  const WordSpan span = WordsOf(offset, count);
  std::vector<float> words(span.last - span.first);
  MUOND_RETURN_IF_ERROR(backend.CopyToHost(tensor.buffer->data() + span.first, words.data(), words.size()));
  WidenHalfBytes(HalfFormatOf(tensor.dtype), HalfBytes(words, span.skip), host, count);
  return absl::OkStatus();
}

absl::Status WriteStored(Backend& backend, StoredTensor& tensor, size_t offset, size_t count, const float* host) {
  MUOND_RETURN_IF_ERROR(CheckRegion(tensor, offset, count));
  if (tensor.is_fp32()) return backend.CopyToDevice(host, tensor.fp32() + offset, count);
  if (backend.HostAddressable()) return backend.Narrow(tensor.dtype, host, tensor.Ref(offset).data, count);
  if (count == 0) return absl::OkStatus();
  const WordSpan span = WordsOf(offset, count);
  std::vector<float> words(span.last - span.first);
  float* device = tensor.buffer->data() + span.first;
  // A word half inside the region keeps its other half: read those first.
  if (span.skip != 0) MUOND_RETURN_IF_ERROR(backend.CopyToHost(device, words.data(), 1));
  if ((offset + count) % 2 != 0 && (words.size() > 1 || span.skip == 0)) {
    MUOND_RETURN_IF_ERROR(backend.CopyToHost(device + words.size() - 1, words.data() + words.size() - 1, 1));
  }
  NarrowToHalfBytes(HalfFormatOf(tensor.dtype), host, HalfBytes(words, span.skip), count);
  return backend.CopyToDevice(words.data(), device, words.size());
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
  MUOND_RETURN_IF_ERROR(backend.Widen(tensor.dtype, tensor.Ref(offset).data, scratch, count));
  return scratch;
}

absl::Status StagingArea::Store(Backend& backend, int lane, StoredTensor& tensor, size_t offset, size_t count) {
  if (tensor.is_fp32()) return absl::OkStatus();
  MUOND_RETURN_IF_ERROR(CheckRegion(tensor, offset, count));
  const std::unique_ptr<kernels::DeviceBuffer>& scratch = lanes_.at(static_cast<size_t>(lane));
  if (scratch == nullptr || scratch->size() < count) {
    return absl::InternalError(absl::StrCat("staging lane ", lane, " stores ", count, " elements it did not load"));
  }
  return backend.Narrow(tensor.dtype, scratch->data(), tensor.Ref(offset).data, count);
}

size_t StagingArea::floats() const {
  size_t total = 0;
  for (const auto& scratch : lanes_) total += scratch ? scratch->size() : 0;
  return total;
}

}  // namespace muond::optim
