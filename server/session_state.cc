// Session::ExportState / ImportState: the whole optimizer state of a session as host tensors, used by
// the GetState / SetState RPCs (clients' state_dict / load_state_dict).
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/session.h"

namespace muond::server {

namespace {
constexpr char kMasterSlot[] = "master";
}  // namespace

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
  for (size_t i = 0; i < params_.size(); ++i) {
    const optim::ParamState& param = params_[i];
    state.step_counts.push_back(param.step_count);
    StateTensor master{i, kMasterSlot, std::vector<float>(param.numel)};
    MUOND_RETURN_IF_ERROR(backend_->CopyToHost(param.master->data(), master.values.data(), param.numel));
    state.tensors.push_back(std::move(master));
    for (const optim::StateSlot& slot : param.slots) {
      StateTensor t{i, slot.name, std::vector<float>(param.numel)};
      MUOND_RETURN_IF_ERROR(backend_->CopyToHost(slot.buffer->data(), t.values.data(), param.numel));
      state.tensors.push_back(std::move(t));
    }
  }
  return state;
}

absl::Status Session::ImportState(SessionState state) {
  if (state.last_step < 0) {
    return absl::InvalidArgumentError(absl::StrCat("header.last_step: must be >= 0, got ", state.last_step));
  }
  if (state.step_counts.size() != config_.parameters.size()) {
    return absl::InvalidArgumentError(absl::StrCat("header.step_counts: expected one count for each of the ",
                                                   config_.parameters.size(), " parameters, got ",
                                                   state.step_counts.size()));
  }
  absl::MutexLock lock(&mu_);
  // Every (parameter, slot) pair must arrive exactly once, complete; nothing is written before that
  // has been checked, so a bad request leaves the session as it was.
  absl::flat_hash_set<std::pair<size_t, std::string>> expected;
  for (size_t i = 0; i < params_.size(); ++i) {
    expected.insert({i, kMasterSlot});
    for (const std::string& slot : optimizers_[config_.parameters[i].group]->SlotNames()) expected.insert({i, slot});
  }
  for (const StateTensor& t : state.tensors) {
    const ParameterConfig& pc = config_.parameters[t.parameter];
    if (!expected.erase({t.parameter, t.slot})) {
      return absl::InvalidArgumentError(absl::StrCat("chunk.slot: '", t.slot, "' is not a state slot of '",
                                                     pc.name, "' or was sent twice"));
    }
    if (static_cast<int64_t>(t.values.size()) != pc.numel) {
      return absl::InvalidArgumentError(absl::StrCat("chunk.data: ", pc.name, "/", t.slot, " has ",
                                                     t.values.size(), " of ", pc.numel, " elements"));
    }
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
  for (const StateTensor& t : state.tensors) {
    optim::ParamState& param = params_[t.parameter];
    float* target = t.slot == kMasterSlot ? param.master->data() : param.Slot(t.slot)->data();
    MUOND_RETURN_IF_ERROR(backend_->CopyToDevice(t.values.data(), target, param.numel));
  }
  last_step_ = state.last_step;
  initialized_ = true;
  last_result_ = v1::StepResult();
  last_result_.set_step(last_step_);
  last_result_.set_applied(true);
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
  return persistence_->SaveCheckpoint(state);
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

}  // namespace muond::server
