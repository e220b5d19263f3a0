// The daemon's state directory (--state-dir): one folder per session holding its checkpoint and, in
// journal mode, its step journal. FileSessionPersistence is a session's handle on its folder;
// RestoreSessions rebuilds every session found there at start-up (checkpoint, then the journal's
// steps replayed on top), refusing — with the file named — anything truncated or altered.
//
// Durability modes:
//   snapshot  checkpoints on upload, on request, every --checkpoint-every steps and at shutdown;
//             a crash loses the steps since the last checkpoint.
//   journal   additionally appends and fsyncs every step before it is applied and acknowledged, so
//             an acknowledged step survives kill -9.
//
// A FileSessionPersistence is used under its session's lock; RestoreSessions runs before serving.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "server/session.h"
#include "server/session_config.h"
#include "server/step_journal.h"

namespace muond::server {

enum class Durability { kSnapshot, kJournal };

struct StateDirOptions {
  std::string state_dir;
  Durability durability = Durability::kSnapshot;
  int64_t checkpoint_every = 0;  // steps; 0: only on upload, request and shutdown
  std::string backend_name;
};

class FileSessionPersistence final : public SessionPersistence {
 public:
  static absl::StatusOr<std::unique_ptr<FileSessionPersistence>> Open(const StateDirOptions& options,
                                                                      const Session& session,
                                                                      std::string owner);

  absl::Status RecordStep(const v1::StepHeader& header, const std::vector<AssembledTensor>& gradients) override;
  absl::Status SaveCheckpoint(const SessionState& state) override;
  int64_t checkpoint_every() const override { return options_.checkpoint_every; }
  void Discard() override;

 private:
  FileSessionPersistence(StateDirOptions options, std::string dir, const Session& session, std::string owner)
      : options_(std::move(options)), dir_(std::move(dir)), session_(session), owner_(std::move(owner)) {}

  const StateDirOptions options_;
  const std::string dir_;
  const Session& session_;
  const std::string owner_;
  StepJournal journal_;
};

struct RestoredSession {
  std::shared_ptr<Session> session;  // with its owner and its optimizer state at the last step
};

// Restores every session under options.state_dir (creating the folder if needed). Any unusable
// checkpoint or journal fails the whole restore with a message naming the file.
absl::StatusOr<std::vector<RestoredSession>> RestoreSessions(const StateDirOptions& options,
                                                             kernels::Backend* backend, const SpecLimits& limits);

}  // namespace muond::server
