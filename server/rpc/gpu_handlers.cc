// MuondService's GPU transport calls: RegisterCudaMemory, UnregisterCudaMemory, StepCuda (CUDA IPC),
// OpenNcclChannel, CloseNcclChannel, StepNccl (docs/transports.md). On a backend without a GPU each
// is refused with FAILED_PRECONDITION saying so (the backend's refusal).
#include <algorithm>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/echo.h"
#include "common/status_macros.h"
#include "grpc/support/time.h"
#include "server/rpc/muond_service.h"
#include "server/rpc/out_of_band_step.h"
#include "server/rpc/rpc_deadline.h"
#include "server/transport/cuda_ipc/cuda_ipc_step.h"
#include "server/transport/nccl/nccl_step.h"

namespace muond::rpc {
namespace {

transport::BoundSession BoundTo(const session::Session& session) { return {session.id(), session.serial()}; }

}  // namespace

bool MuondService::StillOpen(const transport::BoundSession& bound, const std::string& caller) const {
  absl::StatusOr<std::shared_ptr<session::Session>> now = registry_->Find(bound.id, caller);
  return now.ok() && (*now)->serial() == bound.serial;
}

grpc::Status MuondService::RegisterCudaMemory(grpc::ServerContext* context,
                                              const v1::RegisterCudaMemoryRequest* request,
                                              v1::RegisterCudaMemoryResponse* response) {
  return Serve(calls_, context, "RegisterCudaMemory", [&](const std::string& caller) -> absl::Status {
    MUOND_ASSIGN_OR_RETURN(transport::CudaMemoryRegions * regions, CudaRegions());
    MUOND_RETURN_IF_ERROR(session::CheckSessionId(request->session_id(), "session_id"));
    MUOND_ASSIGN_OR_RETURN(std::shared_ptr<session::Session> session, registry_->Find(request->session_id(), caller));
    if (request->device() < 0) {
      return absl::InvalidArgumentError(absl::StrCat("device: a CUDA device ordinal, got ", request->device()));
    }
    const transport::BoundSession bound = BoundTo(*session);
    MUOND_ASSIGN_OR_RETURN(uint64_t bytes, regions->Register(caller, *request, bound));
    // Closed meanwhile: what CloseSession dropped did not include this.
    if (!StillOpen(bound, caller)) {
      regions->DropSession(bound);
      return absl::NotFoundError(absl::StrCat("session_id: session '", Echo(request->session_id()),
                                              "' was closed while its CUDA memory was registered"));
    }
    response->set_byte_size(bytes);
    return absl::OkStatus();
  });
}

grpc::Status MuondService::UnregisterCudaMemory(grpc::ServerContext* context,
                                                const v1::UnregisterCudaMemoryRequest* request,
                                                v1::UnregisterCudaMemoryResponse*) {
  return Serve(calls_, context, "UnregisterCudaMemory", [&](const std::string& caller) -> absl::Status {
    MUOND_ASSIGN_OR_RETURN(transport::CudaMemoryRegions * regions, CudaRegions());
    return regions->Unregister(caller, request->name());
  });
}

grpc::Status MuondService::StepCuda(grpc::ServerContext* context, const v1::StepSharedRequest* request,
                                    v1::StepSharedResponse* response) {
  return Serve(calls_, context, "StepCuda", [&](const std::string& caller) -> absl::Status {
    MUOND_ASSIGN_OR_RETURN(transport::CudaMemoryRegions * regions, CudaRegions());
    const v1::StepHeader& header = request->header();
    MUOND_ASSIGN_OR_RETURN(std::shared_ptr<session::Session> session, FindStepSession(*registry_, header, caller));
    MUOND_RETURN_IF_ERROR(CheckNoStreamAnswerOptions(header, "a CUDA IPC step"));
    // Every place is checked before the step begins: an applied step always has somewhere to go.
    MUOND_ASSIGN_OR_RETURN(
        std::vector<transport::CudaTensorPlace> gradients,
        transport::ResolveCudaTensors(session->config(), *regions, caller, BoundTo(*session), request->gradients(),
                                      "gradients", /*require_all=*/false, header.rank()));
    MUOND_ASSIGN_OR_RETURN(
        std::vector<transport::CudaTensorPlace> parameters,
        transport::ResolveCudaTensors(session->config(), *regions, caller, BoundTo(*session), request->parameters(),
                                      "parameters", /*require_all=*/true, header.rank()));
    // The client's event must complete by the call's deadline; a client that went away (its call
    // cancelled: it died, or gave up) ends the wait at once.
    const transport::EventWait wait(CallDeadline(*context), [context] { return CallerGaveUp(*context); });
    // A call its caller gave up before it began touches no memory: the caller may be using it for
    // its next try already. One given up later writes no answer (answer_gate.h).
    if (wait.caller_gone()) return absl::CancelledError("the caller gave this call up before it began");
    transport::AnswerClaims claims =
        transport::ClaimCudaRegions(gradients, parameters, header.session_id(), header.rank());
    transport::CudaIpcGradientSource source(backend_, std::move(gradients), wait);
    transport::CudaIpcParameterSink sink(session.get(), backend_, std::move(parameters), wait, std::move(claims));
    // Written device to device: nothing read back to the host.
    return RunOutOfBandStep(*session, header, /*device_answer=*/true, source, sink, *options_.metrics, response);
  });
}

grpc::Status MuondService::OpenNcclChannel(grpc::ServerContext* context, const v1::OpenNcclChannelRequest* request,
                                           v1::OpenNcclChannelResponse* response) {
  return Serve(calls_, context, "OpenNcclChannel", [&](const std::string& caller) -> absl::Status {
    MUOND_ASSIGN_OR_RETURN(transport::NcclChannels * channels, NcclChannels());
    MUOND_RETURN_IF_ERROR(session::CheckSessionId(request->session_id(), "session_id"));
    MUOND_ASSIGN_OR_RETURN(std::shared_ptr<session::Session> session, registry_->Find(request->session_id(), caller));
    const int world_size = session->config().world_size;
    if (request->rank() < 0 || request->rank() >= world_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank: ", request->rank(), " is not a rank of a session of ", world_size));
    }
    MUOND_ASSIGN_OR_RETURN(transport::NcclChannels::Opened opened,
                           channels->Open(caller, BoundTo(*session), request->rank()));
    // Closed meanwhile: what CloseSession dropped did not include this.
    if (!StillOpen(BoundTo(*session), caller)) {
      channels->Drop(caller, opened.name);
      return absl::NotFoundError(absl::StrCat("session_id: session '", Echo(request->session_id()),
                                              "' was closed while its NCCL channel was opened"));
    }
    response->set_channel(opened.name);
    response->set_unique_id(
        std::string(reinterpret_cast<const char*>(opened.unique_id.data()), opened.unique_id.size()));
    response->set_nranks(2);
    response->set_client_rank(1);
    response->set_timeout_seconds(absl::ToDoubleSeconds(channels->limits().join_timeout));
    return absl::OkStatus();
  });
}

grpc::Status MuondService::CloseNcclChannel(grpc::ServerContext* context, const v1::CloseNcclChannelRequest* request,
                                            v1::CloseNcclChannelResponse*) {
  return Serve(calls_, context, "CloseNcclChannel", [&](const std::string& caller) -> absl::Status {
    MUOND_ASSIGN_OR_RETURN(transport::NcclChannels * channels, NcclChannels());
    return channels->Close(caller, request->channel());
  });
}

grpc::Status MuondService::StepNccl(grpc::ServerContext* context, const v1::StepNcclRequest* request,
                                    v1::StepSharedResponse* response) {
  return Serve(calls_, context, "StepNccl", [&](const std::string& caller) -> absl::Status {
    MUOND_ASSIGN_OR_RETURN(transport::NcclChannels * channels, NcclChannels());
    const v1::StepHeader& header = request->header();
    MUOND_ASSIGN_OR_RETURN(std::shared_ptr<session::Session> session, FindStepSession(*registry_, header, caller));
    MUOND_ASSIGN_OR_RETURN(std::shared_ptr<transport::NcclChannel> channel,
                           channels->Find(caller, request->channel(), BoundTo(*session), "channel"));
    if (!channel->busy.TryLock()) {
      // Left alone: the step using it goes on.
      return absl::FailedPreconditionError(
          absl::StrCat("channel: another step is using NCCL channel '", Echo(request->channel()), "'"));
    }
    // From here on this call owns the channel, and whatever fails closes it: the client's transfers
    // may be in flight (docs/transports.md).
    bool keep_channel = false;
    absl::Cleanup release = [&] {
      channel->last_used = absl::Now();
      channel->busy.Unlock();
      if (!keep_channel) channels->Drop(caller, request->channel());
    };
    MUOND_RETURN_IF_ERROR(CheckNoStreamAnswerOptions(header, "an NCCL step"));
    if (header.rank() != channel->rank) {
      return absl::InvalidArgumentError(absl::StrCat("header.rank: channel '", Echo(request->channel()), "' is rank ",
                                                     channel->rank, "'s, not rank ", header.rank(), "'s"));
    }
    const bool prepare = header.phase() == v1::STEP_PHASE_PREPARE;
    MUOND_ASSIGN_OR_RETURN(std::vector<transport::TensorRef> gradients,
                           transport::ResolveNcclTensors(session->config(), request->gradients(), "gradients",
                                                         /*require_all=*/false, header.rank()));
    MUOND_ASSIGN_OR_RETURN(std::vector<transport::TensorRef> parameters,
                           transport::ResolveNcclTensors(session->config(), request->parameters(), "parameters",
                                                         /*require_all=*/!prepare, header.rank()));
    if (prepare && !parameters.empty()) {
      return absl::InvalidArgumentError("parameters: a prepare answers no parameters; list none");
    }
    // Each transfer ends by the call's deadline, and within --nccl-timeout of its start.
    const absl::Time call_deadline = CallDeadline(*context);
    const absl::Duration timeout = channels->limits().join_timeout;
    transport::NcclGradientSource source(backend_, channel.get(), std::move(gradients), call_deadline, timeout);
    transport::NcclParameterSink sink(session.get(), backend_, channel.get(), std::move(parameters), call_deadline,
                                      timeout);
    // Sent from the device: nothing read back to the host.
    MUOND_RETURN_IF_ERROR(
        RunOutOfBandStep(*session, header, /*device_answer=*/true, source, sink, *options_.metrics, response));
    keep_channel = true;
    return absl::OkStatus();
  });
}

absl::Time MuondService::CallDeadline(const grpc::ServerContext& context) const {
  absl::Time deadline =
      options_.rpc_timeout > absl::ZeroDuration() ? absl::Now() + options_.rpc_timeout : absl::InfiniteFuture();
  // From the raw deadline: a far one (a client's "forever" of centuries) would overflow a
  // std::chrono time point.
  const gpr_timespec raw = context.raw_deadline();
  if (gpr_time_cmp(raw, gpr_inf_future(raw.clock_type)) != 0) {
    const gpr_timespec left = gpr_time_sub(raw, gpr_now(raw.clock_type));
    deadline = std::min(deadline, absl::Now() + absl::Seconds(left.tv_sec) + absl::Nanoseconds(left.tv_nsec));
  }
  return deadline;
}

absl::StatusOr<transport::CudaMemoryRegions*> MuondService::CudaRegions() const {
  if (options_.transports.cuda_regions == nullptr)
    return absl::FailedPreconditionError("the daemon offers no CUDA IPC transport");
  return options_.transports.cuda_regions;
}

absl::StatusOr<transport::NcclChannels*> MuondService::NcclChannels() const {
  if (options_.transports.nccl_channels == nullptr)
    return absl::FailedPreconditionError("the daemon offers no NCCL transport");
  return options_.transports.nccl_channels;
}

}  // namespace muond::rpc
