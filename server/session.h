// Session: one trainer's optimizer — the fp32 masters and optimizer state of its parameters in
// backend memory, the per-group optimizers, and the step counter that makes every step apply once.
//
// Step k is applied exactly once: k must be last_step + 1; a request for k == last_step (a retry
// after a lost answer) returns the parameters as they were after k without touching any state; any
// other k is FAILED_PRECONDITION naming the expected step. Requests are checked completely before
// any state changes, so a rejected request changes nothing. Non-finite gradients skip the update but
// advance the counter (as torch's GradScaler skips optimizer.step()).
//
// Thread-safety: all methods are safe to call concurrently; one mutex serializes the operations of a
// session (different sessions run in parallel). Results hand out immutable snapshots, so responses
// are streamed without holding the lock.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kernels/backend.h"
#include "kernels/optim/optimizer.h"
#include "muond/v1/muond.pb.h"
#include "server/session_config.h"
#include "server/gradient_staging.h"
#include "server/tensor_assembler.h"

namespace muond::server {

// Host copy of every parameter after some step; never modified once published.
struct ParameterSnapshot {
  int64_t step = 0;
  std::vector<std::vector<float>> values;  // indexed like config.parameters
};

struct StepOutcome {
  v1::StepResult result;
  std::shared_ptr<const ParameterSnapshot> parameters;
};

// A slot of the exported state: "master" or an optimizer slot, with its fp32 values.
struct StateTensor {
  size_t parameter = 0;
  std::string slot;
  std::vector<float> values;
};

struct SessionState {
  int64_t last_step = 0;
  std::vector<int64_t> step_counts;  // per parameter
  std::vector<StateTensor> tensors;
};

// Where a session's durable state goes (its folder of --state-dir). Called under the session's lock.
class SessionPersistence {
 public:
  virtual ~SessionPersistence() = default;
  // Before step k changes any state: an error refuses the step (journal mode makes it durable here).
  virtual absl::Status RecordStep(const v1::StepHeader& header, const std::vector<AssembledTensor>& gradients) = 0;
  // Writes a checkpoint of `state`; steps recorded before it are no longer needed.
  virtual absl::Status SaveCheckpoint(const SessionState& state) = 0;
  virtual int64_t checkpoint_every() const = 0;  // 0: never by step count
  virtual void Discard() = 0;                    // the session was closed: remove its files
};

class Session {
 public:
  // `owner` is the identity of the caller that created the session ("" without authentication).
  static absl::StatusOr<std::unique_ptr<Session>> Create(std::string id, v1::SessionSpec spec,
                                                         SessionConfig config, kernels::Backend* backend,
                                                         std::string owner = "");

  const std::string& id() const { return id_; }
  const std::string& owner() const { return owner_; }
  const v1::SessionSpec& spec() const { return spec_; }
  const SessionConfig& config() const { return config_; }

  int64_t last_step() const;
  bool initialized() const;

  // Replaces the masters with `tensors` (every one complete) and resets the optimizer state. Refused
  // with FAILED_PRECONDITION once a step has been applied.
  absl::Status Upload(std::vector<AssembledTensor> tensors);

  // Early check of the step number, so a stream can be refused before its gradients are read.
  // Step() checks again under the lock.
  absl::Status CheckStepNumber(int64_t step) const;

  // Applies (or replays) one step; `gradients` come from a finished TensorAssembler. With a world
  // size N > 1 the call waits until every rank has sent step k, then the gradients are averaged
  // (per parameter, over the ranks that sent it, summed in rank order so the result does not depend
  // on arrival order), the step is applied once with rank 0's header (overrides, clipping, QK-clip
  // logits), and every rank gets the same answer. A rank that resends while waiting replaces its
  // gradients. If a rank is missing after the straggler timeout the step is ABORTED for all and the
  // state is unchanged.
  // `staged`, when given, holds the gradients already copied to the backend while the stream was
  // read (see StageGradients); it is given back when the step is done.
  absl::StatusOr<StepOutcome> Step(const v1::StepHeader& header, std::vector<AssembledTensor> gradients,
                                   std::unique_ptr<StagedGradients> staged = nullptr);

  // Backend buffers (and a transfer) that a step stream copies its gradients into as they arrive;
  // pass them to Step with the assembled gradients. Null while another stream holds them (that
  // stream's gradients are then copied from the host when applied).
  absl::StatusOr<std::unique_ptr<StagedGradients>> StageGradients();

  // Applies a step recorded in the journal (already averaged), at start-up.
  absl::StatusOr<StepOutcome> ReplayStep(const v1::StepHeader& header, std::vector<AssembledTensor> gradients);

  // The current parameters and, through `last_step`, the step they belong to (read atomically).
  std::shared_ptr<const ParameterSnapshot> Parameters(int64_t* last_step) const;

  absl::StatusOr<SessionState> ExportState() const;

  // Makes the session durable from now on; restored sessions attach it after their replay.
  void AttachPersistence(std::unique_ptr<SessionPersistence> persistence);
  // Writes a checkpoint now and returns its step; FAILED_PRECONDITION without a state directory.
  absl::StatusOr<int64_t> Checkpoint();
  // Closing: removes the session's files (the session must not be used afterwards).
  void DiscardPersistence();
  // Replaces masters, slots and counters at once after checking that `state` is complete.
  absl::Status ImportState(SessionState state);

 private:
  Session(std::string id, v1::SessionSpec spec, SessionConfig config, kernels::Backend* backend);

  absl::Status CheckStepNumberLocked(int64_t step) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::StatusOr<StepOutcome> ApplyStepLocked(const v1::StepHeader& header, std::vector<AssembledTensor> gradients,
                                              StagedGradients* staged = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<StepOutcome> AggregateLocked(const v1::StepHeader& header, std::vector<AssembledTensor> gradients)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::vector<optim::StepHyper>> ResolveHyper(const v1::StepHeader& header) const;
  // header.qk_logits → (pair index, logits); checks names and head counts.
  absl::StatusOr<std::vector<std::pair<size_t, std::vector<double>>>> ResolveQkLogits(
      const v1::StepHeader& header) const;
  absl::Status ApplyQkClip(const std::vector<std::pair<size_t, std::vector<double>>>& logits)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Lends the gradient buffers (`staged`'s, or a set filled here from the host values) to the
  // parameters for the optimizer step and takes them back afterwards, whatever happens.
  absl::Status ApplyGradients(const std::vector<optim::StepHyper>& hyper,
                              std::vector<AssembledTensor>& gradients, double clip_coefficient,
                              StagedGradients* staged) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::shared_ptr<const ParameterSnapshot>> ReadBack(int64_t step) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::StatusOr<SessionState> ExportStateLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::Status CheckpointLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string id_;
  std::string owner_;  // set by Create, immutable afterwards
  const v1::SessionSpec spec_;
  const SessionConfig config_;
  kernels::Backend* const backend_;
  std::unique_ptr<GradientPool> gradient_pool_;  // set by Create; thread-safe itself

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<optim::Optimizer>> optimizers_ ABSL_GUARDED_BY(mu_);  // per group
  std::vector<optim::ParamState> params_ ABSL_GUARDED_BY(mu_);
  bool initialized_ ABSL_GUARDED_BY(mu_) = false;
  int64_t last_step_ ABSL_GUARDED_BY(mu_) = 0;
  v1::StepResult last_result_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const ParameterSnapshot> snapshot_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<SessionPersistence> persistence_ ABSL_GUARDED_BY(mu_);

  // The step being gathered from the ranks (world size > 1); generation changes whenever a gathering
  // ends, so waiting ranks can tell an abort from a spurious wake-up.
  struct PendingStep {
    int64_t step = 0;  // 0: none
    uint64_t generation = 0;
    int arrived = 0;
    std::vector<std::optional<std::pair<v1::StepHeader, std::vector<AssembledTensor>>>> ranks;
  };
  PendingStep pending_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muond::server
