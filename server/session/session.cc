#include "server/session/session.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/echo.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/optim/qk_clip.h"
#include "server/session/memory_quota.h"
#include "server/session/value_rules.h"

namespace muond::session {

Session::Session(std::string id, SessionConfig config, kernels::Backend* backend, std::string owner)
    : id_(std::move(id)), owner_(std::move(owner)), config_(std::move(config)),
      state_bytes_(EstimateSessionBytes(config_)), backend_(backend), gather_(config_.world_size) {}

absl::StatusOr<std::unique_ptr<Session>> Session::Create(std::string id, SessionConfig config,
                                                         kernels::Backend* backend, std::string owner) {
  std::unique_ptr<Session> session(new Session(std::move(id), std::move(config), backend, std::move(owner)));
  absl::MutexLock lock(&session->mu_);
  const SessionConfig& cfg = session->config_;
  for (const GroupConfig& group : cfg.groups) {
    MUOND_ASSIGN_OR_RETURN(std::unique_ptr<optim::Optimizer> optimizer, optim::Optimizer::Create(group.options));
    session->default_hyper_.push_back(optimizer->DefaultHyper());
    session->optimizers_.push_back(std::move(optimizer));
  }
  session->params_.resize(cfg.parameters.size());
  if (cfg.loss_scaler.has_value()) session->loss_scaler_ = optim::InitialLossScale(*cfg.loss_scaler);
  std::vector<int64_t> numel;
  for (const ParameterConfig& pc : cfg.parameters) numel.push_back(pc.numel);
  session->gradient_pool_ = std::make_unique<GradientPool>(backend, numel);
  session->host_gradients_ = std::make_unique<HostGradients>(std::move(numel));
  // The session holds its gradient memory from the start (what its memory estimate counts): on a
  // host-memory backend the host tensors steps decode into, else a backend set.
  if (backend->HostAddressable()) {
    session->host_gradients_->Preallocate();
  } else {
    MUOND_RETURN_IF_ERROR(session->gradient_pool_->Preallocate());
  }
  for (size_t i = 0; i < cfg.parameters.size(); ++i) {
    const ParameterConfig& pc = cfg.parameters[i];
    optim::ParamState& state = session->params_[i];
    state = ParamStateOf(pc);
    const optim::Optimizer& optimizer = *session->optimizers_[pc.group];
    absl::Status fits = optimizer.CheckParameter(state);
    if (!fits.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("spec.parameters[", i, "] '", pc.name, "': ", fits.message()));
    }
    MUOND_ASSIGN_OR_RETURN(state.master, optim::AllocateStored(*backend, optimizer.options().master_dtype,
                                                               static_cast<size_t>(pc.numel)));
    MUOND_RETURN_IF_ERROR(optimizer.InitState(*backend, state));
  }
  absl::MutexLock masters(&session->masters_mu_);
  MUOND_ASSIGN_OR_RETURN(session->snapshot_, session->ReadBack(0));
  return session;
}

int64_t Session::last_step() const {
  absl::ReaderMutexLock lock(&mu_);
  return last_step_;
}

double Session::loss_scale() const {
  absl::ReaderMutexLock lock(&mu_);
  return loss_scaler_.has_value() ? loss_scaler_->scale : 0.0;
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

bool Session::initialized() const {
  absl::ReaderMutexLock lock(&mu_);
  return initialized_;
}

absl::Status Session::NotInitializedError() const {
  return absl::FailedPreconditionError(
      absl::StrCat("session '", id_, "' has no parameters yet: upload them first (UploadParameters)"));
}

absl::Status Session::Upload(std::vector<HostTensor> tensors) {
  absl::MutexLock lock(&mu_);
  if (last_step_ > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session '", id_, "' has applied ", last_step_,
        " steps; initial parameters can only be uploaded before the first step (use SetState to replace a "
        "trained state)"));
  }
  std::vector<double> bounds(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    MUOND_ASSIGN_OR_RETURN(bounds[i], CheckTensorValues("chunk.data", params_[i].name, tensors[i].values,
                                                        /*non_negative=*/false, params_[i].master.dtype));
  }
  {
    absl::MutexLock masters(&masters_mu_);
    ++masters_version_;
    for (size_t i = 0; i < params_.size(); ++i) {
      optim::ParamState& state = params_[i];
      MUOND_RETURN_IF_ERROR(optim::WriteStored(*backend_, state.master, 0, state.numel, tensors[i].values.data()));
      state.master_bound = bounds[i];
      state.slots.clear();
      state.step_count = 0;
      MUOND_RETURN_IF_ERROR(optimizers_[config_.parameters[i].group]->InitState(*backend_, state));
    }
    MUOND_ASSIGN_OR_RETURN(snapshot_, ReadBack(0));
  }
  initialized_ = true;
  if (persistence_) MUOND_RETURN_IF_ERROR(CheckpointLocked());
  return absl::OkStatus();
}

// ---- The step ----

absl::StatusOr<Session::StepKind> Session::ClassifyLocked(int64_t step) const {
  if (step == last_step_ && last_step_ > 0) return StepKind::kReplay;
  if (step == last_step_ + 1) return StepKind::kNext;
  return absl::FailedPreconditionError(absl::StrCat(
      "header.step: expected step ", last_step_ + 1,
      last_step_ > 0 ? absl::StrCat(" (or ", last_step_, " to replay the last one)") : std::string(), ", got ",
      step));
}

absl::StatusOr<StepOutcome> Session::ReplayOutcomeLocked(bool device_answer) {
  if (!device_answer) MUOND_RETURN_IF_ERROR(HostSnapshotLocked());
  StepOutcome replay{last_result_, snapshot_};
  replay.result.replayed = true;
  return replay;
}

absl::StatusOr<std::unique_ptr<IncomingStep>> Session::BeginStep(StepRequest request) {
  StepKind kind;
  bool journaled = false;
  {
    absl::ReaderMutexLock lock(&mu_);
    if (!initialized_) return NotInitializedError();
    MUOND_ASSIGN_OR_RETURN(kind, ClassifyLocked(request.step));
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
  const bool one_rank = kind == StepKind::kNext && config_.world_size == 1 && phase != StepPhase::kCommit;
  if (one_rank && phase == StepPhase::kWhole && !backend_->HostAddressable()) {
    MUOND_ASSIGN_OR_RETURN(staged, StagedGradients::Start(gradient_pool_.get(), backend_));
  }
  // Gradients in device memory may stay there unless something needs their values on the host.
  const bool device_gradients = !journaled && !plan.request.count_zeros;
  return std::unique_ptr<IncomingStep>(new IncomingStep(config_, std::move(plan), kind == StepKind::kReplay,
                                                        one_rank ? host_gradients_.get() : nullptr,
                                                        std::move(staged), device_gradients));
}

float* IncomingStep::DeviceGradient(size_t index) {
  if (!takes_device_gradients()) return nullptr;
  return staged_->lease().set().buffer(index)->data();
}

void IncomingStep::MarkDeviceGradient(size_t index) {
  HostTensor& tensor = gradients_[index];
  tensor.received = config_.parameters[index].numel;
  tensor.sum_squares = 0.0;  // taken in FinishStep
  tensor.staged = true;
  tensor.device_only = true;
}

absl::Status Session::SumDeviceGradients(IncomingStep& step) {
  std::vector<size_t> indices;
  std::vector<kernels::Backend::Slice> slices;
  for (size_t i = 0; i < step.gradients_.size(); ++i) {
    if (!step.gradients_[i].device_only) continue;
    indices.push_back(i);
    slices.push_back({step.staged_->lease().set().buffer(i)->data(), static_cast<size_t>(config_.parameters[i].numel)});
  }
  if (slices.empty()) return absl::OkStatus();
  std::vector<double> sums(slices.size());
  MUOND_RETURN_IF_ERROR(backend_->SumSquaresEach(slices, sums.data()));
  for (size_t k = 0; k < indices.size(); ++k) step.gradients_[indices[k]].sum_squares = sums[k];
  return absl::OkStatus();
}

absl::Status IncomingStep::Stage(size_t index, int64_t offset, size_t count) {
  if (staged_ == nullptr) return absl::OkStatus();
  HostTensor& tensor = gradients_[index];
  MUOND_RETURN_IF_ERROR(staged_->Add(index, offset, tensor.values.data() + offset, count));
  tensor.staged = true;
  return absl::OkStatus();
}

absl::StatusOr<StepOutcome> Session::FinishStep(std::unique_ptr<IncomingStep> step) {
  if (step->staged_ != nullptr) {
    MUOND_RETURN_IF_ERROR(step->staged_->Finish());
    if (!step->replay_) MUOND_RETURN_IF_ERROR(SumDeviceGradients(*step));
  }
  absl::MutexLock lock(&mu_);
  // The state may have moved since BeginStep (another stream of the same step, say): classify again
  // under the lock, where the answer holds until the step is applied.
  MUOND_ASSIGN_OR_RETURN(StepKind kind, ClassifyLocked(step->plan_.request.step));
  const StepPhase phase = step->plan_.request.phase;
  if (kind == StepKind::kReplay) {
    MUOND_ASSIGN_OR_RETURN(StepOutcome replay, ReplayOutcomeLocked(step->plan_.request.device_answer));
    if (phase == StepPhase::kPrepare) replay.parameters = nullptr;  // a prepare answers without parameters
    return replay;
  }
  if (phase == StepPhase::kCommit) return CommitLocked(step->plan_, step->gradients_);
  // Each rank's grad_scale against the loss scaler before it joins the others (rank 0's is applied).
  MUOND_RETURN_IF_ERROR(GradScaleLocked(step->plan_).status());
  if (config_.world_size > 1) return GatherLocked(std::move(step->plan_), std::move(step->gradients_));
  if (phase == StepPhase::kPrepare) return PrepareLocked(std::move(step->plan_), std::move(step->gradients_), 0);
  return ApplyLocked(step->plan_, step->gradients_, step->staged_.get());
}

absl::StatusOr<double> Session::GradientMaxAbs(const HostTensor& gradient, size_t index, StagedGradients* staged) const {
  if (!gradient.device_only) return static_cast<double>(MaxAbs(gradient.values));
  if (staged == nullptr) return absl::InternalError("a gradient in device memory without its staged buffers");
  std::vector<float> values(static_cast<size_t>(config_.parameters[index].numel));
  MUOND_RETURN_IF_ERROR(backend_->CopyToHost(staged->lease().set().buffer(index)->data(), values.data(), values.size()));
  return static_cast<double>(MaxAbs(values));
}

Session::GradientTotals Session::TotalsOf(const std::vector<HostTensor>& gradients) const {
  GradientTotals totals;
  for (size_t i = 0; i < gradients.size(); ++i) {
    totals.sum_squares += gradients[i].sum_squares;  // 0 for a parameter without a gradient
    if (totals.non_finite_reason.empty() && !std::isfinite(gradients[i].sum_squares)) {
      totals.non_finite_reason = absl::StrCat("non-finite gradient in '", config_.parameters[i].name, "'");
    }
  }
  return totals;
}

int64_t Session::CountZeros(const std::vector<HostTensor>& gradients) {
  int64_t zeros = 0;
  for (const HostTensor& gradient : gradients) {
    if (!gradient.present()) continue;
    zeros += std::count(gradient.values.begin(), gradient.values.end(), 0.0f);  // +0 and -0
  }
  return zeros;
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
  result.grad_norm = std::sqrt(totals.sum_squares) * unscale;  // this shard's part of the norm
  result.skip_reason = totals.non_finite_reason;
  result.loss_scale = loss_scaler_.has_value() ? loss_scaler_->scale : 0.0;
  if (result.skip_reason.empty()) {
    // The magnitude guard with this shard's own norm: the global norm is at least as large, so its
    // clipping only shrinks the update, and a step this guard passes passes at the commit too.
    std::vector<optim::StepBounds> bounds(params_.size());
    MUOND_ASSIGN_OR_RETURN(
        result.skip_reason,
        GuardMagnitudesLocked(plan, gradients, nullptr, ClipCoefficient(plan, result.grad_norm) * unscale, bounds));
  }
  DropPreparedLocked();
  prepared_ = PreparedStep{std::move(plan), std::move(gradients), result, generation};
  return StepOutcome{result, nullptr};
}

absl::StatusOr<StepOutcome> Session::CommitLocked(const StepPlan& commit, const std::vector<HostTensor>& gradients) {
  for (size_t i = 0; i < gradients.size(); ++i) {
    if (gradients[i].present()) {
      return absl::InvalidArgumentError(absl::StrCat("header.num_chunks: a commit carries no gradients ('",
                                                     config_.parameters[i].name, "' came with it); they come with the prepare"));
    }
  }
  const int64_t step = commit.request.step;
  if (!prepared_.has_value() || prepared_->plan.request.step != step) {
    return absl::FailedPreconditionError(absl::StrCat(
        "header.step: step ", step, " was not prepared on this shard (",
        prepared_.has_value() ? absl::StrCat("step ", prepared_->plan.request.step, " is") : std::string("nothing is"),
        "; a restarted daemon holds no prepared step): prepare it again on every shard, then commit"));
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

absl::StatusOr<StepOutcome> Session::ApplyJournaledStep(StepRequest request, std::vector<HostTensor> gradients) {
  MUOND_ASSIGN_OR_RETURN(StepPlan plan, PlanStep(config_, default_hyper_, std::move(request)));
  absl::MutexLock lock(&mu_);
  MUOND_ASSIGN_OR_RETURN(StepKind kind, ClassifyLocked(plan.request.step));
  if (kind != StepKind::kNext) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", plan.request.step, " was applied already (last step ", last_step_, ")"));
  }
  return ApplyLocked(plan, gradients, nullptr);
}

absl::StatusOr<StepOutcome> Session::GatherLocked(StepPlan plan, std::vector<HostTensor> gradients) {
  const int64_t step = plan.request.step;
  const int rank = plan.request.rank;
  const bool prepare = plan.request.phase == StepPhase::kPrepare;
  const uint64_t generation = gather_.Add(std::move(plan), std::move(gradients));
  if (gather_.complete()) {
    auto [applied_plan, mean] = gather_.TakeAverage(config_.parameters.size());
    if (prepare) return PrepareLocked(std::move(applied_plan), std::move(mean), generation);
    return ApplyLocked(applied_plan, mean, nullptr);
  }

  MUOND_LOG(debug, "session {}: step {} has {} of {} ranks; rank {} waits up to {} s for the rest", id_, step,
            gather_.arrived(), config_.world_size, rank, config_.straggler_timeout_seconds);
  const int64_t last_step_before = last_step_;
  auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return last_step_ != last_step_before || gather_.generation() != generation;
  };
  const bool finished = mu_.AwaitWithTimeout(absl::Condition(&done), absl::Seconds(config_.straggler_timeout_seconds));
  if (last_step_ >= step) {
    if (prepare) return StepOutcome{last_result_, nullptr};
    return StepOutcome{last_result_, snapshot_};
  }
  if (prepare && prepared_.has_value() && prepared_->generation == generation) {
    return StepOutcome{prepared_->result, nullptr};  // the last rank prepared the step for every rank
  }
  if (finished) {
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
  // The step is durable (journal mode) before it changes anything.
  if (persistence_) MUOND_RETURN_IF_ERROR(persistence_->RecordStep(plan.request, gradients));

  const auto start = std::chrono::steady_clock::now();
  StepResult result;
  result.step = plan.request.step;
  // Counted before the optimizer runs (on the CPU backend it reads, and may scale, these in place).
  if (plan.request.count_zeros) result.num_zeros_in_grad = CountZeros(gradients);
  const GradientTotals totals = TotalsOf(gradients);
  // A commit clips with the global norm over every shard (already unscaled: the prepares answered
  // unscaled sums) and skips when any shard must. The gradients are multiplied once, by the clip
  // coefficient over the loss scale.
  const std::optional<ShardDecision>& decision = plan.request.decision;
  const double unscale = 1.0 / grad_scale;
  const double norm = decision.has_value() ? decision->grad_norm : std::sqrt(totals.sum_squares) * unscale;
  result.grad_norm = norm;
  const double clip = ClipCoefficient(plan, norm) * unscale;
  std::vector<optim::StepBounds> bounds(params_.size());
  if (!totals.non_finite_reason.empty()) {
    result.skip_reason = totals.non_finite_reason;
  } else if (decision.has_value() && !decision->skip_reason.empty()) {
    result.skip_reason = decision->skip_reason;
  } else {
    MUOND_ASSIGN_OR_RETURN(result.skip_reason, GuardMagnitudesLocked(plan, gradients, staged, clip, bounds));
  }
  result.applied = result.skip_reason.empty();
  if (result.applied) {
    absl::MutexLock masters(&masters_mu_);  // waits for answers still reading the masters
    ++masters_version_;
    MUOND_RETURN_IF_ERROR(ApplyGradients(plan, gradients, clip, staged));
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
  result.compute_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  last_step_ = result.step;
  last_result_ = result;
  if (persistence_ && persistence_->checkpoint_every() > 0 && last_step_ % persistence_->checkpoint_every() == 0) {
    // The step stands either way (the journal, if any, holds it); a failed periodic checkpoint is
    // reported and retried at the next period.
    if (absl::Status saved = CheckpointLocked(); !saved.ok()) {
      MUOND_EVENT(warn, "checkpoint_failed", id_, last_step_, "session {}: checkpoint at step {} failed: {}", id_,
                  last_step_, saved.message());
    }
  }
  return StepOutcome{result, snapshot_};
}

absl::Status Session::ApplyGradients(const StepPlan& plan, std::vector<HostTensor>& gradients,
                                     double clip_coefficient, StagedGradients* staged) {
  // On a host-memory backend the optimizer reads the host values in place; otherwise they are in
  // the staged set or copied into a set here.
  const bool in_place = backend_->HostAddressable();
  GradientLease own;
  if (staged == nullptr && !in_place) own = gradient_pool_->Acquire();
  GradientSet* set = staged != nullptr ? &staged->lease().set() : own ? &own.set() : nullptr;
  absl::Cleanup take_back = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    for (size_t i = 0; i < params_.size(); ++i) {
      if (params_[i].grad == nullptr) continue;
      if (set != nullptr) set->buffer(i) = std::move(params_[i].grad);
      params_[i].grad.reset();
    }
  };
  const float c = static_cast<float>(clip_coefficient);
  std::vector<std::vector<optim::ParamState*>> by_group(optimizers_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    optim::ParamState& state = params_[i];
    HostTensor& gradient = gradients[i];
    state.has_grad = gradient.present();
    if (!state.has_grad) continue;
    if (in_place) {
      // Clipped (and unscaled) where the values are: one fp32 multiply per element on every path,
      // so all agree.
      if (clip_coefficient != 1.0) MUOND_RETURN_IF_ERROR(backend_->ScaleBatched(gradient.values.data(), state.numel, 1, &c));
      state.grad = std::make_unique<kernels::BorrowedBuffer>(gradient.values.data(), gradient.values.size());
    } else {
      MUOND_ASSIGN_OR_RETURN(kernels::DeviceBuffer * buffer, gradient_pool_->Buffer(*set, i));
      if (gradient.staged && staged != nullptr) {
        if (clip_coefficient != 1.0) MUOND_RETURN_IF_ERROR(backend_->ScaleBatched(buffer->data(), state.numel, 1, &c));
      } else {
        if (clip_coefficient != 1.0) {
          for (float& g : gradient.values) g *= c;
        }
        MUOND_RETURN_IF_ERROR(backend_->CopyToDevice(gradient.values.data(), buffer->data(), state.numel));
      }
      state.grad = std::move(set->buffer(i));
    }
    by_group[config_.parameters[i].group].push_back(&state);
  }
  for (size_t g = 0; g < optimizers_.size(); ++g) {
    if (by_group[g].empty()) continue;
    MUOND_RETURN_IF_ERROR(optimizers_[g]->Step(*backend_, plan.hyper[g], by_group[g]));
  }
  return absl::OkStatus();
}

namespace {

// Widens `bounds` by the rounding of storing each tensor in its format, and says where the result
// would pass the limit of that format, or of fp32 for what the step computes on the way ("" when
// nowhere).
std::string WithinStorageLimits(const optim::ParamState& param, optim::StepBounds& bounds) {
  auto limit = [&](const optim::StoredTensor& tensor, double& bound, const std::string& what) -> std::string {
    bound *= 1.0 + kernels::StorageRoundoff(tensor.dtype);
    const double most = StorageLimit(tensor.dtype);
    if (bound <= most) return "";
    return absl::StrCat(what, " to magnitudes up to ", bound, ", beyond the limit of ", most, " that keeps ",
                        std::string(kernels::StorageDtypeName(tensor.dtype)), " finite");
  };
  if (std::string beyond = limit(param.master, bounds.master, "(its master)"); !beyond.empty()) return beyond;
  for (size_t s = 0; s < param.slots.size() && s < bounds.slots.size(); ++s) {
    std::string beyond = limit(param.slots[s].tensor, bounds.slots[s], absl::StrCat("(its ", param.slots[s].name, ")"));
    if (!beyond.empty()) return beyond;
  }
  if (bounds.peak > kMagnitudeLimit) {
    return absl::StrCat("or its optimizer state to magnitudes up to ", bounds.peak, ", beyond the limit of ",
                        kMagnitudeLimit, " that keeps fp32 finite");
  }
  return "";
}

}  // namespace

absl::StatusOr<std::string> Session::GuardMagnitudesLocked(const StepPlan& plan,
                                                           const std::vector<HostTensor>& gradients,
                                                           StagedGradients* staged, double clip_coefficient,
                                                           std::vector<optim::StepBounds>& after) {
  for (size_t i = 0; i < params_.size(); ++i) {
    const HostTensor& gradient = gradients[i];
    if (!gradient.present()) continue;
    const size_t group = config_.parameters[i].group;
    const optim::Optimizer& optimizer = *optimizers_[group];
    // Every |g| is at most the tensor's L2 norm: a bound at no cost, tightened (with the exact
    // magnitudes of the state) only when it is not good enough.
    const double rounding = optim::kBoundRounding;
    after[i] = optimizer.BoundStep(plan.hyper[group], params_[i],
                                   std::sqrt(gradient.sum_squares) * clip_coefficient * rounding);
    if (WithinStorageLimits(params_[i], after[i]).empty()) continue;
    MUOND_RETURN_IF_ERROR(MeasureMagnitudesLocked(i));
    MUOND_ASSIGN_OR_RETURN(const double max_abs, GradientMaxAbs(gradient, i, staged));
    after[i] = optimizer.BoundStep(plan.hyper[group], params_[i], max_abs * clip_coefficient * rounding);
    if (std::string beyond = WithinStorageLimits(params_[i], after[i]); !beyond.empty()) {
      return absl::StrCat("the update could take '", params_[i].name, "' ", beyond, "; nothing was changed");
    }
  }
  return std::string();
}

absl::Status Session::MeasureMagnitudesLocked(size_t i) {
  optim::ParamState& state = params_[i];
  std::vector<float> values(state.numel);
  MUOND_RETURN_IF_ERROR(optim::ReadStored(*backend_, state.master, 0, state.numel, values.data()));
  state.master_bound = MaxAbs(values);
  const optim::Optimizer& optimizer = *optimizers_[config_.parameters[i].group];
  for (optim::StateSlot& slot : state.slots) {
    values.resize(optimizer.SlotNumel(state, slot.name));
    MUOND_RETURN_IF_ERROR(optim::ReadStored(*backend_, slot.tensor, 0, values.size(), values.data()));
    slot.bound = MaxAbs(values);
  }
  return absl::OkStatus();
}

absl::Status Session::ApplyQkClip(const StepPlan& plan) {
  for (const auto& [pair, max_logits] : plan.qk_logits) {
    const QkClipConfig& clip = config_.qk_clip[pair];
    const optim::GroupOptions& options = config_.groups[config_.parameters[clip.query].group].options;
    optim::ParamState& query = params_[clip.query];
    optim::ParamState& key = params_[clip.key];
    // 16-bit masters are scaled in fp32 scratch (reserved before the step) and rounded back.
    const size_t nq = static_cast<size_t>(query.numel), nk = static_cast<size_t>(key.numel);
    optim::StagingArea& staging = qk_staging_;
    MUOND_ASSIGN_OR_RETURN(float* q, staging.Load(*backend_, 0, query.master, 0, nq));
    MUOND_ASSIGN_OR_RETURN(float* k, staging.Load(*backend_, 1, key.master, 0, nk));
    if (clip.mla.has_value()) {
      MUOND_RETURN_IF_ERROR(optim::ApplyMlaQkClip(*backend_, q, query.shape[1], k, key.shape[1], *clip.mla, max_logits,
                                                  options.qk_clip_threshold, options.qk_clip_alpha));
    } else {
      MUOND_RETURN_IF_ERROR(optim::ApplyQkClip(*backend_, q, query.numel, k, key.numel, max_logits,
                                               options.qk_clip_threshold, options.qk_clip_alpha));
    }
    MUOND_RETURN_IF_ERROR(staging.Store(*backend_, 0, query.master, 0, nq));
    MUOND_RETURN_IF_ERROR(staging.Store(*backend_, 1, key.master, 0, nk));
  }
  return absl::OkStatus();
}

absl::Status Session::ReserveQkClipLocked(const StepPlan& plan) {
  for (const auto& [pair, max_logits] : plan.qk_logits) {
    const QkClipConfig& clip = config_.qk_clip[pair];
    optim::ParamState& query = params_[clip.query];
    optim::ParamState& key = params_[clip.key];
    MUOND_RETURN_IF_ERROR(qk_staging_.Reserve(*backend_, 0, query.master, static_cast<size_t>(query.numel)));
    MUOND_RETURN_IF_ERROR(qk_staging_.Reserve(*backend_, 1, key.master, static_cast<size_t>(key.numel)));
  }
  return absl::OkStatus();
}

// ---- State in and out, durability ----

std::vector<int64_t> Session::TensorShape(size_t parameter, std::string_view slot) const {
  const ParameterConfig& pc = config_.parameters[parameter];
  if (slot == kMasterSlot) return pc.shape;
  // Shapes and optimizers are fixed at creation: no lock needed.
  return optimizers_[pc.group]->SlotShape(ParamStateOf(pc), slot);
}

absl::StatusOr<SessionState> Session::ExportState() const {
  absl::ReaderMutexLock lock(&mu_);
  return ExportStateLocked();
}

absl::StatusOr<SessionState> Session::ExportStateLocked() const {
  if (!initialized_) {
    return absl::FailedPreconditionError(absl::StrCat("session '", id_, "' has no parameters yet"));
  }
  SessionState state;
  state.last_step = last_step_;
  state.loss_scaler = loss_scaler_;
  for (size_t i = 0; i < params_.size(); ++i) {
    const optim::ParamState& param = params_[i];
    state.step_counts.push_back(param.step_count);
    StateTensor master{i, kMasterSlot, std::vector<float>(param.numel), param.master.dtype};
    MUOND_RETURN_IF_ERROR(optim::ReadStored(*backend_, param.master, 0, param.numel, master.values.data()));
    state.tensors.push_back(std::move(master));
    const optim::Optimizer& optimizer = *optimizers_[config_.parameters[i].group];
    for (const optim::StateSlot& slot : param.slots) {
      StateTensor t{i, slot.name, std::vector<float>(optimizer.SlotNumel(param, slot.name)), slot.tensor.dtype};
      MUOND_RETURN_IF_ERROR(optim::ReadStored(*backend_, slot.tensor, 0, t.values.size(), t.values.data()));
      state.tensors.push_back(std::move(t));
    }
  }
  return state;
}

absl::Status Session::ImportState(SessionState state) {
  MUOND_RETURN_IF_ERROR(CheckStepNumber("header.last_step", state.last_step, 0));
  if (state.step_counts.size() != config_.parameters.size()) {
    return absl::InvalidArgumentError(absl::StrCat("header.step_counts: expected one count for each of the ",
                                                   config_.parameters.size(), " parameters, got ",
                                                   state.step_counts.size()));
  }
  for (size_t i = 0; i < state.step_counts.size(); ++i) {
    // A parameter is updated by some of the session's steps, never by more.
    if (state.step_counts[i] < 0 || state.step_counts[i] > state.last_step) {
      return absl::InvalidArgumentError(absl::StrCat("header.step_counts: '", config_.parameters[i].name,
                                                     "' has count ", state.step_counts[i],
                                                     "; counts must be between 0 and last_step (",
                                                     state.last_step, ")"));
    }
  }
  if (state.loss_scaler.has_value()) {
    if (!config_.loss_scaler.has_value()) {
      return absl::InvalidArgumentError("header.loss_scaler: the session has no loss scaler (spec.loss_scaler)");
    }
    MUOND_RETURN_IF_ERROR(optim::ValidateLossScalerState(*config_.loss_scaler, *state.loss_scaler));
  }
  absl::MutexLock lock(&mu_);
  // Every (parameter, slot) pair must arrive exactly once, complete; nothing is written before that
  // has been checked, so a bad request leaves the session as it was.
  absl::flat_hash_set<std::pair<size_t, std::string>> expected;
  for (size_t i = 0; i < params_.size(); ++i) {
    expected.insert({i, kMasterSlot});
    for (const std::string& slot : optimizers_[config_.parameters[i].group]->SlotNames()) expected.insert({i, slot});
  }
  std::vector<double> bounds(state.tensors.size());  // each tensor's largest |x|
  for (const StateTensor& t : state.tensors) {
    const ParameterConfig& pc = config_.parameters[t.parameter];
    if (!expected.erase({t.parameter, t.slot})) {
      return absl::InvalidArgumentError(absl::StrCat("chunk.slot: '", Echo(t.slot), "' is not a state slot of '",
                                                     pc.name, "' or was sent twice"));
    }
    const size_t numel = t.slot == kMasterSlot ? static_cast<size_t>(pc.numel)
                                               : optimizers_[pc.group]->SlotNumel(params_[t.parameter], t.slot);
    if (t.values.size() != numel) {
      return absl::InvalidArgumentError(absl::StrCat("chunk.data: ", pc.name, "/", t.slot, " has ",
                                                     t.values.size(), " of ", numel, " elements"));
    }
    MUOND_ASSIGN_OR_RETURN(bounds[&t - state.tensors.data()],
                           CheckTensorValues("chunk.data", absl::StrCat(pc.name, "/", t.slot), t.values,
                                             optimizers_[pc.group]->SlotIsNonNegative(t.slot),
                                             t.slot == kMasterSlot ? config_.groups[pc.group].options.master_dtype
                                                                   : optimizers_[pc.group]->SlotDtype(t.slot)));
  }
  if (!expected.empty()) {
    const auto& [index, slot] = *expected.begin();
    return absl::InvalidArgumentError(
        absl::StrCat("chunk.slot: ", config_.parameters[index].name, "/", slot, " is missing"));
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    optim::ParamState& param = params_[i];
    if (param.slots.empty()) {
      MUOND_RETURN_IF_ERROR(optimizers_[config_.parameters[i].group]->InitState(*backend_, param));
    }
    param.step_count = state.step_counts[i];
  }
  absl::MutexLock masters(&masters_mu_);
  ++masters_version_;
  for (const StateTensor& t : state.tensors) {
    optim::ParamState& param = params_[t.parameter];
    optim::StoredTensor& target = t.slot == kMasterSlot ? param.master : *param.Slot(t.slot);
    MUOND_RETURN_IF_ERROR(optim::WriteStored(*backend_, target, 0, t.values.size(), t.values.data()));
    const double bound = bounds[&t - state.tensors.data()];
    if (t.slot == kMasterSlot) {
      param.master_bound = bound;
    } else {
      for (optim::StateSlot& slot : param.slots) {
        if (slot.name == t.slot) slot.bound = bound;
      }
    }
  }
  last_step_ = state.last_step;
  if (state.loss_scaler.has_value()) loss_scaler_ = state.loss_scaler;
  initialized_ = true;
  DropPreparedLocked();  // prepared for a state that is gone
  last_result_ = StepResult();
  last_result_.step = last_step_;
  last_result_.applied = true;
  last_result_.loss_scale = loss_scaler_.has_value() ? loss_scaler_->scale : 0.0;
  MUOND_ASSIGN_OR_RETURN(snapshot_, ReadBack(last_step_));
  if (persistence_) MUOND_RETURN_IF_ERROR(CheckpointLocked());
  return absl::OkStatus();
}

void Session::AttachPersistence(std::unique_ptr<SessionPersistence> persistence) {
  absl::MutexLock lock(&mu_);
  persistence_ = std::move(persistence);
}

absl::Status Session::CheckpointLocked() {
  MUOND_ASSIGN_OR_RETURN(SessionState state, ExportStateLocked());
  return persistence_->SaveCheckpoint(std::move(state));
}

absl::StatusOr<int64_t> Session::Checkpoint() {
  // Exclusive: no step may be journaled between the export and the journal being emptied.
  absl::MutexLock lock(&mu_);
  if (!persistence_) {
    return absl::FailedPreconditionError("checkpoints need a state directory: start muond with --state-dir");
  }
  if (!initialized_) {
    return absl::FailedPreconditionError(absl::StrCat("session '", id_, "' has no parameters yet"));
  }
  MUOND_RETURN_IF_ERROR(CheckpointLocked());
  return last_step_;
}

void Session::DiscardPersistence() {
  absl::MutexLock lock(&mu_);
  if (persistence_) persistence_->Discard();
  persistence_.reset();
}

}  // namespace muond::session
