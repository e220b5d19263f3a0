#include "server/durability/state_dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "server/durability/env.h"

namespace muond::durability {
namespace {

// The pid the holder wrote, as text ("" when it cannot be read: it may be writing it right now).
std::string HolderOf(int fd) {
  char buffer[32] = {};
  const ssize_t got = ::pread(fd, buffer, sizeof(buffer) - 1, 0);
  int pid = 0;
  if (got <= 0 || !absl::SimpleAtoi(absl::StripAsciiWhitespace(std::string(buffer, static_cast<size_t>(got))), &pid)) {
    return "";
  }
  return absl::StrCat(" (pid ", pid, ")");
}

}  // namespace

absl::StatusOr<std::unique_ptr<StateDirLock>> StateDirLock::Acquire(const std::string& state_dir) {
  const std::string path = absl::StrCat(state_dir, "/", kStateDirLockFile);
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    if (errno == ELOOP) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot lock --state-dir: ", path, " is a symbolic link (state files are never reached through links)"));
    }
    return ErrnoStatus(absl::StrCat("cannot lock --state-dir: cannot open ", path), errno);
  }
  std::unique_ptr<StateDirLock> lock(new StateDirLock(fd));  // closes it on every return below
  struct stat info;
  if (::fstat(fd, &info) != 0) return ErrnoStatus(absl::StrCat("cannot lock --state-dir: cannot stat ", path), errno);
  if (!S_ISREG(info.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat("cannot lock --state-dir: ", path, " is not a regular file"));
  }
  int locked;
  do {
    locked = ::flock(fd, LOCK_EX | LOCK_NB);
  } while (locked != 0 && errno == EINTR);
  if (locked != 0) {
    if (errno == EWOULDBLOCK) {
      return absl::FailedPreconditionError(absl::StrCat("--state-dir ", state_dir, " is in use by another muond",
                                                        HolderOf(fd), ", which holds ", path,
                                                        ": one daemon per state directory"));
    }
    if (errno == ENOLCK || errno == EOPNOTSUPP || errno == ENOSYS) {
      const absl::Status why = ErrnoStatus("flock", errno);
      return absl::FailedPreconditionError(absl::StrCat("cannot lock ", path, ": the file system of --state-dir ",
                                                        state_dir, " does not support locks (", why.message(),
                                                        "); give a folder on a local disk"));
    }
    return ErrnoStatus(absl::StrCat("cannot lock ", path), errno);
  }
  const std::string pid = absl::StrCat(::getpid(), "\n");
  // The pid is for the message only: a failure to write it leaves the lock held all the same.
  if (::ftruncate(fd, 0) == 0) (void)!::pwrite(fd, pid.data(), pid.size(), 0);
  return lock;
}

StateDirLock::~StateDirLock() { ::close(fd_); }

}  // namespace muond::durability
