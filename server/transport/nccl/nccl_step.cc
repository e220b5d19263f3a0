#include "server/transport/nccl/nccl_step.h"

#include "common/status_macros.h"
#include "server/transport/api_codec/api_conversion.h"
#include "server/transport/device/device_tensors.h"

namespace muond::transport {
namespace {

// A device buffer of at least `bytes` bytes.
absl::StatusOr<std::unique_ptr<kernels::DeviceBuffer>> AllocateBytes(kernels::Backend& backend, uint64_t bytes) {
  return backend.Allocate(static_cast<size_t>((bytes + sizeof(float) - 1) / sizeof(float)));
}

}  // namespace

absl::StatusOr<std::vector<TensorRef>> ResolveNcclTensors(
    const session::SessionConfig& config, const google::protobuf::RepeatedPtrField<v1::NcclTensor>& refs,
    absl::string_view field, bool require_all, int rank) {
  return ResolveTensorRefs(
      config, refs.size(),
      [&](int i) {
        RefFields fields{refs[i].name(), refs[i].dtype(), refs[i].byte_size()};
        fields.rank = rank;
        return fields;
      },
      field, require_all,
      [](const std::string&, const std::string& at) -> absl::StatusOr<uint64_t> {
        return absl::InternalError(absl::StrCat(at, ": NCCL tensors have no region"));
      });
}

absl::Status NcclGradientSource::ReadGradients(session::IncomingStep& step) {
  const absl::Time deadline = TransferDeadline(call_deadline_, timeout_);
  MUOND_RETURN_IF_ERROR(channel_->peer->Ready(deadline));
  // Where each gradient lands: its backend buffer (fp32, a step that takes device gradients), else a
  // buffer of its own.
  std::vector<std::unique_ptr<kernels::DeviceBuffer>> own(refs_.size());
  std::vector<kernels::ByteRange> ranges;
  for (size_t i = 0; i < refs_.size(); ++i) {
    const TensorRef& ref = refs_[i];
    if (ref.bytes == 0) {  // a rank's empty part: no transfer (the client sends none)
      ranges.push_back({nullptr, 0});
    } else if (!step.replay() && GoesToDevice(step, ref.index) && ref.dtype == v1::DTYPE_FP32) {
      ranges.push_back({step.DeviceGradient(ref.index), ref.bytes});
    } else {
      MUOND_ASSIGN_OR_RETURN(own[i], AllocateBytes(*backend_, ref.bytes));
      ranges.push_back({own[i]->data(), ref.bytes});
    }
  }
  MUOND_RETURN_IF_ERROR(channel_->peer->Receive(ranges, deadline));
  for (const TensorRef& ref : refs_) bytes_received_ += static_cast<int64_t>(ref.bytes);
  if (step.replay()) return absl::OkStatus();  // applied already: received, and dropped
  for (size_t i = 0; i < refs_.size(); ++i) {
    const TensorRef& ref = refs_[i];
    if (own[i] == nullptr && ref.bytes > 0) {
      step.MarkDeviceGradient(ref.index);
    } else {
      MUOND_RETURN_IF_ERROR(
          TakeDeviceGradient(*backend_, step, ref.index, ref.dtype, ranges[i].data, ref.bytes, host_bytes_));
    }
  }
  // The widened copies read `own` on the backend's stream: done before it is freed.
  return backend_->Synchronize();
}

absl::Status NcclParameterSink::Send(const session::StepOutcome& outcome, session::ParameterReader& parameters) {
  if (outcome.parameters != nullptr) {
    // Held until the values are in the send buffers, not while the peer receives them.
    MUOND_RETURN_IF_ERROR(parameters.Hold());
    std::vector<std::unique_ptr<kernels::DeviceBuffer>> buffers;
    std::vector<kernels::ByteRange> ranges;
    for (const TensorRef& ref : refs_) {
      if (ref.bytes == 0) continue;  // a rank's empty part: no transfer (the client awaits none)
      MUOND_ASSIGN_OR_RETURN(std::unique_ptr<kernels::DeviceBuffer> buffer, AllocateBytes(*backend_, ref.bytes));
      if (outcome.parameters->on_device) {
        MUOND_RETURN_IF_ERROR(
            session_->CopyParameterOnDevice(*outcome.parameters, ref.index, StorageOf(ref.dtype), buffer->data()));
      } else {
        MUOND_RETURN_IF_ERROR(
            PutDeviceParameter(*backend_, parameters.Values(ref.index), ref.dtype, buffer->data(), host_bytes_));
      }
      ranges.push_back({buffer->data(), ref.bytes});
      buffers.push_back(std::move(buffer));
      bytes_sent_ += static_cast<int64_t>(ref.bytes);
    }
    parameters.Release();
    MUOND_RETURN_IF_ERROR(channel_->peer->Send(ranges, TransferDeadline(call_deadline_, timeout_)));
  }
  result_ = ToProto(outcome.result);
  return absl::OkStatus();
}

}  // namespace muond::transport
