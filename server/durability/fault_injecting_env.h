// FaultInjectingEnv: an Env for tests that passes everything through to a base Env, except the
// faults a test arms: an Append that writes only half its data or hits a full disk, a failed fsync
// (of a file or a folder), a failed rename, a failed truncation, a failed read. A fault targets the files whose path
// contains a given substring (an empty substring matches every path). It also keeps the folders it was
// asked to fsync, in order (synced_folders()).
//
// A fault fires once and is then disarmed, unless armed with sticky = true, in which case it keeps
// failing every matching operation once it is due, until ClearFaults(). `after_appends` /
// `after_syncs` let that many matching operations succeed first; they are counted from the moment the
// fault is armed, across every matching file, including files opened before it was armed. Every armed
// fault counts every matching operation; if several are due at once, the one armed first fires and
// the others fire on the following operations.
//
// Ownership: the base Env is not owned and must outlive this Env; this Env must outlive the
// WritableFiles it hands out (they consult it on every call).
//
// Thread-safety: thread-safe, like every Env; faults may be armed while other threads do I/O. The
// decision to fail is taken under a mutex, the I/O itself outside it.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/durability/env.h"

namespace muond::durability {

enum class AppendFault {
  kShortWrite,  // the first half of the data reaches the base file; INTERNAL "... short write ..."
  kNoSpace,     // nothing is written; RESOURCE_EXHAUSTED "...: No space left on device"
};

enum class TruncateFault {
  kNothingTruncated,    // the file is left as it was; INTERNAL "cannot truncate <path>: ..."
  kTruncatedNotSynced,  // the file is cut, then its fsync fails: INTERNAL "cannot fsync <path>: ..."
};

class FaultInjectingEnv : public Env {
 public:
  explicit FaultInjectingEnv(Env* base);
  ~FaultInjectingEnv() override;

  // The (after_appends + 1)-th Append to a file whose path contains `path_substring` fails.
  void FailAppend(absl::string_view path_substring, AppendFault fault, int after_appends = 0, bool sticky = false);
  // The (after_syncs + 1)-th Sync of a matching file, or SyncDir of a matching folder, fails with
  // INTERNAL "cannot fsync <path>: Input/output error" (for a folder "cannot fsync folder <path>: ...")
  // without syncing.
  void FailSync(absl::string_view path_substring, int after_syncs = 0, bool sticky = false);
  // The next RenameFile whose destination contains `to_substring` fails with INTERNAL
  // "cannot rename <from> to <to>: Input/output error" and renames nothing.
  void FailRename(absl::string_view to_substring, bool sticky = false);
  // The next Truncate of a matching file fails (with Input/output error), as `fault` says.
  void FailTruncate(absl::string_view path_substring, TruncateFault fault = TruncateFault::kNothingTruncated,
                    bool sticky = false);
  // The next ReadFile or NewReadableFile of a matching file fails as the POSIX Env fails with
  // `error_number` (ErrnoStatus: "cannot read <path>: <its text>") and reads nothing.
  void FailRead(absl::string_view path_substring, int error_number, bool sticky = false);
  // Every folder SyncDir was asked for since construction, in order (a failed one too).
  std::vector<std::string> synced_folders() const;
  // Disarms every fault, sticky or not. faults_triggered() is kept.
  void ClearFaults();
  // How many times a fault has fired since construction (a sticky fault counts every failure).
  int faults_triggered() const;

  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path) override;
  absl::StatusOr<std::unique_ptr<WritableFile>> NewAppendableFile(const std::string& path) override;
  absl::StatusOr<std::string> ReadFile(const std::string& path, uint64_t max_bytes) override;
  absl::StatusOr<std::unique_ptr<ReadableFile>> NewReadableFile(const std::string& path) override;
  absl::Status RenameFile(const std::string& from, const std::string& to) override;
  absl::Status RemoveFile(const std::string& path) override;
  absl::Status RemoveTree(const std::string& path) override;
  absl::Status CreateDirs(const std::string& path) override;
  absl::Status SyncDir(const std::string& path) override;
  bool FileExists(const std::string& path) override;
  absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) override;
  bool IsDirectory(const std::string& path) override;
  bool IsLink(const std::string& path) override;
  absl::StatusOr<uint64_t> GetFileSize(const std::string& path) override;

 private:
  class FaultyWritableFile;

  enum class Operation { kAppend, kSync, kRename, kTruncate, kRead };

  struct Fault {
    Operation operation;
    std::string path_substring;
    AppendFault append_fault;      // only for kAppend
    TruncateFault truncate_fault;  // only for kTruncate
    int passes_left;               // matching operations that still succeed before it fires
    bool sticky;
    int error_number = 0;  // only for kRead
  };

  void Arm(Fault fault) ABSL_LOCKS_EXCLUDED(mu_);
  // Counts one `operation` on `path` against the armed faults; returns the fault that fires, if any.
  std::optional<Fault> Trigger(Operation operation, absl::string_view path) ABSL_LOCKS_EXCLUDED(mu_);

  absl::Status Append(WritableFile& base_file, absl::string_view data);
  absl::Status Sync(WritableFile& base_file);
  absl::Status Truncate(WritableFile& base_file, uint64_t size);

  Env* const base_;
  mutable absl::Mutex mu_;
  std::vector<Fault> faults_ ABSL_GUARDED_BY(mu_);  // in the order they were armed
  int faults_triggered_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::string> synced_folders_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muond::durability
