// Session: state in and out — tensor shapes, ExportState and ImportState (checked in full before
// anything is written), and the session's durability (persistence, checkpoints). See session.h.
#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/echo.h"
#include "common/error_reason.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/session/partition.h"
#include "server/session/session.h"
#include "server/session/value_rules.h"

namespace muond::session {

std::vector<int64_t> Session::TensorShape(size_t parameter, std::string_view slot) const {
  const ParameterConfig& pc = config_.parameters[parameter];
  if (slot == kMasterSlot) return pc.shape;
  // Shapes and optimizers are fixed at creation: no lock needed.
  return optimizers_[pc.group]->SlotShape(ParamStateOf(pc), slot);
}

size_t Session::StateNumelLocked(size_t parameter, const std::string& slot) const {
  const ParameterConfig& pc = config_.parameters[parameter];
  if (slot == kMasterSlot) return static_cast<size_t>(pc.numel);
  return optimizers_[pc.group]->SlotNumel(params_[parameter], slot);
}

absl::StatusOr<SessionState> Session::ExportState() const {
  absl::ReaderMutexLock lock(&mu_);
  return ExportStateLocked();
}

absl::StatusOr<SessionState> Session::ExportStateLocked() const {
  if (!initialized_) {
    return absl::FailedPreconditionError(absl::StrCat("session '", id_, "' has no parameters yet"));
  }
  MUOND_RETURN_IF_ERROR(BrokenLocked());  // no checkpoint or state dict of a state that is no step's
  SessionState state;
  state.last_step = last_step_;
  state.loss_scaler = loss_scaler_;
  state.pushes = pushes_;
  state.parts_written = part_load_.Record();
  if (last_decision_known_ && last_step_ > 0) {
    state.last_decision = LastDecision{last_result_.applied, last_result_.grad_norm, last_result_.skip_reason};
  }
  state.last_overrides = last_overrides_;
  state.contributors = RememberedContributorsLocked();
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

absl::StatusOr<std::string> Session::DifferenceFromLoadedLocked(int rank, const SessionState& state) const {
  const std::vector<int> before = part_load_.LoadedWith(state.last_step, state.step_counts, last_step_);
  if (before.empty()) return std::string();
  std::vector<float> held;
  for (const StateTensor& t : state.tensors) {
    const ParameterConfig& pc = config_.parameters[t.parameter];
    const optim::ParamState& param = params_[t.parameter];
    const optim::StoredTensor* stored = t.slot == kMasterSlot ? &param.master : param.Slot(t.slot);
    if (stored == nullptr) continue;
    const size_t whole = StateNumelLocked(t.parameter, t.slot);
    const ElementRange mine = StatePartOf(config_, t.parameter, whole, rank);
    if (mine.size() == 0) continue;
    auto same = [&](int other) { return other != rank && StatePartOf(config_, t.parameter, whole, other) == mine; };
    auto other = std::find_if(before.begin(), before.end(), same);
    if (other == before.end()) continue;
    held.resize(static_cast<size_t>(mine.size()));
    MUOND_RETURN_IF_ERROR(
        optim::ReadStored(*backend_, *stored, static_cast<size_t>(mine.begin), held.size(), held.data()));
    for (size_t i = 0; i < held.size(); ++i) {
      if (RoundedToStorage(t.values[i], stored->dtype) == held[i]) continue;
      return absl::StrCat("rank ", rank, "'s ", pc.name, "/", t.slot, " differs from what rank ", *other,
                          ", which holds the same elements, loaded of a state of step ", state.last_step, " (element ",
                          mine.begin + static_cast<int64_t>(i), ": ", absl::StrFormat("%.9g", t.values[i]), " against ",
                          absl::StrFormat("%.9g", held[i]), ")");
    }
  }
  return std::string();
}

absl::Status Session::CheckContributors(const std::vector<StepContributors>& contributors, int64_t last_step) const {
  if (config_.world_size == 1 || config_.sync.mode == SyncMode::kAsync) {
    return absl::InvalidArgumentError("contributors: the session's steps are not gathered from several ranks");
  }
  if (contributors.size() > kRememberedSteps) {
    return absl::InvalidArgumentError(
        absl::StrCat("contributors: ", contributors.size(), " steps; at most ", kRememberedSteps, " are kept"));
  }
  int64_t previous = 0;
  for (const StepContributors& c : contributors) {
    const bool ranks_fit = !c.ranks.empty() && std::is_sorted(c.ranks.begin(), c.ranks.end()) &&
                           std::adjacent_find(c.ranks.begin(), c.ranks.end()) == c.ranks.end() &&
                           c.ranks.front() >= 0 && c.ranks.back() < config_.world_size;
    if (c.step <= previous || c.step > last_step || !ranks_fit || !(c.total_weight > 0) ||
        !std::isfinite(c.total_weight)) {
      return absl::InvalidArgumentError(
          absl::StrCat("contributors: the record of step ", c.step, " (", c.ranks.size(), " ranks, total weight ",
                       c.total_weight, ") does not fit a session of ", config_.world_size, " ranks at step ", last_step,
                       " (steps ascending, ranks ascending and below world_size, a ", "positive weight)"));
    }
    previous = c.step;
  }
  return absl::OkStatus();
}

absl::Status Session::ImportState(SessionState state, int rank) {
  MUOND_RETURN_IF_ERROR(CheckStepNumber("header.last_step", state.last_step, 0));
  if (state.step_counts.size() != config_.parameters.size()) {
    return absl::InvalidArgumentError(absl::StrCat("header.step_counts: expected one count for each of the ",
                                                   config_.parameters.size(), " parameters, got ",
                                                   state.step_counts.size()));
  }
  for (size_t i = 0; i < state.step_counts.size(); ++i) {
    // A parameter is updated by some of the session's steps, never by more.
    if (state.step_counts[i] < 0 || state.step_counts[i] > state.last_step) {
      return absl::InvalidArgumentError(
          absl::StrCat("header.step_counts: '", config_.parameters[i].name, "' has count ", state.step_counts[i],
                       "; counts must be between 0 and last_step (", state.last_step, ")"));
    }
  }
  if (!state.pushes.empty()) {
    const size_t ranks = config_.sync.mode == SyncMode::kAsync ? static_cast<size_t>(config_.world_size) : 0;
    if (state.pushes.size() != ranks) {
      return absl::InvalidArgumentError(
          absl::StrCat("pushes: ", state.pushes.size(), " records for a session with ", ranks, " asynchronous ranks"));
    }
    for (const PushRecord& p : state.pushes) {
      if (p.push < 0 || p.global_step < 0 || p.global_step > state.last_step || p.staleness < 0) {
        return absl::InvalidArgumentError(absl::StrCat("pushes: a record (", p.push, ", ", p.global_step, ", ",
                                                       p.staleness, ") is out of range for last_step ",
                                                       state.last_step));
      }
    }
  }
  if (state.loss_scaler.has_value()) {
    if (!config_.loss_scaler.has_value()) {
      return absl::InvalidArgumentError("header.loss_scaler: the session has no loss scaler (spec.loss_scaler)");
    }
    MUOND_RETURN_IF_ERROR(optim::ValidateLossScalerState(*config_.loss_scaler, *state.loss_scaler));
  }
  if (state.contributors.has_value()) MUOND_RETURN_IF_ERROR(CheckContributors(*state.contributors, state.last_step));
  if (state.last_overrides.has_value()) {
    // A checkpoint's record of the last step's overrides: values that step could have been sent
    // with, or dropped as unknown (only an attach's answer reads them; the session stands).
    std::vector<optim::StepHyper> hyper = default_hyper_;
    if (absl::Status fits = ApplyOverrides(config_, *state.last_overrides, "last_overrides", hyper); !fits.ok()) {
      MUOND_EVENT(warn, "last_overrides_dropped", id_, state.last_step,
                  "session {}: the checkpoint's last_overrides are dropped (an attach answers them as unknown): {}",
                  id_, fits.message());
      state.last_overrides.reset();
    }
  }
  absl::MutexLock lock(&mu_);
  MUOND_RETURN_IF_ERROR(CheckOpen());
  // Ranks holding parts load one state, each its own parts (SetState carries the rank).
  const bool by_parts = rank >= 0 && AnyPartitioned(config_);
  if (by_parts) MUOND_RETURN_IF_ERROR(part_load_.CheckLoad(rank, state.last_step, state.step_counts));
  // A restored checkpoint's record of the parts written (whole imports only).
  const std::optional<PartsWritten> parts_written = by_parts ? std::nullopt : state.parts_written;
  if (parts_written.has_value()) {
    if (!AnyPartitioned(config_)) return absl::InvalidArgumentError("parts_written: the session has no partition");
    MUOND_RETURN_IF_ERROR(part_load_.CheckRecord(*parts_written, state.last_step, state.step_counts));
  }
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
      return absl::InvalidArgumentError(
          absl::StrCat("chunk.slot: '", Echo(t.slot), "' is not a state slot of '", pc.name, "' or was sent twice"));
    }
    const size_t whole = StateNumelLocked(t.parameter, t.slot);
    const size_t numel = static_cast<size_t>(StatePartOf(config_, t.parameter, whole, rank).size());
    if (t.values.size() != numel) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk.data: ", pc.name, "/", t.slot, " has ", t.values.size(), " of ", numel, " elements"));
    }
    MUOND_ASSIGN_OR_RETURN(bounds[&t - state.tensors.data()],
                           CheckTensorValues("chunk.data", absl::StrCat(pc.name, "/", t.slot), t.values,
                                             optimizers_[pc.group]->SlotIsNonNegative(t.slot),
                                             t.slot == kMasterSlot ? config_.groups[pc.group].options.master_dtype
                                                                   : optimizers_[pc.group]->SlotDtype(t.slot)));
  }
  // A rank's empty part of a tensor has nothing to send.
  absl::erase_if(expected, [&](const std::pair<size_t, std::string>& left) {
    return StatePartOf(config_, left.first, StateNumelLocked(left.first, left.second), rank).size() == 0;
  });
  if (!expected.empty()) {
    const auto& [index, slot] = *expected.begin();
    return absl::InvalidArgumentError(
        absl::StrCat("chunk.slot: ", config_.parameters[index].name, "/", slot, " is missing"));
  }
  // Ranks holding the same elements load the same values. A rank whose values differ while the
  // load is under way would mix two states; once it is over, it is another state of the same step,
  // a new load that the other ranks then make too.
  bool another_state = false;
  if (by_parts) {
    MUOND_ASSIGN_OR_RETURN(const std::string difference, DifferenceFromLoadedLocked(rank, state));
    if (!difference.empty() && part_load_.under_way()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "chunk.data: ", difference,
          ", and the other ranks have not loaded theirs yet: ranks holding the same elements load the same state "
          "dict; nothing was loaded"));
    }
    another_state = !difference.empty();
  }
  // From here the state is being replaced: a failure leaves part of it replaced, no step's state.
  absl::Cleanup half_replaced = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { BreakByReplacementLocked(/*upload=*/false); };
  for (size_t i = 0; i < params_.size(); ++i) {
    optim::ParamState& param = params_[i];
    if (param.slots.empty()) {
      MUOND_RETURN_IF_ERROR(optimizers_[config_.parameters[i].group]->InitState(*backend_, param));
    }
    param.step_count = state.step_counts[i];
  }
  absl::MutexLock masters(&masters_mu_);
  ChangeMastersLocked();
  for (const StateTensor& t : state.tensors) {
    optim::ParamState& param = params_[t.parameter];
    optim::StoredTensor& target = t.slot == kMasterSlot ? param.master : *param.Slot(t.slot);
    const size_t whole = StateNumelLocked(t.parameter, t.slot);
    const ElementRange part = StatePartOf(config_, t.parameter, whole, rank);
    MUOND_RETURN_IF_ERROR(
        optim::WriteStored(*backend_, target, static_cast<size_t>(part.begin), t.values.size(), t.values.data()));
    // A part's bound joins the others' (every rank loads its own): it covers the whole tensor.
    const bool partial = static_cast<size_t>(part.size()) != whole;
    const double bound = bounds[&t - state.tensors.data()];
    if (t.slot == kMasterSlot) {
      param.master_bound = partial ? std::max(param.master_bound, bound) : bound;
    } else {
      for (optim::StateSlot& slot : param.slots) {
        if (slot.name == t.slot) slot.bound = partial ? std::max(slot.bound, bound) : bound;
      }
    }
  }
  if (by_parts) {
    part_load_.Loaded(rank, state.last_step, state.step_counts, last_step_, another_state);
  } else if (parts_written.has_value()) {
    part_load_.Restore(*parts_written);
  } else {
    part_load_.WroteWhole();
  }
  if (gather_.arrived() > 0 && gather_.step() != state.last_step + 1) {
    // Ranks wait for the others in a step that is no longer the next one: it is aborted for them
    // (GatherLocked answers the refusal), nothing of it applied. A step that follows the loaded
    // state goes on gathering: ranks that load the same state dict before their next step (a
    // lock-step load_state_dict) step on it, whichever loads last.
    const std::string why = absl::StrCat(
        "step ", gather_.step(), ": a SetState replaced the session's state with that of step ", state.last_step,
        " while ranks waited in it; no update was applied, send step ", state.last_step + 1, " instead");
    RefuseGatheringLocked(absl::AbortedError(why));
  }
  last_step_ = state.last_step;
  if (state.loss_scaler.has_value()) loss_scaler_ = state.loss_scaler;
  if (!state.pushes.empty()) {
    pushes_ = state.pushes;
  } else {
    // A state from SetState (which carries no push records): each rank's numbering goes on, but the
    // global steps its last push became belong to the state replaced.
    for (PushRecord& p : pushes_) p.global_step = p.staleness = 0;
  }
  initialized_ = true;
  // The state is the loaded one now; loaded by parts, once every rank has loaded its own.
  if (!part_load_.under_way()) broken_.clear();
  // A loaded or restored state holds the values the ranks share, unless it was restored in the
  // middle of an upload: then the ranks that had uploaded theirs hold them.
  uploaded_by_rank_.assign(static_cast<size_t>(config_.world_size), true);
  if (parts_written.has_value() && parts_written->upload) {
    uploaded_by_rank_.assign(static_cast<size_t>(config_.world_size), false);
    for (int r : parts_written->ranks) uploaded_by_rank_[static_cast<size_t>(r)] = true;
  }
  DropPreparedLocked();  // prepared for a state that is gone
  last_result_ = StepResult();
  last_result_.step = last_step_;
  last_result_.applied = true;
  // Who took part in the steps before: a restored checkpoint's record, or unknown (a SetState's state
  // is another history).
  contributors_.clear();
  for (StepContributors& c : state.contributors.value_or(std::vector<StepContributors>())) {
    if (c.step == last_step_) {
      last_result_.contributors = c.ranks;
      last_result_.total_weight = c.total_weight;
    }
    RememberContributorsLocked(std::move(c));
  }
  last_result_.loss_scale = loss_scaler_.has_value() ? loss_scaler_->scale : 0.0;
  // A restored checkpoint keeps how its last step went; a SetState's state does not say.
  last_decision_known_ = state.last_decision.has_value() || last_step_ == 0;
  // Likewise the last step's overrides (a SetState's state does not carry them: its client has its own).
  last_overrides_ = last_step_ == 0 ? std::vector<GroupOverride>() : state.last_overrides;
  if (state.last_decision.has_value()) {
    last_result_.applied = state.last_decision->applied;
    last_result_.grad_norm = state.last_decision->grad_norm;
    last_result_.skip_reason = state.last_decision->skip_reason;
  }
  MUOND_ASSIGN_OR_RETURN(snapshot_, ReadBack(last_step_));
  std::move(half_replaced).Cancel();
  return SaveReplacedStateLocked("SetState");
}

void Session::AttachPersistence(std::unique_ptr<SessionPersistence> persistence) {
  absl::MutexLock lock(&mu_);
  persistence_ = std::move(persistence);
}

absl::Status Session::CheckpointLocked() {
  MUOND_ASSIGN_OR_RETURN(SessionState state, ExportStateLocked());
  MUOND_RETURN_IF_ERROR(persistence_->SaveCheckpoint(std::move(state)));
  unsaved_.clear();
  return absl::OkStatus();
}

absl::Status Session::SaveReplacedStateLocked(absl::string_view what) {
  if (!persistence_) return absl::OkStatus();
  const absl::Status saved = CheckpointLocked();
  if (saved.ok()) return saved;
  unsaved_ = std::string(saved.message());
  MUOND_EVENT(error, "checkpoint_failed", id_, last_step_, "session {}: the state {} put in place was not saved: {}",
              id_, what, unsaved_);
  if (gather_.arrived() > 0) {  // ranks waiting in the next step: it cannot be applied now
    RefuseGatheringLocked(UnsavedLocked());
  }
  const std::string message =
      absl::StrCat("session '", id_, "': the state ", what, " put in place could not be saved (", unsaved_,
                   "); no step is applied until a checkpoint succeeds: send it again, or call Checkpoint");
  // A checkpoint too large to be read back stays so; a disk may recover.
  return saved.code() == absl::StatusCode::kFailedPrecondition ? absl::FailedPreconditionError(message)
                                                               : absl::UnavailableError(message);
}

absl::Status Session::UnsavedLocked() const {
  if (unsaved_.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "session '", id_, "': the state the last upload or SetState put in place is not saved (", unsaved_,
      "); no step is applied until a checkpoint succeeds: send that upload or SetState again, or call Checkpoint"));
}

absl::Status Session::CheckOpen() const {
  if (!closed_) return absl::OkStatus();
  return WithReason(absl::NotFoundError(absl::StrCat("session '", Echo(id_), "' was closed")),
                    ErrorReason::kSessionNotFound);
}

absl::Status Session::BrokenLocked() const {
  if (broken_.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(broken_);
}

void Session::BreakLocked(int64_t step, const absl::Status& why, bool journaled, const absl::Status& not_withdrawn) {
  // Either the state is half a step, or it is step - 1's but the journal may hold step `step`, which a
  // restart would apply (a resend would be recorded twice). A withdrawal that failed after its cut
  // (the fsync) may have removed the record: a restart then restores step - 1.
  const bool withdrawal_failed = !not_withdrawn.ok();
  const std::string what = withdrawal_failed
                               ? absl::StrCat("failed before it changed the state (", why.message(),
                                              "), but its journal record could not be withdrawn (",
                                              not_withdrawn.message(), "), so a restart of the daemon may apply it")
                               : absl::StrCat("failed after it began changing the state (", why.message(),
                                              "), which is now neither step ", step - 1, "'s nor step ", step, "'s");
  std::string restart;
  if (withdrawal_failed) {
    restart = absl::StrCat("or a restart of the daemon restores it from its journal (through step ", step, ", or step ",
                           step - 1, " should the record be gone), ");
  } else if (journaled) {
    restart = absl::StrCat("or a restart of the daemon restores it through step ", step, " from its journal, ");
  }
  broken_ = absl::StrCat("session '", id_, "': step ", step, " ", what,
                         ": no step is applied and no state read until SetState (load_state_dict) puts a saved state "
                         "in place, ",
                         restart, "or the session is closed");
  MUOND_EVENT(error, "session_broken", id_, step, "{}", broken_);
}

void Session::BreakByReplacementLocked(bool upload) {
  broken_ = absl::StrCat("session '", id_, "': ", upload ? "an upload" : "a SetState",
                         " failed after it began replacing the state, which is now no step's: no step is applied "
                         "and no state read until ",
                         upload ? "an upload" : "SetState (load_state_dict)",
                         " is sent again and succeeds, or the session is closed");
  MUOND_EVENT(error, "session_broken", id_, last_step_, "{}", broken_);
}

absl::Status Session::RefusesStepsLocked() const {
  MUOND_RETURN_IF_ERROR(CheckOpen());
  MUOND_RETURN_IF_ERROR(UnsavedLocked());
  return BrokenLocked();
}

absl::StatusOr<int64_t> Session::Checkpoint() {
  // Exclusive: no step may be journaled between the export and the journal being emptied.
  absl::MutexLock lock(&mu_);
  MUOND_RETURN_IF_ERROR(CheckOpen());
  if (!persistence_) {
    return absl::FailedPreconditionError("checkpoints need a state directory: start muond with --state-dir");
  }
  if (!initialized_) {
    return absl::FailedPreconditionError(absl::StrCat("session '", id_, "' has no parameters yet"));
  }
  MUOND_RETURN_IF_ERROR(CheckpointLocked());
  return last_step_;
}

void Session::Close() {
  std::unique_ptr<SessionPersistence> persistence;
  {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    if (gather_.arrived() > 0) RefuseGatheringLocked(CheckOpen());
    persistence = std::move(persistence_);  // nothing journals or checkpoints from now on
  }
  // Outside the lock: removing a large folder must not hold up calls that still read the session.
  if (persistence) persistence->Discard();
}

}  // namespace muond::session
