#include "server/transport/shm/shared_mapping.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace muond::transport {

absl::StatusOr<SealedMemfd> SealedMemfd::Check(int fd, uint64_t max_bytes) {
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
  // What would refuse a writable shared mapping is refused here, when the memfd is passed.
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || (flags & O_ACCMODE) != O_RDWR || (seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) != 0) {
    return refuse("cannot map the memfd read-write (open it O_RDWR and do not seal it against writes)");
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) return refuse(absl::StrCat("fstat failed: ", std::strerror(errno)));
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size == 0) return refuse("the memfd is empty (size it with ftruncate before sealing)");
  if (size > max_bytes) {
    return refuse(absl::StrCat("the memfd has ", size, " bytes, more than the daemon's limit of ", max_bytes,
                               " (--shm-max-region-bytes)"));
  }
  return SealedMemfd(fd, size);
}

SealedMemfd::~SealedMemfd() {
  if (fd_ >= 0) ::close(fd_);
}

SealedMemfd& SealedMemfd::operator=(SealedMemfd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    size_ = other.size_;
  }
  return *this;
}

absl::StatusOr<std::shared_ptr<SharedMapping>> SealedMemfd::Map() && {
  const int fd = std::exchange(fd_, -1);
  void* data = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int error = errno;
  ::close(fd);  // the mapping keeps the memory
  if (data == MAP_FAILED && error == ENOMEM) {
    return absl::ResourceExhaustedError(absl::StrCat("the daemon has no address space left to map ", size_, " bytes"));
  }
  if (data == MAP_FAILED) {
    return absl::InvalidArgumentError(absl::StrCat("cannot map the memfd read-write: ", std::strerror(error),
                                                   " (open it O_RDWR and do not seal it against writes)"));
  }
  return std::shared_ptr<SharedMapping>(new SharedMapping(static_cast<char*>(data), size_));
}

absl::StatusOr<std::shared_ptr<SharedMapping>> SharedMapping::Map(int fd, uint64_t max_bytes) {
  absl::StatusOr<SealedMemfd> memfd = SealedMemfd::Check(fd, max_bytes);
  if (!memfd.ok()) return memfd.status();
  return std::move(*memfd).Map();
}

SharedMapping::~SharedMapping() { ::munmap(data_, size_); }

}  // namespace muond::transport
