#include "server/session/session_registry.h"

#include <algorithm>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/echo.h"
#include "common/error_reason.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/optim/options.h"
#include "server/durability/checkpoint.h"
#include "server/security/caller_identity.h"
#include "server/session/state_dir.h"

namespace muond::session {
namespace {

// The one ownership check of the daemon. Without authentication every caller and owner is "".
absl::Status CheckSessionOwner(const Session& session, const std::string& caller) {
  return security::CheckOwner(session.owner(), caller, session.id());
}

// A session whose checkpoints a restore could not read is refused before it exists (with a state
// directory, where its checkpoints are what it survives by).
absl::Status CheckCheckpointRoom(const SessionConfig& config, const std::string& owner) {
  std::vector<std::string> names;
  names.reserve(config.parameters.size());
  for (const ParameterConfig& parameter : config.parameters) names.push_back(parameter.name);
  return durability::CheckCheckpointRoom(config.spec_json, names, config.world_size, owner);
}

// A new session's groups set no option to a value they would not read (heloco_kappa without heloco,
// qk_clip_threshold without QK-clip pairs: optim::CheckOptionsAreRead). A shard of a sharded session
// sees only its own pairs: it goes by the whole session's count its placement gives, and lets
// QK-clip's options pass when the client did not send one. Only at creation: a session restored or
// attached to keeps the spec an earlier muond accepted.
absl::Status CheckEveryOptionIsRead(const SessionConfig& config) {
  const bool qk_clip_reads = !config.qk_clip.empty() || (config.shard.count > 0 && config.shard.qk_clip_pairs != 0);
  for (size_t g = 0; g < config.groups.size(); ++g) {
    if (absl::Status read = optim::CheckOptionsAreRead(config.groups[g].options, qk_clip_reads); !read.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("spec.groups[", g, "].options.", read.message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CreateResult> SessionRegistry::CreateOrAttach(const std::string& id, const std::string& spec_json,
                                                             const std::string& caller,
                                                             const std::string& create_token) {
  MUOND_RETURN_IF_ERROR(CheckSessionId(id));
  if (create_token.size() > kMaxCreateTokenBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("create_token: at most ", kMaxCreateTokenBytes, " bytes, got ", create_token.size()));
  }
  std::shared_ptr<Session> existing;
  std::optional<durability::StateDirOptions> persistence;
  bool retried = false;  // the request that created the session, sent again
  {
    absl::MutexLock lock(&mu_);
    existing = FindOnceCreatedLocked(id);
    if (!existing) MUOND_RETURN_IF_ERROR(CheckRoomLocked(id, 0));
    retried = existing && CreatedByLocked(id, create_token);
    persistence = persistence_;
  }
  if (existing) return Attach(std::move(existing), spec_json, caller, retried);
  // Parsed and checked without the registry's lock: a large spec takes a while, and the other
  // sessions' calls go on meanwhile.
  MUOND_ASSIGN_OR_RETURN(SessionConfig config, codec_->Parse(spec_json, limits_));
  MUOND_RETURN_IF_ERROR(CheckEveryOptionIsRead(config));
  if (persistence) MUOND_RETURN_IF_ERROR(CheckCheckpointRoom(config, caller));
  const int64_t bytes = EstimateSessionBytes(config);
  {
    absl::MutexLock lock(&mu_);
    existing = FindOnceCreatedLocked(id);  // another call created it meanwhile
    if (!existing) {
      MUOND_RETURN_IF_ERROR(CheckRoomLocked(id, bytes));
      MUOND_RETURN_IF_ERROR(CheckNsWorkspace(id, config, *backend_));
      creating_.emplace(id, bytes);  // counted against the limits from now on
    }
    retried = existing && CreatedByLocked(id, create_token);
  }
  if (existing) return Attach(std::move(existing), spec_json, caller, retried);
  // Allocated (and its folder made) without the registry's lock as well. The id stops being created
  // whatever happens, an exception included, so the calls waiting for it never wait for ever.
  bool settled = false;
  absl::Cleanup unsettle = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (settled) return;
    absl::MutexLock lock(&mu_);
    creating_.erase(id);
  };
  absl::StatusOr<std::shared_ptr<Session>> created = NewSession(id, std::move(config), caller, persistence);
  absl::MutexLock lock(&mu_);
  settled = true;
  creating_.erase(id);
  if (!created.ok()) return created.status();
  std::shared_ptr<Session> shared = *std::move(created);
  sessions_.emplace(id, shared);
  if (!create_token.empty()) create_tokens_[id] = create_token;
  ReportLocked();
  metrics_->SessionOpened(id, shared->serial(), {});
  const SessionConfig& made = shared->config();
  MUOND_EVENT(info, "session_created", id, 0, "session {} created: {} tensors, {} parameters, {} groups", id,
              made.parameters.size(), made.total_elements, made.groups.size());
  for (const GroupConfig& group : made.groups) {
    for (const std::string& caveat : optim::PrecisionCaveats(group.options)) {
      MUOND_EVENT(warn, "precision_caveat", id, 0, "session {} group '{}': {}", id, group.name, caveat);
    }
  }
  return CreateResult{std::move(shared), false};
}

std::shared_ptr<Session> SessionRegistry::FindOnceCreatedLocked(const std::string& id) {
  auto created = [this, &id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !creating_.contains(id); };
  mu_.Await(absl::Condition(&created));
  auto it = sessions_.find(id);
  return it == sessions_.end() ? nullptr : it->second;
}

bool SessionRegistry::CreatedByLocked(const std::string& id, const std::string& create_token) const {
  if (create_token.empty()) return false;
  auto it = create_tokens_.find(id);
  return it != create_tokens_.end() && it->second == create_token;
}

absl::StatusOr<CreateResult> SessionRegistry::Attach(std::shared_ptr<Session> session, const std::string& spec_json,
                                                     const std::string& caller, bool retried) const {
  MUOND_RETURN_IF_ERROR(CheckSessionOwner(*session, caller));
  const std::string& id = session->id();
  absl::Status same = codec_->CheckSame(session->config().spec_json, spec_json);
  // ALREADY_EXISTS for a different spec; a request refused for itself (its labels) keeps its code.
  if (!same.ok()) return absl::Status(same.code(), absl::StrCat("session_id '", Echo(id), "': ", same.message()));
  if (retried) {
    MUOND_EVENT(info, "session_create_retried", id, session->last_step(),
                "session {}: its create was sent again (the answer was lost); answered as created", id);
    return CreateResult{std::move(session), false};
  }
  MUOND_EVENT(info, "session_attached", id, session->last_step(), "session {} attached at step {}", id,
              session->last_step());
  return CreateResult{std::move(session), true};
}

absl::Status SessionRegistry::CheckRoomLocked(const std::string& id, int64_t bytes) {
  if (closing_.contains(id)) {
    return absl::UnavailableError(absl::StrCat("session_id '", Echo(id),
                                               "': the session of that id is still being closed (a call on it is "
                                               "running); try again"));
  }
  const size_t held = sessions_.size() + creating_.size();
  if (static_cast<int>(held) >= max_sessions_) {
    return absl::ResourceExhaustedError(absl::StrCat("session_id '", Echo(id), "': the daemon already holds ", held,
                                                     " sessions (--max-sessions ", max_sessions_,
                                                     "); close one first"));
  }
  if (bytes == 0) return absl::OkStatus();
  PruneClosedLocked();
  int64_t creating = 0;
  for (const auto& [other, other_bytes] : creating_) creating += other_bytes;
  return CheckMemoryQuota(id, bytes, HeldBytesLocked() + creating + ClosedButHeldBytesLocked(), memory_);
}

absl::StatusOr<std::shared_ptr<Session>> SessionRegistry::NewSession(
    const std::string& id, SessionConfig config, const std::string& caller,
    const std::optional<durability::StateDirOptions>& persistence) const {
  MUOND_ASSIGN_OR_RETURN(std::unique_ptr<Session> session, Session::Create(id, std::move(config), backend_, caller));
  std::shared_ptr<Session> shared = std::move(session);
  if (persistence) {
    MUOND_ASSIGN_OR_RETURN(std::unique_ptr<FilePersistence> files,
                           FilePersistence::Open(*persistence, *shared, metrics_));
    shared->AttachPersistence(std::move(files));
  }
  return shared;
}

absl::StatusOr<std::shared_ptr<Session>> SessionRegistry::Find(const std::string& id, const std::string& caller,
                                                               absl::string_view field) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) {
    return WithReason(absl::NotFoundError(absl::StrCat(field, ": no session '", Echo(id), "'")),
                      ErrorReason::kSessionNotFound);
  }
  MUOND_RETURN_IF_ERROR(CheckSessionOwner(*it->second, caller));
  return it->second;
}

absl::StatusOr<uint64_t> SessionRegistry::Close(const std::string& id, const std::string& caller) {
  std::shared_ptr<Session> session;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end()) {
      return WithReason(absl::NotFoundError(absl::StrCat("session_id: no session '", Echo(id), "'")),
                        ErrorReason::kSessionNotFound);
    }
    MUOND_RETURN_IF_ERROR(CheckSessionOwner(*it->second, caller));
    session = std::move(it->second);
    sessions_.erase(it);
    create_tokens_.erase(id);
    closing_.insert(id);
    PruneClosedLocked();
    closed_.emplace_back(session, session->state_bytes());
    ReportLocked();
  }
  metrics_->SessionClosed(id);
  // Waits for a call that holds the session's lock (a step being applied, a checkpoint, an upload or
  // SetState), with the registry free for every other session.
  session->Close();
  MUOND_EVENT(info, "session_closed", id, session->last_step(), "session {} closed at step {}", id,
              session->last_step());
  absl::MutexLock lock(&mu_);
  closing_.erase(id);
  return session->serial();
}

absl::Status SessionRegistry::EnablePersistence(const durability::StateDirOptions& options) {
  MUOND_ASSIGN_OR_RETURN(std::vector<std::shared_ptr<Session>> restored,
                         RestoreSessions(options, backend_, *codec_, limits_, metrics_));
  // A journal replay measured its last step: its figures show until the next one, as they do in the
  // session's summary. Read before the registry's lock, which is never held while taking a session's.
  std::vector<HealthWatch::Latest> health;
  for (const std::shared_ptr<Session>& session : restored) health.push_back(session->LatestHealth());
  absl::MutexLock lock(&mu_);
  persistence_ = options;
  for (size_t i = 0; i < restored.size(); ++i) {
    std::shared_ptr<Session>& session = restored[i];
    metrics_->SessionOpened(session->id(), session->serial(), GroupFiguresOf(health[i].clips, health[i].telemetry));
    const std::string id = session->id();
    sessions_.emplace(id, std::move(session));
  }
  ReportLocked();
  return absl::OkStatus();
}

int SessionRegistry::CheckpointAll() {
  int written = 0;
  for (const std::shared_ptr<Session>& session : List()) {
    if (!session->initialized()) continue;
    absl::StatusOr<int64_t> step = session->Checkpoint();
    if (step.ok()) {
      ++written;
    } else if (step.status().code() != absl::StatusCode::kFailedPrecondition) {
      MUOND_EVENT(error, "checkpoint_failed", session->id(), session->last_step(),
                  "session {}: final checkpoint failed: {}", session->id(), step.status().message());
    }
  }
  return written;
}

std::vector<std::shared_ptr<Session>> SessionRegistry::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Session>> out;
  for (const auto& [id, session] : sessions_) out.push_back(session);
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a->id() < b->id(); });
  return out;
}

size_t SessionRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return sessions_.size();
}

std::vector<std::shared_ptr<Session>> SessionRegistry::ListOwnedBy(const std::string& caller) const {
  std::vector<std::shared_ptr<Session>> out = List();
  std::erase_if(out, [&](const std::shared_ptr<Session>& session) { return session->owner() != caller; });
  return out;
}

void SessionRegistry::ReportLocked() const {
  metrics_->SessionsHeld(static_cast<int>(sessions_.size()), HeldBytesLocked());
}

int64_t SessionRegistry::HeldBytesLocked() const {
  // Summed afresh (at most --max-sessions terms), so a closed session stops counting the moment it
  // leaves the map, whichever path removed it.
  int64_t bytes = 0;
  for (const auto& [id, session] : sessions_) bytes += session->state_bytes();
  return bytes;
}

int64_t SessionRegistry::ClosedButHeldBytesLocked() const {
  int64_t bytes = 0;
  for (const auto& [closed, closed_bytes] : closed_) {
    if (!closed.expired()) bytes += closed_bytes;
  }
  return bytes;
}

void SessionRegistry::PruneClosedLocked() {
  std::erase_if(closed_, [](const auto& closed) { return closed.first.expired(); });
}

}  // namespace muond::session
