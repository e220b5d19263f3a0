// CudaMemoryRegions: the daemon's table of CUDA IPC memory its clients registered (docs/transports.md,
// "CUDA IPC"): a client's flat device buffer and its interprocess event, opened once in the
// backend's device and kept open until the region goes.
//
// A region is private to its caller (named as shared-memory regions are) and bound to one session:
// steps of other sessions cannot name it. It goes when the caller unregisters it, when its session
// closes (DropSession), or — when registered with a liveness ticket of the shm socket — when that
// socket connection closes (DropConnection): the client exited, and the device memory it exported is
// released once the daemon closes its handle. A step that found a region keeps it (shared_ptr) open
// until the step is done.
//
// Thread-safety: thread-safe. Handles are opened and closed outside the table's lock.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kernels/backend.h"
#include "muond/v1/muond.pb.h"
#include "server/transport/answer_gate.h"
#include "server/transport/liveness_tickets.h"
#include "server/transport/region_table.h"

namespace muond::transport {

struct CudaRegion {
  BoundSession session;
  uint64_t connection = 0;  // the liveness connection; 0: none
  std::unique_ptr<kernels::PeerMemory> memory;
  std::unique_ptr<kernels::PeerEvent> event;
  AnswerGate answers;  // which step call may still write its answer here (answer_gate.h)
};

class CudaMemoryRegions {
 public:
  // `backend` opens the handles; `liveness` (null without a shm socket) resolves liveness tickets.
  // Neither is owned; both must outlive this.
  CudaMemoryRegions(kernels::Backend* backend, LivenessTickets* liveness, int max_regions_per_caller = 64)
      : backend_(backend), liveness_(liveness), max_regions_per_caller_(max_regions_per_caller) {}

  // Opens and files the request's memory and event under (caller, name) for `session` (the request's,
  // which the caller has checked is theirs). Errors name the request's fields; ALREADY_EXISTS for a
  // name in use; RESOURCE_EXHAUSTED beyond the per-caller limit.
  absl::StatusOr<uint64_t> Register(const std::string& caller, const v1::RegisterCudaMemoryRequest& request,
                                    const BoundSession& session);
  absl::Status Unregister(const std::string& caller, const std::string& name);
  // The caller's region `name` for a step of `session`; errors name `field`.
  absl::StatusOr<std::shared_ptr<CudaRegion>> Find(const std::string& caller, const std::string& name,
                                                   const BoundSession& session, const std::string& field) const;
  // The regions of `session` (not those of a later session of the same id).
  void DropSession(const BoundSession& session);
  void DropConnection(uint64_t connection);
  size_t size() const;

 private:
  kernels::Backend* const backend_;
  LivenessTickets* const liveness_;
  const int max_regions_per_caller_;
  mutable absl::Mutex mu_;
  RegionTable<CudaRegion> regions_ ABSL_GUARDED_BY(mu_){"CUDA memory", ErrorReason::kRegionNotFound};
};

}  // namespace muond::transport
