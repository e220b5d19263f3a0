// MuondService's shared-memory calls: GrantSharedMemory, RegisterSharedMemory, UnregisterSharedMemory,
// SharedMemoryStatus and StepShared (docs/transports.md).
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/rpc/muond_service.h"
#include "server/rpc/out_of_band_step.h"
#include "server/rpc/rpc_deadline.h"
#include "server/transport/shm/shm_step.h"

namespace muond::rpc {

absl::StatusOr<transport::SharedMemoryRegions*> MuondService::ShmRegions() const {
  if (options_.transports.shm_regions == nullptr) {
    return absl::FailedPreconditionError(
        "the daemon offers no shared-memory transport (started with --shm-socket none); use the gRPC transport");
  }
  return options_.transports.shm_regions;
}

grpc::Status MuondService::GrantSharedMemory(grpc::ServerContext* context, const v1::GrantSharedMemoryRequest*,
                                             v1::GrantSharedMemoryResponse* response) {
  return Serve(calls_, context, "GrantSharedMemory", [&](const std::string& caller) -> absl::Status {
    MUOND_ASSIGN_OR_RETURN(transport::SharedMemoryRegions * regions, ShmRegions());
    response->set_grant(regions->Grant(caller));
    response->set_expires_in_seconds(absl::ToDoubleSeconds(regions->limits().pending_timeout));
    response->set_max_pending_memfds(regions->limits().max_pending_per_connection);
    return absl::OkStatus();
  });
}

grpc::Status MuondService::RegisterSharedMemory(grpc::ServerContext* context,
                                                const v1::RegisterSharedMemoryRequest* request,
                                                v1::RegisterSharedMemoryResponse* response) {
  return Serve(calls_, context, "RegisterSharedMemory", [&](const std::string& caller) -> absl::Status {
    MUOND_ASSIGN_OR_RETURN(transport::SharedMemoryRegions * regions, ShmRegions());
    MUOND_ASSIGN_OR_RETURN(uint64_t bytes, regions->Register(caller, request->name(), request->ticket()));
    response->set_byte_size(bytes);
    return absl::OkStatus();
  });
}

grpc::Status MuondService::UnregisterSharedMemory(grpc::ServerContext* context,
                                                  const v1::UnregisterSharedMemoryRequest* request,
                                                  v1::UnregisterSharedMemoryResponse*) {
  return Serve(calls_, context, "UnregisterSharedMemory", [&](const std::string& caller) -> absl::Status {
    MUOND_ASSIGN_OR_RETURN(transport::SharedMemoryRegions * regions, ShmRegions());
    return regions->Unregister(caller, request->name());
  });
}

grpc::Status MuondService::SharedMemoryStatus(grpc::ServerContext* context,
                                              const v1::SharedMemoryStatusRequest* request,
                                              v1::SharedMemoryStatusResponse* response) {
  return Serve(calls_, context, "SharedMemoryStatus", [&](const std::string& caller) -> absl::Status {
    MUOND_ASSIGN_OR_RETURN(transport::SharedMemoryRegions * regions, ShmRegions());
    MUOND_ASSIGN_OR_RETURN(std::vector<transport::RegionStatus> status, regions->Status(caller, request->name()));
    for (const transport::RegionStatus& region : status) {
      v1::SharedMemoryRegion* out = response->add_regions();
      out->set_name(region.name);
      out->set_byte_size(region.byte_size);
      out->set_steps_in_flight(region.steps_in_flight);
    }
    return absl::OkStatus();
  });
}

grpc::Status MuondService::StepShared(grpc::ServerContext* context, const v1::StepSharedRequest* request,
                                      v1::StepSharedResponse* response) {
  return Serve(calls_, context, "StepShared", [&](const std::string& caller) -> absl::Status {
    MUOND_ASSIGN_OR_RETURN(transport::SharedMemoryRegions * regions, ShmRegions());
    const v1::StepHeader& header = request->header();
    MUOND_ASSIGN_OR_RETURN(std::shared_ptr<session::Session> session, FindStepSession(*registry_, header, caller));
    MUOND_RETURN_IF_ERROR(CheckNoStreamAnswerOptions(header, "a shared-memory step"));
    // Every place is checked before the step begins: an applied step always has somewhere to go.
    MUOND_ASSIGN_OR_RETURN(std::vector<transport::SharedTensorPlace> gradients,
                           transport::ResolveSharedTensors(session->config(), *regions, caller, request->gradients(),
                                                           "gradients", /*require_all=*/false, header.rank()));
    MUOND_ASSIGN_OR_RETURN(std::vector<transport::SharedTensorPlace> parameters,
                           transport::ResolveSharedTensors(session->config(), *regions, caller, request->parameters(),
                                                           "parameters", /*require_all=*/true, header.rank()));
    // A call its caller gave up before it began (its deadline passed while it queued) touches no
    // region: the caller may be using them for its next try already. One given up later writes no
    // answer (answer_gate.h).
    const auto given_up = [context] { return CallerGaveUp(*context); };
    if (given_up()) return absl::CancelledError("the caller gave this call up before it began");
    transport::AnswerClaims claims =
        transport::ClaimSharedRegions(gradients, parameters, header.session_id(), header.rank());
    transport::ShmGradientSource source(std::move(gradients), &regions->copy_pool());
    transport::ShmParameterSink sink(std::move(parameters), &regions->copy_pool(), std::move(claims), given_up);
    return RunOutOfBandStep(*session, header, /*device_answer=*/false, source, sink, *options_.metrics, response);
  });
}

}  // namespace muond::rpc
