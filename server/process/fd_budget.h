// The daemon's descriptor budget: the soft RLIMIT_NOFILE raised at start-up, and the share of it the
// shared-memory socket may hold, so that a peer filling that share never leaves gRPC without a
// descriptor to accept a connection with. Plain functions; no shared state.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"

namespace muond::server {

struct FdLimit {
  uint64_t soft_before = 0;  // the soft limit the daemon was started with
  uint64_t hard = 0;
  uint64_t soft = 0;  // the soft limit now
};

// Sets the soft RLIMIT_NOFILE to `wanted` (0: the hard limit), never above the hard limit.
absl::StatusOr<FdLimit> RaiseFdLimit(uint64_t wanted);

struct FdBudget {
  int shm_connections = 0;  // --shm-max-connections
  int shm_pending = 0;      // --shm-max-pending-fds
};

// The shared-memory socket's share of `fd_limit` descriptors where the flags say 0 (auto): a sixteenth
// for connections (8 to 1024) and an eighth for unclaimed memfds (16 to 65536), leaving at least
// three quarters to gRPC, the metrics endpoint and the state directory. Explicit values are kept.
FdBudget DeriveFdBudget(uint64_t fd_limit, int shm_connections, int shm_pending);

}  // namespace muond::server
