// The session layer's side of --state-dir: FilePersistence makes a Session durable through its
// folder (durability::SessionFiles), and RestoreSessions rebuilds every session found there at
// start-up — its checkpoint, then the journal's steps applied on top — refusing, with the file
// named, anything truncated, altered or not fitting its spec. LoadSession is that rebuilding for one
// folder, with every check and no write: the daemon's restore and `muondctl state verify` both run it.
//
// A FilePersistence is used under its session's lock; RestoreSessions runs before serving;
// LoadSession touches nothing but the session it returns.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "server/durability/session_files.h"
#include "server/metrics/metrics.h"
#include "server/session/session.h"
#include "server/session/spec_codec.h"

namespace muond::session {

class FilePersistence final : public SessionPersistence {
 public:
  // `session` must outlive the persistence (the session owns it); so must `metrics`, which hears of
  // every journal append and checkpoint. `last_generation`: the highest checkpoint generation a
  // restored session's files name (durability::SessionFolder); 0 for a new session.
  // `journal_complete_bytes`: a restored session's durability::JournalContents::complete_bytes.
  static absl::StatusOr<std::unique_ptr<FilePersistence>> Open(
      const durability::StateDirOptions& options, const Session& session,
      metrics::Metrics* metrics = metrics::NoMetrics(), uint64_t last_generation = 0,
      std::optional<uint64_t> journal_complete_bytes = std::nullopt);

  absl::Status RecordStep(const StepRequest& request, const std::vector<HostTensor>& gradients) override;
  absl::Status WithdrawStep() override;
  absl::Status SaveCheckpoint(SessionState state) override;
  bool CheckpointDue(int64_t last_step) const override;
  bool records_gradients() const override { return files_->options().durability == durability::Durability::kJournal; }
  void Discard() override { files_->Discard(); }

 private:
  FilePersistence(std::unique_ptr<durability::SessionFiles> files, const Session& session, metrics::Metrics* metrics)
      : files_(std::move(files)), session_(session), metrics_(metrics) {}

  std::unique_ptr<durability::SessionFiles> files_;
  const Session& session_;
  metrics::Metrics* const metrics_;
  // Journal mode: the gradient bytes recorded since the last checkpoint, and after a checkpoint that
  // failed once they were due, what they were then (the next try waits for another budget's worth).
  int64_t JournalBudget() const;
  int64_t journaled_bytes_ = 0;
  int64_t last_recorded_bytes_ = 0;  // the gradient bytes of the last step recorded, until withdrawn
  int64_t retry_after_bytes_ = 0;
};

// What a checkpoint of `session` in `state` holds (FilePersistence::SaveCheckpoint writes it), its
// metadata naming `backend`. Moves the tensors out of `state`.
durability::CheckpointData CheckpointOf(const Session& session, SessionState state, std::string backend);

// One session folder rebuilt in memory: the checkpoint read and checked against its spec, the
// journal's records replayed on top. Nothing on disk changes and no persistence is attached.
struct LoadedSession {
  std::shared_ptr<Session> session;
  int64_t checkpoint_step = 0;
  uint64_t last_generation = 0;          // durability::SessionFolder's
  int64_t replayed = 0;                  // journaled steps applied after the checkpoint
  size_t records_before_checkpoint = 0;  // journal records written before it, not replayed
  bool dropped_torn_tail = false;        // the journal ended in a record cut short by a crash
  uint64_t journal_complete_bytes = 0;   // where its last complete record ends (a torn tail after)
  std::string journal_path;
};

// Every check of a restore, for the folder `dir` of options.state_dir: the errors name the file
// (DATA_LOSS for contents that are truncated, altered or do not fit the spec; FAILED_PRECONDITION for
// a link or an entry that is not a regular file; the Env's errors otherwise).
absl::StatusOr<LoadedSession> LoadSession(const durability::StateDirOptions& options, const std::string& dir,
                                          kernels::Backend* backend, const SpecCodec& codec, const SpecLimits& limits);

// The sizes the spec of a checkpoint (its metadata, `metadata_file`) gives, parsed as a restore
// parses it (into `config` when not null): each parameter's element count and the most bytes its
// tensors file can hold. DATA_LOSS naming `metadata_file` for a spec that does not parse.
absl::StatusOr<durability::SpecSizes> CheckpointSpecSizes(const durability::CheckpointData& metadata,
                                                          const std::string& metadata_file, const SpecCodec& codec,
                                                          const SpecLimits& limits,
                                                          absl::StatusOr<SessionConfig>* config = nullptr);

// Whether a LoadSession error is the daemon's trouble (memory, a quota) rather than the folder's:
// such an error stops the start-up whatever options.on_damaged says, and the folder stays in place.
bool IsDaemonTrouble(const absl::Status& status);

// Restores every session under options.state_dir (creating the folder if needed), each with its
// FilePersistence attached. A folder LoadSession refuses is moved into the quarantine (logged and
// counted through `metrics`) with options.on_damaged == kQuarantine, and fails the whole restore with
// kFail; so does any error writing a restored session's fresh checkpoint.
absl::StatusOr<std::vector<std::shared_ptr<Session>>> RestoreSessions(const durability::StateDirOptions& options,
                                                                      kernels::Backend* backend, const SpecCodec& codec,
                                                                      const SpecLimits& limits,
                                                                      metrics::Metrics* metrics = metrics::NoMetrics());

}  // namespace muond::session
