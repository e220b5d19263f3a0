// Session: the update of an applied step — what it reads of the gradients (sums of squares, zeros,
// largest magnitudes), lending the gradient buffers to the optimizers, the finiteness guard that
// bounds every master and slot before anything is written, and QK-clip. See session.h.
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/optim/qk_clip.h"
#include "server/session/session.h"
#include "server/session/value_rules.h"

namespace muond::session {

absl::StatusOr<double> Session::GradientMaxAbs(const HostTensor& gradient, size_t index,
                                               StagedGradients* staged) const {
  if (!gradient.device_only) return static_cast<double>(MaxAbs(gradient.values));
  if (staged == nullptr) return absl::InternalError("a gradient in device memory without its staged buffers");
  std::vector<float> values(static_cast<size_t>(config_.parameters[index].numel));
  MUOND_RETURN_IF_ERROR(
      backend_->CopyToHost(staged->lease().set().buffer(index)->data(), values.data(), values.size()));
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

absl::Status Session::ApplyGradients(const StepPlan& plan, std::vector<HostTensor>& gradients,
                                     const std::vector<double>& group_coefficients, StagedGradients* staged,
                                     std::vector<optim::StepTelemetry>& telemetry, bool& changing) {
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
  std::vector<std::vector<optim::ParamState*>> by_group(optimizers_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    optim::ParamState& state = params_[i];
    HostTensor& gradient = gradients[i];
    state.has_grad = gradient.present();
    state.grad_is_zero = state.has_grad && gradient.sum_squares == 0;
    if (!state.has_grad) continue;
    const double clip_coefficient = group_coefficients[config_.parameters[i].group];
    const float c = static_cast<float>(clip_coefficient);
    if (in_place) {
      // Clipped (and unscaled) where the values are: one fp32 multiply per element on every path,
      // so all agree.
      if (clip_coefficient != 1.0) {
        MUOND_RETURN_IF_ERROR(backend_->ScaleBatched(gradient.values.data(), state.numel, 1, &c));
      }
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
  // Every gradient is where the optimizer reads it: from here the masters change.
  ChangeMastersLocked();
  changing = true;
  telemetry.assign(optimizers_.size(), {});
  for (size_t g = 0; g < optimizers_.size(); ++g) {
    if (by_group[g].empty()) continue;
    telemetry[g].measure = config_.groups[g].options.telemetry;
    MUOND_RETURN_IF_ERROR(optimizers_[g]->StepMeasured(*backend_, plan.hyper[g], by_group[g], telemetry[g]));
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
                                                           StagedGradients* staged,
                                                           const std::vector<double>& group_coefficients,
                                                           std::vector<optim::StepBounds>& after) {
  for (size_t i = 0; i < params_.size(); ++i) {
    const HostTensor& gradient = gradients[i];
    if (!gradient.present()) continue;
    const size_t group = config_.parameters[i].group;
    const double clip_coefficient = group_coefficients[group];
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

}  // namespace muond::session
