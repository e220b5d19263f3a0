#include "server/durable_file.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"

namespace muond::server {
namespace {

absl::Status ErrnoError(absl::string_view what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

absl::Status WriteAll(int fd, absl::string_view bytes, const std::string& path) {
  while (!bytes.empty()) {
    const ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("cannot write", path);
    }
    bytes.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status SyncDirectory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoError("cannot open folder", dir);
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return ErrnoError("cannot fsync folder", dir);
  return absl::OkStatus();
}

absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents) {
  const std::string temp = path + ".tmp";
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError("cannot create", temp);
  absl::Status written = WriteAll(fd, contents, temp);
  if (written.ok() && ::fsync(fd) != 0) written = ErrnoError("cannot fsync", temp);
  ::close(fd);
  if (!written.ok()) {
    ::unlink(temp.c_str());
    return written;
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) return ErrnoError("cannot rename into", path);
  return SyncDirectory(std::filesystem::path(path).parent_path().string());
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError("cannot open", path);
  std::string contents;
  char buffer[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      ::close(fd);
      return ErrnoError("cannot read", path);
    }
    if (n == 0) break;
    contents.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  return contents;
}

std::string Sha256Hex(absl::string_view bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_Digest(bytes.data(), bytes.size(), digest, &length, EVP_sha256(), nullptr);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  for (unsigned int i = 0; i < length; ++i) {
    hex.push_back(kHex[digest[i] >> 4]);
    hex.push_back(kHex[digest[i] & 15]);
  }
  return hex;
}

AppendOnlyFile::~AppendOnlyFile() { Close(); }

absl::Status AppendOnlyFile::Open(const std::string& path) {
  Close();
  path_ = path;
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd_ < 0) return ErrnoError("cannot open", path);
  return SyncDirectory(std::filesystem::path(path).parent_path().string());
}

absl::Status AppendOnlyFile::Append(absl::string_view bytes) {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, " is not open"));
  absl::Status written = WriteAll(fd_, bytes, path_);
  if (!written.ok()) return written;
  // fdatasync: the data and the new size are durable, which is all a reader needs.
  if (::fdatasync(fd_) != 0) return ErrnoError("cannot fsync", path_);
  return absl::OkStatus();
}

absl::Status AppendOnlyFile::Truncate() {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, " is not open"));
  if (::ftruncate(fd_, 0) != 0) return ErrnoError("cannot truncate", path_);
  if (::fsync(fd_) != 0) return ErrnoError("cannot fsync", path_);
  return absl::OkStatus();
}

void AppendOnlyFile::Close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

}  // namespace muond::server
