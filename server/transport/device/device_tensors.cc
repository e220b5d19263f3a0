#include "server/transport/device/device_tensors.h"

#include "common/status_macros.h"
#include "proto/wire/dtype_codec.h"
#include "server/session/partition.h"
#include "server/transport/api_codec/tensor_decode.h"

namespace muond::transport {

kernels::StorageDtype StorageOf(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_BF16:
      return kernels::StorageDtype::kBf16;
    case v1::DTYPE_FP16:
      return kernels::StorageDtype::kFp16;
    default:
      return kernels::StorageDtype::kFp32;
  }
}

size_t RankElements(const session::IncomingStep& step, size_t index) {
  return static_cast<size_t>(session::PartElements(step.config(), index, step.plan().request.rank));
}

bool GoesToDevice(session::IncomingStep& step, size_t index) {
  return step.takes_device_gradients() &&
         static_cast<int64_t>(RankElements(step, index)) == step.config().parameters[index].numel;
}

absl::Status TakeDeviceGradient(kernels::Backend& backend, session::IncomingStep& step, size_t index, v1::DType dtype,
                                const void* src, uint64_t bytes, std::string& host_bytes) {
  const size_t numel = RankElements(step, index);
  if (GoesToDevice(step, index)) {
    float* dst = step.DeviceGradient(index);
    if (dtype == v1::DTYPE_FP32) {
      MUOND_RETURN_IF_ERROR(backend.CopyOnDevice(static_cast<const float*>(src), dst, numel));
    } else {
      MUOND_RETURN_IF_ERROR(backend.Widen(StorageOf(dtype), src, dst, numel));
    }
    step.MarkDeviceGradient(index);
    return absl::OkStatus();
  }
  host_bytes.resize(bytes);
  if (bytes > 0) MUOND_RETURN_IF_ERROR(backend.CopyBytes(src, host_bytes.data(), bytes));
  HostTensor& tensor = step.gradients()[index];
  if (tensor.values.size() != numel) tensor.values.resize(numel);
  tensor.sum_squares =
      DecodeSumSquares(dtype, absl::string_view(host_bytes), std::span<float>(tensor.values.data(), numel));
  tensor.received = static_cast<int64_t>(numel);
  return step.Stage(index, 0, numel);
}

absl::Status PutDeviceParameter(kernels::Backend& backend, std::span<const float> values, v1::DType dtype, void* dst,
                                std::string& host_bytes) {
  host_bytes.resize(values.size() * wire::ElementSize(dtype));
  wire::EncodeTo(dtype, values, host_bytes.data());
  return backend.CopyBytes(host_bytes.data(), dst, host_bytes.size());
}

}  // namespace muond::transport
