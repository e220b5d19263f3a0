#include "client/transport/shm_step_transport.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "client/transport/out_of_band_try.h"
#include "client/transport/parameter_output.h"
#include "grpcpp/grpcpp.h"
#include "proto/wire/dtype_codec.h"

namespace muond::client {
namespace {

std::string Unviable(const v1::ServerInfo& info) {
  if (info.shm_socket().empty()) return "the daemon offers no shared-memory transport (--shm-socket none)";
  if (std::string elsewhere = NotOnThisHost(info); !elsewhere.empty()) return elsewhere;
  if (!ShmSocketReachable(info.shm_socket())) {
    return absl::StrCat("the daemon's socket ", info.shm_socket(), " cannot be reached from here");
  }
  return "";
}

}  // namespace

const TransportKind& ShmTransportKind() {
  static const TransportKind kind{.name = "shm",
                                  .unviable = Unviable,
                                  .open = [](Client& client, const Session& session) -> std::unique_ptr<StepTransport> {
                                    return std::make_unique<ShmStepTransport>(client, session);
                                  }};
  return kind;
}

absl::Status ShmStepTransport::SetUpRegion() {
  absl::Status status = TrySetUpRegion();
  // A daemon that is away is another try's business; anything else is the daemon saying no.
  refusal_ = status.ok() || IsTransient(status.code()) ? absl::OkStatus() : status;
  return status;
}

absl::Status ShmStepTransport::TrySetUpRegion() {
  region_.reset();
  // One try: a daemon that is down makes this step attempt fail, and the session's retries go on.
  v1::ServerInfo info;
  {
    grpc::ClientContext context;
    client_.PrepareContext(context);
    absl::Status reached = FromGrpcStatus(client_.stub().GetServerInfo(&context, v1::GetServerInfoRequest(), &info));
    if (!reached.ok()) return reached;
  }
  if (info.shm_socket().empty()) {
    return absl::FailedPreconditionError("transport: the daemon no longer offers shared memory");
  }
  uint64_t bytes = 0;
  offsets_.clear();
  for (const auto& [name, numel] : session_.element_counts()) {
    offsets_[name] = bytes;
    bytes += static_cast<uint64_t>(numel) * sizeof(float);  // fits every dtype, in or out
  }
  absl::StatusOr<std::string> grant = client_.SharedMemoryGrant(info);
  if (!grant.ok()) return grant.status();
  absl::StatusOr<std::unique_ptr<ShmRegion>> region =
      ShmRegion::Create(info.shm_socket(), std::max<uint64_t>(bytes, 1), *grant, client_.options().rpc_timeout);
  if (!region.ok()) return region.status();
  const std::string name = absl::StrCat(session_.id(), "/", (*region)->ticket().substr(0, 8));
  grpc::ClientContext context;
  client_.PrepareContext(context);
  v1::RegisterSharedMemoryRequest request;
  request.set_name(name);
  request.set_ticket((*region)->ticket());
  v1::RegisterSharedMemoryResponse response;
  absl::Status registered = FromGrpcStatus(client_.stub().RegisterSharedMemory(&context, request, &response));
  if (!registered.ok()) return registered;
  region_ = *std::move(region);
  region_name_ = name;
  return absl::OkStatus();
}

void ShmStepTransport::WriteGradients(std::span<const TensorView> gradients, v1::StepSharedRequest& request) {
  const std::map<std::string, int64_t>& counts = session_.element_counts();
  for (const TensorView& tensor : gradients) {
    const v1::DType dtype = session_.WireDType(tensor.name);
    v1::SharedTensor* ref = AddReference(request.mutable_gradients(), tensor.name, region_name_, 0,
                                         tensor.values.size() * wire::ElementSize(dtype), dtype);
    auto slot = offsets_.find(tensor.name);
    auto numel = counts.find(tensor.name);
    if (slot == offsets_.end() || numel == counts.end() ||
        static_cast<int64_t>(tensor.values.size()) != numel->second) {
      continue;  // not written: the daemon refuses the reference, naming the field
    }
    ref->set_offset(slot->second);
    if (staged_.count(tensor.name) == 0) wire::EncodeTo(dtype, tensor.values, region_->data() + slot->second);
  }
}

bool ShmStepTransport::StageGradient(const TensorView& gradient) {
  if (region_ == nullptr && !SetUpRegion().ok()) return false;  // the try sets it up, or fails
  auto slot = offsets_.find(gradient.name);
  auto numel = session_.element_counts().find(gradient.name);
  if (slot == offsets_.end() || numel == session_.element_counts().end() ||
      static_cast<int64_t>(gradient.values.size()) != numel->second) {
    return false;
  }
  wire::EncodeTo(session_.WireDType(gradient.name), gradient.values, region_->data() + slot->second);
  staged_.insert(gradient.name);
  return true;
}

absl::StatusOr<StepReply> ShmStepTransport::StepOnce(const v1::StepHeader& header, const StepPayload& payload,
                                                     const StepOptions& options) {
  if (region_ == nullptr) {
    if (absl::Status ready = SetUpRegion(); !ready.ok()) return ready;
  }
  v1::StepSharedRequest request;
  *request.mutable_header() = header;
  // Written before every try (an answer overwrites them with parameters), but for those a
  // streamed step staged for this one.
  WriteGradients(payload.gradients, request);
  staged_.clear();
  const v1::DType answer = session_.ReturnDType(options);
  for (const auto& [name, numel] : session_.element_counts()) {
    AddReference(request.mutable_parameters(), name, region_name_, offsets_[name],
                 static_cast<uint64_t>(numel) * wire::ElementSize(answer), answer);
  }
  grpc::ClientContext context;
  client_.PrepareContext(context);
  v1::StepSharedResponse response;
  absl::Status status = FromGrpcStatus(client_.stub().StepShared(&context, request, &response));
  if (!status.ok()) {
    FailedTry failed = ReadFailedTry(status, "region");
    if (failed.registration_lost) region_.reset();
    return failed.status;
  }
  StepReply reply;
  CopyResult(response.result(), &reply);
  if (options.phase == v1::STEP_PHASE_PREPARE) return reply;  // the region still holds the gradients
  for (const auto& [name, numel] : session_.element_counts()) {
    absl::StatusOr<std::span<float>> values = Destination(name, numel, options.parameters_out, &reply.parameters);
    if (!values.ok()) return values.status();
    wire::Decode(answer, absl::string_view(region_->data() + offsets_[name], numel * wire::ElementSize(answer)),
                 *values);
  }
  return reply;
}

}  // namespace muond::client
