#include "client/cuda_ipc_stepper.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "client/transport/cuda_ipc_step_transport.h"

namespace muond::client {
namespace {

bool IsWireDType(v1::DType dtype) {
  return dtype == v1::DTYPE_FP32 || dtype == v1::DTYPE_BF16 || dtype == v1::DTYPE_FP16;
}

// Each tensor names a parameter of `session`, with its element count (the rank's part when the
// session holds parts), a wire dtype and memory (none for an empty part).
absl::Status CheckDeviceTensors(const Session& session, std::span<const DeviceTensor> tensors,
                                const std::string& field) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const DeviceTensor& t = tensors[i];
    const std::string at = absl::StrCat(field, "[", i, "]");
    auto numel = session.element_counts().find(t.name);
    if (numel == session.element_counts().end()) {
      return absl::InvalidArgumentError(absl::StrCat(at, ".name: no parameter '", t.name, "'"));
    }
    if (t.numel != numel->second) {
      return absl::InvalidArgumentError(
          absl::StrCat(at, ".numel: ", t.numel, " elements for '", t.name, "' of ", numel->second));
    }
    if (!IsWireDType(t.dtype)) return absl::InvalidArgumentError(absl::StrCat(at, ".dtype: fp32, bf16 or fp16"));
    if (t.data == nullptr && t.numel > 0) return absl::InvalidArgumentError(absl::StrCat(at, ".data: null"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaIpcStepper>> CudaIpcStepper::Create(Client* client, Session* session, int device,
                                                                       void* stream) {
  absl::StatusOr<v1::ServerInfo> info = client->GetServerInfo();
  if (!info.ok()) return info.status();
  if (absl::Status viable = CheckViable(CudaIpcTransportKind(), *info); !viable.ok()) return viable;
  absl::StatusOr<std::unique_ptr<CudaIpcStepTransport>> transport =
      CudaIpcStepTransport::Open(*client, *session, device, stream);
  if (!transport.ok()) return transport.status();
  if (absl::Status registered = (*transport)->Register(); !registered.ok()) return registered;
  return std::unique_ptr<CudaIpcStepper>(new CudaIpcStepper(session, *std::move(transport)));
}

CudaIpcStepper::CudaIpcStepper(Session* session, std::unique_ptr<CudaIpcStepTransport> transport)
    : session_(session), transport_(std::move(transport)) {}

CudaIpcStepper::~CudaIpcStepper() = default;

const std::string& CudaIpcStepper::region_name() const { return transport_->region_name(); }

absl::StatusOr<StepReply> CudaIpcStepper::Step(int64_t step, std::span<const DeviceTensor> gradients,
                                               std::span<const DeviceTensor> parameters_out,
                                               const StepOptions& options) {
  // Checked before anything is sent: a step must never be applied with nowhere to put its answer.
  if (absl::Status ok = CheckDeviceTensors(*session_, gradients, "gradients"); !ok.ok()) return ok;
  if (absl::Status ok = CheckDeviceTensors(*session_, parameters_out, "parameters_out"); !ok.ok()) return ok;
  const StepPayload payload{.device_gradients = gradients, .device_parameters_out = parameters_out};
  return session_->StepThrough(*transport_, step, payload, options);
}

}  // namespace muond::client
