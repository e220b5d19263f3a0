// The daemon's state directory (--state-dir): one folder per session, named by the session id,
// holding its checkpoint and, in journal mode, its step journal (journal.log).
//
// SessionFiles is one session's handle on its folder: it appends steps to the journal, writes
// checkpoints (which empty the journal) and removes the folder when the session is closed.
// ListSessionFolders and LoadSessionFolder read the directory back at start-up;
// QuarantineSessionFolder moves a folder that cannot be restored aside, into kQuarantineFolder.
//
// Confinement: a session folder is named by a valid session id (CheckSessionId) and is never a
// symbolic link; its files are opened without following links (env.h).
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

// What start-up does with a session folder that cannot be restored (--on-damaged-state).
enum class DamagedState {
  kQuarantine,  // move it into kQuarantineFolder, log it, count it, serve the other sessions
  kFail,        // stop the daemon (exit 1) naming the file
};

struct StateDirOptions {
  std::string state_dir;
  Durability durability = Durability::kSnapshot;
  int64_t checkpoint_every = 0;  // steps; 0: only on upload, request and shutdown
  // Journal mode: a checkpoint is also due once the gradients journaled since the last one take as
  // many bytes as the session's state, and at least this many (a small session's records are mostly
  // their fields: checkpointing it every few steps would cost more than the journal it empties).
  int64_t journal_floor_bytes = int64_t{64} << 20;
  std::string backend_name;
  DamagedState on_damaged = DamagedState::kQuarantine;
  Env* env = Env::Default();  // not owned
  // false: LoadSessionFolder reads the checkpoint alone, leaving the journal unread (muondctl's
  // `export --checkpoint-only`); a daemon always reads it.
  bool read_journal = true;
};

inline constexpr char kJournalFile[] = "journal.log";
// The folder of the state directory that damaged session folders are moved into, as
// <id>.<UTC time>. Not a valid session id, so it never collides with a session's folder.
inline constexpr char kQuarantineFolder[] = "+quarantine";
// The folder a closed session's folder is moved into, in one rename, before its files are removed;
// start-up removes what a stop left there. Not a valid session id either.
inline constexpr char kClosedFolder[] = "+closed";

// OK when `id` is a valid session id ([A-Za-z0-9._-]{1,128}, not "." or ".."), which is also what
// makes it a safe folder name; INVALID_ARGUMENT naming `field` otherwise.
absl::Status CheckSessionId(const std::string& id, absl::string_view field = "session_id");

class SessionFiles {
 public:
  // Creates the session's folder if needed and, in journal mode, opens its journal.
  // `last_generation`: the highest checkpoint generation the folder's files name
  // (SessionFolder::last_generation; 0 for a new session); the next checkpoint takes the one after.
  // `journal_complete_bytes`: for a restored session, where its journal's last complete record ends
  // (JournalContents::complete_bytes): a torn tail past it is cut off before the next record.
  static absl::StatusOr<std::unique_ptr<SessionFiles>> Open(
      const StateDirOptions& options, const std::string& session_id, uint64_t last_generation = 0,
      std::optional<uint64_t> journal_complete_bytes = std::nullopt);

  const StateDirOptions& options() const { return options_; }
  const std::string& dir() const { return dir_; }

  // Journal mode: appends the step durably, naming the generation of the last checkpoint tried.
  // Snapshot mode: nothing to do.
  absl::Status RecordStep(absl::string_view request, const std::vector<HostTensor>& gradients);
  // Journal mode: removes the record RecordStep appended last, durably (StepJournal::WithdrawLast): its
  // step failed before it changed any state. Snapshot mode: nothing to do.
  absl::Status WithdrawStep();
  // Writes `data` as the folder's checkpoint, of the next generation, then empties the journal (it
  // holds nothing newer). A journal that cannot be emptied is logged, not an error: its records name
  // an older generation, which a restore skips. The generation counts tries, failed ones included:
  // a write that failed may yet have put its checkpoint in place, and the steps after it follow it.
  absl::Status SaveCheckpoint(CheckpointData data);
  // Removes the folder and everything in it: moved into kClosedFolder first (durably), so that a
  // crash halfway through the removal leaves no folder a restart would take for the session.
  void Discard();

 private:
  SessionFiles(StateDirOptions options, std::string dir, uint64_t last_generation)
      : options_(std::move(options)),
        dir_(std::move(dir)),
        journal_(options_.env),
        checkpoint_generation_(last_generation) {}

  const StateDirOptions options_;
  const std::string dir_;
  StepJournal journal_;
  uint64_t checkpoint_generation_;  // of the last checkpoint tried
};

// What a session folder holds at start-up.
struct SessionFolder {
  std::string dir;
  std::string journal_path;
  CheckpointData checkpoint;
  JournalContents journal;               // the records written since the checkpoint was tried
  size_t records_before_checkpoint = 0;  // records of an older generation, left out of `journal`
  // The highest generation the checkpoint or any journal record names: tries that failed before a
  // stop count, so that a generation is never given twice.
  uint64_t last_generation = 0;
};

// The session folders of the state directory (creating it if needed), sorted. Folders without a
// checkpoint (sessions that never received their parameters) are removed, with a log line; entries
// whose name is not a session id are left alone — kQuarantineFolder and lost+found quietly, any
// other folder with one warning naming it (escaped) — except kClosedFolder, whose leftovers are
// removed. A symbolic link is listed, for LoadSessionFolder to refuse.
absl::StatusOr<std::vector<std::string>> ListSessionFolders(const StateDirOptions& options);

// Folders of a state directory that are known not to be sessions and pass without a word
// (`+quarantine`, `+closed`, `lost+found`).
bool IsKnownNonSessionFolder(const std::string& name);
// What the daemon logs for any other folder whose name is not a session id, which it leaves alone
// (the name escaped); `muondctl state verify` fails such a folder with the same words.
std::string ForeignFolderMessage(const std::string& state_dir, const std::string& name);

// What a checkpoint's spec says of its session's size: each parameter's element count (the journal's
// records are checked against them) and the most bytes its tensors file can hold.
struct SpecSizes {
  std::vector<int64_t> numel;
  uint64_t max_tensor_bytes = 0;
};
using SpecSizesOf = std::function<absl::StatusOr<SpecSizes>(const CheckpointData&)>;

// Reads a folder's checkpoint and journal, sized by the checkpoint's spec, hence the callback: parse
// the spec (called once the metadata is read, before the tensors), return its sizes.
// Records of a generation older than the checkpoint's were written before it and are left out.
// Refuses a folder that is a symbolic link.
absl::StatusOr<SessionFolder> LoadSessionFolder(const StateDirOptions& options, const std::string& dir,
                                                const SpecSizesOf& spec_sizes);

// Moves the session folder `dir` into <state_dir>/kQuarantineFolder/<name>.<UTC time> (never deletes
// anything) and makes the move durable. Returns the new path.
absl::StatusOr<std::string> QuarantineSessionFolder(const StateDirOptions& options, const std::string& dir);
// Moves the session folder `dir` into <state_dir>/<folder>/<name>.<UTC time>[.<n>] (creating it; never
// through a link in its place, never over an entry there) and makes the move durable. Once the folder
// has moved, its new path is returned even if making that durable failed (logged).
absl::StatusOr<std::string> MoveSessionFolderInto(const StateDirOptions& options, const std::string& dir,
                                                  absl::string_view folder);

}  // namespace muond::durability
