#include "client/transport/cuda_ipc_step_transport.h"

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/shm_region.h"
#include "client/transport/out_of_band_try.h"
#include "grpcpp/grpcpp.h"
#include "proto/wire/dtype_codec.h"

namespace muond::client {
namespace {

constexpr uint64_t kSlotBytes = 4;  // one slot per element: fp32 at most, either way

absl::Status CudaError(cudaError_t error, const std::string& what) {
  if (error == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // not sticky: keep it from resurfacing in a later call
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(error), " (", cudaGetErrorString(error), ")"));
}

std::string Unviable(const v1::ServerInfo& info) {
  if (!info.cuda_ipc()) {
    return absl::StrCat("the daemon offers no CUDA IPC (its backend is ", info.backend(),
                        "; CUDA IPC needs --backend cuda)");
  }
  if (std::string elsewhere = NotOnThisHost(info); !elsewhere.empty()) {
    return absl::StrCat("CUDA IPC needs the daemon on this node; ", elsewhere);
  }
  return "";
}

}  // namespace

const TransportKind& CudaIpcTransportKind() {
  static const TransportKind kind{.name = "cuda_ipc", .unviable = Unviable, .open = nullptr};
  return kind;
}

struct CudaIpcStepTransport::Cuda {
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

absl::StatusOr<std::unique_ptr<CudaIpcStepTransport>> CudaIpcStepTransport::Open(Client& client, const Session& session,
                                                                                 int device, void* stream) {
  std::map<std::string, uint64_t> slots;
  uint64_t bytes = 0;
  for (const auto& [name, numel] : session.element_counts()) {
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
  if (absl::Status made =
          CudaError(cudaEventCreateWithFlags(&cuda->event, cudaEventInterprocess | cudaEventDisableTiming),
                    "cudaEventCreateWithFlags");
      !made.ok()) {
    return made;
  }
  return std::unique_ptr<CudaIpcStepTransport>(
      new CudaIpcStepTransport(client, session, std::move(cuda), std::move(slots)));
}

CudaIpcStepTransport::CudaIpcStepTransport(Client& client, const Session& session, std::unique_ptr<Cuda> cuda,
                                           std::map<std::string, uint64_t> slots)
    : client_(client), session_(session), cuda_(std::move(cuda)), slots_(std::move(slots)) {}

CudaIpcStepTransport::~CudaIpcStepTransport() {
  if (registered_) {
    grpc::ClientContext context;
    client_.PrepareContext(context);
    v1::UnregisterCudaMemoryRequest request;
    request.set_name(region_name_);
    v1::UnregisterCudaMemoryResponse response;
    // Best effort: closing the liveness connection (Cuda's destructor) drops it as well.
    client_.stub().UnregisterCudaMemory(&context, request, &response).ok();
  }
}

absl::Status CudaIpcStepTransport::Register() {
  registered_ = false;
  absl::StatusOr<v1::ServerInfo> info = client_.GetServerInfo();
  if (!info.ok()) return info.status();
  // A new liveness connection per registration: a restarted daemon closed the old one.
  if (cuda_->socket >= 0) ::close(cuda_->socket);
  cuda_->socket = -1;
  v1::RegisterCudaMemoryRequest request;
  if (!info->shm_socket().empty()) {
    absl::StatusOr<int> socket = ConnectShmSocket(info->shm_socket(), client_.options().rpc_timeout);
    if (!socket.ok()) return socket.status();
    cuda_->socket = *socket;
    absl::StatusOr<std::string> grant = client_.SharedMemoryGrant(*info);
    if (!grant.ok()) return grant.status();
    if (absl::Status presented = PresentGrant(*socket, *grant); !presented.ok()) return presented;
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
  region_name_ = absl::StrCat("cuda-", session_.id(), "-", absl::Hex(std::random_device()(), absl::kZeroPad8));
  request.set_name(region_name_);
  request.set_session_id(session_.id());
  request.set_mem_handle(std::string(reinterpret_cast<const char*>(&mem), sizeof(mem)));
  request.set_event_handle(std::string(reinterpret_cast<const char*>(&event), sizeof(event)));
  request.set_byte_size(cuda_->bytes);
  request.set_device(cuda_->device);
  grpc::ClientContext context;
  client_.PrepareContext(context);
  v1::RegisterCudaMemoryResponse response;
  if (absl::Status status = FromGrpcStatus(client_.stub().RegisterCudaMemory(&context, request, &response));
      !status.ok()) {
    return status;
  }
  registered_ = true;
  return absl::OkStatus();
}

absl::Status CudaIpcStepTransport::WriteGradients(std::span<const DeviceTensor> gradients,
                                                  v1::StepSharedRequest& request) {
  char* base = static_cast<char*>(cuda_->buffer);
  for (const DeviceTensor& t : gradients) {
    const uint64_t bytes = static_cast<uint64_t>(t.numel) * wire::ElementSize(t.dtype);
    const uint64_t offset = slots_.at(t.name);
    if (bytes == 0) {  // a rank's empty part: nothing to copy, an empty reference
      AddReference(request.mutable_gradients(), t.name, region_name_, offset, 0, t.dtype);
      continue;
    }
    if (absl::Status copied =
            CudaError(cudaMemcpyAsync(base + offset, t.data, bytes, cudaMemcpyDeviceToDevice, cuda_->stream),
                      absl::StrCat("copying gradient '", t.name, "'"));
        !copied.ok()) {
      return copied;
    }
    AddReference(request.mutable_gradients(), t.name, region_name_, offset, bytes, t.dtype);
  }
  // The daemon's copies wait for this on the device.
  return CudaError(cudaEventRecord(cuda_->event, cuda_->stream), "cudaEventRecord");
}

absl::Status CudaIpcStepTransport::ReadParameters(std::span<const DeviceTensor> parameters_out) {
  const char* base = static_cast<const char*>(cuda_->buffer);
  for (const DeviceTensor& t : parameters_out) {
    const uint64_t bytes = static_cast<uint64_t>(t.numel) * wire::ElementSize(t.dtype);
    if (bytes == 0) continue;  // a rank's empty part
    if (absl::Status copied =
            CudaError(cudaMemcpyAsync(t.data, base + slots_.at(t.name), bytes, cudaMemcpyDeviceToDevice, cuda_->stream),
                      absl::StrCat("copying parameter '", t.name, "'"));
        !copied.ok()) {
      return copied;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<StepReply> CudaIpcStepTransport::StepOnce(const v1::StepHeader& header, const StepPayload& payload,
                                                         const StepOptions& options) {
  if (!registered_) {
    if (absl::Status again = Register(); !again.ok()) return again;
  }
  if (absl::Status set = CudaError(cudaSetDevice(cuda_->device), "cudaSetDevice"); !set.ok()) return set;
  v1::StepSharedRequest request;
  *request.mutable_header() = header;
  // Written before every try: an answer overwrites the slots with parameters.
  if (absl::Status written = WriteGradients(payload.device_gradients, request); !written.ok()) return written;
  std::map<std::string, v1::DType> answer_dtypes;
  for (const DeviceTensor& t : payload.device_parameters_out) answer_dtypes[t.name] = t.dtype;
  for (const auto& [name, numel] : session_.element_counts()) {
    auto wanted = answer_dtypes.find(name);
    const v1::DType dtype = wanted != answer_dtypes.end() ? wanted->second : v1::DTYPE_FP32;
    AddReference(request.mutable_parameters(), name, region_name_, slots_.at(name),
                 static_cast<uint64_t>(numel) * wire::ElementSize(dtype), dtype);
  }
  grpc::ClientContext context;
  client_.PrepareContext(context);
  v1::StepSharedResponse response;
  absl::Status status = FromGrpcStatus(client_.stub().StepCuda(&context, request, &response));
  if (!status.ok()) {
    FailedTry failed = ReadFailedTry(status, "CUDA memory");
    if (failed.registration_lost) registered_ = false;
    return failed.status;
  }
  StepReply reply;
  CopyResult(response.result(), &reply);
  if (options.phase == v1::STEP_PHASE_PREPARE) return reply;
  // The daemon synchronized before answering: the slots hold the parameters.
  if (absl::Status read = ReadParameters(payload.device_parameters_out); !read.ok()) return read;
  return reply;
}

}  // namespace muond::client
