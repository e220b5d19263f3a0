#include "server/durability/session_files.h"

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"

namespace muond::durability {

absl::StatusOr<std::unique_ptr<SessionFiles>> SessionFiles::Open(const StateDirOptions& options,
                                                                 const std::string& session_id) {
  const std::string dir = options.state_dir + "/" + session_id;
  MUOND_RETURN_IF_ERROR(options.env->CreateDirs(dir));
  std::unique_ptr<SessionFiles> files(new SessionFiles(options, dir));
  if (options.durability == Durability::kJournal) {
    MUOND_RETURN_IF_ERROR(files->journal_.Open(dir + "/" + kJournalFile));
  }
  return files;
}

absl::Status SessionFiles::RecordStep(absl::string_view request, const std::vector<HostTensor>& gradients) {
  if (options_.durability != Durability::kJournal) return absl::OkStatus();
  return journal_.Append(request, gradients);
}

absl::Status SessionFiles::SaveCheckpoint(const CheckpointData& data) {
  MUOND_RETURN_IF_ERROR(WriteCheckpoint(options_.env, dir_, data));
  // The checkpoint holds every journaled step now.
  if (options_.durability == Durability::kJournal) MUOND_RETURN_IF_ERROR(journal_.Clear());
  return absl::OkStatus();
}

void SessionFiles::Discard() {
  journal_.Close();
  if (absl::Status removed = options_.env->RemoveTree(dir_); !removed.ok()) {
    MUOND_LOG(warn, "cannot remove {}: {}", dir_, removed.message());
  }
}

absl::StatusOr<std::vector<std::string>> ListSessionFolders(const StateDirOptions& options) {
  Env* env = options.env;
  if (absl::Status created = env->CreateDirs(options.state_dir); !created.ok()) {
    return absl::InternalError(absl::StrCat("cannot create --state-dir ", options.state_dir, ": ", created.message()));
  }
  MUOND_ASSIGN_OR_RETURN(std::vector<std::string> names, env->ListDir(options.state_dir));
  std::vector<std::string> dirs;
  for (const std::string& name : names) {
    const std::string dir = options.state_dir + "/" + name;
    if (!env->IsDirectory(dir)) continue;
    if (!env->FileExists(dir + "/" + kCheckpointMetadataFile)) {
      // Created but never given its parameters: nothing to restore.
      MUOND_LOG(info, "ignoring {}: no checkpoint (the session never received its parameters)", dir);
      env->RemoveTree(dir).IgnoreError();
      continue;
    }
    dirs.push_back(dir);
  }
  return dirs;
}

absl::StatusOr<SessionFolder> LoadSessionFolder(const StateDirOptions& options, const std::string& dir,
                                                const std::function<absl::StatusOr<size_t>(const CheckpointData&)>&
                                                    num_parameters) {
  SessionFolder folder;
  folder.dir = dir;
  folder.journal_path = dir + "/" + kJournalFile;
  MUOND_ASSIGN_OR_RETURN(folder.checkpoint, ReadCheckpoint(options.env, dir));
  MUOND_ASSIGN_OR_RETURN(size_t count, num_parameters(folder.checkpoint));
  MUOND_ASSIGN_OR_RETURN(folder.journal, StepJournal::Read(options.env, folder.journal_path, count));
  return folder;
}

}  // namespace muond::durability
