#include "server/process/fd_budget.h"

#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace muond::server {

absl::StatusOr<FdLimit> RaiseFdLimit(uint64_t wanted) {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) {
    return absl::InternalError(absl::StrCat("getrlimit(RLIMIT_NOFILE): ", std::strerror(errno)));
  }
  FdLimit out;
  out.soft_before = limit.rlim_cur;
  out.hard = limit.rlim_max;
  const rlim_t target = wanted == 0 ? limit.rlim_max : std::min<rlim_t>(wanted, limit.rlim_max);
  if (target != limit.rlim_cur) {
    limit.rlim_cur = target;
    if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) {
      return absl::InternalError(absl::StrCat("setrlimit(RLIMIT_NOFILE, ", target, "): ", std::strerror(errno)));
    }
  }
  out.soft = target;
  return out;
}

FdBudget DeriveFdBudget(uint64_t fd_limit, int shm_connections, int shm_pending) {
  const auto share = [fd_limit](uint64_t divisor, uint64_t low, uint64_t high) {
    return static_cast<int>(std::clamp<uint64_t>(fd_limit / divisor, low, high));
  };
  FdBudget budget;
  budget.shm_connections = shm_connections > 0 ? shm_connections : share(16, 8, 1024);
  budget.shm_pending = shm_pending > 0 ? shm_pending : share(8, 16, 65536);
  return budget;
}

}  // namespace muond::server
