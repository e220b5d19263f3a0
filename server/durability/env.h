// Env: the file-system environment the daemon's durable state goes through (after leveldb's Env).
// Code that writes the state directory (durable files, the step journal, checkpoints) takes an Env*
// instead of calling POSIX directly, so that production uses Env::Default() (real POSIX calls) and
// unit tests can substitute a FaultInjectingEnv that fails a chosen write, fsync or rename.
//
// Ownership: Env::Default() is process-wide and never deleted; any other Env is owned by whoever
// made it and must outlive every WritableFile it handed out. A WritableFile is owned by its caller
// (std::unique_ptr); destroying it closes the file without reporting errors, so callers that need to
// know whether the close succeeded call Close() first.
//
// Thread-safety: Env implementations are thread-safe. A WritableFile is used by one thread at a time.
//
// Errors are absl::Status values whose message names the file and the errno text, e.g.
// "cannot write /x/journal.log: No space left on device". Codes: NOT_FOUND for a missing file or
// folder, PERMISSION_DENIED for EACCES/EPERM, RESOURCE_EXHAUSTED for a full disk (ENOSPC, EDQUOT)
// or the process's own shortage (EMFILE, ENFILE, ENOMEM, ENOBUFS),
// FAILED_PRECONDITION for an entry that is not what a state file may be (a symbolic link, a FIFO, a
// device), OUT_OF_RANGE for a file larger than a read's limit, INTERNAL for every other I/O error.
//
// Confinement: the files of a state directory are never reached through a link. Opening a file for
// reading or writing does not follow a symbolic link in the file's own name (O_NOFOLLOW) and accepts
// regular files only (a FIFO or a device is refused without blocking); callers check the folders they
// build paths from (IsLink) and never take a path component from a file's contents unchecked.
//
// Durability: like POSIX, creating, renaming or removing an entry is durable only after SyncDir() of
// the folder holding it; data written to a file is durable only after Sync().
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace muond::durability {

// A file open for sequential writing. Used by one thread at a time.
class WritableFile {
 public:
  WritableFile() = default;
  WritableFile(const WritableFile&) = delete;
  WritableFile& operator=(const WritableFile&) = delete;
  virtual ~WritableFile();

  // Writes all of `data` at the end of the file, or fails. A failure may leave a prefix of `data`
  // written, so a caller that must not leave partial records behind frames them (length, checksum).
  virtual absl::Status Append(absl::string_view data) = 0;
  // fdatasync-level durability: on OK the data appended so far and the file's size survive a crash.
  virtual absl::Status Sync() = 0;
  // Cuts the file to its first `size` bytes, durably (ftruncate + fsync); later appends start at
  // `size`. 0 empties it. A `size` beyond what the file holds is DATA_LOSS, nothing changed.
  virtual absl::Status Truncate(uint64_t size) = 0;
  // Closes the file; later calls other than Close() and path() fail with FAILED_PRECONDITION. Closing
  // twice is OK. Close does not sync.
  virtual absl::Status Close() = 0;
  virtual const std::string& path() const = 0;
};

// A regular file open for reading at any offset. Used by one thread at a time.
class ReadableFile {
 public:
  ReadableFile() = default;
  ReadableFile(const ReadableFile&) = delete;
  ReadableFile& operator=(const ReadableFile&) = delete;
  virtual ~ReadableFile();

  // The file's size when it was opened.
  virtual uint64_t size() const = 0;
  // Reads up to `n` bytes from `offset` into `out`; fewer only where the file ends (the count read).
  virtual absl::StatusOr<size_t> ReadAt(uint64_t offset, char* out, size_t n) = 0;
};

// ReadFile's limit for a file whose size only the disk bounds (a journal): the file must still be a
// regular file, read up to the size it had when opened.
inline constexpr uint64_t kNoReadLimit = std::numeric_limits<uint64_t>::max();

class Env {
 public:
  Env() = default;
  Env(const Env&) = delete;
  Env& operator=(const Env&) = delete;
  virtual ~Env();

  // The process-wide POSIX environment; never deleted, so it may be used during static destruction.
  static Env* Default();

  // Creates `path` (mode 0644) or truncates it, for writing from offset 0. Like the next one, refuses
  // a `path` that is a symbolic link (dangling or not) or not a regular file, creating nothing.
  virtual absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path) = 0;
  // Opens `path` for appending, creating it (mode 0644) if missing; existing contents are kept.
  virtual absl::StatusOr<std::unique_ptr<WritableFile>> NewAppendableFile(const std::string& path) = 0;
  // The whole contents of the regular file `path`, which holds at most `max_bytes` bytes (otherwise
  // OUT_OF_RANGE naming the file, its size and the limit). Never follows a link in `path`'s
  // own name, never blocks on a FIFO, and reads no more than the size the file had when opened.
  virtual absl::StatusOr<std::string> ReadFile(const std::string& path, uint64_t max_bytes) = 0;
  // The regular file `path` open for reading piece by piece (a journal, whose size only the disk
  // bounds, read a record at a time); refuses what ReadFile refuses.
  virtual absl::StatusOr<std::unique_ptr<ReadableFile>> NewReadableFile(const std::string& path) = 0;
  // rename(2): atomically replaces `to` if it exists.
  virtual absl::Status RenameFile(const std::string& from, const std::string& to) = 0;
  // Removes one file (not a folder); a missing file is NOT_FOUND.
  virtual absl::Status RemoveFile(const std::string& path) = 0;
  // Removes `path` and, if it is a folder, everything under it; a missing path is OK.
  virtual absl::Status RemoveTree(const std::string& path) = 0;
  // mkdir -p: creates `path` and any missing parents; an existing folder is OK.
  virtual absl::Status CreateDirs(const std::string& path) = 0;
  // fsync of a folder: makes the creation, renaming and removal of its entries durable.
  virtual absl::Status SyncDir(const std::string& path) = 0;
  // Whether `path` names an existing entry (file, folder, ...). Errors read as false.
  virtual bool FileExists(const std::string& path) = 0;
  // The names (not paths) of the entries of folder `path`, sorted, without "." and "..".
  virtual absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) = 0;
  // Whether `path` is a folder (following symbolic links). Errors read as false.
  virtual bool IsDirectory(const std::string& path) = 0;
  // Whether `path` itself is a symbolic link (not following it). Errors read as false.
  virtual bool IsLink(const std::string& path) = 0;
  // The size in bytes of the file `path`.
  virtual absl::StatusOr<uint64_t> GetFileSize(const std::string& path) = 0;
};

// For Env implementations: the status for an I/O error `error_number` (an errno value) with the
// message "<context>: <errno text>", e.g. ErrnoStatus("cannot write /x", ENOSPC) is
// RESOURCE_EXHAUSTED "cannot write /x: No space left on device". Codes as in the comment at the top.
absl::Status ErrnoStatus(absl::string_view context, int error_number);

}  // namespace muond::durability
