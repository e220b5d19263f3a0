#include "server/session_store.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/checkpoint.h"
#include "server/logging.h"

namespace muond::server {
namespace {

namespace fs = std::filesystem;
constexpr char kJournalFile[] = "journal.log";

std::string SessionDir(const StateDirOptions& options, const std::string& session_id) {
  return options.state_dir + "/" + session_id;
}

}  // namespace

absl::StatusOr<std::unique_ptr<FileSessionPersistence>> FileSessionPersistence::Open(const StateDirOptions& options,
                                                                                     const Session& session,
                                                                                     std::string owner) {
  const std::string dir = SessionDir(options, session.id());
  std::error_code error;
  fs::create_directories(dir, error);
  if (error) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", error.message()));
  std::unique_ptr<FileSessionPersistence> persistence(
      new FileSessionPersistence(options, dir, session, std::move(owner)));
  if (options.durability == Durability::kJournal) {
    MUOND_RETURN_IF_ERROR(persistence->journal_.Open(dir + "/" + kJournalFile));
  }
  return persistence;
}

absl::Status FileSessionPersistence::RecordStep(const v1::StepHeader& header,
                                                const std::vector<AssembledTensor>& gradients) {
  if (options_.durability != Durability::kJournal) return absl::OkStatus();
  absl::Status appended = journal_.Append(header, gradients);
  if (!appended.ok()) {
    MUOND_LOG(error, "session {}: step {} refused, the journal failed: {}", session_.id(), header.step(),
              appended.message());
    return absl::UnavailableError(absl::StrCat("the step could not be made durable: ", appended.message()));
  }
  return absl::OkStatus();
}

absl::Status FileSessionPersistence::SaveCheckpoint(const SessionState& state) {
  CheckpointContents contents{session_.id(), owner_, session_.spec(), state};
  MUOND_RETURN_IF_ERROR(WriteCheckpoint(dir_, contents, session_.config(), options_.backend_name));
  // The checkpoint holds every journaled step now.
  if (options_.durability == Durability::kJournal) MUOND_RETURN_IF_ERROR(journal_.Clear());
  return absl::OkStatus();
}

void FileSessionPersistence::Discard() {
  journal_.Close();
  std::error_code error;
  fs::remove_all(dir_, error);
  if (error) MUOND_LOG(warn, "cannot remove {}: {}", dir_, error.message());
}

absl::StatusOr<std::vector<RestoredSession>> RestoreSessions(const StateDirOptions& options,
                                                             kernels::Backend* backend, const SpecLimits& limits) {
  std::error_code error;
  fs::create_directories(options.state_dir, error);
  if (error) return absl::InternalError(absl::StrCat("cannot create --state-dir ", options.state_dir));
  std::vector<RestoredSession> restored;
  std::vector<fs::path> dirs;
  for (const auto& entry : fs::directory_iterator(options.state_dir, error)) {
    if (entry.is_directory()) dirs.push_back(entry.path());
  }
  std::sort(dirs.begin(), dirs.end());
  for (const fs::path& dir : dirs) {
    if (!fs::exists(dir / "checkpoint.json")) {
      // Created but never given its parameters: nothing to restore.
      MUOND_LOG(info, "ignoring {}: no checkpoint (the session never received its parameters)", dir.string());
      fs::remove_all(dir, error);
      continue;
    }
    MUOND_ASSIGN_OR_RETURN(CheckpointContents contents, ReadCheckpoint(dir.string(), limits));
    if (contents.session_id != dir.filename().string()) {
      return absl::DataLossError(absl::StrCat("checkpoint ", dir.string(), "/checkpoint.json names session '",
                                              contents.session_id, "'"));
    }
    MUOND_ASSIGN_OR_RETURN(SessionConfig config, ParseSessionSpec(contents.spec, limits));
    const size_t num_parameters = config.parameters.size();
    std::vector<int64_t> numel;
    for (const ParameterConfig& p : config.parameters) numel.push_back(p.numel);
    MUOND_ASSIGN_OR_RETURN(std::unique_ptr<Session> unique,
                           Session::Create(contents.session_id, contents.spec, std::move(config), backend,
                                                           contents.owner));
    std::shared_ptr<Session> session = std::move(unique);
    absl::Status imported = session->ImportState(std::move(contents.state));
    if (!imported.ok()) {
      return absl::DataLossError(absl::StrCat("checkpoint ", dir.string(), " is unusable: ", imported.message()));
    }
    const int64_t checkpoint_step = session->last_step();

    const std::string journal_file = (dir / kJournalFile).string();
    MUOND_ASSIGN_OR_RETURN(JournalContents journal, StepJournal::Read(journal_file, num_parameters));
    int64_t replayed = 0;
    for (JournalRecord& record : journal.records) {
      const int64_t step = record.header.step();
      if (step <= session->last_step()) continue;  // already in the checkpoint
      if (step != session->last_step() + 1) {
        return absl::DataLossError(absl::StrCat("journal ", journal_file, " is unusable: step ", step,
                                                " follows step ", session->last_step()));
      }
      for (size_t i = 0; i < num_parameters; ++i) {
        if (record.gradients[i].present() && record.gradients[i].received != numel[i]) {
          return absl::DataLossError(absl::StrCat("journal ", journal_file, " is unusable: step ", step,
                                                  " has a gradient of the wrong size"));
        }
      }
      absl::StatusOr<StepOutcome> outcome = session->ReplayStep(record.header, std::move(record.gradients));
      if (!outcome.ok()) {
        return absl::DataLossError(
            absl::StrCat("journal ", journal_file, ": step ", step, " does not replay: ", outcome.status().message()));
      }
      ++replayed;
    }
    if (journal.dropped_torn_tail) {
      MUOND_LOG(warn, "journal {} ended in a partly written record (a crash during an unacknowledged step); "
                "dropped it", journal_file);
    }
    MUOND_ASSIGN_OR_RETURN(std::unique_ptr<FileSessionPersistence> persistence,
                           FileSessionPersistence::Open(options, *session, contents.owner));
    session->AttachPersistence(std::move(persistence));
    // Fold the replayed steps into a fresh checkpoint, which also empties the journal.
    MUOND_RETURN_IF_ERROR(session->Checkpoint().status());
    MUOND_LOG(info, "session {} restored at step {} (checkpoint at step {} + {} journaled steps)", session->id(),
              session->last_step(), checkpoint_step, replayed);
    restored.push_back({std::move(session)});
  }
  return restored;
}

}  // namespace muond::server
