// Durable file primitives for the daemon's state directory: atomic replacement of a file (write a
// temporary, fsync it, rename it over the target, fsync the folder), whole-file reads, an append-only
// file whose appends are fsynced, and SHA-256 digests. Errors name the file. Stateless functions are
// thread-safe; an AppendOnlyFile is used by one thread at a time.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace muond::server {

// After it returns OK, `path` holds exactly `contents`, even across a power cut; a crash before
// that leaves the previous file (or none) in place.
absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents);
absl::StatusOr<std::string> ReadWholeFile(const std::string& path);
absl::Status SyncDirectory(const std::string& dir);
std::string Sha256Hex(absl::string_view bytes);

class AppendOnlyFile {
 public:
  AppendOnlyFile() = default;
  AppendOnlyFile(const AppendOnlyFile&) = delete;
  AppendOnlyFile& operator=(const AppendOnlyFile&) = delete;
  ~AppendOnlyFile();

  // Opens (creating it if needed) for appending.
  absl::Status Open(const std::string& path);
  // Appends and fsyncs: on OK the bytes survive a crash.
  absl::Status Append(absl::string_view bytes);
  // Empties the file durably.
  absl::Status Truncate();
  void Close();
  const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  std::string path_;
};

}  // namespace muond::server
