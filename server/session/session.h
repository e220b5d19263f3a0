// Session: one trainer's optimizer — the fp32 masters and optimizer state of its parameters in
// backend memory, the per-group optimizers, and the step counter that makes every step apply once.
//
// The path of a step: BeginStep checks the request (StepPlan) and decides whether it is the next
// step or a retry of the applied one; a transport fills the returned IncomingStep with gradients;
// FinishStep applies it — or, for a retry, answers with the parameters as they were after it —
// and returns the answer. Step k is applied exactly once: k must be last_step + 1; k == last_step
// (a retry after a lost answer) is a replay that touches no state; any other k is
// FAILED_PRECONDITION naming the expected step. Everything that can refuse a request is checked
// before any state changes. Non-finite gradients skip the update but advance the counter (as
// torch's GradScaler skips optimizer.step()). With world size N > 1, FinishStep waits until every
// rank has sent step k (RankGather), applies the average once and answers every rank; a rank
// missing after the straggler timeout aborts the step for all (ABORTED), state unchanged.
//
// Sharded sessions (docs/sharding.md) take each step in two phases. A prepare reads (and, with
// several ranks, averages) the gradients, holds them as the session's prepared step, and answers
// their sums of squares; nothing changes. A commit of that step applies the held gradients with the
// decision the client took over every shard (the global norm for clipping, or a skip). A prepare sent
// again replaces the held step; a commit of an applied step is a replay; a commit with nothing
// prepared (say, after a restart) is FAILED_PRECONDITION, and the client prepares again.
//
// Thread-safety: all methods are safe to call concurrently; one mutex serializes the operations of
// a session (different sessions run in parallel). Answers hand out immutable snapshots, so they are
// sent without holding the lock.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/host_tensor.h"
#include "kernels/backend.h"
#include "kernels/optim/optimizer.h"
#include "server/session/gradient_staging.h"
#include "server/session/health_watch.h"
#include "server/session/incoming_step.h"
#include "server/session/parameter_reader.h"
#include "server/session/part_load.h"
#include "server/session/rank_gather.h"
#include "server/session/session_config.h"
#include "server/session/session_persistence.h"
#include "server/session/step_plan.h"
#include "server/session/step_types.h"

namespace muond::session {

class Session {
 public:
  // How many of its last steps a session of several gathering ranks remembers the contributors of
  // (answering a resend whether its gradients were used); checkpoints keep them.
  static constexpr size_t kRememberedSteps = 64;

  // `owner` is the identity of the caller that created the session ("" without authentication).
  static absl::StatusOr<std::unique_ptr<Session>> Create(std::string id, SessionConfig config,
                                                         kernels::Backend* backend, std::string owner = "");

  const std::string& id() const { return id_; }
  const std::string& owner() const { return owner_; }
  const SessionConfig& config() const { return config_; }
  // Backend memory the session holds, as the quotas count it (EstimateSessionBytes of its config,
  // computed once at creation).
  int64_t state_bytes() const { return state_bytes_; }
  // Distinct for every session the process creates: a closed session and a new one of the same id
  // differ (what the metrics tell them apart by).
  uint64_t serial() const { return serial_; }

  int64_t last_step() const;
  // The groups' clipping and telemetry of the last applied step (health_watch.h).
  HealthWatch::Latest LatestHealth() const;
  // What a live view shows of the session's traffic (muondctl top): a step of `rank` arrived over
  // `transport` ("grpc", "shm", …), refused or not. Activity: the last step's transport, and when
  // each rank's last step arrived (absl::InfinitePast() for none yet). Thread-safe.
  void NoteStepArrived(int rank, std::string_view transport);
  struct Activity {
    std::string last_transport;
    std::vector<absl::Time> rank_seen;  // by rank
  };
  Activity activity() const;
  // True for the first caller with a step beyond the last claimed: a step of several ranks is
  // answered once per rank, and its health warnings are logged and counted once. Thread-safe.
  bool ClaimHealthReport(int64_t step);
  bool initialized() const;

  // Replaces the masters with `tensors` (every one complete) and resets the optimizer state.
  // Refused with FAILED_PRECONDITION once a step has been applied.
  absl::Status Upload(std::vector<HostTensor> tensors);
  // `rank`'s upload of its parts (docs/ranks.md, Ranks that hold parts): each partitioned
  // parameter's part written into its range, each replicated parameter whole (every one of them
  // present, each part of the rank's size); the optimizer state of every parameter reset. Refused
  // once a step has been applied. Rank -1: every parameter whole (Upload).
  absl::Status UploadParts(int rank, std::vector<HostTensor> tensors);

  // Checks `request` and classifies it (next step or replay) before its gradients are read.
  absl::StatusOr<std::unique_ptr<IncomingStep>> BeginStep(StepRequest request);
  // Applies (or replays) a begun step whose gradients have all arrived; see the class comment.
  absl::StatusOr<StepOutcome> FinishStep(std::unique_ptr<IncomingStep> step);
  // Applies a step recorded in the journal (already averaged over ranks), at start-up.
  absl::StatusOr<StepOutcome> ApplyJournaledStep(StepRequest request, std::vector<HostTensor> gradients);

  // The current parameters and, through `last_step`, the step they belong to (read atomically).
  // Read them through OpenParameters, or take both at once with ReadLatestParameters.
  std::shared_ptr<const ParameterSnapshot> Parameters(int64_t* last_step) const;

  // A reader of `snapshot` (or of `rank`'s view of it: its parts of partitioned parameters, the rest
  // whole), held; ABORTED when its values are views of masters that have changed since it was taken
  // (a later step, an upload or SetState). See ParameterReader.
  absl::StatusOr<ParameterReader> OpenParameters(std::shared_ptr<const ParameterSnapshot> snapshot,
                                                 std::optional<int> rank = std::nullopt) const;

  // The current parameters held readable: the step they belong to and their reader.
  struct LatestParameters {
    int64_t last_step = 0;
    ParameterReader reader;
  };
  // Parameters and OpenParameters together: a step that changes the masters between the two makes
  // the snapshot stale, and the parameters after it are read instead (a few times; then ABORTED).
  // The snapshot is still on the device (on_device) when it could not be read back.
  absl::StatusOr<LatestParameters> ReadLatestParameters(std::optional<int> rank = std::nullopt) const;

  // Writes parameter `index` of an on-device snapshot (ParameterSnapshot::on_device) to backend
  // memory `dst` — the backend's own or peer memory — as `numel` elements of `dtype`, enqueued on the
  // backend (ordered before any later change of the masters); ABORTED when the masters changed since
  // the snapshot.
  absl::Status CopyParameterOnDevice(const ParameterSnapshot& snapshot, size_t index, kernels::StorageDtype dtype,
                                     void* dst) const;

  // The shape of tensor `slot` ("master" or an optimizer slot) of parameter `parameter`: the
  // parameter's shape, or a reduced one (NorMuon's second moment).
  std::vector<int64_t> TensorShape(size_t parameter, std::string_view slot) const ABSL_NO_THREAD_SAFETY_ANALYSIS;

  // The loss scaler's current scale (the one the next step's loss is multiplied by); 0 when the
  // session has no loss scaler.
  double loss_scale() const;
  // An asynchronous session's record of `rank`'s last push (a zero record otherwise, or for a rank
  // out of range).
  PushRecord LastPush(int rank) const;
  // The last step and the overrides it ran with beyond the groups' options (SessionState's
  // last_overrides; nullopt when not known: after a SetState, or a restore from a checkpoint of an
  // earlier version, until the next step), read together: what an attach answers, so that a
  // client's schedulers resume from the values the session last ran with.
  struct LastStepOverrides {
    int64_t step = 0;
    std::optional<std::vector<GroupOverride>> overrides;
  };
  LastStepOverrides LastOverrides() const;

  absl::StatusOr<SessionState> ExportState() const;
  // Replaces masters, slots and counters at once after checking that `state` is complete.
  // `rank` >= 0: the tensors are that rank's parts of the partitioned parameters' masters and
  // element-wise slots (StatePartOf), written into their ranges; an empty part may be absent. Every
  // rank loads its parts with the same header before its next step.
  absl::Status ImportState(SessionState state, int rank = -1);

  // Makes the session durable from now on; restored sessions attach it after their replay.
  void AttachPersistence(std::unique_ptr<SessionPersistence> persistence);
  // Writes a checkpoint now and returns its step; FAILED_PRECONDITION without a state directory.
  absl::StatusOr<int64_t> Checkpoint();
  // Closes the session: every later step, upload, SetState and checkpoint is refused (NOT_FOUND,
  // SESSION_NOT_FOUND, "was closed"), ranks waiting in a step are answered with that refusal, and the
  // session's files are removed. Calls that looked the session up before may still read it.
  void Close();
  // OK until Close; then the refusal above. Lock-free: a stream's transport asks between pieces.
  absl::Status CheckOpen() const;

 private:
  enum class StepKind { kNext, kReplay };

  // A prepared step of a sharded session, held until its commit.
  struct PreparedStep {
    StepPlan plan;                      // rank 0's, with several ranks
    std::vector<HostTensor> gradients;  // averaged over the ranks
    StepResult result;                  // the prepare's answer
    uint64_t generation = 0;            // the rank gathering that completed it (several ranks)
  };

  Session(std::string id, SessionConfig config, kernels::Backend* backend, std::string owner);

  // The one decision of what step k is: the next one, a replay of the applied one, or refused. In a
  // quorum session an earlier step is answered like a replay as well (a rank that fell behind).
  absl::StatusOr<StepKind> ClassifyLocked(int64_t step) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The answer of a replay of `request`: the last step's result and parameters, with whether the
  // asking rank's gradients of the step it sent were used.
  absl::StatusOr<StepOutcome> ReplayOutcomeLocked(const StepRequest& request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `rank`'s gradients were used by `step` (every rank's unless recorded otherwise; false
  // for a quorum step no longer remembered).
  bool IncludedLocked(int64_t step, int rank) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // A gathered step's contributors, remembered for the last kRememberedSteps steps.
  void RememberContributorsLocked(StepContributors contributors) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OK when a restored record of contributors fits the session and a state of `last_step`.
  absl::Status CheckContributors(const std::vector<StepContributors>& contributors, int64_t last_step) const;
  // What ExportState keeps of them: the remembered steps' of a session of several gathering ranks.
  std::optional<std::vector<StepContributors>> RememberedContributorsLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Which step `request` is: ClassifyLocked on the global step, or for an asynchronous session the
  // rank's next push, a resend of its last one, or refused.
  absl::StatusOr<StepKind> ClassifyRequestLocked(const StepRequest& request) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Asynchronous sessions: a resend's answer (the push's record, the latest parameters), and a new
  // push checked against the staleness bound and applied as the next global step.
  absl::StatusOr<StepOutcome> ResendOutcomeLocked(const StepRequest& request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<StepOutcome> PushLocked(StepPlan plan, std::vector<HostTensor>& gradients)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Applies a taken push: its staleness scaling, then the step; records the push.
  absl::StatusOr<StepOutcome> ApplyPushLocked(StepPlan plan, std::vector<HostTensor>& gradients)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the gathering under way, its waiting ranks answered with `why` (gather_refused_).
  void RefuseGatheringLocked(absl::Status why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A journal's push before it replays: FAILED_PRECONDITION unless it is what PushLocked made of the
  // rank's next push at the next global step (a damaged record is refused, never replayed).
  absl::Status CheckJournaledPushLocked(const StepRequest& push) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Whether the gathering of a multi-rank step can be taken now: every rank arrived, or (quorum)
  // min_ranks have and the grace time since the min_ranks-th has passed.
  // Whether the gathering step is taken now: every rank arrived, or the quorum (with every part
  // there) and its grace.
  bool GatherReadyLocked(absl::Time now) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Whether rank `rank`'s upload leaves parameter `index` as it is, every rank starting from one set of
  // values: a replicated parameter once rank 0 uploaded it (as DDP broadcasts rank 0's), an HSDP part
  // once another of its replicas did (partition.h, SameHolders). uploaded_by_rank_ sized first.
  bool KeepsUploadedValuesLocked(size_t index, int rank) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Quorum sessions: min_ranks have arrived, holding every part of every partitioned parameter.
  bool QuorumReachedLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Takes the gathering and applies (or prepares) it.
  absl::StatusOr<StepOutcome> TakeGatheredLocked(bool prepare, uint64_t generation) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reads the parameters back to the host when the snapshot is on the device (the last step's answer
  // went over a GPU transport).
  absl::Status HostSnapshotLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A multi-rank step's rank joins the gathering with its gradients and their loss scale (checked by
  // FinishStep, GradScaleLocked), and waits for the step to be taken.
  absl::StatusOr<StepOutcome> GatherLocked(StepPlan plan, std::vector<HostTensor> gradients, double grad_scale)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The gradients' squares summed in parameter order (how the step's norm is defined), and why a
  // non-finite one skips the step ("" when every one is finite).
  struct GradientTotals {
    double sum_squares = 0;
    std::string non_finite_reason;
  };
  GradientTotals TotalsOf(const std::vector<HostTensor>& gradients) const;
  // The elements of the present gradients that are exactly zero (log_num_zeros_in_grad).
  static int64_t CountZeros(const std::vector<HostTensor>& gradients);
  // Holds `gradients` as the prepared step and answers their sums of squares.
  absl::StatusOr<StepOutcome> PrepareLocked(StepPlan plan, std::vector<HostTensor> gradients, uint64_t generation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Applies the prepared step with the decision `commit` carries.
  absl::StatusOr<StepOutcome> CommitLocked(const StepPlan& commit, const std::vector<HostTensor>& gradients)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropPreparedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The step `plan`: decided, journaled (journal mode), then applied or skipped. A failure once the
  // masters began to change breaks the session (BreakLocked). Deciding (the checks, clipping and the
  // magnitude guard's reads) comes before the record; staging the gradients for the optimizer (scaled
  // by the clip coefficient in place; on a device, copied there) comes after it, and a failure there
  // withdraws the record (SessionPersistence::WithdrawStep), breaking the session only when that fails.
  absl::StatusOr<StepOutcome> ApplyLocked(const StepPlan& plan, std::vector<HostTensor>& gradients,
                                          StagedGradients* staged) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What a step will do, decided from its gradients and the state before anything changes: the
  // answer's norms, clipping and skip reason, and the bounds the state will have after it.
  struct DecidedStep {
    StepResult result;
    StepClipping clipping;
    std::vector<optim::StepBounds> bounds;  // by parameter
    double seconds = 0;                     // the time deciding took (part of compute_seconds)
  };
  absl::StatusOr<DecidedStep> DecideLocked(const StepPlan& plan, const std::vector<HostTensor>& gradients,
                                           StagedGradients* staged, double grad_scale)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ApplyLocked after the record; sets `changing` once the masters begin to change.
  absl::StatusOr<StepOutcome> ApplyRecordedLocked(const StepPlan& plan, std::vector<HostTensor>& gradients,
                                                  StagedGradients* staged, DecidedStep decided, bool& changing)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Lends the gradient buffers (`staged`'s, a set filled here from the host values, or on a
  // host-memory backend the host values themselves) to the parameters for the optimizer step and
  // takes them back afterwards, whatever happens. Each group's gradients are first multiplied by
  // its coefficient (clipping and unscaling; StepClipping). Once every gradient is in place
  // (ChangeMastersLocked) it sets `changing`: a failure before that changed no state. Each group's
  // optimizer measures its step into `telemetry` (by group; health_watch.h).
  absl::Status ApplyGradients(const StepPlan& plan, std::vector<HostTensor>& gradients,
                              const std::vector<double>& group_coefficients, StagedGradients* staged,
                              std::vector<optim::StepTelemetry>& telemetry, bool& changing)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, masters_mu_);
  absl::Status ApplyQkClip(const StepPlan& plan) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reserves the fp32 scratch QK-clip needs for the 16-bit masters of `plan`'s pairs, before the
  // step changes anything (ApplyQkClip then allocates nothing).
  absl::Status ReserveQkClipLocked(const StepPlan& plan) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The factor a step's gradients are divided by: the loss scaler's current scale, or the step's
  // grad_scale, or 1. INVALID_ARGUMENT when a step's grad_scale disagrees with the scaler.
  absl::StatusOr<double> GradScaleLocked(const StepPlan& plan) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The finiteness guard (docs/algorithms.md, Finite steps): bounds every parameter's magnitudes
  // after the step before anything is written. Fills `after` (indexed like params_) and returns
  // an empty string when the step keeps every master and slot within kMagnitudeLimit, else the
  // reason the step is not applied.
  // The largest |g| of parameter `index`'s gradient, read from the backend for one left there.
  absl::StatusOr<double> GradientMaxAbs(const HostTensor& gradient, size_t index, StagedGradients* staged) const;
  absl::StatusOr<std::string> GuardMagnitudesLocked(const StepPlan& plan, const std::vector<HostTensor>& gradients,
                                                    StagedGradients* staged,
                                                    const std::vector<double>& group_coefficients,
                                                    std::vector<optim::StepBounds>& after)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Replaces parameter i's bounds with its exact magnitudes, read from the backend.
  absl::Status MeasureMagnitudesLocked(size_t i) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The snapshot answers read after `step`: views of the fp32 masters on a host-memory backend,
  // else (and for 16-bit masters) host copies. Called with masters_mu_ held for writing (the masters just changed).
  absl::StatusOr<std::shared_ptr<const ParameterSnapshot>> ReadBack(int64_t step) const ABSL_SHARED_LOCKS_REQUIRED(mu_)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(masters_mu_);
  absl::StatusOr<SessionState> ExportStateLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::Status CheckpointLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After an upload or SetState changed the state: its checkpoint, or UNAVAILABLE (FAILED_PRECONDITION
  // for a checkpoint that can never be written) saying the state is in place but not saved (unsaved_
  // set: steps wait for a checkpoint that succeeds, and ranks waiting in one are refused).
  absl::Status SaveReplacedStateLocked(absl::string_view what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FAILED_PRECONDITION while unsaved_ is set.
  absl::Status UnsavedLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // FAILED_PRECONDITION while broken_ is set.
  absl::Status BrokenLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Marks the state as no step's: step `step` failed with `why` after it began changing it; or, with
  // `not_withdrawn` an error, before it changed anything, but its journal record could not be
  // withdrawn (SessionPersistence::WithdrawStep) and a restart would apply it.
  void BreakLocked(int64_t step, const absl::Status& why, bool journaled,
                   const absl::Status& not_withdrawn = absl::OkStatus()) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks the state as no step's: a SetState (or, with `upload`, an upload) failed after it began
  // replacing it (a device copy, an allocation, the read-back), leaving some tensors or counts
  // replaced and others not. Steps wait for that load or upload to be sent again and succeed.
  void BreakByReplacementLocked(bool upload) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What stops any step from being applied now: CheckOpen(), then UnsavedLocked(), then BrokenLocked().
  absl::Status RefusesStepsLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Ranks that loaded a state of this step and counts before `rank` in the load it would join, and
  // hold some of the same elements (the HSDP replicas of its shard; every rank, for a parameter held
  // whole), have written their values: empty when `rank`'s equal them once rounded to storage, else
  // the first difference, in words.
  absl::StatusOr<std::string> DifferenceFromLoadedLocked(int rank, const SessionState& state) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The whole element count of a parameter's master (kMasterSlot) or of one of its optimizer slots.
  size_t StateNumelLocked(size_t parameter, const std::string& slot) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::Status NotInitializedError() const;
  // Before the masters change: leaves every reader of the current masters (none is held) a copy of
  // what it has not finished (ParameterReader), those that need least first, while all the copies
  // fit in the parameters' fp32 bytes; the others are replaced. Then counts the change.
  void ChangeMastersLocked() ABSL_SHARED_LOCKS_REQUIRED(mu_) ABSL_EXCLUSIVE_LOCKS_REQUIRED(masters_mu_);
  friend class ParameterReader;

  const std::string id_;
  const std::string owner_;
  const SessionConfig config_;
  const int64_t state_bytes_;
  const uint64_t serial_;
  kernels::Backend* const backend_;
  std::vector<optim::StepHyper> default_hyper_;    // per group; set by Create, immutable afterwards
  std::unique_ptr<GradientPool> gradient_pool_;    // set by Create; thread-safe itself
  std::unique_ptr<HostGradients> host_gradients_;  // set by Create; thread-safe itself

  mutable absl::Mutex mu_;
  // Held for writing (after mu_) whenever the masters change (ChangeMastersLocked), and for reading
  // by every answer while it encodes from views of them (a held ParameterReader); masters_version_
  // counts the changes.
  mutable absl::Mutex masters_mu_ ABSL_ACQUIRED_AFTER(mu_);
  uint64_t masters_version_ ABSL_GUARDED_BY(masters_mu_) = 0;
  // The readers alive, held or not: a writer leaves those of the current masters a copy first, all
  // their copies together within the parameters' fp32 bytes (answer_copy_bytes_ counts them).
  mutable absl::Mutex readers_mu_ ABSL_ACQUIRED_AFTER(masters_mu_);
  mutable absl::flat_hash_set<ParameterReader::Registration*> readers_ ABSL_GUARDED_BY(readers_mu_);
  mutable int64_t answer_copy_bytes_ ABSL_GUARDED_BY(readers_mu_) = 0;
  std::vector<std::unique_ptr<optim::Optimizer>> optimizers_ ABSL_GUARDED_BY(mu_);  // per group
  std::vector<optim::ParamState> params_ ABSL_GUARDED_BY(mu_);
  bool initialized_ ABSL_GUARDED_BY(mu_) = false;
  // By rank: it uploaded its parts (all set by a whole upload or a loaded or restored state); read by
  // KeepsUploadedValuesLocked.
  std::vector<bool> uploaded_by_rank_ ABSL_GUARDED_BY(mu_);
  int64_t last_step_ ABSL_GUARDED_BY(mu_) = 0;
  StepResult last_result_ ABSL_GUARDED_BY(mu_);
  // Whether last_result_ says how the last step went: false after a SetState, or a restore from a
  // checkpoint of an earlier version, until the next step (a resent sharded prepare is then refused).
  bool last_decision_known_ ABSL_GUARDED_BY(mu_) = true;
  std::optional<std::vector<GroupOverride>> last_overrides_ ABSL_GUARDED_BY(mu_) = std::vector<GroupOverride>();
  // Mutable: an on-device snapshot is replaced by its host copy when first read (HostSnapshotLocked).
  mutable std::shared_ptr<const ParameterSnapshot> snapshot_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<SessionPersistence> persistence_ ABSL_GUARDED_BY(mu_);
  // Why the state an upload or SetState put in place could not be checkpointed; empty once a
  // checkpoint succeeds. While set, no step is applied: its journal record would follow records of the
  // state replaced, which is what a restart would restore (UnsavedLocked).
  std::string unsaved_ ABSL_GUARDED_BY(mu_);
  // Why the state is no step's: a step failed after it began changing it (its journal record written,
  // or some groups' masters updated), and a resend would apply it again on top; or a SetState or an
  // upload failed halfway. While set, no step is applied and no state exported (GetState,
  // checkpoints) until ImportState (or an upload before the first step) replaces it; a restart
  // restores the state directory's (with the journal, through the failed step). Empty when sound.
  std::string broken_ ABSL_GUARDED_BY(mu_);
  // Set under mu_ by Close; read without it by CheckOpen (a transport between pieces of a stream).
  std::atomic<bool> closed_ = false;
  RankGather gather_ ABSL_GUARDED_BY(mu_);
  // The gathering last refused as a whole (a load under way, parts that disagree, a state replaced
  // or not saved under it), and why: the ranks that waited in it are answered with that refusal.
  std::pair<uint64_t, absl::Status> gather_refused_ ABSL_GUARDED_BY(mu_);
  PartLoad part_load_ ABSL_GUARDED_BY(mu_);       // a state partitioned ranks load part by part
  HealthWatch health_ ABSL_GUARDED_BY(mu_);       // telemetry and health warnings, step to step
  std::atomic<int64_t> health_reported_step_{0};  // ClaimHealthReport's last step
  mutable absl::Mutex activity_mu_;               // guards activity_ alone; taken after nothing
  Activity activity_ ABSL_GUARDED_BY(activity_mu_);
  // Asynchronous sessions: each rank's last push (its number, the global step it became and its
  // staleness), by rank; checkpointed (SessionState::pushes).
  std::vector<PushRecord> pushes_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, StepContributors> contributors_ ABSL_GUARDED_BY(mu_);  // by step, the last kRememberedSteps
  // The dynamic loss scaler's state, for a session whose spec has one; advanced by every applied
  // or skipped step (optim::UpdateLossScale), exported with the state.
  std::optional<optim::LossScalerState> loss_scaler_ ABSL_GUARDED_BY(mu_);
  // QK-clip's fp32 scratch for 16-bit query and key masters (lanes 0 and 1); empty otherwise.
  optim::StagingArea qk_staging_ ABSL_GUARDED_BY(mu_);
  std::optional<PreparedStep> prepared_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muond::session
