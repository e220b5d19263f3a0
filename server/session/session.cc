// Session: creation (optimizers, masters, preallocated gradient memory), the counters' accessors and
// the upload of initial parameters. The step is in session_step.cc and session_update.cc, state in
// and out in session_state.cc, the parameters answers read in session_parameters.cc. See session.h.
#include "server/session/session.h"

#include <algorithm>
#include <atomic>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/session/memory_quota.h"
#include "server/session/partition.h"
#include "server/session/value_rules.h"

namespace muond::session {

namespace {

uint64_t NextSerial() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

Session::Session(std::string id, SessionConfig config, kernels::Backend* backend, std::string owner)
    : id_(std::move(id)),
      owner_(std::move(owner)),
      config_(std::move(config)),
      state_bytes_(EstimateSessionBytes(config_)),
      serial_(NextSerial()),
      backend_(backend),
      gather_(config_.world_size),
      part_load_(ReplicaOf(config_)),
      pushes_(config_.sync.mode == SyncMode::kAsync ? config_.world_size : 0) {}

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
    MUOND_ASSIGN_OR_RETURN(
        state.master, optim::AllocateStored(*backend, optimizer.options().master_dtype, static_cast<size_t>(pc.numel)));
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

HealthWatch::Latest Session::LatestHealth() const {
  absl::ReaderMutexLock lock(&mu_);
  return health_.latest();
}

void Session::NoteStepArrived(int rank, std::string_view transport) {
  absl::MutexLock lock(&activity_mu_);
  activity_.last_transport = std::string(transport);
  if (activity_.rank_seen.empty()) activity_.rank_seen.assign(config_.world_size, absl::InfinitePast());
  if (rank >= 0 && rank < static_cast<int>(activity_.rank_seen.size())) activity_.rank_seen[rank] = absl::Now();
}

Session::Activity Session::activity() const {
  absl::MutexLock lock(&activity_mu_);
  Activity copy = activity_;
  if (copy.rank_seen.empty()) copy.rank_seen.assign(config_.world_size, absl::InfinitePast());
  return copy;
}

bool Session::ClaimHealthReport(int64_t step) {
  int64_t reported = health_reported_step_.load();
  while (step > reported) {
    if (health_reported_step_.compare_exchange_weak(reported, step)) return true;
  }
  return false;
}

double Session::loss_scale() const {
  absl::ReaderMutexLock lock(&mu_);
  return loss_scaler_.has_value() ? loss_scaler_->scale : 0.0;
}

PushRecord Session::LastPush(int rank) const {
  absl::ReaderMutexLock lock(&mu_);
  if (rank < 0 || static_cast<size_t>(rank) >= pushes_.size()) return PushRecord();
  return pushes_[rank];
}

Session::LastStepOverrides Session::LastOverrides() const {
  absl::ReaderMutexLock lock(&mu_);
  return LastStepOverrides{last_step_, last_overrides_};
}

bool Session::initialized() const {
  absl::ReaderMutexLock lock(&mu_);
  return initialized_;
}

absl::Status Session::NotInitializedError() const {
  return absl::FailedPreconditionError(
      absl::StrCat("session '", id_, "' has no parameters yet: upload them first (UploadParameters)"));
}

absl::Status Session::Upload(std::vector<HostTensor> tensors) { return UploadParts(-1, std::move(tensors)); }

bool Session::KeepsUploadedValuesLocked(size_t index, int rank) const {
  if (rank < 0) return false;  // a whole upload writes everything
  if (!IsPartitioned(config_, index)) return rank > 0 && uploaded_by_rank_[0];
  for (int holder : SameHolders(config_, index, rank)) {
    if (holder != rank && uploaded_by_rank_[static_cast<size_t>(holder)]) return true;
  }
  return false;
}

absl::Status Session::UploadParts(int rank, std::vector<HostTensor> tensors) {
  for (size_t i = 0; i < config_.parameters.size(); ++i) {
    const ElementRange part = PartOf(config_, i, rank);
    if (part.size() > 0 && !tensors[i].present()) {
      const std::string& name = config_.parameters[i].name;
      return absl::InvalidArgumentError(
          rank < 0 ? absl::StrCat("chunk.name: parameter '", name, "' is missing; every parameter must be sent")
                   : absl::StrCat("chunk.name: rank ", rank, " holds elements [", part.begin, ", ", part.end, ") of '",
                                  name, "' and uploaded none; every part must be sent"));
    }
  }
  absl::MutexLock lock(&mu_);
  MUOND_RETURN_IF_ERROR(CheckOpen());
  if (last_step_ > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("session '", id_, "' has applied ", last_step_,
                     " steps; initial parameters can only be uploaded before the first step (use SetState to replace a "
                     "trained state)"));
  }
  // Ranks holding parts each upload theirs (part_load.h): the first step waits for all of them.
  const bool by_parts = rank >= 0 && AnyPartitioned(config_);
  if (by_parts) MUOND_RETURN_IF_ERROR(part_load_.CheckUpload(rank));
  std::vector<double> bounds(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    MUOND_ASSIGN_OR_RETURN(bounds[i], CheckTensorValues("chunk.data", params_[i].name, tensors[i].values,
                                                        /*non_negative=*/false, params_[i].master.dtype));
  }
  // The replicated parameters of a partitioned session are rank 0's, as DDP broadcasts rank 0's, and
  // an HSDP part the first of its replicas' to upload it: another rank's values for them are then
  // checked and left out.
  uploaded_by_rank_.resize(static_cast<size_t>(config_.world_size), false);
  // From here the masters are being replaced: a failure leaves part of them replaced.
  absl::Cleanup half_replaced = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { BreakByReplacementLocked(/*upload=*/true); };
  {
    absl::MutexLock masters(&masters_mu_);
    ChangeMastersLocked();
    for (size_t i = 0; i < params_.size(); ++i) {
      if (KeepsUploadedValuesLocked(i, rank)) continue;
      const ElementRange part = PartOf(config_, i, rank);
      optim::ParamState& state = params_[i];
      if (part.size() > 0) {
        MUOND_RETURN_IF_ERROR(optim::WriteStored(*backend_, state.master, static_cast<size_t>(part.begin),
                                                 static_cast<size_t>(part.size()), tensors[i].values.data()));
      }
      // A part's bound joins the other parts' (they arrive from several ranks); a whole one replaces it.
      state.master_bound = part.size() < state.numel ? std::max(state.master_bound, bounds[i]) : bounds[i];
      state.slots.clear();
      state.step_count = 0;
      MUOND_RETURN_IF_ERROR(optimizers_[config_.parameters[i].group]->InitState(*backend_, state));
    }
    MUOND_ASSIGN_OR_RETURN(snapshot_, ReadBack(0));
  }
  initialized_ = true;
  if (by_parts) {
    part_load_.Uploaded(rank);
  } else {
    part_load_.WroteWhole();
  }
  if (rank < 0) {
    uploaded_by_rank_.assign(static_cast<size_t>(config_.world_size), true);
  } else {
    uploaded_by_rank_[static_cast<size_t>(rank)] = true;
  }
  if (!part_load_.under_way()) broken_.clear();  // a first step that broke: the upload replaced it
  std::move(half_replaced).Cancel();
  return SaveReplacedStateLocked("the upload");
}

}  // namespace muond::session
