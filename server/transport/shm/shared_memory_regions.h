// SharedMemoryRegions: the daemon's table of shared-memory regions, between the Unix-domain socket
// that receives clients' memfds (ShmSocketServer) and the RPCs that name them.
//
// A descriptor received on a socket connection becomes a pending region under a one-time ticket
// (128 random bits; unguessable): checked, held as a descriptor, not mapped. RegisterSharedMemory
// claims the ticket under a name private to the authenticated caller and maps it then, so an
// unauthenticated peer can hold descriptors (bounded below) but never address space; from then on
// the caller's steps name the region, which holds its mapping and no descriptor. A region goes when its
// caller unregisters it, or when the socket connection that passed it closes — the client exited or
// crashed, so nothing it registered outlives it; pending tickets of a closed connection go too.
// Regions are shared_ptrs: a step that resolved a region keeps it mapped until the step is done.
//
// The same connections vouch for other resources a client holds (CUDA IPC memory): as
// LivenessTickets, a liveness ticket ('L' on the socket) names a connection, and the listeners set
// with OnConnectionClosed hear when it closes.
//
// Limits: at most `max_pending_per_connection` unclaimed tickets per connection, `max_pending`
// daemon-wide (each holds a descriptor), and `max_regions_per_caller` regions per caller
// (RESOURCE_EXHAUSTED beyond); a ticket not claimed within `pending_timeout` expires
// (ExpirePending, called by the socket's thread). `max_connections` is the socket server's.
//
// The table also names the threads that steps over its regions copy with (copy_pool()): the copies
// out of and into the regions are split over them (shm_step.h). The daemon on the CPU backend passes
// the backend's own pool, so copies and compute share its --threads threads and its gate (one call
// at a time, never more threads than --threads); otherwise the table makes a pool of `copy_threads`
// (a step's own thread included) for itself.
// Thread-safety: thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/compute_pool.h"
#include "server/transport/liveness_tickets.h"
#include "server/transport/region_table.h"
#include "server/transport/shm/shared_mapping.h"

namespace muond::transport {

struct SharedMemoryLimits {
  int max_connections = 1024;  // socket connections at once (each holds a descriptor)
  int max_pending = 4096;      // unclaimed tickets, daemon-wide (each holds a descriptor)
  absl::Duration pending_timeout = absl::Seconds(60);
  int max_pending_per_connection = 64;
  int max_regions_per_caller = 256;
  uint64_t max_region_bytes = uint64_t{1} << 40;
};

struct RegionStatus {
  std::string name;
  uint64_t byte_size = 0;
  int steps_in_flight = 0;
};

class SharedMemoryRegions : public LivenessTickets {
 public:
  // `copy_pool`, when given, must outlive the table.
  explicit SharedMemoryRegions(SharedMemoryLimits limits = {}, ComputePool* copy_pool = nullptr, int copy_threads = 1)
      : limits_(limits),
        own_copy_pool_(copy_pool == nullptr ? std::make_unique<ComputePool>(copy_threads) : nullptr),
        copy_pool_(copy_pool != nullptr ? copy_pool : own_copy_pool_.get()) {}

  const SharedMemoryLimits& limits() const { return limits_; }
  // The threads steps copy with; one call at a time passes through its gate.
  ComputePool& copy_pool() { return *copy_pool_; }

  // The socket side. A connection id for a new connection.
  uint64_t OpenConnection();
  // Files `memfd` under a new ticket of `connection`, expiring `pending_timeout` after `now`, and
  // returns the ticket; RESOURCE_EXHAUSTED (the memfd closed) beyond either pending limit.
  absl::StatusOr<std::string> AddPending(uint64_t connection, SealedMemfd memfd, absl::Time now = absl::Now());
  // Drops the tickets unclaimed at `now` past their expiry; returns how many.
  int ExpirePending(absl::Time now);
  // When the next unclaimed ticket expires (absl::InfiniteFuture() when none is held).
  absl::Time NextExpiry() const;
  // Unclaimed tickets held now.
  int PendingCount() const;
  // Drops the connection's pending tickets, every region it passed and its liveness ticket, then
  // tells the listeners (on the socket's thread).
  void CloseConnection(uint64_t connection);

  // The RPC side; errors name the request's fields.
  absl::StatusOr<uint64_t> Register(const std::string& caller, const std::string& name, const std::string& ticket);
  absl::Status Unregister(const std::string& caller, const std::string& name);
  // The caller's regions (all of them when `name` is empty); NOT_FOUND for an unknown name.
  absl::StatusOr<std::vector<RegionStatus>> Status(const std::string& caller, const std::string& name) const;
  // The caller's region `name`; `field` names it in errors.
  absl::StatusOr<std::shared_ptr<SharedMapping>> Find(const std::string& caller, const std::string& name,
                                                      const std::string& field) const;

 private:
  struct Pending {
    uint64_t connection;
    SealedMemfd memfd;
    absl::Time expires;
  };
  void DropConnectionLocked(uint64_t connection, std::vector<std::shared_ptr<SharedMapping>>& dropped,
                            std::vector<SealedMemfd>& dropped_pending) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const SharedMemoryLimits limits_;
  const std::unique_ptr<ComputePool> own_copy_pool_;
  ComputePool* const copy_pool_;
  mutable absl::Mutex mu_;
  uint64_t next_connection_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<std::string, Pending> pending_ ABSL_GUARDED_BY(mu_);  // by ticket
  RegionTable<SharedMapping> regions_ ABSL_GUARDED_BY(mu_){"shared-memory region", ErrorReason::kRegionNotFound};
};

}  // namespace muond::transport
