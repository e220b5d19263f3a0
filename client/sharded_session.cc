#include "client/sharded_session.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <new>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace muond::client {
namespace {

absl::Status NameShard(const absl::Status& status, int shard, const std::string& endpoint) {
  absl::Status named(status.code(), absl::StrCat("shard ", shard, " (", endpoint, "): ", status.message()));
  return WithReasonOf(status, std::move(named));
}

// A whole sharded step is sent again after these: a transient failure, or a shard that lost its
// prepared step (a restart between prepare and commit).
bool ResendStep(const absl::Status& status) {
  return status.code() == absl::StatusCode::kUnavailable || status.code() == absl::StatusCode::kDeadlineExceeded ||
         ReasonOf(status) == v1::STEP_NOT_PREPARED;
}

}  // namespace

template <typename T, typename Call>
absl::StatusOr<std::vector<T>> ShardedSession::OnEveryShard(Call call) {
  const size_t n = sessions_.size();
  std::vector<absl::StatusOr<T>> results(n, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (size_t k = 1; k < n; ++k) threads.emplace_back([&, k] { results[k] = call(static_cast<int>(k)); });
  results[0] = call(0);
  for (std::thread& t : threads) t.join();
  std::vector<T> out;
  for (size_t k = 0; k < n; ++k) {
    if (!results[k].ok()) return NameShard(results[k].status(), static_cast<int>(k), endpoints_[k]);
    out.push_back(*std::move(results[k]));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<ShardedSession>> ShardedSession::Open(ClientOptions options,
                                                                     std::vector<std::string> endpoints,
                                                                     const std::string& session_id,
                                                                     const v1::SessionSpec& spec) {
  std::set<std::string> seen;
  for (size_t k = 0; k < endpoints.size(); ++k) {
    if (!seen.insert(endpoints[k]).second) {
      return absl::InvalidArgumentError(absl::StrCat("endpoints[", k, "]: '", endpoints[k], "' is listed twice"));
    }
  }
  absl::StatusOr<Placement> placement = PlaceSpec(spec, static_cast<int>(endpoints.size()));
  if (!placement.ok()) return placement.status();
  std::unique_ptr<ShardedSession> sharded(new ShardedSession());
  sharded->endpoints_ = std::move(endpoints);
  sharded->session_id_ = session_id;
  sharded->spec_ = spec;
  sharded->placement_ = *std::move(placement);
  for (int i = 0; i < spec.parameters_size(); ++i)
    sharded->shard_of_[spec.parameters(i).name()] = sharded->placement_.shard_of[i];
  for (size_t k = 0; k < sharded->endpoints_.size(); ++k) {
    sharded->indices_of_.push_back(sharded->placement_.ParametersOf(static_cast<int>(k)));
  }
  sharded->options_ = options;
  for (const std::string& endpoint : sharded->endpoints_) {
    ClientOptions mine = options;
    mine.endpoint = endpoint;
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(mine);
    if (!client.ok()) return client.status();
    sharded->clients_.push_back(*std::move(client));
  }
  sharded->sessions_.resize(sharded->endpoints_.size());
  ShardedSession* self = sharded.get();
  absl::StatusOr<std::vector<int64_t>> steps = self->OnEveryShard<int64_t>([&](int k) -> absl::StatusOr<int64_t> {
    v1::SessionSpec mine = ShardSpec(spec, self->placement_, self->endpoints_, k);
    absl::StatusOr<std::unique_ptr<Session>> session = self->clients_[k]->CreateSession(session_id, mine);
    if (!session.ok()) return session.status();
    self->sessions_[k] = *std::move(session);
    return self->sessions_[k]->last_step();
  });
  // A refused open leaves nothing behind: the sessions it created (never ones it attached to) go.
  auto roll_back = [&](absl::Status status) {
    for (size_t k = 0; k < self->sessions_.size(); ++k) {
      if (self->sessions_[k] != nullptr && !self->sessions_[k]->attached()) {
        (void)self->clients_[k]->CloseSession(session_id);  // best effort
      }
    }
    return status;
  };
  if (!steps.ok()) return roll_back(steps.status());
  const std::vector<int64_t> answered = *steps;  // the step each shard's attach answer is of
  // Its steps retried on each shard as a plain session's are.
  self->FinishCutOffStep(*steps);
  // From here Step retries whole steps (both phases), not a shard's part of one.
  for (const std::unique_ptr<Session>& session : self->sessions_) session->set_step_attempts(1);
  absl::StatusOr<int64_t> common = self->CommonStep(*steps);
  if (!common.ok()) return roll_back(common.status());
  self->last_step_ = *common;
  self->TakeLastOverrides(answered);
  self->attached_ = self->initialized_ = true;
  for (const auto& session : self->sessions_) {
    self->attached_ = self->attached_ && session->attached();
    self->initialized_ = self->initialized_ && session->initialized();
  }
  return sharded;
}

void ShardedSession::TakeLastOverrides(const std::vector<int64_t>& answered) {
  std::vector<v1::GroupOverride> merged;
  for (size_t k = 0; k < sessions_.size(); ++k) {
    if (answered[k] != last_step_) continue;
    const std::optional<std::vector<v1::GroupOverride>>& record = sessions_[k]->last_overrides();
    if (!record.has_value()) {
      last_overrides_.reset();
      return;
    }
    for (const v1::GroupOverride& o : *record) {
      const bool seen =
          std::any_of(merged.begin(), merged.end(), [&](const v1::GroupOverride& m) { return m.group() == o.group(); });
      if (!seen) merged.push_back(o);  // every shard ran the step with the same overrides
    }
  }
  last_overrides_ = std::move(merged);
}

void ShardedSession::FinishCutOffStep(std::vector<int64_t>& steps) {
  const int64_t ahead = *std::max_element(steps.begin(), steps.end());
  if (*std::min_element(steps.begin(), steps.end()) != ahead - 1) return;
  // A shard that committed step `ahead` answers a resent prepare of it with its decision, which
  // every shard ahead applied alike: one of them is asked.
  const size_t done = static_cast<size_t>(std::find(steps.begin(), steps.end(), ahead) - steps.begin());
  StepOptions prepare;
  prepare.phase = v1::STEP_PHASE_PREPARE;
  absl::StatusOr<StepReply> replay = sessions_[done]->Step(ahead, {}, prepare);
  if (!replay.ok() || !replay->replayed) return;
  StepOptions commit;
  commit.phase = v1::STEP_PHASE_COMMIT;
  commit.decision = Decide({*std::move(replay)});
  for (size_t k = 0; k < steps.size(); ++k) {
    if (steps[k] == ahead) continue;
    if (!sessions_[k]->Step(ahead, {}, commit).ok()) return;
    steps[k] = ahead;
  }
}

absl::Status ShardedSession::NameShardsBehind(absl::Status refused) {
  if (refused.code() != absl::StatusCode::kFailedPrecondition || !absl::StrContains(refused.message(), "header.step")) {
    return refused;
  }
  absl::StatusOr<std::vector<int64_t>> steps = ShardSteps();
  if (!steps.ok()) return refused;
  absl::StatusOr<int64_t> common = CommonStep(*steps);
  return common.ok() ? refused : common.status();
}

absl::StatusOr<std::vector<int64_t>> ShardedSession::ShardSteps() {
  return OnEveryShard<int64_t>([&](int k) -> absl::StatusOr<int64_t> {
    absl::StatusOr<std::vector<v1::SessionSummary>> sessions = clients_[k]->ListSessions();
    if (!sessions.ok()) return sessions.status();
    for (const v1::SessionSummary& s : *sessions) {
      if (s.session_id() == session_id_) return s.last_step();
    }
    return absl::NotFoundError(absl::StrCat("session '", session_id_, "' is not open"));
  });
}

absl::StatusOr<int64_t> ShardedSession::CommonStep(const std::vector<int64_t>& steps) const {
  const int64_t ahead = *std::max_element(steps.begin(), steps.end());
  std::vector<std::string> behind;
  for (size_t k = 0; k < steps.size(); ++k) {
    if (steps[k] != ahead) behind.push_back(absl::StrCat("shard ", k, " (", endpoints_[k], ") at step ", steps[k]));
  }
  if (behind.empty()) return ahead;
  if (cut_off_.has_value() && cut_off_->step == ahead && *std::min_element(steps.begin(), steps.end()) == ahead - 1) {
    const std::string what =
        cut_off_->gradients_kept
            ? absl::StrCat("the next Step(", ahead,
                           ") sends it again (with its own gradients) and brings every shard to step ", ahead)
            : absl::StrCat("its gradients could not be kept, so Step(", ahead,
                           ") is refused: restore every shard to one step, then DropCutOffStep() (or open the session "
                           "again)");
    return absl::FailedPreconditionError(absl::StrCat("session '", session_id_, "': step ", ahead,
                                                      " was cut off in its commit: ", absl::StrJoin(behind, ", "),
                                                      ", the others at step ", ahead, "; ", what));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "the shards are at different steps: ", absl::StrJoin(behind, ", "), ", the others at step ", ahead,
      " (a daemon restarted from an older checkpoint, or a step was cut off mid-commit); restore every shard to one "
      "step before training on"));
}

absl::Status ShardedSession::HoldParts(int rank) {
  return OnEveryShard<bool>([&](int k) -> absl::StatusOr<bool> {
           absl::Status held = sessions_[k]->HoldParts(rank);
           if (!held.ok()) return held;
           return true;
         })
      .status();
}

absl::Status ShardedSession::UploadParameters(std::span<const TensorView> parameters) {
  std::vector<std::vector<TensorView>> by_shard(sessions_.size());
  for (const TensorView& t : parameters) {
    auto it = shard_of_.find(t.name);
    by_shard[it == shard_of_.end() ? 0 : it->second].push_back(t);  // an unknown name: refused by shard 0
  }
  absl::StatusOr<std::vector<bool>> done = OnEveryShard<bool>([&](int k) -> absl::StatusOr<bool> {
    absl::Status uploaded = sessions_[k]->UploadParameters(by_shard[k]);
    if (!uploaded.ok()) return uploaded;
    return true;
  });
  if (!done.ok()) return done.status();
  initialized_ = true;
  return absl::OkStatus();
}

v1::ShardDecision ShardedSession::Decide(const std::vector<StepReply>& prepared) const {
  v1::ShardDecision decision;
  for (const StepReply& reply : prepared) {
    if (reply.replayed) {  // this shard committed the step already: its decision stands
      decision.set_grad_norm(reply.grad_norm);
      if (!reply.applied) decision.set_skip_reason(reply.skip_reason);
      return decision;
    }
  }
  std::vector<double> sums(spec_.parameters_size(), 0.0);
  for (size_t k = 0; k < prepared.size(); ++k) {
    const std::vector<int>& mine = indices_of_[k];
    for (size_t j = 0; j < mine.size() && j < prepared[k].sum_squares.size(); ++j)
      sums[mine[j]] = prepared[k].sum_squares[j];
  }
  // Summed in the whole session's order, as one daemon sums its parameters: the same norm, bit for bit.
  double total = 0.0;
  int first_bad = -1;
  for (size_t i = 0; i < sums.size(); ++i) {
    total += sums[i];
    if (first_bad < 0 && !std::isfinite(sums[i])) first_bad = static_cast<int>(i);
  }
  decision.set_grad_norm(std::sqrt(total));
  if (first_bad >= 0) {
    decision.set_skip_reason(absl::StrCat("non-finite gradient in '", spec_.parameters(first_bad).name(), "'"));
  } else {
    for (const StepReply& reply : prepared) {
      if (!reply.skip_reason.empty()) {
        decision.set_skip_reason(reply.skip_reason);
        break;
      }
    }
  }
  return decision;
}

absl::StatusOr<StepReply> ShardedSession::StepOnce(int64_t step, const std::vector<std::vector<TensorView>>& gradients,
                                                   const StepOptions& options, bool& may_apply) {
  const size_t n = sessions_.size();
  // One daemon holds the whole session (ShardSpec gives it no placement): its steps are whole.
  if (n == 1) return sessions_[0]->Step(step, gradients[0], options);
  std::vector<StepOptions> prepare(n, options), commit(n, options);
  for (size_t k = 0; k < n; ++k) {
    prepare[k].phase = v1::STEP_PHASE_PREPARE;
    prepare[k].parameters_out.clear();
    prepare[k].qk_logits.clear();
    commit[k].phase = v1::STEP_PHASE_COMMIT;
    commit[k].parameters_out.clear();
    commit[k].qk_logits.clear();
  }
  // Each shard gets the QK-clip logits of its own pairs and writes its own parameters_out.
  for (const auto& [query, logits] : options.qk_logits) {
    auto it = shard_of_.find(query);
    prepare[it == shard_of_.end() ? 0 : it->second].qk_logits[query] = logits;  // unknown: refused by shard 0
  }
  for (const auto& [name, out] : options.parameters_out) {
    auto it = shard_of_.find(name);
    if (it == shard_of_.end())
      return absl::InvalidArgumentError(absl::StrCat("parameters_out['", name, "']: no such parameter"));
    commit[it->second].parameters_out[name] = out;
  }
  // Before any prepare: a commit refused for its output after another shard's commit applied the
  // step would leave the shards at two steps.
  for (size_t k = 0; k < n; ++k) {
    if (absl::Status fits = sessions_[k]->CheckParametersOut(commit[k]); !fits.ok()) return fits;
  }
  // With several ranks a shard holds this rank's prepared part after its call ended, and another
  // rank's commit applies it.
  if (spec_.world_size() > 1) may_apply = true;
  absl::StatusOr<std::vector<StepReply>> prepared =
      OnEveryShard<StepReply>([&](int k) { return sessions_[k]->Step(step, gradients[k], prepare[k]); });
  if (!prepared.ok()) return NameShardsBehind(prepared.status());
  // Every shard took this step's prepare, so each is at the step before it or beyond: an earlier
  // kept step is applied everywhere, and a failure from here keeps this one.
  if (cut_off_.has_value() && cut_off_->step < step) cut_off_.reset();
  const v1::ShardDecision decision = Decide(*prepared);
  for (StepOptions& o : commit) o.decision = decision;
  static const std::vector<TensorView> kNone;
  may_apply = true;
  absl::StatusOr<std::vector<StepReply>> committed =
      OnEveryShard<StepReply>([&](int k) { return sessions_[k]->Step(step, kNone, commit[k]); });
  if (!committed.ok()) return committed.status();
  StepReply reply;
  reply.step = step;
  reply.applied = decision.skip_reason().empty();
  reply.skip_reason = decision.skip_reason();
  reply.grad_norm = decision.grad_norm();
  reply.replayed = true;
  for (StepReply& part : *committed) {
    reply.replayed = reply.replayed && part.replayed;
    reply.compute_seconds = std::max(reply.compute_seconds, part.compute_seconds);
    reply.num_zeros_in_grad += part.num_zeros_in_grad;
    reply.loss_scale = part.loss_scale;  // every shard's scaler saw the same decisions
    reply.parameters.merge(part.parameters);
  }
  return reply;
}

absl::StatusOr<StepReply> ShardedSession::Step(int64_t step, std::span<const TensorView> gradients,
                                               const StepOptions& options) {
  std::vector<std::vector<TensorView>> by_shard(sessions_.size());
  for (const TensorView& g : gradients) {
    auto it = shard_of_.find(g.name);
    by_shard[it == shard_of_.end() ? 0 : it->second].push_back(g);  // an unknown name: refused by shard 0
  }
  const std::vector<std::vector<TensorView>>* sent = &by_shard;
  const StepOptions* sent_options = &options;
  StepOptions resent_options;
  if (cut_off_.has_value() && cut_off_->step == step) {
    // Some shards may have committed it: the others must commit their decision with the gradients
    // it was computed from, not this call's, as one daemon answers a resend of a step it applied.
    if (!cut_off_->gradients_kept) {
      return absl::FailedPreconditionError(absl::StrCat(
          "session '", session_id_, "': step ", step,
          " failed once some shards may have applied it, and its gradients could not be kept to send it again; "
          "restore every shard to one step, then DropCutOffStep() (or open the session again), before training "
          "on"));
    }
    Warn(options_, absl::StrCat("muond: session ", session_id_, ": step ", step,
                                " failed once some shards may have applied it; it is sent again with its own "
                                "gradients and options (this call's gradients are not used)"));
    resent_options = cut_off_->options;
    resent_options.parameters_out = options.parameters_out;
    sent = &cut_off_->views;
    sent_options = &resent_options;
  }
  std::chrono::milliseconds backoff = options_.retry_backoff;
  absl::Status before;
  bool may_be_applied = false;
  for (int attempt = 1;; ++attempt) {
    absl::StatusOr<StepReply> reply = StepOnce(step, *sent, *sent_options, may_be_applied);
    if (reply.ok()) {
      reply->attempts = attempt;
      last_step_ = step;
      cut_off_.reset();
      return reply;
    }
    const bool again = ResendStep(reply.status()) && attempt < options_.max_step_attempts;
    if (!again && may_be_applied) KeepCutOffStep(step, *sent, *sent_options);
    if (!ResendStep(reply.status())) return OnLaterTry(reply.status(), attempt, before);
    before = reply.status();
    if (attempt >= options_.max_step_attempts) return AfterTries(reply.status(), attempt);
    // Every shard's channel reconnects during one pause, not one pause after another.
    (void)OnEveryShard<bool>([&](int k) -> absl::StatusOr<bool> {
      clients_[k]->PauseBeforeRetry(backoff);
      return true;
    });
    backoff *= 2;
  }
}

std::optional<int64_t> ShardedSession::cut_off_step() const {
  if (!cut_off_.has_value()) return std::nullopt;
  return cut_off_->step;
}

void ShardedSession::KeepCutOffStep(int64_t step, const std::vector<std::vector<TensorView>>& gradients,
                                    const StepOptions& options) {
  // Kept already: this step's resend failed too, or this step failed while an earlier one is kept,
  // which must still be sent with its own gradients (replacing it would send it with others').
  if (cut_off_.has_value()) return;
  CutOffStep& kept = cut_off_.emplace(CutOffStep{});
  kept.step = step;
  try {
    kept.options = options;
    kept.options.parameters_out.clear();  // the caller's memory of that call
    for (const std::vector<TensorView>& shard : gradients) {
      for (const TensorView& g : shard) kept.values.emplace_back(g.values.begin(), g.values.end());
    }
    size_t next = 0;
    for (const std::vector<TensorView>& shard : gradients) {
      std::vector<TensorView>& mine = kept.views.emplace_back();
      for (const TensorView& g : shard) mine.push_back({g.name, g.shape, kept.values[next++]});
    }
    kept.gradients_kept = true;
  } catch (const std::bad_alloc&) {
    // Kept without them, so that its number is never sent with other gradients.
    kept.options = StepOptions{};
    kept.values.clear();
    kept.views.clear();
    Warn(options_, absl::StrCat("muond: session ", session_id_, ": step ", step,
                                " failed once some shards may have applied it, and its gradients cannot be kept "
                                "(out of memory): the next step of its number is refused"));
  }
}

void ShardedSession::DropCutOffStep() { cut_off_.reset(); }

absl::StatusOr<ParameterMap> ShardedSession::GetParameters(int64_t* last_step) {
  std::vector<int64_t> steps(sessions_.size());
  absl::StatusOr<std::vector<ParameterMap>> parts =
      OnEveryShard<ParameterMap>([&](int k) { return sessions_[k]->GetParameters(&steps[k]); });
  if (!parts.ok()) return parts.status();
  absl::StatusOr<int64_t> common = CommonStep(steps);
  if (!common.ok()) return common.status();
  if (last_step != nullptr) *last_step = *common;
  ParameterMap all;
  for (ParameterMap& part : *parts) all.merge(part);
  return all;
}

absl::StatusOr<int64_t> ShardedSession::Checkpoint() {
  if (sessions_.size() > 1) {
    absl::StatusOr<std::vector<int64_t>> before = ShardSteps();
    // A shard without the session: its own checkpoint call below refuses, with the daemon's reason.
    if (!before.ok() && before.status().code() != absl::StatusCode::kNotFound) return before.status();
    if (before.ok()) {
      if (absl::StatusOr<int64_t> common = CommonStep(*before); !common.ok()) return common.status();
    }
  }
  absl::StatusOr<std::vector<int64_t>> steps = OnEveryShard<int64_t>([&](int k) { return sessions_[k]->Checkpoint(); });
  if (!steps.ok()) return steps.status();
  return CommonStep(*steps);
}

absl::StatusOr<StateDigest> ShardedSession::GetStateDigest() {
  absl::StatusOr<std::vector<StateDigest>> shards =
      OnEveryShard<StateDigest>([&](int k) { return sessions_[k]->GetStateDigest(); });
  if (!shards.ok()) return shards.status();
  std::vector<int64_t> steps;
  for (const StateDigest& shard : *shards) steps.push_back(shard.step);
  if (absl::StatusOr<int64_t> common = CommonStep(steps); !common.ok()) return common.status();
  return CombineShardDigests(*shards);
}

absl::Status ShardedSession::Close() {
  absl::StatusOr<std::vector<bool>> closed = OnEveryShard<bool>([&](int k) -> absl::StatusOr<bool> {
    absl::Status status = sessions_[k]->Close();
    if (!status.ok() && status.code() != absl::StatusCode::kNotFound) return status;
    return true;
  });
  return closed.status();
}

}  // namespace muond::client
