// SharedMemoryRegions: the daemon's table of shared-memory regions, between the Unix-domain socket
// that receives clients' memfds (ShmSocketServer) and the RPCs that name them.
//
// Only an authenticated caller's connection holds descriptors. GrantSharedMemory gives the caller a
// one-time grant (128 random bits); the first socket connection that presents it (Bind) is the
// caller's from then on. A descriptor received on a bound connection becomes a pending region under a
// one-time ticket: checked, held as a descriptor, not mapped. RegisterSharedMemory claims the ticket
// — by the same caller only — under a name private to that caller and maps it then; from then on the
// caller's steps name the region, which holds its mapping and no descriptor. A region goes when its
// caller unregisters it, or when the socket connection that passed it closes — the client exited or
// crashed, so nothing it registered outlives it; pending tickets of a closed connection go too.
// Regions are shared_ptrs: a step that resolved a region keeps it mapped until the step is done.
//
// The same connections vouch for other resources a client holds (CUDA IPC memory): as
// LivenessTickets, a liveness ticket ('L' on a bound connection) names a connection, and the
// listeners set with OnConnectionClosed hear when it closes.
//
// Limits, so that no caller can stop another from registering: at most `max_pending_per_connection`
// unclaimed tickets per connection and `max_pending` daemon-wide (each holds a descriptor) — when the
// daemon-wide budget is full, a new memfd takes the place of the oldest unclaimed one of the caller
// holding the most; at most a quarter of `max_connections` bound connections per caller and
// kMaxGrantsPerCaller outstanding grants per caller (the oldest goes); `max_regions_per_caller`
// regions per caller (RESOURCE_EXHAUSTED beyond). A grant or ticket not used within
// `pending_timeout` expires (ExpirePending, called by the socket's thread). Without authentication
// every caller is the same one, so the shares protect nobody from anybody: only the eviction of the
// oldest unclaimed memfd does.
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
  static constexpr int kMaxGrantsPerCaller = 64;
  uint64_t max_region_bytes = uint64_t{1} << 40;
};

struct RegionStatus {
  std::string name;
  uint64_t byte_size = 0;
  int steps_in_flight = 0;  // step calls that named it and have not ended
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

  // The RPC side: a one-time grant for `caller`, valid until `pending_timeout` after `now`.
  std::string Grant(const std::string& caller, absl::Time now = absl::Now());

  // The socket side. A connection id for a new connection.
  uint64_t OpenConnection();
  // Binds `connection` to the caller `grant` was given to (using the grant up). PERMISSION_DENIED
  // for an unknown, used or expired grant; RESOURCE_EXHAUSTED when the caller holds its share of
  // connections; FAILED_PRECONDITION when the connection is bound already.
  absl::Status Bind(uint64_t connection, const std::string& grant, absl::Time now = absl::Now());
  bool IsBound(uint64_t connection) const;
  // Files `memfd` under a new ticket of the bound `connection`, expiring `pending_timeout` after
  // `now`, and returns the ticket. RESOURCE_EXHAUSTED (the memfd closed) beyond the connection's
  // limit; at the daemon-wide one the oldest unclaimed memfd of the caller holding the most goes
  // (counted in *evicted). FAILED_PRECONDITION for a connection that is not bound.
  absl::StatusOr<std::string> AddPending(uint64_t connection, SealedMemfd memfd, absl::Time now = absl::Now(),
                                         int* evicted = nullptr);
  // Drops the tickets and grants unclaimed at `now` past their expiry; returns how many tickets.
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
    std::string caller;
    SealedMemfd memfd;
    absl::Time expires;
  };
  struct GrantEntry {
    std::string caller;
    absl::Time expires;
  };
  void DropConnectionLocked(uint64_t connection, std::vector<std::shared_ptr<SharedMapping>>& dropped,
                            std::vector<SealedMemfd>& dropped_pending) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const SharedMemoryLimits limits_;
  const std::unique_ptr<ComputePool> own_copy_pool_;
  ComputePool* const copy_pool_;
  mutable absl::Mutex mu_;
  uint64_t next_connection_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<std::string, Pending> pending_ ABSL_GUARDED_BY(mu_);    // by ticket
  absl::flat_hash_map<std::string, GrantEntry> grants_ ABSL_GUARDED_BY(mu_);  // by grant
  absl::flat_hash_map<uint64_t, std::string> bound_ ABSL_GUARDED_BY(mu_);     // connection → caller
  RegionTable<SharedMapping> regions_ ABSL_GUARDED_BY(mu_){"shared-memory region", ErrorReason::kRegionNotFound};
};

}  // namespace muond::transport
