#include "server/durability/fault_injecting_env.h"

#include <algorithm>
#include <cerrno>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace muond::durability {

// Forwards to the base file, letting the Env decide on every Append, Sync and Truncate whether to fail it, so
// that faults armed after the file was opened still apply.
class FaultInjectingEnv::FaultyWritableFile final : public WritableFile {
 public:
  FaultyWritableFile(FaultInjectingEnv* env, std::unique_ptr<WritableFile> base) : env_(env), base_(std::move(base)) {}

  absl::Status Append(absl::string_view data) override { return env_->Append(*base_, data); }
  absl::Status Sync() override { return env_->Sync(*base_); }
  absl::Status Truncate(uint64_t size) override { return env_->Truncate(*base_, size); }
  absl::Status Close() override { return base_->Close(); }
  const std::string& path() const override { return base_->path(); }

 private:
  FaultInjectingEnv* const env_;
  const std::unique_ptr<WritableFile> base_;
};

FaultInjectingEnv::FaultInjectingEnv(Env* base) : base_(base) {}

FaultInjectingEnv::~FaultInjectingEnv() = default;

void FaultInjectingEnv::FailAppend(absl::string_view path_substring, AppendFault fault, int after_appends,
                                   bool sticky) {
  Arm(Fault{Operation::kAppend, std::string(path_substring), fault, TruncateFault::kNothingTruncated,
            std::max(after_appends, 0), sticky});
}

void FaultInjectingEnv::FailSync(absl::string_view path_substring, int after_syncs, bool sticky) {
  Arm(Fault{Operation::kSync, std::string(path_substring), AppendFault::kShortWrite, TruncateFault::kNothingTruncated,
            std::max(after_syncs, 0), sticky});
}

void FaultInjectingEnv::FailRename(absl::string_view to_substring, bool sticky) {
  Arm(Fault{Operation::kRename, std::string(to_substring), AppendFault::kShortWrite, TruncateFault::kNothingTruncated,
            0, sticky});
}

void FaultInjectingEnv::FailTruncate(absl::string_view path_substring, TruncateFault fault, bool sticky) {
  Arm(Fault{Operation::kTruncate, std::string(path_substring), AppendFault::kShortWrite, fault, 0, sticky});
}

void FaultInjectingEnv::FailRead(absl::string_view path_substring, int error_number, bool sticky) {
  Arm(Fault{Operation::kRead, std::string(path_substring), AppendFault::kShortWrite, TruncateFault::kNothingTruncated,
            0, sticky, error_number});
}

std::vector<std::string> FaultInjectingEnv::synced_folders() const {
  absl::MutexLock lock(&mu_);
  return synced_folders_;
}

void FaultInjectingEnv::ClearFaults() {
  absl::MutexLock lock(&mu_);
  faults_.clear();
}

int FaultInjectingEnv::faults_triggered() const {
  absl::MutexLock lock(&mu_);
  return faults_triggered_;
}

void FaultInjectingEnv::Arm(Fault fault) {
  absl::MutexLock lock(&mu_);
  faults_.push_back(std::move(fault));
}

std::optional<FaultInjectingEnv::Fault> FaultInjectingEnv::Trigger(Operation operation, absl::string_view path) {
  absl::MutexLock lock(&mu_);
  std::optional<Fault> fired;
  for (auto it = faults_.begin(); it != faults_.end();) {
    if (it->operation != operation || !absl::StrContains(path, it->path_substring)) {
      ++it;
    } else if (it->passes_left > 0) {
      --it->passes_left;
      ++it;
    } else if (fired.has_value()) {
      ++it;  // due as well: stays armed and fires on the next matching operation
    } else {
      fired = *it;
      ++faults_triggered_;
      it = it->sticky ? it + 1 : faults_.erase(it);
    }
  }
  return fired;
}

absl::Status FaultInjectingEnv::Append(WritableFile& base_file, absl::string_view data) {
  const std::optional<Fault> fault = Trigger(Operation::kAppend, base_file.path());
  if (!fault.has_value()) return base_file.Append(data);
  const std::string context = absl::StrCat("cannot write ", base_file.path());
  switch (fault->append_fault) {
    case AppendFault::kShortWrite: {
      // What a crash or an I/O error in the middle of a write leaves behind: a prefix of the data.
      const absl::string_view prefix = data.substr(0, data.size() / 2);
      absl::Status written = base_file.Append(prefix);
      if (!written.ok()) return written;
      return absl::InternalError(
          absl::StrCat(context, ": short write (injected): wrote ", prefix.size(), " of ", data.size(), " bytes"));
    }
    case AppendFault::kNoSpace:
      // The same status the POSIX Env gives for a real ENOSPC.
      return ErrnoStatus(context, ENOSPC);
  }
  return absl::InternalError(absl::StrCat(context, ": unknown injected fault"));
}

absl::Status FaultInjectingEnv::Sync(WritableFile& base_file) {
  if (Trigger(Operation::kSync, base_file.path()).has_value()) {
    return ErrnoStatus(absl::StrCat("cannot fsync ", base_file.path()), EIO);
  }
  return base_file.Sync();
}

absl::Status FaultInjectingEnv::Truncate(WritableFile& base_file, uint64_t size) {
  const std::optional<Fault> fault = Trigger(Operation::kTruncate, base_file.path());
  if (!fault.has_value()) return base_file.Truncate(size);
  if (fault->truncate_fault == TruncateFault::kNothingTruncated) {
    return ErrnoStatus(absl::StrCat("cannot truncate ", base_file.path()), EIO);
  }
  absl::Status truncated = base_file.Truncate(size);
  if (!truncated.ok()) return truncated;
  return ErrnoStatus(absl::StrCat("cannot fsync ", base_file.path()), EIO);
}

absl::StatusOr<std::unique_ptr<WritableFile>> FaultInjectingEnv::NewWritableFile(const std::string& path) {
  absl::StatusOr<std::unique_ptr<WritableFile>> base_file = base_->NewWritableFile(path);
  if (!base_file.ok()) return base_file.status();
  return std::make_unique<FaultyWritableFile>(this, std::move(base_file).value());
}

absl::StatusOr<std::unique_ptr<WritableFile>> FaultInjectingEnv::NewAppendableFile(const std::string& path) {
  absl::StatusOr<std::unique_ptr<WritableFile>> base_file = base_->NewAppendableFile(path);
  if (!base_file.ok()) return base_file.status();
  return std::make_unique<FaultyWritableFile>(this, std::move(base_file).value());
}

absl::StatusOr<std::string> FaultInjectingEnv::ReadFile(const std::string& path, uint64_t max_bytes) {
  if (std::optional<Fault> fault = Trigger(Operation::kRead, path); fault.has_value()) {
    return ErrnoStatus(absl::StrCat("cannot read ", path), fault->error_number);
  }
  return base_->ReadFile(path, max_bytes);
}

absl::StatusOr<std::unique_ptr<ReadableFile>> FaultInjectingEnv::NewReadableFile(const std::string& path) {
  if (std::optional<Fault> fault = Trigger(Operation::kRead, path); fault.has_value()) {
    return ErrnoStatus(absl::StrCat("cannot read ", path), fault->error_number);
  }
  return base_->NewReadableFile(path);
}

absl::Status FaultInjectingEnv::RenameFile(const std::string& from, const std::string& to) {
  if (Trigger(Operation::kRename, to).has_value()) {
    return ErrnoStatus(absl::StrCat("cannot rename ", from, " to ", to), EIO);
  }
  return base_->RenameFile(from, to);
}

absl::Status FaultInjectingEnv::RemoveFile(const std::string& path) { return base_->RemoveFile(path); }

absl::Status FaultInjectingEnv::RemoveTree(const std::string& path) { return base_->RemoveTree(path); }

absl::Status FaultInjectingEnv::CreateDirs(const std::string& path) { return base_->CreateDirs(path); }

absl::Status FaultInjectingEnv::SyncDir(const std::string& path) {
  {
    absl::MutexLock lock(&mu_);
    synced_folders_.push_back(path);
  }
  if (Trigger(Operation::kSync, path).has_value()) {
    return ErrnoStatus(absl::StrCat("cannot fsync folder ", path), EIO);
  }
  return base_->SyncDir(path);
}

bool FaultInjectingEnv::FileExists(const std::string& path) { return base_->FileExists(path); }

absl::StatusOr<std::vector<std::string>> FaultInjectingEnv::ListDir(const std::string& path) {
  return base_->ListDir(path);
}

bool FaultInjectingEnv::IsDirectory(const std::string& path) { return base_->IsDirectory(path); }

bool FaultInjectingEnv::IsLink(const std::string& path) { return base_->IsLink(path); }

absl::StatusOr<uint64_t> FaultInjectingEnv::GetFileSize(const std::string& path) { return base_->GetFileSize(path); }

}  // namespace muond::durability
