#include "server/transport/cuda_ipc/cuda_memory_regions.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/echo.h"
#include "common/status_macros.h"

namespace muond::transport {

absl::StatusOr<uint64_t> CudaMemoryRegions::Register(const std::string& caller,
                                                     const v1::RegisterCudaMemoryRequest& request,
                                                     const BoundSession& session) {
  MUOND_RETURN_IF_ERROR(CheckRegionName(request.name()));
  if (request.mem_handle().size() != kernels::kIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("mem_handle: a cudaIpcMemHandle_t has ", kernels::kIpcHandleBytes,
                                                   " bytes, got ", request.mem_handle().size()));
  }
  if (request.event_handle().size() != kernels::kIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("event_handle: a cudaIpcEventHandle_t has ",
                                                   kernels::kIpcHandleBytes, " bytes, got ",
                                                   request.event_handle().size()));
  }
  if (request.byte_size() == 0) return absl::InvalidArgumentError("byte_size: must be positive");
  uint64_t connection = 0;
  if (!request.liveness_ticket().empty()) {
    if (liveness_ == nullptr) {
      return absl::FailedPreconditionError(
          "liveness_ticket: the daemon has no shm_socket (started with --shm-socket none) to issue one");
    }
    MUOND_ASSIGN_OR_RETURN(connection, liveness_->LivenessConnection(request.liveness_ticket(), "liveness_ticket"));
  }
  {
    absl::MutexLock lock(&mu_);
    if (regions_.contains(caller, request.name())) {
      return absl::AlreadyExistsError(
          absl::StrCat("name: CUDA memory '", Echo(request.name()), "' is registered already; unregister it first"));
    }
    const int held = regions_.CountOf(caller);
    if (held >= max_regions_per_caller_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("name: this caller holds ", held, " CUDA memory regions, the most allowed; unregister one"));
    }
  }
  // Opened outside the lock: opening maps memory into the daemon's device, which takes a while.
  auto region = std::make_shared<CudaRegion>();
  region->session = session;
  region->connection = connection;
  MUOND_ASSIGN_OR_RETURN(region->memory, backend_->OpenPeerMemory(request.mem_handle(), request.byte_size()));
  MUOND_ASSIGN_OR_RETURN(region->event, backend_->OpenPeerEvent(request.event_handle()));
  const uint64_t size = region->memory->size();
  {
    absl::MutexLock lock(&mu_);
    if (!regions_.Insert({.caller = caller, .session = region->session, .connection = connection}, request.name(),
                         region)) {
      return absl::AlreadyExistsError(
          absl::StrCat("name: CUDA memory '", Echo(request.name()), "' was registered meanwhile"));
    }
  }
  // The connection may have closed while the handles were opening: its listener ran before the
  // region was filed, so check again.
  if (connection != 0 && !liveness_->LivenessConnection(request.liveness_ticket(), "liveness_ticket").ok()) {
    DropConnection(connection);
    return absl::CancelledError("liveness_ticket: the client's shm_socket connection closed while registering");
  }
  return size;
}

absl::Status CudaMemoryRegions::Unregister(const std::string& caller, const std::string& name) {
  std::shared_ptr<CudaRegion> dropped;  // closed after the lock
  absl::MutexLock lock(&mu_);
  dropped = regions_.Take(caller, name);
  if (dropped == nullptr)
    return absl::NotFoundError(absl::StrCat("name: no CUDA memory '", Echo(name), "' is registered"));
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<CudaRegion>> CudaMemoryRegions::Find(const std::string& caller, const std::string& name,
                                                                    const BoundSession& session,
                                                                    const std::string& field) const {
  absl::MutexLock lock(&mu_);
  return regions_.Find(caller, name, &session, field,
                       " is registered (RegisterCudaMemory; a restarted daemon has none)");
}

void CudaMemoryRegions::DropSession(const BoundSession& session) {
  std::vector<std::shared_ptr<CudaRegion>> dropped;  // closed after the lock
  absl::MutexLock lock(&mu_);
  dropped = regions_.TakeSession(session);
}

void CudaMemoryRegions::DropConnection(uint64_t connection) {
  std::vector<std::shared_ptr<CudaRegion>> dropped;  // closed after the lock
  absl::MutexLock lock(&mu_);
  dropped = regions_.TakeConnection(connection);
}

size_t CudaMemoryRegions::size() const {
  absl::MutexLock lock(&mu_);
  return regions_.size();
}

}  // namespace muond::transport
