#include "server/durability/session_files.h"

#include <algorithm>
#include <optional>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "common/status_macros.h"

namespace muond::durability {
namespace {

absl::Status LinkedFolder(const std::string& dir) {
  return absl::FailedPreconditionError(
      absl::StrCat("session folder ", dir, " is a symbolic link (state files are never reached through links)"));
}

// Removes the records of a generation older than `generation` (written before that checkpoint);
// returns how many.
size_t LeaveOutRecordsBefore(uint64_t generation, std::vector<JournalRecord>& records) {
  const size_t before = records.size();
  std::erase_if(records, [&](const JournalRecord& record) { return record.checkpoint_generation < generation; });
  return before - records.size();
}

}  // namespace

absl::Status CheckSessionId(const std::string& id, absl::string_view field) {
  const bool valid =
      !id.empty() && id.size() <= 128 && id != "." && id != ".." && std::all_of(id.begin(), id.end(), [](char c) {
        return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
      });
  if (valid) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": '", id.substr(0, 140), "' is not a session id (1 to 128 of [A-Za-z0-9._-])"));
}

absl::StatusOr<std::unique_ptr<SessionFiles>> SessionFiles::Open(const StateDirOptions& options,
                                                                 const std::string& session_id,
                                                                 uint64_t last_generation,
                                                                 std::optional<uint64_t> journal_complete_bytes) {
  MUOND_RETURN_IF_ERROR(CheckSessionId(session_id));
  const std::string dir = options.state_dir + "/" + session_id;
  if (options.env->IsLink(dir)) return LinkedFolder(dir);
  MUOND_RETURN_IF_ERROR(options.env->CreateDirs(dir));
  // The folder's entry in the state directory is durable before any step in it is acknowledged: a
  // power loss must not take the folder, with its journal, away.
  MUOND_RETURN_IF_ERROR(options.env->SyncDir(options.state_dir));
  std::unique_ptr<SessionFiles> files(new SessionFiles(options, dir, last_generation));
  if (options.durability == Durability::kJournal) {
    MUOND_RETURN_IF_ERROR(files->journal_.Open(dir + "/" + kJournalFile, journal_complete_bytes));
  }
  return files;
}

absl::Status SessionFiles::RecordStep(absl::string_view request, const std::vector<HostTensor>& gradients) {
  if (options_.durability != Durability::kJournal) return absl::OkStatus();
  return journal_.Append(checkpoint_generation_, request, gradients);
}

absl::Status SessionFiles::WithdrawStep() {
  if (options_.durability != Durability::kJournal) return absl::OkStatus();
  return journal_.WithdrawLast();
}

absl::Status SessionFiles::SaveCheckpoint(CheckpointData data) {
  data.generation = ++checkpoint_generation_;
  MUOND_RETURN_IF_ERROR(WriteCheckpoint(options_.env, dir_, data));
  // The checkpoint holds every journaled step now, or replaced them (a SetState).
  if (options_.durability == Durability::kJournal) {
    if (absl::Status cleared = journal_.Clear(); !cleared.ok()) {
      MUOND_LOG(warn,
                "session {}: checkpoint written, but its journal could not be emptied ({}); its records predate it",
                data.session_id, cleared.message());
    }
  }
  return absl::OkStatus();
}

void SessionFiles::Discard() {
  journal_.Close();
  // Out of the sessions' names first, in one rename made durable: a crash while the files are removed
  // one by one must not leave a folder that a restart takes for the session (without its journal, or
  // its checkpoint).
  Env* env = options_.env;
  std::string doomed = dir_;
  if (absl::StatusOr<std::string> moved = MoveSessionFolderInto(options_, dir_, kClosedFolder); moved.ok()) {
    doomed = *moved;
  } else {
    // Removed in place, its checkpoint first and durably: a folder left without one is removed at the
    // next start, never restored.
    MUOND_LOG(warn, "cannot move {} aside before removing it: {}", dir_, moved.status().message());
    if (env->RemoveFile(dir_ + "/" + kCheckpointMetadataFile).ok()) env->SyncDir(dir_).IgnoreError();
  }
  if (absl::Status removed = env->RemoveTree(doomed); !removed.ok()) {
    MUOND_LOG(warn, "cannot remove {}: {}", doomed, removed.message());
  }
}

bool IsKnownNonSessionFolder(const std::string& name) {
  return name == kQuarantineFolder || name == kClosedFolder || name == "lost+found";
}

std::string ForeignFolderMessage(const std::string& state_dir, const std::string& name) {
  return absl::StrCat("ignoring ", state_dir, "/", absl::CHexEscape(name.substr(0, 256)),
                      ": the folder's name is not a session id (1 to 128 of [A-Za-z0-9._-]); a session's folder is "
                      "named by its id");
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
    if (name == kClosedFolder && !env->IsLink(dir)) {
      // Closed sessions whose removal a stop cut short.
      if (absl::Status removed = env->RemoveTree(dir); !removed.ok()) {
        MUOND_LOG(warn, "cannot remove {}: {}", dir, removed.message());
      }
      continue;
    }
    if (IsKnownNonSessionFolder(name)) continue;
    if (!CheckSessionId(name).ok()) {
      // Left alone, but said (the name escaped): an operator who renamed a session's folder learns
      // why it did not come back.
      MUOND_LOG(warn, "{}", ForeignFolderMessage(options.state_dir, name));
      continue;
    }
    if (env->IsLink(dir)) {
      dirs.push_back(dir);  // LoadSessionFolder refuses it; nothing is removed through a link
      continue;
    }
    const std::string metadata_file = dir + "/" + kCheckpointMetadataFile;
    if (!env->FileExists(metadata_file) && !env->IsLink(metadata_file)) {
      // Created but never given its parameters: nothing to restore. (A dangling link in place of the
      // checkpoint is damage, for LoadSessionFolder to refuse, not an empty folder.)
      MUOND_LOG(info, "ignoring {}: no checkpoint (the session never received its parameters)", dir);
      env->RemoveTree(dir).IgnoreError();
      continue;
    }
    dirs.push_back(dir);
  }
  return dirs;
}

absl::StatusOr<SessionFolder> LoadSessionFolder(const StateDirOptions& options, const std::string& dir,
                                                const SpecSizesOf& spec_sizes) {
  if (options.env->IsLink(dir)) return LinkedFolder(dir);
  SessionFolder folder;
  folder.dir = dir;
  folder.journal_path = dir + "/" + kJournalFile;
  std::optional<SpecSizes> sizes;
  auto bound = [&](const CheckpointData& metadata) -> absl::StatusOr<uint64_t> {
    MUOND_ASSIGN_OR_RETURN(sizes, spec_sizes(metadata));
    return sizes->max_tensor_bytes;
  };
  MUOND_ASSIGN_OR_RETURN(folder.checkpoint, ReadCheckpoint(options.env, dir, bound));
  if (!sizes.has_value()) return absl::InternalError("the checkpoint was read without its spec's sizes");
  if (options.read_journal) {
    MUOND_ASSIGN_OR_RETURN(folder.journal, StepJournal::Read(options.env, folder.journal_path, sizes->numel));
  }
  folder.last_generation = folder.checkpoint.generation;
  for (const JournalRecord& record : folder.journal.records) {
    folder.last_generation = std::max(folder.last_generation, record.checkpoint_generation);
  }
  folder.records_before_checkpoint = LeaveOutRecordsBefore(folder.checkpoint.generation, folder.journal.records);
  return folder;
}

absl::StatusOr<std::string> QuarantineSessionFolder(const StateDirOptions& options, const std::string& dir) {
  return MoveSessionFolderInto(options, dir, kQuarantineFolder);
}

absl::StatusOr<std::string> MoveSessionFolderInto(const StateDirOptions& options, const std::string& dir,
                                                  absl::string_view folder) {
  Env* env = options.env;
  const std::string into = absl::StrCat(options.state_dir, "/", folder);
  // Never moved out of the state directory through a link put in the folder's place.
  if (env->IsLink(into)) {
    return absl::FailedPreconditionError(
        absl::StrCat(into, " is a symbolic link (state files are never reached through links)"));
  }
  MUOND_RETURN_IF_ERROR(env->CreateDirs(into));
  const std::string name = dir.substr(dir.rfind('/') + 1);
  const std::string stamp = absl::FormatTime("%Y%m%dT%H%M%E3SZ", absl::Now(), absl::UTCTimeZone());
  std::string target = absl::StrCat(into, "/", name, ".", stamp);
  // Never replace what is already there: a restart, or a session of the same id closed again, within
  // the same millisecond.
  for (int n = 1; env->FileExists(target) || env->IsLink(target); ++n) {
    target = absl::StrCat(into, "/", name, ".", stamp, ".", n);
  }
  MUOND_RETURN_IF_ERROR(env->RenameFile(dir, target));
  // Moved: the caller goes on with the new path whether or not the move is durable yet.
  for (const std::string& folder_moved : {into, options.state_dir}) {
    if (absl::Status synced = env->SyncDir(folder_moved); !synced.ok()) {
      MUOND_LOG(warn, "moved {} to {}, but the move may not survive a crash: {}", dir, target, synced.message());
      break;
    }
  }
  return target;
}

}  // namespace muond::durability
