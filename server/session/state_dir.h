// The session layer's side of --state-dir: FilePersistence makes a Session durable through its
// folder (durability::SessionFiles), and RestoreSessions rebuilds every session found there at
// start-up — its checkpoint, then the journal's steps applied on top — refusing, with the file
// named, anything truncated, altered or not fitting its spec.
//
// A FilePersistence is used under its session's lock; RestoreSessions runs before serving.
#pragma once

#include <memory>
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
  // every journal append and checkpoint.
  static absl::StatusOr<std::unique_ptr<FilePersistence>> Open(const durability::StateDirOptions& options,
                                                               const Session& session,
                                                               metrics::Metrics* metrics = metrics::NoMetrics());

  absl::Status RecordStep(const StepRequest& request, const std::vector<HostTensor>& gradients) override;
  absl::Status SaveCheckpoint(SessionState state) override;
  int64_t checkpoint_every() const override { return files_->options().checkpoint_every; }
  bool records_gradients() const override { return files_->options().durability == durability::Durability::kJournal; }
  void Discard() override { files_->Discard(); }

 private:
  FilePersistence(std::unique_ptr<durability::SessionFiles> files, const Session& session,
                  metrics::Metrics* metrics)
      : files_(std::move(files)), session_(session), metrics_(metrics) {}

  std::unique_ptr<durability::SessionFiles> files_;
  const Session& session_;
  metrics::Metrics* const metrics_;
};

// Restores every session under options.state_dir (creating the folder if needed), each with its
// FilePersistence attached. Any unusable checkpoint or journal fails the whole restore with a
// message naming the file.
absl::StatusOr<std::vector<std::shared_ptr<Session>>> RestoreSessions(const durability::StateDirOptions& options,
                                                                      kernels::Backend* backend,
                                                                      const SpecCodec& codec,
                                                                      const SpecLimits& limits,
                                                                      metrics::Metrics* metrics = metrics::NoMetrics());

}  // namespace muond::session
