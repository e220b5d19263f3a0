// The POSIX Env behind Env::Default(): plain system calls, every descriptor opened with O_CLOEXEC (the
// daemon must not leak state-directory descriptors into child processes), EINTR retried. Files are
// opened with O_NOFOLLOW | O_NONBLOCK and checked to be regular files before any byte moves.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <exception>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "server/durability/env.h"

namespace muond::durability {
namespace {

absl::Status PathError(absl::string_view what, const std::string& path, int error_number) {
  return ErrnoStatus(absl::StrCat(what, " ", path), error_number);
}

int OpenRetryingEintr(const std::string& path, int flags, mode_t mode = 0) {
  int fd;
  do {
    fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

// Opens a state file: never through a link in its own name (ELOOP), never blocking on a FIFO
// (O_NONBLOCK: a reader opens at once, a writer fails with ENXIO), and only if it is a regular file.
// On success *size is the file's size; on failure the descriptor is closed and the error names `path`.
absl::StatusOr<int> OpenStateFile(absl::string_view what, const std::string& path, int flags, uint64_t* size) {
  const int fd = OpenRetryingEintr(path, flags | O_NOFOLLOW | O_NONBLOCK, 0644);
  if (fd < 0) {
    const int error_number = errno;
    if (error_number == ELOOP) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, " ", path, ": it is a symbolic link (state files are never reached through links)"));
    }
    if (error_number == ENXIO) {
      return absl::FailedPreconditionError(absl::StrCat(what, " ", path, ": not a regular file"));
    }
    return PathError(what, path, error_number);
  }
  struct stat info;
  if (::fstat(fd, &info) != 0) {
    const int error_number = errno;
    ::close(fd);
    return PathError(what, path, error_number);
  }
  if (!S_ISREG(info.st_mode)) {
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat(what, " ", path, ": not a regular file"));
  }
  // Regular files ignore O_NONBLOCK, but it is cleared so that nothing later depends on that.
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  *size = static_cast<uint64_t>(info.st_size);
  return fd;
}

class PosixReadableFile final : public ReadableFile {
 public:
  PosixReadableFile(std::string path, int fd, uint64_t size) : path_(std::move(path)), fd_(fd), size_(size) {}
  ~PosixReadableFile() override { ::close(fd_); }

  uint64_t size() const override { return size_; }
  absl::StatusOr<size_t> ReadAt(uint64_t offset, char* out, size_t n) override {
    size_t done = 0;
    while (done < n) {
      const ssize_t got = ::pread(fd_, out + done, n - done, static_cast<off_t>(offset + done));
      if (got < 0) {
        if (errno == EINTR) continue;
        return PathError("cannot read", path_, errno);
      }
      if (got == 0) break;  // the end of the file
      done += static_cast<size_t>(got);
    }
    return done;
  }

 private:
  const std::string path_;
  const int fd_;
  const uint64_t size_;
};

class PosixWritableFile final : public WritableFile {
 public:
  PosixWritableFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  // Errors are dropped here; callers that need them call Close().
  ~PosixWritableFile() override {
    if (fd_ >= 0) ::close(fd_);
  }

  absl::Status Append(absl::string_view data) override {
    if (fd_ < 0) return ClosedError();
    // write(2) may write fewer bytes than asked (signals, large sizes): loop until all are written.
    while (!data.empty()) {
      const ssize_t n = ::write(fd_, data.data(), data.size());
      if (n < 0) {
        if (errno == EINTR) continue;
        return PathError("cannot write", path_, errno);
      }
      data.remove_prefix(static_cast<size_t>(n));
    }
    return absl::OkStatus();
  }

  absl::Status Sync() override {
    if (fd_ < 0) return ClosedError();
    // fdatasync: the data and the size are durable, which is all a reader needs; mtime is not.
    int rc;
    do {
      rc = ::fdatasync(fd_);
    } while (rc != 0 && errno == EINTR);
    if (rc != 0) return PathError("cannot fsync", path_, errno);
    return absl::OkStatus();
  }

  absl::Status Truncate(uint64_t size) override {
    if (fd_ < 0) return ClosedError();
    // Never grown with zeros: a file shorter than what its writer wrote was changed under it.
    struct stat st {};
    if (::fstat(fd_, &st) != 0) return PathError("cannot stat", path_, errno);
    if (size > static_cast<uint64_t>(st.st_size)) {
      return absl::DataLossError(absl::StrCat("cannot truncate ", path_, " to ", size, " bytes: it holds only ",
                                              st.st_size, " (changed by something else)"));
    }
    const auto length = static_cast<off_t>(size);
    int rc;
    do {
      rc = ::ftruncate(fd_, length);
    } while (rc != 0 && errno == EINTR);
    if (rc != 0) return PathError("cannot truncate", path_, errno);
    // Without O_APPEND the offset would stay at the old end and the next write would leave a hole.
    if (::lseek(fd_, length, SEEK_SET) < 0) return PathError("cannot seek", path_, errno);
    do {
      rc = ::fsync(fd_);
    } while (rc != 0 && errno == EINTR);
    if (rc != 0) return PathError("cannot fsync", path_, errno);
    return absl::OkStatus();
  }

  absl::Status Close() override {
    if (fd_ < 0) return absl::OkStatus();
    const int fd = fd_;
    fd_ = -1;
    // No retry on EINTR: Linux releases the descriptor anyway, and a retry could close another
    // thread's freshly opened file.
    if (::close(fd) != 0) return PathError("cannot close", path_, errno);
    return absl::OkStatus();
  }

  const std::string& path() const override { return path_; }

 private:
  absl::Status ClosedError() const { return absl::FailedPreconditionError(absl::StrCat(path_, " is closed")); }

  const std::string path_;
  int fd_;
};

class PosixEnv final : public Env {
 public:
  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path) override {
    // Truncated only once it is known to be a regular file: a link or a FIFO is left as it was.
    uint64_t size = 0;
    MUOND_ASSIGN_OR_RETURN(const int fd, OpenStateFile("cannot create", path, O_WRONLY | O_CREAT, &size));
    if (::ftruncate(fd, 0) != 0) {
      const int error_number = errno;
      ::close(fd);
      return PathError("cannot truncate", path, error_number);
    }
    return std::make_unique<PosixWritableFile>(path, fd);
  }

  absl::StatusOr<std::unique_ptr<WritableFile>> NewAppendableFile(const std::string& path) override {
    uint64_t size = 0;
    MUOND_ASSIGN_OR_RETURN(const int fd, OpenStateFile("cannot open", path, O_WRONLY | O_CREAT | O_APPEND, &size));
    return std::make_unique<PosixWritableFile>(path, fd);
  }

  absl::StatusOr<std::string> ReadFile(const std::string& path, uint64_t max_bytes) override {
    uint64_t size = 0;
    MUOND_ASSIGN_OR_RETURN(const int fd, OpenStateFile("cannot read", path, O_RDONLY, &size));
    if (size > max_bytes) {
      ::close(fd);
      return absl::OutOfRangeError(
          absl::StrCat("cannot read ", path, ": it holds ", size, " bytes, more than the ", max_bytes, " allowed"));
    }
    std::string contents;
    try {
      contents.resize(static_cast<size_t>(size));
    } catch (const std::exception&) {  // std::bad_alloc, std::length_error
      ::close(fd);
      return absl::ResourceExhaustedError(absl::StrCat("cannot read ", path, ": no memory for its ", size, " bytes"));
    }
    // Up to the size it had when opened: a file that grows meanwhile cannot make the read unbounded.
    size_t done = 0;
    while (done < contents.size()) {
      const ssize_t n = ::read(fd, contents.data() + done, contents.size() - done);
      if (n < 0) {
        if (errno == EINTR) continue;
        const int error_number = errno;
        ::close(fd);
        return PathError("cannot read", path, error_number);
      }
      if (n == 0) break;  // it shrank since fstat
      done += static_cast<size_t>(n);
    }
    ::close(fd);
    contents.resize(done);
    return contents;
  }

  absl::StatusOr<std::unique_ptr<ReadableFile>> NewReadableFile(const std::string& path) override {
    uint64_t size = 0;
    MUOND_ASSIGN_OR_RETURN(const int fd, OpenStateFile("cannot read", path, O_RDONLY, &size));
    return std::make_unique<PosixReadableFile>(path, fd, size);
  }

  absl::Status RenameFile(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) {
      return ErrnoStatus(absl::StrCat("cannot rename ", from, " to ", to), errno);
    }
    return absl::OkStatus();
  }

  absl::Status RemoveFile(const std::string& path) override {
    if (::unlink(path.c_str()) != 0) return PathError("cannot remove", path, errno);
    return absl::OkStatus();
  }

  absl::Status RemoveTree(const std::string& path) override {
    std::error_code error;
    // remove_all treats a missing path as success, as promised.
    std::filesystem::remove_all(path, error);
    if (error) return PathError("cannot remove", path, error.value());
    return absl::OkStatus();
  }

  absl::Status CreateDirs(const std::string& path) override {
    std::error_code error;
    std::filesystem::create_directories(path, error);
    if (error) return PathError("cannot create folder", path, error.value());
    // create_directories reports no error when `path` exists as a file; the caller asked for a folder.
    if (!IsDirectory(path)) return PathError("cannot create folder", path, ENOTDIR);
    return absl::OkStatus();
  }

  absl::Status SyncDir(const std::string& path) override {
    const int fd = OpenRetryingEintr(path, O_RDONLY | O_DIRECTORY);
    if (fd < 0) return PathError("cannot open folder", path, errno);
    int rc;
    do {
      rc = ::fsync(fd);
    } while (rc != 0 && errno == EINTR);
    const int error_number = errno;
    ::close(fd);
    if (rc != 0) return PathError("cannot fsync folder", path, error_number);
    return absl::OkStatus();
  }

  bool FileExists(const std::string& path) override { return ::access(path.c_str(), F_OK) == 0; }

  absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) override {
    std::error_code error;
    std::filesystem::directory_iterator it(path, error);
    if (error) return PathError("cannot list", path, error.value());
    std::vector<std::string> names;
    // The iterator skips "." and ".."; increment(error) instead of ++ because ++ throws.
    for (const std::filesystem::directory_iterator end; it != end; it.increment(error)) {
      if (error) break;
      names.push_back(it->path().filename().string());
    }
    if (error) return PathError("cannot list", path, error.value());
    std::sort(names.begin(), names.end());
    return names;
  }

  bool IsDirectory(const std::string& path) override {
    struct stat info;
    return ::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
  }

  bool IsLink(const std::string& path) override {
    struct stat info;
    return ::lstat(path.c_str(), &info) == 0 && S_ISLNK(info.st_mode);
  }

  absl::StatusOr<uint64_t> GetFileSize(const std::string& path) override {
    struct stat info;
    if (::stat(path.c_str(), &info) != 0) return PathError("cannot stat", path, errno);
    return static_cast<uint64_t>(info.st_size);
  }
};

}  // namespace

Env* Env::Default() {
  // Leaked on purpose: code running during static destruction may still write state.
  static Env* const env = new PosixEnv();
  return env;
}

}  // namespace muond::durability
