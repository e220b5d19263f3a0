#include "server/session/state_dir.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/optim/optimizer.h"
#include "server/session/memory_quota.h"

namespace muond::session {
namespace {

// Step counts by parameter name, in the session's parameter order: -1 for a parameter without one
// (refused by the import), and names the session lacks left out.
std::vector<int64_t> CountsByParameter(const SessionConfig& config,
                                       const std::vector<std::pair<std::string, int64_t>>& counts) {
  std::vector<int64_t> by_parameter(config.parameters.size(), -1);
  for (const auto& [name, count] : counts) {
    auto it = config.parameter_index.find(name);
    if (it != config.parameter_index.end()) by_parameter[it->second] = count;
  }
  return by_parameter;
}

// Every parameter of the spec has its master in the checkpoint, with the spec's shape; the masters'
// values were read from the tensor file, so the spec asks for no more memory than that file held.
absl::Status CheckMastersHaveTheSpecsShapes(const SessionConfig& config, const durability::CheckpointData& data,
                                            const std::string& metadata_file) {
  std::vector<bool> found(config.parameters.size(), false);
  for (const durability::CheckpointTensor& t : data.tensors) {
    if (t.slot != kMasterSlot) continue;
    auto it = config.parameter_index.find(t.parameter);
    if (it == config.parameter_index.end()) continue;  // named in StateFromCheckpoint's refusal
    if (t.shape != config.parameters[it->second].shape) {
      return durability::CheckpointCorrupt(metadata_file,
                                           absl::StrCat("tensor '", t.parameter.substr(0, 200), "/", kMasterSlot,
                                                        "' does not have the shape its spec gives the parameter"));
    }
    found[it->second] = true;
  }
  for (size_t i = 0; i < found.size(); ++i) {
    if (!found[i]) {
      return durability::CheckpointCorrupt(
          metadata_file, absl::StrCat("parameter '", config.parameters[i].name, "' has no master tensor"));
    }
  }
  return absl::OkStatus();
}

static_assert(Session::kRememberedSteps <= durability::kMaxCheckpointContributorSteps,
              "a checkpoint keeps every remembered step's contributors");

// The checkpoint's tensors in the session's terms, each checked against the shapes the session's
// spec gives them.
absl::StatusOr<SessionState> StateFromCheckpoint(durability::CheckpointData& data, const Session& session,
                                                 const std::string& dir) {
  const SessionConfig& config = session.config();
  SessionState state;
  state.last_step = data.last_step;
  if (data.loss_scaler.has_value()) {
    state.loss_scaler = optim::LossScalerState{.scale = data.loss_scaler->scale,
                                               .growth_tracker = data.loss_scaler->growth_tracker,
                                               .hysteresis_tracker = data.loss_scaler->hysteresis_tracker};
  }
  for (const durability::CheckpointPush& p : data.pushes) {
    state.pushes.push_back({p.push, p.global_step, p.staleness, p.applied, p.skip_reason});
  }
  state.step_counts = CountsByParameter(config, data.step_counts);
  if (data.last_decision.has_value()) {
    state.last_decision =
        LastDecision{data.last_decision->applied, data.last_decision->grad_norm, data.last_decision->skip_reason};
  }
  if (!data.contributors.empty()) {  // a checkpoint of several gathering ranks (ImportState checks it)
    std::vector<StepContributors>& contributors = state.contributors.emplace();
    for (durability::CheckpointContributors& c : data.contributors) {
      contributors.push_back(StepContributors{c.step, std::move(c.ranks), c.total_weight});
    }
  }
  if (data.last_overrides.has_value()) {
    // Only an attach's answer reads it: a record that does not decode is dropped as unknown (the
    // import drops one that does not fit the groups the same way), not the session with it.
    absl::StatusOr<std::vector<GroupOverride>> overrides = DecodeOverrides(*data.last_overrides);
    if (overrides.ok()) {
      state.last_overrides = *std::move(overrides);
    } else {
      MUOND_EVENT(warn, "last_overrides_dropped", data.session_id, data.last_step,
                  "session {}: {}/{}'s last_overrides are dropped (an attach answers them as unknown): {}",
                  data.session_id, dir, durability::kCheckpointMetadataFile, overrides.status().message());
    }
  }
  if (data.parts_written.has_value()) {
    const durability::CheckpointPartsWritten& parts = *data.parts_written;
    PartsWritten& written = state.parts_written.emplace();
    written.upload = parts.upload;
    written.last_step = parts.last_step;
    if (!parts.upload) {
      // Every parameter's count, and no other name (the import checks their values).
      if (parts.step_counts.size() != config.parameters.size()) {
        return durability::CheckpointCorrupt(
            dir, absl::StrCat("parts_written.step_counts has ", parts.step_counts.size(), " counts for ",
                              config.parameters.size(), " parameters"));
      }
      for (const auto& [name, count] : parts.step_counts) {
        if (!config.parameter_index.contains(name)) {
          return durability::CheckpointCorrupt(
              dir, absl::StrCat("parts_written.step_counts names '", name.substr(0, 200), "', not a parameter"));
        }
      }
      written.step_counts = CountsByParameter(config, parts.step_counts);
    }
    for (int64_t rank : parts.ranks) {
      if (rank < 0 || rank >= config.world_size) {
        return durability::CheckpointCorrupt(
            dir, absl::StrCat("parts_written.ranks holds ", rank, ", not a rank of the session's ", config.world_size));
      }
      written.ranks.push_back(static_cast<int>(rank));
    }
  }
  for (durability::CheckpointTensor& t : data.tensors) {
    auto it = config.parameter_index.find(t.parameter);
    const std::string key = absl::StrCat(t.parameter, "/", t.slot);
    if (it == config.parameter_index.end()) {
      return durability::CheckpointCorrupt(dir, absl::StrCat("unknown tensor '", key, "'"));
    }
    if (t.shape != session.TensorShape(it->second, t.slot)) {
      return durability::CheckpointCorrupt(dir, absl::StrCat("tensor '", key, "' does not have the spec's shape"));
    }
    // Any of the dtypes is taken: the values are rounded to the tensor's storage format on import
    // (exactly, for a checkpoint the session wrote).
    state.tensors.push_back({it->second, t.slot, std::move(t.values)});
  }
  return state;
}

// The safetensors name of a storage format.
std::string_view SafetensorsDtype(kernels::StorageDtype dtype) {
  switch (dtype) {
    case kernels::StorageDtype::kBf16:
      return "BF16";
    case kernels::StorageDtype::kFp16:
      return "F16";
    case kernels::StorageDtype::kFp32:
      return "F32";
  }
  return "F32";
}

}  // namespace

absl::StatusOr<std::unique_ptr<FilePersistence>> FilePersistence::Open(const durability::StateDirOptions& options,
                                                                       const Session& session,
                                                                       metrics::Metrics* metrics,
                                                                       uint64_t last_generation,
                                                                       std::optional<uint64_t> journal_complete_bytes) {
  MUOND_ASSIGN_OR_RETURN(
      std::unique_ptr<durability::SessionFiles> files,
      durability::SessionFiles::Open(options, session.id(), last_generation, journal_complete_bytes));
  return std::unique_ptr<FilePersistence>(new FilePersistence(std::move(files), session, metrics));
}

absl::Status FilePersistence::RecordStep(const StepRequest& request, const std::vector<HostTensor>& gradients) {
  const auto start = std::chrono::steady_clock::now();
  absl::Status appended = files_->RecordStep(EncodeStepRequest(request), gradients);
  if (files_->options().durability == durability::Durability::kJournal) {
    metrics_->JournalAppended(absl::FromChrono(std::chrono::steady_clock::now() - start), appended.ok());
  }
  if (!appended.ok()) {
    MUOND_EVENT(error, "journal_failed", session_.id(), request.step,
                "session {}: step {} refused, the journal failed: {}", session_.id(), request.step, appended.message());
    return absl::UnavailableError(absl::StrCat("the step could not be made durable: ", appended.message()));
  }
  last_recorded_bytes_ = 0;
  if (records_gradients()) {
    for (const HostTensor& g : gradients) {
      last_recorded_bytes_ += static_cast<int64_t>(g.values.size() * sizeof(float));
    }
  }
  journaled_bytes_ += last_recorded_bytes_;
  return absl::OkStatus();
}

absl::Status FilePersistence::WithdrawStep() {
  absl::Status withdrawn = files_->WithdrawStep();
  if (records_gradients()) metrics_->JournalRecordWithdrawn(withdrawn.ok());
  if (!withdrawn.ok()) return withdrawn;
  journaled_bytes_ -= last_recorded_bytes_;
  last_recorded_bytes_ = 0;
  return absl::OkStatus();
}

int64_t FilePersistence::JournalBudget() const {
  return std::max<int64_t>(session_.state_bytes(), files_->options().journal_floor_bytes);
}

bool FilePersistence::CheckpointDue(int64_t last_step) const {
  const int64_t every = files_->options().checkpoint_every;
  if (every > 0 && last_step % every == 0) return true;
  return records_gradients() && journaled_bytes_ >= JournalBudget() + retry_after_bytes_;
}

durability::CheckpointData CheckpointOf(const Session& session, SessionState state, std::string backend) {
  const SessionConfig& config = session.config();
  durability::CheckpointData data;
  data.session_id = session.id();
  data.owner = session.owner();
  data.spec_json = config.spec_json;
  data.backend = std::move(backend);
  data.last_step = state.last_step;
  for (size_t i = 0; i < config.parameters.size(); ++i) {
    data.step_counts.emplace_back(config.parameters[i].name, state.step_counts[i]);
  }
  if (state.loss_scaler.has_value()) {
    data.loss_scaler = durability::CheckpointLossScaler{state.loss_scaler->scale, state.loss_scaler->growth_tracker,
                                                        state.loss_scaler->hysteresis_tracker};
  }
  for (const PushRecord& p : state.pushes) {
    data.pushes.push_back({p.push, p.global_step, p.staleness, p.applied, p.skip_reason});
  }
  if (state.last_decision.has_value()) {
    data.last_decision = durability::CheckpointLastDecision{
        state.last_decision->applied, state.last_decision->grad_norm, state.last_decision->skip_reason};
  }
  if (state.last_overrides.has_value()) data.last_overrides = EncodeOverrides(*state.last_overrides);
  for (const StepContributors& c : state.contributors.value_or(std::vector<StepContributors>())) {
    data.contributors.push_back(durability::CheckpointContributors{c.step, c.total_weight, c.ranks});
  }
  if (state.parts_written.has_value()) {
    const PartsWritten& written = *state.parts_written;
    durability::CheckpointPartsWritten& parts = data.parts_written.emplace();
    parts.upload = written.upload;
    parts.last_step = written.last_step;
    for (size_t i = 0; i < written.step_counts.size(); ++i) {
      parts.step_counts.emplace_back(config.parameters[i].name, written.step_counts[i]);
    }
    parts.ranks.assign(written.ranks.begin(), written.ranks.end());
  }
  for (StateTensor& t : state.tensors) {
    const ParameterConfig& param = config.parameters[t.parameter];
    std::vector<int64_t> shape = session.TensorShape(t.parameter, t.slot);
    data.tensors.push_back(
        {param.name, std::move(t.slot), std::move(shape), std::move(t.values), std::string(SafetensorsDtype(t.dtype))});
  }
  return data;
}

absl::Status FilePersistence::SaveCheckpoint(SessionState state) {
  durability::CheckpointData data = CheckpointOf(session_, std::move(state), files_->options().backend_name);
  const auto start = std::chrono::steady_clock::now();
  absl::Status saved = files_->SaveCheckpoint(std::move(data));
  metrics_->CheckpointWritten(absl::FromChrono(std::chrono::steady_clock::now() - start), saved.ok());
  if (saved.ok()) {
    journaled_bytes_ = retry_after_bytes_ = 0;  // the journal starts anew
  } else if (records_gradients() && journaled_bytes_ >= JournalBudget()) {
    retry_after_bytes_ = journaled_bytes_;  // tried again once another budget's worth is journaled
  }
  return saved;
}

namespace {

// The most bytes the header of a checkpoint's safetensors file can take for `config`: one JSON entry
// per tensor "<parameter>/<slot>" (each character escaped to at most 6 bytes), its dtype, shape and
// offsets, and the __metadata__ strings (bounded as checkpoint.json is).
uint64_t SafetensorsHeaderBound(const SessionConfig& config) {
  std::vector<std::vector<std::string>> slots_of;
  for (const GroupConfig& group : config.groups) {
    absl::StatusOr<std::unique_ptr<optim::Optimizer>> optimizer = optim::Optimizer::Create(group.options);
    // Options no optimizer accepts: as many slots as any optimizer has, with long names.
    slots_of.push_back(optimizer.ok() ? (*optimizer)->SlotNames() : std::vector<std::string>(4, std::string(64, 's')));
  }
  uint64_t bytes = 8 + durability::kMaxCheckpointMetadataBytes;
  for (const ParameterConfig& p : config.parameters) {
    const uint64_t entry = 128 + 24 * p.shape.size();  // quotes, dtype, shape and offsets
    bytes += 6 * (p.name.size() + 7) + entry;          // "<name>/master"
    for (const std::string& slot : slots_of[p.group]) bytes += 6 * (p.name.size() + 1 + slot.size()) + entry;
  }
  return bytes;
}

}  // namespace

absl::StatusOr<durability::SpecSizes> CheckpointSpecSizes(const durability::CheckpointData& metadata,
                                                          const std::string& metadata_file, const SpecCodec& codec,
                                                          const SpecLimits& limits,
                                                          absl::StatusOr<SessionConfig>* config) {
  absl::StatusOr<SessionConfig> parsed = codec.Parse(metadata.spec_json, limits);
  if (!parsed.ok()) return durability::CheckpointCorrupt(metadata_file, parsed.status().message());
  durability::SpecSizes sizes;
  for (const ParameterConfig& p : parsed->parameters) sizes.numel.push_back(p.numel);
  // Masters and state at their stored widths are within the session's memory estimate (which counts
  // gradients too); twice it leaves room for any encoding of them, beside the header's bound.
  sizes.max_tensor_bytes = 2 * static_cast<uint64_t>(EstimateSessionBytes(*parsed)) + SafetensorsHeaderBound(*parsed);
  if (config != nullptr) *config = std::move(parsed);
  return sizes;
}

absl::StatusOr<LoadedSession> LoadSession(const durability::StateDirOptions& options, const std::string& dir,
                                          kernels::Backend* backend, const SpecCodec& codec, const SpecLimits& limits) {
  const std::string metadata_file = dir + "/" + durability::kCheckpointMetadataFile;
  absl::StatusOr<SessionConfig> config;
  auto parse = [&](const durability::CheckpointData& data) {
    return CheckpointSpecSizes(data, metadata_file, codec, limits, &config);
  };
  MUOND_ASSIGN_OR_RETURN(durability::SessionFolder folder, durability::LoadSessionFolder(options, dir, parse));
  const std::string folder_name = dir.substr(dir.rfind('/') + 1);
  if (folder.checkpoint.session_id != folder_name) {
    return durability::CheckpointCorrupt(metadata_file,
                                         absl::StrCat("session_id '", folder.checkpoint.session_id.substr(0, 140),
                                                      "' is not the folder's name '", folder_name, "'"));
  }
  // The spec sizes what the session allocates: a spec its own tensor file contradicts is refused
  // here, before that allocation, not by the shape checks after it.
  MUOND_RETURN_IF_ERROR(CheckMastersHaveTheSpecsShapes(*config, folder.checkpoint, metadata_file));
  MUOND_ASSIGN_OR_RETURN(
      std::unique_ptr<Session> unique,
      Session::Create(folder.checkpoint.session_id, *std::move(config), backend, folder.checkpoint.owner));
  LoadedSession loaded;
  loaded.session = std::move(unique);
  loaded.journal_path = folder.journal_path;
  loaded.dropped_torn_tail = folder.journal.dropped_torn_tail;
  loaded.journal_complete_bytes = folder.journal.complete_bytes;
  loaded.last_generation = folder.last_generation;
  loaded.records_before_checkpoint = folder.records_before_checkpoint;
  Session& session = *loaded.session;
  MUOND_ASSIGN_OR_RETURN(SessionState state, StateFromCheckpoint(folder.checkpoint, session, dir));
  absl::Status imported = session.ImportState(std::move(state));
  if (!imported.ok()) {
    return absl::DataLossError(absl::StrCat("checkpoint ", dir, " is unusable: ", imported.message()));
  }
  loaded.checkpoint_step = session.last_step();

  // The journal's reader has checked each record's framing, CRCs and gradient sizes against the spec,
  // and left out the records written before the checkpoint was tried.
  for (durability::JournalRecord& record : folder.journal.records) {
    absl::StatusOr<StepRequest> request = DecodeStepRequest(record.request);
    if (!request.ok()) {
      return absl::DataLossError(
          absl::StrCat("journal ", folder.journal_path, " is unusable: ", request.status().message()));
    }
    const int64_t step = GlobalStepOf(*request);
    // Already in the checkpoint: records from before it wait for the next truncation. After it,
    // each record follows the one before (a record repeated, or one missing, is damage).
    if (step <= loaded.checkpoint_step) continue;
    if (step != session.last_step() + 1) {
      return absl::DataLossError(absl::StrCat("journal ", folder.journal_path, " is unusable: step ", step,
                                              " follows step ", session.last_step()));
    }
    absl::StatusOr<StepOutcome> outcome = session.ApplyJournaledStep(*std::move(request), std::move(record.gradients));
    if (!outcome.ok()) {
      return absl::DataLossError(absl::StrCat("journal ", folder.journal_path, ": step ", step,
                                              " does not replay: ", outcome.status().message()));
    }
    ++loaded.replayed;
  }
  return loaded;
}

bool IsDaemonTrouble(const absl::Status& status) {
  return status.code() == absl::StatusCode::kResourceExhausted || status.code() == absl::StatusCode::kUnavailable;
}

absl::StatusOr<std::vector<std::shared_ptr<Session>>> RestoreSessions(const durability::StateDirOptions& options,
                                                                      kernels::Backend* backend, const SpecCodec& codec,
                                                                      const SpecLimits& limits,
                                                                      metrics::Metrics* metrics) {
  MUOND_ASSIGN_OR_RETURN(std::vector<std::string> dirs, durability::ListSessionFolders(options));
  std::vector<std::shared_ptr<Session>> restored;
  for (const std::string& dir : dirs) {
    absl::StatusOr<LoadedSession> loaded = LoadSession(options, dir, backend, codec, limits);
    if (!loaded.ok()) {
      if (IsDaemonTrouble(loaded.status()) || options.on_damaged == durability::DamagedState::kFail) {
        return loaded.status();
      }
      absl::StatusOr<std::string> moved = durability::QuarantineSessionFolder(options, dir);
      if (!moved.ok()) {
        return absl::InternalError(absl::StrCat(
            loaded.status().message(), "; and it cannot be moved into the quarantine: ", moved.status().message()));
      }
      const std::string name = dir.substr(dir.rfind('/') + 1);
      MUOND_EVENT(error, "session_quarantined", name, 0, "session folder {} cannot be restored: {}; moved to {}", dir,
                  loaded.status().message(), *moved);
      metrics->SessionQuarantined();
      continue;
    }
    std::shared_ptr<Session> session = std::move(loaded->session);
    if (loaded->dropped_torn_tail) {
      MUOND_LOG(warn,
                "journal {} ended in a partly written record (a crash during an unacknowledged step); "
                "dropped it",
                loaded->journal_path);
    }
    if (loaded->records_before_checkpoint > 0) {
      MUOND_LOG(info,
                "journal {}: {} records written before the checkpoint in place (which replaced them) not replayed",
                loaded->journal_path, loaded->records_before_checkpoint);
    }
    MUOND_ASSIGN_OR_RETURN(
        std::unique_ptr<FilePersistence> persistence,
        FilePersistence::Open(options, *session, metrics, loaded->last_generation, loaded->journal_complete_bytes));
    session->AttachPersistence(std::move(persistence));
    // Fold the replayed steps into a fresh checkpoint, which also empties the journal. Should it fail
    // for this session's own files (an entry in the way of them), the checkpoint and journal read stay
    // as they were, and the journal goes on from them: the session is served all the same. A full
    // disk or a shortage of memory is the daemon's trouble, and stops the start as before.
    if (absl::Status folded = session->Checkpoint().status(); !folded.ok()) {
      if (IsDaemonTrouble(folded)) return folded;
      MUOND_EVENT(warn, "checkpoint_failed", session->id(), session->last_step(),
                  "session {}: restored, but its checkpoint could not be written ({}); its journal keeps the steps",
                  session->id(), folded.message());
    }
    MUOND_EVENT(info, "session_restored", session->id(), session->last_step(),
                "session {} restored at step {} (checkpoint at step {} + {} journaled steps)", session->id(),
                session->last_step(), loaded->checkpoint_step, loaded->replayed);
    restored.push_back(std::move(session));
  }
  return restored;
}

}  // namespace muond::session
