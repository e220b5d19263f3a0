#include "server/transport/shm/shared_mapping.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace muond::transport {

absl::StatusOr<std::shared_ptr<SharedMapping>> SharedMapping::Map(int fd, uint64_t max_bytes) {
  auto refuse = [fd](std::string message) {
    ::close(fd);
    return absl::InvalidArgumentError(std::move(message));
  };
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0) {
    return refuse("the descriptor is not a sealable memfd (create it with memfd_create(MFD_ALLOW_SEALING))");
  }
  if ((seals & F_SEAL_SHRINK) == 0) {
    return refuse("the memfd is not sealed against shrinking (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK))");
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) return refuse(absl::StrCat("fstat failed: ", std::strerror(errno)));
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size == 0) return refuse("the memfd is empty (size it with ftruncate before sealing)");
  if (size > max_bytes) {
    return refuse(absl::StrCat("the memfd has ", size, " bytes, more than the daemon's limit of ", max_bytes,
                               " (--shm-max-region-bytes)"));
  }
  void* data = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) {
    return refuse(absl::StrCat("cannot map the memfd read-write: ", std::strerror(errno),
                               " (open it O_RDWR and do not seal it against writes)"));
  }
  return std::shared_ptr<SharedMapping>(new SharedMapping(fd, static_cast<char*>(data), size));
}

SharedMapping::~SharedMapping() {
  ::munmap(data_, size_);
  ::close(fd_);
}

}  // namespace muond::transport
