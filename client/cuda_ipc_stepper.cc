#include "client/cuda_ipc_stepper.h"

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/host_id.h"
#include "proto/wire/dtype_codec.h"

namespace muond::client {
namespace {

constexpr uint64_t kSlotBytes = 4;  // one slot per element: fp32 at most, either way

absl::Status CudaError(cudaError_t error, const std::string& what) {
  if (error == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // not sticky: keep it from resurfacing in a later call
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(error), " (", cudaGetErrorString(error), ")"));
}

bool IsWireDType(v1::DType dtype) {
  return dtype == v1::DTYPE_FP32 || dtype == v1::DTYPE_BF16 || dtype == v1::DTYPE_FP16;
}

}  // namespace

struct CudaIpcStepper::Cuda {
  int device = 0;
  cudaStream_t stream = nullptr;
  void* buffer = nullptr;
  uint64_t bytes = 0;
  cudaEvent_t event = nullptr;
  int socket = -1;  // the liveness connection to the daemon's socket

  ~Cuda() {
    if (socket >= 0) ::close(socket);
    cudaSetDevice(device);
    if (event != nullptr) cudaEventDestroy(event);
    if (buffer != nullptr) cudaFree(buffer);
  }
};

absl::StatusOr<std::unique_ptr<CudaIpcStepper>> CudaIpcStepper::Create(Client* client, Session* session, int device,
                                                                        void* stream) {
  absl::StatusOr<v1::ServerInfo> info = client->GetServerInfo();
  if (!info.ok()) return info.status();
  if (!info->cuda_ipc()) {
    return absl::FailedPreconditionError(absl::StrCat("transport: the daemon offers no CUDA IPC (its backend is ",
                                                      info->backend(), "; CUDA IPC needs --backend cuda)"));
  }
  if (info->host_id().empty() || info->host_id() != HostId()) {
    return absl::FailedPreconditionError("transport: CUDA IPC needs the daemon on this node; it is on another host");
  }
  std::map<std::string, uint64_t> slots;
  uint64_t bytes = 0;
  for (const auto& [name, numel] : session->numel_) {
    slots[name] = bytes;
    bytes += kSlotBytes * static_cast<uint64_t>(numel);
  }
  auto cuda = std::make_unique<Cuda>();
  cuda->device = device;
  cuda->stream = static_cast<cudaStream_t>(stream);
  cuda->bytes = std::max<uint64_t>(bytes, kSlotBytes);
  if (absl::Status set = CudaError(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")")); !set.ok()) {
    return set;
  }
  // A buffer of its own (cudaMalloc): what a caching allocator hands out may not be exportable.
  if (absl::Status got = CudaError(cudaMalloc(&cuda->buffer, cuda->bytes), "cudaMalloc"); !got.ok()) return got;
  if (absl::Status made = CudaError(cudaEventCreateWithFlags(&cuda->event, cudaEventInterprocess | cudaEventDisableTiming),
                                    "cudaEventCreateWithFlags");
      !made.ok()) {
    return made;
  }
  std::unique_ptr<CudaIpcStepper> stepper(new CudaIpcStepper(client, session, std::move(cuda), std::move(slots)));
  if (absl::Status registered = stepper->Register(); !registered.ok()) return registered;
  return stepper;
}

CudaIpcStepper::CudaIpcStepper(Client* client, Session* session, std::unique_ptr<Cuda> cuda,
                               std::map<std::string, uint64_t> slots)
    : client_(client), session_(session), cuda_(std::move(cuda)), slots_(std::move(slots)) {}

CudaIpcStepper::~CudaIpcStepper() {
  if (registered_) {
    grpc::ClientContext context;
    client_->PrepareContext(context);
    v1::UnregisterCudaMemoryRequest request;
    request.set_name(region_name_);
    v1::UnregisterCudaMemoryResponse response;
    // Best effort: closing the liveness connection (Cuda's destructor) drops it as well.
    client_->stub().UnregisterCudaMemory(&context, request, &response).ok();
  }
}

absl::Status CudaIpcStepper::Register() {
  registered_ = false;
  absl::StatusOr<v1::ServerInfo> info = client_->GetServerInfo();
  if (!info.ok()) return info.status();
  // A new liveness connection per registration: a restarted daemon closed the old one.
  if (cuda_->socket >= 0) ::close(cuda_->socket);
  cuda_->socket = -1;
  v1::RegisterCudaMemoryRequest request;
  if (!info->shm_socket().empty()) {
    absl::StatusOr<int> socket = ConnectShmSocket(info->shm_socket());
    if (!socket.ok()) return socket.status();
    cuda_->socket = *socket;
    absl::StatusOr<std::string> ticket = RequestLivenessTicket(*socket);
    if (!ticket.ok()) return ticket.status();
    request.set_liveness_ticket(*ticket);
  }
  cudaIpcMemHandle_t mem;
  cudaIpcEventHandle_t event;
  if (absl::Status got = CudaError(cudaIpcGetMemHandle(&mem, cuda_->buffer), "cudaIpcGetMemHandle"); !got.ok()) {
    return got;
  }
  if (absl::Status got = CudaError(cudaIpcGetEventHandle(&event, cuda_->event), "cudaIpcGetEventHandle"); !got.ok()) {
    return got;
  }
  // A name of its own per registration: an earlier one on this daemon goes with its liveness
  // connection (closed above), or with the session.
  region_name_ = absl::StrCat("cuda-", session_->id(), "-", absl::Hex(std::random_device()(), absl::kZeroPad8));
  request.set_name(region_name_);
  request.set_session_id(session_->id());
  request.set_mem_handle(std::string(reinterpret_cast<const char*>(&mem), sizeof(mem)));
  request.set_event_handle(std::string(reinterpret_cast<const char*>(&event), sizeof(event)));
  request.set_byte_size(cuda_->bytes);
  request.set_device(cuda_->device);
  grpc::ClientContext context;
  client_->PrepareContext(context);
  v1::RegisterCudaMemoryResponse response;
  if (absl::Status status = FromGrpcStatus(client_->stub().RegisterCudaMemory(&context, request, &response));
      !status.ok()) {
    return status;
  }
  registered_ = true;
  return absl::OkStatus();
}

absl::StatusOr<StepReply> CudaIpcStepper::Step(int64_t step, std::span<const DeviceTensor> gradients,
                                               std::span<const DeviceTensor> parameters_out,
                                               const StepOptions& options) {
  // Checked before anything is sent: a step must never be applied with nowhere to put its answer.
  auto check = [&](std::span<const DeviceTensor> tensors, const std::string& field) -> absl::Status {
    for (size_t i = 0; i < tensors.size(); ++i) {
      const DeviceTensor& t = tensors[i];
      const std::string at = absl::StrCat(field, "[", i, "]");
      auto numel = session_->numel_.find(t.name);
      if (numel == session_->numel_.end()) {
        return absl::InvalidArgumentError(absl::StrCat(at, ".name: no parameter '", t.name, "'"));
      }
      if (t.numel != numel->second) {
        return absl::InvalidArgumentError(
            absl::StrCat(at, ".numel: ", t.numel, " elements for '", t.name, "' of ", numel->second));
      }
      if (!IsWireDType(t.dtype)) return absl::InvalidArgumentError(absl::StrCat(at, ".dtype: fp32, bf16 or fp16"));
      if (t.data == nullptr) return absl::InvalidArgumentError(absl::StrCat(at, ".data: null"));
    }
    return absl::OkStatus();
  };
  if (absl::Status ok = check(gradients, "gradients"); !ok.ok()) return ok;
  if (absl::Status ok = check(parameters_out, "parameters_out"); !ok.ok()) return ok;
  std::chrono::milliseconds backoff = client_->options().retry_backoff;
  for (int attempt = 1;; ++attempt) {
    absl::StatusOr<StepReply> reply = StepOnce(step, gradients, parameters_out, options);
    if (reply.ok()) {
      reply->attempts = attempt;
      session_->last_step_ = step;
      return reply;
    }
    if (!IsTransient(reply.status().code()) || attempt >= client_->options().max_step_attempts) return reply;
    client_->PauseBeforeRetry(backoff);
    backoff *= 2;
  }
}

absl::StatusOr<StepReply> CudaIpcStepper::StepOnce(int64_t step, std::span<const DeviceTensor> gradients,
                                                   std::span<const DeviceTensor> parameters_out,
                                                   const StepOptions& options) {
  if (!registered_) {
    if (absl::Status again = Register(); !again.ok()) return again;
  }
  if (absl::Status set = CudaError(cudaSetDevice(cuda_->device), "cudaSetDevice"); !set.ok()) return set;
  char* base = static_cast<char*>(cuda_->buffer);
  v1::StepSharedRequest request;
  *request.mutable_header() = session_->Header(step, options);
  // Written before every try: an answer overwrites the slots with parameters.
  for (const DeviceTensor& t : gradients) {
    const uint64_t bytes = static_cast<uint64_t>(t.numel) * wire::ElementSize(t.dtype);
    const uint64_t offset = slots_.at(t.name);
    if (absl::Status copied = CudaError(cudaMemcpyAsync(base + offset, t.data, bytes, cudaMemcpyDeviceToDevice,
                                                        cuda_->stream),
                                        absl::StrCat("copying gradient '", t.name, "'"));
        !copied.ok()) {
      return copied;
    }
    v1::SharedTensor* ref = request.add_gradients();
    ref->set_name(t.name);
    ref->set_region(region_name_);
    ref->set_offset(offset);
    ref->set_byte_size(bytes);
    ref->set_dtype(t.dtype);
  }
  // The daemon's copies wait for this on the device.
  if (absl::Status recorded = CudaError(cudaEventRecord(cuda_->event, cuda_->stream), "cudaEventRecord");
      !recorded.ok()) {
    return recorded;
  }
  std::map<std::string, v1::DType> answer_dtypes;
  for (const DeviceTensor& t : parameters_out) answer_dtypes[t.name] = t.dtype;
  for (const auto& [name, numel] : session_->numel_) {
    auto wanted = answer_dtypes.find(name);
    const v1::DType dtype = wanted != answer_dtypes.end() ? wanted->second : v1::DTYPE_FP32;
    v1::SharedTensor* ref = request.add_parameters();
    ref->set_name(name);
    ref->set_region(region_name_);
    ref->set_offset(slots_.at(name));
    ref->set_byte_size(static_cast<uint64_t>(numel) * wire::ElementSize(dtype));
    ref->set_dtype(dtype);
  }
  grpc::ClientContext context;
  client_->PrepareContext(context);
  v1::StepSharedResponse response;
  absl::Status status = FromGrpcStatus(client_->stub().StepCuda(&context, request, &response));
  if (!status.ok()) {
    if (status.code() == absl::StatusCode::kUnavailable) registered_ = false;  // a restarted daemon has lost it
    if (ReasonOf(status) == v1::REGION_NOT_FOUND) {
      registered_ = false;
      return absl::UnavailableError(absl::StrCat("the daemon lost this session's CUDA memory (restarted?): ",
                                                 status.message()));
    }
    return status;
  }
  StepReply reply;
  CopyResult(response.result(), &reply);
  if (options.phase == v1::STEP_PHASE_PREPARE) return reply;
  // The daemon synchronized before answering: the slots hold the parameters.
  for (const DeviceTensor& t : parameters_out) {
    const uint64_t bytes = static_cast<uint64_t>(t.numel) * wire::ElementSize(t.dtype);
    if (absl::Status copied = CudaError(cudaMemcpyAsync(t.data, base + slots_.at(t.name), bytes,
                                                        cudaMemcpyDeviceToDevice, cuda_->stream),
                                        absl::StrCat("copying parameter '", t.name, "'"));
        !copied.ok()) {
      return copied;
    }
  }
  return reply;
}

}  // namespace muond::client
