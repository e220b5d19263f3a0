#include "server/session.h"

#include <chrono>
#include <cmath>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "kernels/optim/qk_clip.h"
#include "kernels/status_macros.h"
#include "server/logging.h"

namespace muond::server {

Session::Session(std::string id, v1::SessionSpec spec, SessionConfig config, kernels::Backend* backend)
    : id_(std::move(id)), spec_(std::move(spec)), config_(std::move(config)), backend_(backend) {}

absl::StatusOr<std::unique_ptr<Session>> Session::Create(std::string id, v1::SessionSpec spec,
                                                         SessionConfig config, kernels::Backend* backend,
                                                         std::string owner) {
  std::unique_ptr<Session> session(new Session(std::move(id), std::move(spec), std::move(config), backend));
  session->owner_ = std::move(owner);
  absl::MutexLock lock(&session->mu_);
  const SessionConfig& cfg = session->config_;
  for (const GroupConfig& group : cfg.groups) {
    MUOND_ASSIGN_OR_RETURN(std::unique_ptr<optim::Optimizer> optimizer, optim::Optimizer::Create(group.options));
    session->optimizers_.push_back(std::move(optimizer));
  }
  session->params_.resize(cfg.parameters.size());
  std::vector<int64_t> numel;
  for (const ParameterConfig& pc : cfg.parameters) numel.push_back(pc.numel);
  session->gradient_pool_ = std::make_unique<GradientPool>(backend, std::move(numel));
  MUOND_RETURN_IF_ERROR(session->gradient_pool_->Preallocate());
  auto initial = std::make_shared<ParameterSnapshot>();
  for (size_t i = 0; i < cfg.parameters.size(); ++i) {
    const ParameterConfig& pc = cfg.parameters[i];
    optim::ParamState& state = session->params_[i];
    state.name = pc.name;
    state.shape = pc.shape;
    state.numel = pc.numel;
    state.qkv = pc.qkv;
    const optim::Optimizer& optimizer = *session->optimizers_[pc.group];
    absl::Status fits = optimizer.CheckParameter(state);
    if (!fits.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("spec.parameters[", i, "] '", pc.name, "': ", fits.message()));
    }
    MUOND_ASSIGN_OR_RETURN(state.master, backend->Allocate(pc.numel));
    MUOND_RETURN_IF_ERROR(backend->Fill(state.master->data(), pc.numel, 0.0f));
    MUOND_RETURN_IF_ERROR(optimizer.InitState(*backend, state));
    initial->values.emplace_back(pc.numel, 0.0f);
  }
  session->snapshot_ = std::move(initial);
  return session;
}

int64_t Session::last_step() const {
  absl::ReaderMutexLock lock(&mu_);
  return last_step_;
}

bool Session::initialized() const {
  absl::ReaderMutexLock lock(&mu_);
  return initialized_;
}

absl::Status Session::Upload(std::vector<AssembledTensor> tensors) {
  absl::MutexLock lock(&mu_);
  if (last_step_ > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session '", id_, "' has applied ", last_step_,
        " steps; initial parameters can only be uploaded before the first step (use SetState to replace a "
        "trained state)"));
  }
  auto snapshot = std::make_shared<ParameterSnapshot>();
  for (size_t i = 0; i < params_.size(); ++i) {
    optim::ParamState& state = params_[i];
    MUOND_RETURN_IF_ERROR(backend_->CopyToDevice(tensors[i].values.data(), state.master->data(), state.numel));
    state.slots.clear();
    state.step_count = 0;
    MUOND_RETURN_IF_ERROR(optimizers_[config_.parameters[i].group]->InitState(*backend_, state));
    snapshot->values.push_back(std::move(tensors[i].values));
  }
  snapshot_ = std::move(snapshot);
  initialized_ = true;
  if (persistence_) MUOND_RETURN_IF_ERROR(CheckpointLocked());
  return absl::OkStatus();
}

absl::Status Session::CheckStepNumber(int64_t step) const {
  absl::ReaderMutexLock lock(&mu_);
  if (!initialized_) {
    return absl::FailedPreconditionError(
        absl::StrCat("session '", id_, "' has no parameters yet: upload them first (UploadParameters)"));
  }
  if (step == last_step_ && last_step_ > 0) return absl::OkStatus();  // a replay
  return CheckStepNumberLocked(step);
}

absl::Status Session::CheckStepNumberLocked(int64_t step) const {
  if (step == last_step_ + 1) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "header.step: expected step ", last_step_ + 1,
      last_step_ > 0 ? absl::StrCat(" (or ", last_step_, " to replay the last one)") : std::string(), ", got ",
      step));
}

absl::StatusOr<std::vector<optim::StepHyper>> Session::ResolveHyper(const v1::StepHeader& header) const {
  std::vector<optim::StepHyper> hyper;
  for (const GroupConfig& group : config_.groups) {
    hyper.push_back({group.options.lr, group.options.momentum, group.options.weight_decay});
  }
  for (int i = 0; i < header.overrides_size(); ++i) {
    const v1::GroupOverride& o = header.overrides(i);
    const std::string field = absl::StrCat("header.overrides[", i, "]");
    auto it = config_.group_index.find(o.group());
    if (it == config_.group_index.end()) {
      return absl::NotFoundError(absl::StrCat(field, ".group: unknown group '", o.group(), "'"));
    }
    optim::StepHyper& h = hyper[it->second];
    if (o.has_lr()) {
      if (!std::isfinite(o.lr()) || o.lr() < 0) {
        return absl::InvalidArgumentError(absl::StrCat(field, ".lr: must be finite and >= 0, got ", o.lr()));
      }
      h.lr = o.lr();
    }
    if (o.has_momentum()) {
      if (!(o.momentum() >= 0 && o.momentum() < 1)) {
        return absl::InvalidArgumentError(absl::StrCat(field, ".momentum: must be in [0, 1), got ", o.momentum()));
      }
      h.momentum = o.momentum();
    }
    if (o.has_weight_decay()) {
      if (!std::isfinite(o.weight_decay()) || o.weight_decay() < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ".weight_decay: must be finite and >= 0, got ", o.weight_decay()));
      }
      h.weight_decay = o.weight_decay();
    }
  }
  return hyper;
}

absl::StatusOr<std::unique_ptr<StagedGradients>> Session::StageGradients() {
  return StagedGradients::Start(gradient_pool_.get(), backend_);
}

absl::StatusOr<StepOutcome> Session::Step(const v1::StepHeader& header, std::vector<AssembledTensor> gradients,
                                          std::unique_ptr<StagedGradients> staged) {
  // Everything that can refuse the request is checked before any state changes.
  MUOND_ASSIGN_OR_RETURN(std::vector<optim::StepHyper> hyper, ResolveHyper(header));
  MUOND_ASSIGN_OR_RETURN(auto qk_logits, ResolveQkLogits(header));
  if (header.has_max_grad_norm() && !(std::isfinite(header.max_grad_norm()) && header.max_grad_norm() > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.max_grad_norm: must be finite and > 0, got ", header.max_grad_norm()));
  }
  if (header.rank() < 0 || header.rank() >= config_.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("header.rank: must be in [0, ", config_.world_size,
                                                   "), got ", header.rank()));
  }

  absl::MutexLock lock(&mu_);
  if (!initialized_) {
    return absl::FailedPreconditionError(
        absl::StrCat("session '", id_, "' has no parameters yet: upload them first (UploadParameters)"));
  }
  if (header.step() == last_step_ && last_step_ > 0) {
    StepOutcome replay{last_result_, snapshot_};
    replay.result.set_replayed(true);
    return replay;
  }
  MUOND_RETURN_IF_ERROR(CheckStepNumberLocked(header.step()));
  if (config_.world_size > 1) {
    staged.reset();  // the ranks' gradients are averaged on the host
    return AggregateLocked(header, std::move(gradients));
  }
  return ApplyStepLocked(header, std::move(gradients), staged.get());
}

absl::StatusOr<StepOutcome> Session::ReplayStep(const v1::StepHeader& header, std::vector<AssembledTensor> gradients) {
  absl::MutexLock lock(&mu_);
  MUOND_RETURN_IF_ERROR(CheckStepNumberLocked(header.step()));
  return ApplyStepLocked(header, std::move(gradients));
}

absl::StatusOr<StepOutcome> Session::ApplyStepLocked(const v1::StepHeader& header,
                                                     std::vector<AssembledTensor> gradients,
                                                     StagedGradients* staged) {
  MUOND_ASSIGN_OR_RETURN(std::vector<optim::StepHyper> hyper, ResolveHyper(header));
  MUOND_ASSIGN_OR_RETURN(auto qk_logits, ResolveQkLogits(header));
  // The step is durable (journal mode) before it changes anything.
  if (persistence_) MUOND_RETURN_IF_ERROR(persistence_->RecordStep(header, gradients));

  const auto start = std::chrono::steady_clock::now();
  v1::StepResult result;
  result.set_step(header.step());
  double sum_squares = 0.0;
  std::string first_non_finite;
  for (size_t i = 0; i < gradients.size(); ++i) {
    sum_squares += gradients[i].sum_squares;
    if (first_non_finite.empty() && !std::isfinite(gradients[i].sum_squares)) {
      first_non_finite = config_.parameters[i].name;
    }
  }
  const double norm = std::sqrt(sum_squares);
  result.set_grad_norm(norm);
  if (!first_non_finite.empty()) {
    result.set_applied(false);
    result.set_skip_reason(absl::StrCat("non-finite gradient in '", first_non_finite, "'"));
  } else {
    // torch.nn.utils.clip_grad_norm_: coefficient max_norm / (norm + 1e-6), clamped to 1.
    double clip = 1.0;
    if (header.has_max_grad_norm()) clip = std::min(1.0, header.max_grad_norm() / (norm + 1e-6));
    MUOND_RETURN_IF_ERROR(ApplyGradients(hyper, gradients, clip, staged));
    MUOND_RETURN_IF_ERROR(ApplyQkClip(qk_logits));
    MUOND_ASSIGN_OR_RETURN(snapshot_, ReadBack(header.step()));
    result.set_applied(true);
  }
  result.set_compute_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  last_step_ = header.step();
  last_result_ = result;
  if (persistence_ && persistence_->checkpoint_every() > 0 && last_step_ % persistence_->checkpoint_every() == 0) {
    // The step stands either way (the journal, if any, holds it); a failed periodic checkpoint is
    // reported and retried at the next period.
    if (absl::Status saved = CheckpointLocked(); !saved.ok()) {
      MUOND_LOG(warn, "session {}: checkpoint at step {} failed: {}", id_, last_step_, saved.message());
    }
  }
  return StepOutcome{result, snapshot_};
}

absl::Status Session::ApplyGradients(const std::vector<optim::StepHyper>& hyper,
                                     std::vector<AssembledTensor>& gradients, double clip_coefficient,
                                     StagedGradients* staged) {
  GradientLease own;  // when nothing was staged: a set filled from the host values here
  if (staged == nullptr) own = gradient_pool_->Acquire();
  GradientSet& set = staged != nullptr ? staged->lease().set() : own.set();
  absl::Cleanup take_back = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    for (size_t i = 0; i < params_.size(); ++i) {
      if (params_[i].grad != nullptr) set.buffer(i) = std::move(params_[i].grad);
    }
  };
  const float c = static_cast<float>(clip_coefficient);
  std::vector<std::vector<optim::ParamState*>> by_group(optimizers_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    optim::ParamState& state = params_[i];
    AssembledTensor& gradient = gradients[i];
    state.has_grad = gradient.present();
    if (!state.has_grad) continue;
    MUOND_ASSIGN_OR_RETURN(kernels::DeviceBuffer * buffer, gradient_pool_->Buffer(set, i));
    if (gradient.staged && staged != nullptr) {
      // Clipped where the values are; one fp32 multiply per element either way, so both paths agree.
      if (clip_coefficient < 1.0) MUOND_RETURN_IF_ERROR(backend_->ScaleBatched(buffer->data(), state.numel, 1, &c));
    } else {
      if (clip_coefficient < 1.0) {
        for (float& g : gradient.values) g *= c;
      }
      MUOND_RETURN_IF_ERROR(backend_->CopyToDevice(gradient.values.data(), buffer->data(), state.numel));
    }
    state.grad = std::move(set.buffer(i));
    by_group[config_.parameters[i].group].push_back(&state);
  }
  for (size_t g = 0; g < optimizers_.size(); ++g) {
    if (by_group[g].empty()) continue;
    MUOND_RETURN_IF_ERROR(optimizers_[g]->Step(*backend_, hyper[g], by_group[g]));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::pair<size_t, std::vector<double>>>> Session::ResolveQkLogits(
    const v1::StepHeader& header) const {
  std::vector<std::pair<size_t, std::vector<double>>> resolved;
  for (int i = 0; i < header.qk_logits_size(); ++i) {
    const v1::QkClipLogits& logits = header.qk_logits(i);
    const std::string field = absl::StrCat("header.qk_logits[", i, "]");
    size_t pair = config_.qk_clip.size();
    for (size_t p = 0; p < config_.qk_clip.size(); ++p) {
      if (config_.parameters[config_.qk_clip[p].query].name == logits.query()) pair = p;
    }
    if (pair == config_.qk_clip.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".query: '", logits.query(), "' is not the query of a spec.qk_clip pair"));
    }
    for (const auto& [seen, unused] : resolved) {
      if (seen == pair) {
        return absl::InvalidArgumentError(absl::StrCat(field, ".query: '", logits.query(), "' given twice"));
      }
    }
    if (logits.max_logits_size() != config_.qk_clip[pair].num_heads) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".max_logits: expected ", config_.qk_clip[pair].num_heads,
                                                     " values (one per head), got ", logits.max_logits_size()));
    }
    resolved.emplace_back(pair, std::vector<double>(logits.max_logits().begin(), logits.max_logits().end()));
  }
  return resolved;
}

absl::Status Session::ApplyQkClip(const std::vector<std::pair<size_t, std::vector<double>>>& logits) {
  for (const auto& [pair, max_logits] : logits) {
    const QkClipConfig& clip = config_.qk_clip[pair];
    const optim::GroupOptions& options = config_.groups[config_.parameters[clip.query].group].options;
    optim::ParamState& query = params_[clip.query];
    optim::ParamState& key = params_[clip.key];
    MUOND_RETURN_IF_ERROR(optim::ApplyQkClip(*backend_, query.master->data(), query.numel, key.master->data(),
                                             key.numel, max_logits, options.qk_clip_threshold,
                                             options.qk_clip_alpha));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const ParameterSnapshot>> Session::ReadBack(int64_t step) const {
  auto snapshot = std::make_shared<ParameterSnapshot>();
  snapshot->step = step;
  snapshot->values.reserve(params_.size());
  MUOND_ASSIGN_OR_RETURN(std::unique_ptr<kernels::DeviceToHost> download, backend_->NewDeviceToHost());
  for (const optim::ParamState& state : params_) {
    std::vector<float>& values = snapshot->values.emplace_back(state.numel);
    MUOND_RETURN_IF_ERROR(download->Enqueue(state.master->data(), values.data(), state.numel));
  }
  MUOND_RETURN_IF_ERROR(download->Wait());
  return snapshot;
}

std::shared_ptr<const ParameterSnapshot> Session::Parameters(int64_t* last_step) const {
  absl::ReaderMutexLock lock(&mu_);
  *last_step = last_step_;
  return snapshot_;
}

}  // namespace muond::server
