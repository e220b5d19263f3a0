#include "server/durability/env.h"

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace muond::durability {
namespace {

// strerror_r has two signatures: XSI (returns int, fills the buffer) and GNU (returns the text, which
// may or may not be the buffer). These overloads accept whichever the C library declares.
[[maybe_unused]] const char* StrerrorText(int rc, const char* buffer) { return rc == 0 ? buffer : "Unknown error"; }
[[maybe_unused]] const char* StrerrorText(const char* text, const char* /*buffer*/) { return text; }

// strerror_r rather than strerror: Env implementations are thread-safe, and strerror may use a
// static buffer.
std::string ErrnoText(int error_number) {
  char buffer[256] = {};
  return StrerrorText(strerror_r(error_number, buffer, sizeof(buffer)), buffer);
}

}  // namespace

WritableFile::~WritableFile() = default;

ReadableFile::~ReadableFile() = default;

Env::~Env() = default;

absl::Status ErrnoStatus(absl::string_view context, int error_number) {
  const std::string message = absl::StrCat(context, ": ", ErrnoText(error_number));
  switch (error_number) {
    case ENOENT:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    case ENOSPC:
    case EDQUOT:  // a user's quota is a full disk as far as the caller can act on it
    // The daemon's own shortage (open files, memory), not anything wrong with the file: a restore
    // that meets it stops the start-up instead of quarantining an intact folder.
    case EMFILE:
    case ENFILE:
    case ENOMEM:
    case ENOBUFS:
      return absl::ResourceExhaustedError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace muond::durability
