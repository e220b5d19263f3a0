// The daemon's state directory (--state-dir): one folder per session, named by the session id,
// holding its checkpoint and, in journal mode, its step journal (journal.log).
//
// SessionFiles is one session's handle on its folder: it appends steps to the journal, writes
// checkpoints (which empty the journal) and removes the folder when the session is closed.
// ListSessionFolders and LoadSessionFolder read the directory back at start-up.
//
// Durability modes:
//   snapshot  checkpoints on upload, on request, every --checkpoint-every steps and at shutdown;
//             a crash loses the steps since the last checkpoint.
//   journal   additionally appends and syncs every step before it is applied and acknowledged, so
//             an acknowledged step survives kill -9.
//
// A SessionFiles is used by one thread at a time (its session's lock); the free functions run
// before serving. No gRPC and no session types.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/durability/checkpoint.h"
#include "server/durability/env.h"
#include "server/durability/step_journal.h"

namespace muond::durability {

enum class Durability { kSnapshot, kJournal };

struct StateDirOptions {
  std::string state_dir;
  Durability durability = Durability::kSnapshot;
  int64_t checkpoint_every = 0;  // steps; 0: only on upload, request and shutdown
  std::string backend_name;
  Env* env = Env::Default();     // not owned
};

inline constexpr char kJournalFile[] = "journal.log";

class SessionFiles {
 public:
  // Creates the session's folder if needed and, in journal mode, opens its journal.
  static absl::StatusOr<std::unique_ptr<SessionFiles>> Open(const StateDirOptions& options,
                                                            const std::string& session_id);

  const StateDirOptions& options() const { return options_; }
  const std::string& dir() const { return dir_; }

  // Journal mode: appends the step durably. Snapshot mode: nothing to do.
  absl::Status RecordStep(absl::string_view request, const std::vector<HostTensor>& gradients);
  // Writes `data` as the folder's checkpoint, then empties the journal (it holds nothing newer).
  absl::Status SaveCheckpoint(const CheckpointData& data);
  // Removes the folder and everything in it.
  void Discard();

 private:
  SessionFiles(StateDirOptions options, std::string dir)
      : options_(std::move(options)), dir_(std::move(dir)), journal_(options_.env) {}

  const StateDirOptions options_;
  const std::string dir_;
  StepJournal journal_;
};

// What a session folder holds at start-up.
struct SessionFolder {
  std::string dir;
  std::string journal_path;
  CheckpointData checkpoint;
  JournalContents journal;
};

// The session folders of the state directory (creating it if needed), sorted. Folders without a
// checkpoint (sessions that never received their parameters) are removed, with a log line.
absl::StatusOr<std::vector<std::string>> ListSessionFolders(const StateDirOptions& options);

// Reads a folder's checkpoint and journal; `num_parameters` bounds the journal's parameter indices
// and comes from the checkpoint's spec, so it is a callback: parse the spec, return its count.
absl::StatusOr<SessionFolder> LoadSessionFolder(const StateDirOptions& options, const std::string& dir,
                                                const std::function<absl::StatusOr<size_t>(const CheckpointData&)>&
                                                    num_parameters);

}  // namespace muond::durability
