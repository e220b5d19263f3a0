// Session: the step — classifying it (next, replay or refused), beginning it (the plan, staged
// gradient buffers), finishing it (replay, gather of several ranks, prepare and commit of a sharded
// step, apply) and the journaled steps of a restore. The update itself is in session_update.cc.
// See session.h.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/error_reason.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/session/partition.h"
#include "server/session/session.h"
#include "server/session/value_rules.h"

namespace muond::session {

absl::StatusOr<Session::StepKind> Session::ClassifyLocked(int64_t step) const {
  if (step == last_step_ && last_step_ > 0) return StepKind::kReplay;
  // A rank of a quorum session that fell behind: answered with where the session is.
  if (config_.sync.mode == SyncMode::kQuorum && step >= 1 && step < last_step_) return StepKind::kReplay;
  if (step == last_step_ + 1) return StepKind::kNext;
  return absl::FailedPreconditionError(absl::StrCat(
      "header.step: expected step ", last_step_ + 1,
      last_step_ > 0 ? absl::StrCat(" (or ", last_step_, " to replay the last one)") : std::string(), ", got ", step));
}

absl::StatusOr<Session::StepKind> Session::ClassifyRequestLocked(const StepRequest& request) const {
  // A number no session ever reaches is the request's fault, whatever step the session is at.
  MUOND_RETURN_IF_ERROR(CheckStepNumber("header.step", request.step, 1));
  if (config_.sync.mode != SyncMode::kAsync) return ClassifyLocked(request.step);
  if (request.rank < 0 || request.rank >= config_.world_size) return StepKind::kNext;  // PlanStep refuses it
  const PushRecord& last = pushes_[request.rank];
  // A rank's pushes are numbered 1, 2, … and each was taken (applied, or skipped) before the next
  // could be: any number up to the record's is a resend.
  if (request.step >= 1 && request.step <= last.push) return StepKind::kReplay;
  if (request.step == last.push + 1) return StepKind::kNext;
  return absl::FailedPreconditionError(absl::StrCat(
      "header.step: rank ", request.rank, "'s next push is ", last.push + 1,
      last.push > 0 ? absl::StrCat(" (or 1 to ", last.push, " to resend one already taken)") : std::string(), ", got ",
      request.step));
}

absl::StatusOr<StepOutcome> Session::ResendOutcomeLocked(const StepRequest& request) {
  if (!request.device_answer) MUOND_RETURN_IF_ERROR(HostSnapshotLocked());
  const PushRecord& record = pushes_[request.rank];
  // The session's latest parameters and step, with the outcome of the push resent as far as the
  // record knows it; the measurements of the step (norms, clipping, telemetry) are not kept.
  StepResult result;
  result.step = last_result_.step;
  result.loss_scale = last_result_.loss_scale;
  result.replayed = true;
  result.included = true;
  result.contributors = {request.rank};
  if (request.step == record.push) {
    result.applied = record.applied;
    result.skip_reason = record.skip_reason;
    result.global_step = record.global_step;
    result.staleness = record.staleness;
  } else {
    result.applied = false;
    result.skip_reason = absl::StrCat("push ", request.step, " was taken before rank ", request.rank, "'s push ",
                                      record.push, "; its outcome is not kept, and nothing was applied now");
  }
  return StepOutcome{std::move(result), snapshot_};
}

absl::StatusOr<StepOutcome> Session::PushLocked(StepPlan plan, std::vector<HostTensor>& gradients) {
  const std::optional<int64_t>& base = plan.request.base_step;
  if (!base.has_value()) {
    return absl::InvalidArgumentError(
        "header.base_step: required in an asynchronous session (the global step the gradients were computed on)");
  }
  if (*base < 0 || *base > last_step_) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.base_step: must be in [0, ", last_step_, "] (the session's global step), got ", *base));
  }
  const int64_t staleness = last_step_ - *base;
  if (staleness > config_.sync.max_staleness) {
    return WithReason(absl::FailedPreconditionError(absl::StrCat(
                          "header.base_step: ", *base, " is ", staleness, " global steps behind ", last_step_,
                          ", more than max_staleness ", config_.sync.max_staleness,
                          "; nothing was applied: read the parameters again (GetParameters) and push with the "
                          "new base_step")),
                      ErrorReason::kPushTooStale);
  }
  plan.request.global_step = last_step_ + 1;
  plan.request.staleness = staleness;
  plan.request.contributors = {plan.request.rank};
  plan.request.total_weight = plan.request.weight;
  return ApplyPushLocked(std::move(plan), gradients);
}

absl::StatusOr<StepOutcome> Session::ApplyPushLocked(StepPlan plan, std::vector<HostTensor>& gradients) {
  if (config_.sync.staleness_scaling != StalenessScaling::kNone) {
    const double factor = StalenessFactor(config_.sync, plan.request.staleness);
    for (optim::StepHyper& hyper : plan.hyper) hyper.lr *= factor;
  }
  MUOND_ASSIGN_OR_RETURN(StepOutcome outcome, ApplyLocked(plan, gradients, nullptr));  // records the push
  outcome.result.global_step = plan.request.global_step;
  outcome.result.staleness = plan.request.staleness;
  last_result_.global_step = outcome.result.global_step;
  last_result_.staleness = outcome.result.staleness;
  return outcome;
}

absl::StatusOr<StepOutcome> Session::ReplayOutcomeLocked(const StepRequest& request) {
  if (!last_decision_known_ && config_.shard.count > 0 && request.phase == StepPhase::kPrepare) {
    // The other shards would take the decision from this answer: none rather than a made-up one.
    return absl::FailedPreconditionError(absl::StrCat(
        "header.step: step ", request.step, " is this shard's last step, but how it went is not known here (its ",
        "state was loaded by SetState, or restored from a checkpoint of an earlier version); load the same state ",
        "into every shard and go on from step ", request.step + 1));
  }
  if (!request.device_answer) MUOND_RETURN_IF_ERROR(HostSnapshotLocked());
  StepOutcome replay{last_result_, snapshot_};
  replay.result.replayed = true;
  replay.result.included = IncludedLocked(request.step, request.rank);
  return replay;
}

bool Session::IncludedLocked(int64_t step, int rank) const {
  if (config_.world_size == 1) return true;  // its one rank takes every step alone
  auto it = contributors_.find(step);
  if (it == contributors_.end()) return config_.sync.mode != SyncMode::kQuorum;
  return std::binary_search(it->second.ranks.begin(), it->second.ranks.end(), rank);
}

void Session::RememberContributorsLocked(StepContributors contributors) {
  const int64_t step = contributors.step;
  contributors_[step] = std::move(contributors);
  while (contributors_.size() > kRememberedSteps) contributors_.erase(contributors_.begin());
}

std::optional<std::vector<StepContributors>> Session::RememberedContributorsLocked() const {
  if (config_.world_size == 1 || config_.sync.mode == SyncMode::kAsync) return std::nullopt;  // one rank a step
  std::vector<StepContributors> out;
  for (const auto& [step, contributors] : contributors_) {
    if (step <= last_step_) out.push_back(contributors);
  }
  return out;
}

absl::StatusOr<std::unique_ptr<IncomingStep>> Session::BeginStep(StepRequest request) {
  StepKind kind;
  bool journaled = false;
  {
    absl::ReaderMutexLock lock(&mu_);
    MUOND_RETURN_IF_ERROR(CheckOpen());  // a replay too: the session is gone
    if (!initialized_) return NotInitializedError();
    MUOND_ASSIGN_OR_RETURN(kind, ClassifyRequestLocked(request));
    if (kind == StepKind::kNext) MUOND_RETURN_IF_ERROR(UnsavedLocked());
    MUOND_RETURN_IF_ERROR(BrokenLocked());  // a replay too: its answer would read half a step
    journaled = persistence_ != nullptr && persistence_->records_gradients();
  }
  MUOND_ASSIGN_OR_RETURN(StepPlan plan, PlanStep(config_, default_hyper_, std::move(request)));
  // One rank's gradients go straight to the backend while the rest of them arrive (unless another
  // step of the session holds the buffers, or the backend's memory is the host's and the optimizer
  // reads the decoded values in place); the ranks of a multi-rank session are averaged on the host
  // first, and a replay needs no gradients at all.
  // A prepared step is held across calls until its commit: it stays on the host, and a commit
  // carries no gradients at all.
  std::unique_ptr<StagedGradients> staged;
  const StepPhase phase = plan.request.phase;
  const bool one_rank = kind == StepKind::kNext && config_.world_size == 1 && phase != StepPhase::kCommit &&
                        config_.sync.mode != SyncMode::kAsync;
  if (one_rank && phase == StepPhase::kWhole && !backend_->HostAddressable()) {
    MUOND_ASSIGN_OR_RETURN(staged, StagedGradients::Start(gradient_pool_.get(), backend_));
  }
  // Gradients in device memory may stay there unless something needs their values on the host.
  const bool device_gradients = !journaled && !plan.request.count_zeros;
  return std::make_unique<IncomingStep>(*this, default_hyper_, std::move(plan), kind == StepKind::kReplay,
                                        one_rank ? host_gradients_.get() : nullptr, std::move(staged),
                                        device_gradients);
}

absl::StatusOr<double> Session::GradScaleLocked(const StepPlan& plan) const {
  const std::optional<double>& given = plan.request.grad_scale;
  if (!loss_scaler_.has_value()) return given.value_or(1.0);
  if (given.has_value() && *given != loss_scaler_->scale) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.grad_scale: ", *given, " differs from the session loss scaler's current scale ", loss_scaler_->scale,
        " (the last step answer's loss_scale): scale the loss by that, or leave grad_scale unset"));
  }
  return loss_scaler_->scale;
}

absl::StatusOr<StepOutcome> Session::FinishStep(std::unique_ptr<IncomingStep> step) {
  MUOND_RETURN_IF_ERROR(step->FinishStaging(*backend_));
  absl::MutexLock lock(&mu_);
  MUOND_RETURN_IF_ERROR(CheckOpen());  // closed since BeginStep
  MUOND_RETURN_IF_ERROR(BrokenLocked());
  // The state may have moved since BeginStep (another stream of the same step, say): classify again
  // under the lock, where the answer holds until the step is applied.
  StepPlan& plan = step->mutable_plan();
  MUOND_ASSIGN_OR_RETURN(StepKind kind, ClassifyRequestLocked(plan.request));
  if (step->replay() && kind != StepKind::kReplay) {
    // Begun as a replay, so its gradients were not read; a SetState rewound the session since.
    return absl::AbortedError(absl::StrCat("step ", plan.request.step,
                                           ": the session's state was replaced while this step was read (SetState); "
                                           "nothing was applied: send the step again"));
  }
  const StepPhase phase = plan.request.phase;
  const bool async = config_.sync.mode == SyncMode::kAsync;
  if (async) {
    MUOND_RETURN_IF_ERROR(GradScaleLocked(plan).status());
    if (kind == StepKind::kReplay) return ResendOutcomeLocked(plan.request);
    return PushLocked(std::move(plan), step->gradients());
  }
  if (kind == StepKind::kReplay) {
    MUOND_ASSIGN_OR_RETURN(StepOutcome replay, ReplayOutcomeLocked(plan.request));
    if (phase == StepPhase::kPrepare) replay.parameters = nullptr;  // a prepare answers without parameters
    return replay;
  }
  if (phase == StepPhase::kCommit) return CommitLocked(plan, step->gradients());
  // Each rank's grad_scale against the loss scaler before it joins the others (each rank's gradients
  // are brought to the lowest rank's scale when averaged, and that scale is divided out).
  MUOND_ASSIGN_OR_RETURN(const double grad_scale, GradScaleLocked(plan));
  if (config_.world_size > 1) return GatherLocked(std::move(plan), std::move(step->gradients()), grad_scale);
  if (phase == StepPhase::kPrepare) return PrepareLocked(std::move(plan), std::move(step->gradients()), 0);
  return ApplyLocked(plan, step->gradients(), step->staged());
}

absl::StatusOr<StepOutcome> Session::PrepareLocked(StepPlan plan, std::vector<HostTensor> gradients,
                                                   uint64_t generation) {
  StepResult result;
  result.step = plan.request.step;
  result.prepared = true;
  MUOND_ASSIGN_OR_RETURN(const double grad_scale, GradScaleLocked(plan));
  const double unscale = 1.0 / grad_scale;
  if (plan.request.count_zeros) result.num_zeros_in_grad = CountZeros(gradients);
  // The sums of squares of the unscaled gradients: the client adds them up into the global norm.
  for (const HostTensor& gradient : gradients) result.sum_squares.push_back(gradient.sum_squares * unscale * unscale);
  const GradientTotals totals = TotalsOf(gradients);
  // A sharded session's groups are all of clip_scope global (the spec codec refuses others there).
  const StepClipping clipping = PlanClipping(config_, plan, gradients, unscale, std::nullopt);
  result.grad_norm = clipping.global_norm;  // this shard's part of the norm
  result.skip_reason = totals.non_finite_reason;
  result.loss_scale = loss_scaler_.has_value() ? loss_scaler_->scale : 0.0;
  if (result.skip_reason.empty()) {
    // The magnitude guard with this shard's own norm: the global norm is at least as large, so its
    // clipping only shrinks the update, and a step this guard passes passes at the commit too.
    std::vector<optim::StepBounds> bounds(params_.size());
    MUOND_ASSIGN_OR_RETURN(result.skip_reason,
                           GuardMagnitudesLocked(plan, gradients, nullptr, clipping.coefficients, bounds));
  }
  DropPreparedLocked();
  prepared_ = PreparedStep{std::move(plan), std::move(gradients), result, generation};
  return StepOutcome{result, nullptr};
}

absl::StatusOr<StepOutcome> Session::CommitLocked(const StepPlan& commit, const std::vector<HostTensor>& gradients) {
  for (size_t i = 0; i < gradients.size(); ++i) {
    if (gradients[i].present()) {
      return absl::InvalidArgumentError(absl::StrCat("header.num_chunks: a commit carries no gradients ('",
                                                     config_.parameters[i].name,
                                                     "' came with it); they come with the prepare"));
    }
  }
  const int64_t step = commit.request.step;
  if (!prepared_.has_value() || prepared_->plan.request.step != step) {
    const std::string held =
        prepared_.has_value() ? absl::StrCat("step ", prepared_->plan.request.step, " is") : std::string("nothing is");
    absl::Status refused = absl::FailedPreconditionError(
        absl::StrCat("header.step: step ", step, " was not prepared on this shard (", held,
                     "; a restarted daemon holds no prepared step): prepare it again on every shard, then commit"));
    return WithReason(std::move(refused), ErrorReason::kStepNotPrepared);
  }
  // The global norm over every shard is at least this shard's own (up to the rounding of a sum in
  // another order): a decision below it was not summed from this shard's prepare, and applying it
  // would clip this shard unlike the others.
  const double own = prepared_->result.grad_norm;
  if (const std::optional<ShardDecision>& decision = commit.request.decision;
      decision.has_value() && decision->skip_reason.empty() && std::isfinite(own) &&
      decision->grad_norm < own * (1 - 1e-9)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.decision.grad_norm: ", decision->grad_norm, " is below this shard's own gradient norm ", own,
        " for step ", step, "; the global norm sums every shard's prepare answer (nothing was applied)"));
  }
  // The prepare's plan (rank 0's overrides, clipping limit and QK-clip logits) with the decision.
  StepPlan plan = prepared_->plan;
  plan.request.phase = StepPhase::kCommit;
  plan.request.decision = commit.request.decision;
  plan.request.count_zeros = plan.request.count_zeros || commit.request.count_zeros;
  absl::StatusOr<StepOutcome> outcome = ApplyLocked(plan, prepared_->gradients, nullptr);
  // Applied or not, the held gradients are spent (the optimizer may have clipped them in place): a
  // failed commit is prepared again.
  DropPreparedLocked();
  return outcome;
}

void Session::DropPreparedLocked() {
  if (!prepared_.has_value()) return;
  host_gradients_->GiveBack(std::move(prepared_->gradients));
  prepared_.reset();
}

absl::Status Session::CheckJournaledPushLocked(const StepRequest& push) const {
  // The record must be what PushLocked made of the push when it was taken (a record altered on
  // disk would otherwise replay with another learning rate, numbering or outcome).
  const std::string what = absl::StrCat("rank ", push.rank, "'s push ", push.step, " recorded as global step ",
                                        push.global_step, " with staleness ", push.staleness);
  if (push.global_step != last_step_ + 1) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": it does not follow global step ", last_step_));
  }
  if (push.step != pushes_[push.rank].push + 1) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": the rank's last push was ", pushes_[push.rank].push));
  }
  const int64_t base = push.base_step.value_or(-1);
  if (base < 0 || base > last_step_ || push.staleness != last_step_ - base ||
      push.staleness > config_.sync.max_staleness) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": its base_step ", base,
                                                      " does not give that staleness within max_staleness ",
                                                      config_.sync.max_staleness));
  }
  if (push.contributors != std::vector<int>{push.rank} || push.total_weight != push.weight) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": its contributors or total weight are not its own"));
  }
  return absl::OkStatus();
}

absl::StatusOr<StepOutcome> Session::ApplyJournaledStep(StepRequest request, std::vector<HostTensor> gradients) {
  NormalizeJournaledRequest(config_, request);  // a record of an earlier muond, as that daemon applied it
  MUOND_ASSIGN_OR_RETURN(StepPlan plan, PlanStep(config_, default_hyper_, std::move(request)));
  absl::MutexLock lock(&mu_);
  if (config_.sync.mode == SyncMode::kAsync) {
    // Replayed in the recorded global order, each push with the staleness it had.
    MUOND_RETURN_IF_ERROR(CheckJournaledPushLocked(plan.request));
    return ApplyPushLocked(std::move(plan), gradients);
  }
  MUOND_ASSIGN_OR_RETURN(StepKind kind, ClassifyLocked(plan.request.step));
  if (kind != StepKind::kNext) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", plan.request.step, " was applied already (last step ", last_step_, ")"));
  }
  return ApplyLocked(plan, gradients, nullptr);
}

bool Session::GatherReadyLocked(absl::Time now) const {
  if (gather_.complete()) return true;
  return QuorumReachedLocked() &&
         now >= gather_.reached(config_.sync.min_ranks) + absl::Seconds(config_.sync.grace_seconds);
}

bool Session::QuorumReachedLocked() const {
  // HSDP replicas (partition.replicas) may be left out of a quorum step, but every shard must be there.
  return config_.sync.mode == SyncMode::kQuorum && gather_.arrived() >= config_.sync.min_ranks &&
         gather_.CoversParts(config_);
}

void Session::RefuseGatheringLocked(absl::Status why) {
  gather_refused_ = {gather_.generation(), std::move(why)};
  gather_.Abort();
}

absl::StatusOr<StepOutcome> Session::TakeGatheredLocked(bool prepare, uint64_t generation) {
  auto [applied_plan, mean] = gather_.TakeAverage(config_);
  absl::StatusOr<StepOutcome> outcome = prepare ? PrepareLocked(std::move(applied_plan), std::move(mean), generation)
                                                : ApplyLocked(applied_plan, mean, nullptr);
  // The other ranks of the gathering are answered why (the step or its prepare refused, or the
  // session broken by it), not only that nothing was applied.
  if (!outcome.ok()) gather_refused_ = {generation, broken_.empty() ? outcome.status() : BrokenLocked()};
  return outcome;
}

absl::StatusOr<StepOutcome> Session::GatherLocked(StepPlan plan, std::vector<HostTensor> gradients, double grad_scale) {
  const int64_t step = plan.request.step;
  const int rank = plan.request.rank;
  const bool prepare = plan.request.phase == StepPhase::kPrepare;
  // A rank's part of a partitioned parameter is a piece of the gradient, not a whole one: refused
  // here, before it joins, so the others' step is still to come.
  MUOND_RETURN_IF_ERROR(CheckRankParts(config_, rank, gradients));
  const absl::Time arrived_at = absl::Now();
  const uint64_t generation = gather_.Add(std::move(plan), std::move(gradients), grad_scale, arrived_at);
  const uint64_t send = gather_.last_send();
  const int64_t last_step_before = last_step_;
  const absl::Time straggler_deadline = arrived_at + absl::Seconds(config_.straggler_timeout_seconds);
  MUOND_LOG(debug, "session {}: step {} has {} of {} ranks; rank {} waits up to {} s for the rest", id_, step,
            gather_.arrived(), config_.world_size, rank, config_.straggler_timeout_seconds);
  // Waits for: the step taken by another rank (or aborted), another rank arriving (which may
  // complete the step or reach the quorum), or the next deadline — the quorum's grace or, below the
  // quorum, this rank's straggler timeout.
  for (;;) {
    if (GatherReadyLocked(absl::Now())) {
      // Refused as a whole: nothing applied, every rank that waited in it answered with the reason.
      absl::Status refused = part_load_.CheckStep(step);
      if (refused.ok()) refused = gather_.CheckParts(config_);
      if (!refused.ok()) {
        RefuseGatheringLocked(refused);
        return refused;
      }
      MUOND_ASSIGN_OR_RETURN(StepOutcome outcome, TakeGatheredLocked(prepare, generation));
      // This rank arrived: the step used its gradients, unless it sent the step again meanwhile.
      outcome.result.included = !gather_.Superseded(generation, rank, send);
      return outcome;
    }
    const int arrived = gather_.arrived();
    auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return last_step_ != last_step_before || gather_.generation() != generation || gather_.arrived() != arrived;
    };
    const bool quorum_reached = QuorumReachedLocked();
    const absl::Time deadline =
        quorum_reached ? gather_.reached(config_.sync.min_ranks) + absl::Seconds(config_.sync.grace_seconds)
                       : straggler_deadline;
    mu_.AwaitWithDeadline(absl::Condition(&changed), deadline);
    if (last_step_ != last_step_before || gather_.generation() != generation) break;  // taken or aborted
    if (!quorum_reached && gather_.arrived() == arrived && absl::Now() >= straggler_deadline) break;
  }
  // Refused or aborted as a whole (a SetState may also have moved last_step_ past the step).
  if (gather_.generation() != generation && gather_refused_.first == generation && !gather_refused_.second.ok()) {
    return gather_refused_.second;
  }
  if (last_step_ >= step) {
    StepOutcome outcome{last_result_, prepare ? nullptr : snapshot_};
    // A send whose gradients the rank replaced by sending the step again while it waited was not used.
    outcome.result.included = IncludedLocked(step, rank) && !gather_.Superseded(generation, rank, send);
    // A sharded step another rank prepared for every rank and then committed while this rank's
    // prepare waited: answered as a prepare after the commit is, with the decision the shard applied
    // (replayed), so this rank's decision is that one and not one summed from a commit's result.
    if (prepare) outcome.result.replayed = true;
    return outcome;
  }
  if (prepare && prepared_.has_value() && prepared_->generation == generation) {
    return StepOutcome{prepared_->result, nullptr};  // the last rank prepared the step for every rank
  }
  if (gather_.generation() != generation) {
    return absl::AbortedError(absl::StrCat("step ", step, " was aborted for every rank; no update was applied"));
  }
  // This rank timed out first: abort the step for everyone.
  const std::vector<int> missing = gather_.Abort();
  MUOND_EVENT(warn, "step_aborted", id_, step, "session {}: step {} aborted, ranks {} did not arrive within {} s", id_,
              step, absl::StrJoin(missing, ", "), config_.straggler_timeout_seconds);
  return absl::AbortedError(absl::StrCat("step ", step, ": ranks ", absl::StrJoin(missing, ", "),
                                         " did not arrive within ", config_.straggler_timeout_seconds,
                                         " s (--straggler-timeout); no update was applied, send the step again"));
}

absl::StatusOr<StepOutcome> Session::ApplyLocked(const StepPlan& plan, std::vector<HostTensor>& gradients,
                                                 StagedGradients* staged) {
  MUOND_ASSIGN_OR_RETURN(const double grad_scale, GradScaleLocked(plan));
  MUOND_RETURN_IF_ERROR(ReserveQkClipLocked(plan));  // scratch first: nothing after may fail to allocate
  // A step that is not applied answers with the parameters as they are: on the host, for a transport
  // that answers from there, even when the last step's answer left them on the device.
  if (!plan.request.device_answer) MUOND_RETURN_IF_ERROR(HostSnapshotLocked());
  // The step is durable (journal mode) before it changes anything, and journaled only on a saved state
  // of a session still open.
  MUOND_RETURN_IF_ERROR(RefusesStepsLocked());
  // Decided before the record: a failure here (reading the state's magnitudes) refuses this step
  // alone, with nothing journaled and nothing changed.
  MUOND_ASSIGN_OR_RETURN(DecidedStep decided, DecideLocked(plan, gradients, staged, grad_scale));
  if (persistence_) MUOND_RETURN_IF_ERROR(persistence_->RecordStep(plan.request, gradients));
  // From here a failure leaves a state that is no step's once the masters began to change. One
  // before that (putting the gradients where the optimizer reads them: a device copy, an allocation)
  // changed nothing: in journal mode its record is withdrawn, since a restart would apply it and a
  // resend would be recorded twice, and the step is refused alone; a record that cannot be withdrawn
  // breaks the session.
  const bool journaled = persistence_ != nullptr && persistence_->records_gradients();
  bool changing = false;
  absl::StatusOr<StepOutcome> outcome = ApplyRecordedLocked(plan, gradients, staged, std::move(decided), changing);
  if (outcome.ok()) return outcome;
  const int64_t step = GlobalStepOf(plan.request);
  if (changing) {
    BreakLocked(step, outcome.status(), journaled);
  } else if (journaled) {
    if (absl::Status withdrawn = persistence_->WithdrawStep(); !withdrawn.ok()) {
      BreakLocked(step, outcome.status(), journaled, withdrawn);
    } else {
      MUOND_EVENT(warn, "step_withdrawn", id_, step,
                  "session {}: step {} failed before it changed the state ({}); its journal record was withdrawn", id_,
                  step, outcome.status().message());
    }
  }
  return outcome;
}

absl::StatusOr<Session::DecidedStep> Session::DecideLocked(const StepPlan& plan,
                                                           const std::vector<HostTensor>& gradients,
                                                           StagedGradients* staged, double grad_scale) {
  const auto start = std::chrono::steady_clock::now();
  DecidedStep decided;
  StepResult& result = decided.result;
  result.step = GlobalStepOf(plan.request);
  // Counted before the optimizer runs (on the CPU backend it reads, and may scale, these in place).
  if (plan.request.count_zeros) result.num_zeros_in_grad = CountZeros(gradients);
  const GradientTotals totals = TotalsOf(gradients);
  // A commit clips with the global norm over every shard (already unscaled: the prepares answered
  // unscaled sums) and skips when any shard must. The gradients are multiplied once, by the clip
  // coefficient over the loss scale.
  const std::optional<ShardDecision>& decision = plan.request.decision;
  const double unscale = 1.0 / grad_scale;
  decided.clipping = PlanClipping(config_, plan, gradients, unscale,
                                  decision.has_value() ? std::optional<double>(decision->grad_norm) : std::nullopt);
  const StepClipping& clipping = decided.clipping;
  result.grad_norm = clipping.global_norm;
  for (size_t g = 0; g < config_.groups.size(); ++g) {
    result.group_clips.push_back({config_.groups[g].name, clipping.group_norms[g], clipping.clipped[g]});
  }
  decided.bounds.resize(params_.size());
  if (!totals.non_finite_reason.empty()) {
    result.skip_reason = totals.non_finite_reason;
  } else if (decision.has_value() && !decision->skip_reason.empty()) {
    result.skip_reason = decision->skip_reason;
  } else {
    MUOND_ASSIGN_OR_RETURN(result.skip_reason,
                           GuardMagnitudesLocked(plan, gradients, staged, clipping.coefficients, decided.bounds));
  }
  result.applied = result.skip_reason.empty();
  decided.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return decided;
}

absl::StatusOr<StepOutcome> Session::ApplyRecordedLocked(const StepPlan& plan, std::vector<HostTensor>& gradients,
                                                         StagedGradients* staged, DecidedStep decided, bool& changing) {
  const auto start = std::chrono::steady_clock::now();
  StepResult& result = decided.result;
  const StepClipping& clipping = decided.clipping;
  const std::vector<optim::StepBounds>& bounds = decided.bounds;
  if (result.applied) {
    absl::MutexLock masters(&masters_mu_);  // waits for answers still reading the masters
    std::vector<optim::StepTelemetry> telemetry;
    MUOND_RETURN_IF_ERROR(ApplyGradients(plan, gradients, clipping.coefficients, staged, telemetry, changing));
    std::vector<bool> has_gradient(gradients.size());
    for (size_t i = 0; i < gradients.size(); ++i) has_gradient[i] = gradients[i].present();
    health_.Observe(config_, clipping, has_gradient, telemetry, result);
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!gradients[i].present()) continue;
      params_[i].master_bound = bounds[i].master;
      for (size_t s = 0; s < params_[i].slots.size(); ++s) params_[i].slots[s].bound = bounds[i].slots[s];
    }
    MUOND_RETURN_IF_ERROR(ApplyQkClip(plan));  // multiplies weights by factors <= 1: bounds hold
    if (plan.request.device_answer && config_.world_size == 1 && !backend_->HostAddressable()) {
      auto on_device = std::make_shared<ParameterSnapshot>();
      on_device->step = result.step;
      on_device->on_device = true;
      on_device->generation = masters_version_;
      snapshot_ = std::move(on_device);
    } else {
      MUOND_ASSIGN_OR_RETURN(snapshot_, ReadBack(result.step));
    }
  }
  if (loss_scaler_.has_value()) {
    // A skipped step is an overflow for the scaler (a non-finite gradient, or one so large the
    // update would leave fp32's range), as Megatron-Core's found_inf.
    optim::UpdateLossScale(*config_.loss_scaler, !result.applied, *loss_scaler_);
    result.loss_scale = loss_scaler_->scale;
  }
  result.compute_seconds =
      decided.seconds + std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.contributors = plan.request.contributors;
  result.total_weight = plan.request.total_weight;
  if (result.contributors.empty()) {  // one rank, or a record from before contributors were kept
    for (int r = 0; r < config_.world_size; ++r) result.contributors.push_back(r);
    result.total_weight = config_.world_size == 1 ? plan.request.weight : config_.world_size;
  }
  RememberContributorsLocked(StepContributors{result.step, result.contributors, result.total_weight});
  last_step_ = result.step;
  last_result_ = result;
  last_decision_known_ = true;
  last_overrides_ = OverridesByGroup(config_, plan.request.overrides);
  if (config_.sync.mode == SyncMode::kAsync) {
    // The rank's record, before a periodic checkpoint below saves the state: a checkpoint holding
    // the push's parameters must hold its record, or a resend after a restart would apply it again.
    pushes_[plan.request.rank] = PushRecord{plan.request.step, plan.request.global_step, plan.request.staleness,
                                            result.applied, result.skip_reason};
  }
  if (persistence_ && persistence_->CheckpointDue(last_step_)) {
    // The step stands either way (the journal, if any, holds it); a failed periodic checkpoint is
    // reported and retried at the next period.
    if (absl::Status saved = CheckpointLocked(); !saved.ok()) {
      MUOND_EVENT(warn, "checkpoint_failed", id_, last_step_, "session {}: checkpoint at step {} failed: {}", id_,
                  last_step_, saved.message());
    }
  }
  return StepOutcome{result, snapshot_};
}

}  // namespace muond::session
