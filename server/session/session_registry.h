// SessionRegistry: the daemon's sessions by id — create-or-attach, look-up, close, list — with the
// checks that apply across sessions: ownership, --max-sessions and the memory quotas.
//
// Owns the sessions through shared_ptr so a call that looked a session up keeps it alive even if it
// is closed meanwhile. Borrows the backend, the spec codec and the metrics, which must outlive it.
// Thread-safe: one mutex guards the map; session work (parsing a spec, creating and closing a
// session included) happens outside it.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "kernels/backend.h"
#include "server/durability/session_files.h"
#include "server/metrics/metrics.h"
#include "server/session/memory_quota.h"
#include "server/session/session.h"
#include "server/session/session_config.h"
#include "server/session/spec_codec.h"

namespace muond::session {

struct CreateResult {
  std::shared_ptr<Session> session;
  bool attached = false;
};

class SessionRegistry {
 public:
  SessionRegistry(kernels::Backend* backend, const SpecCodec* codec, SpecLimits limits, int max_sessions,
                  MemoryLimits memory = {}, metrics::Metrics* metrics = metrics::NoMetrics())
      : backend_(backend),
        codec_(codec),
        limits_(limits),
        max_sessions_(max_sessions),
        memory_(memory),
        metrics_(metrics) {}

  // `caller` is the authenticated identity of the request ("" for everyone when authentication is
  // off). A session belongs to the caller that created it; every other caller gets
  // PERMISSION_DENIED naming the session from CreateOrAttach, Find and Close.

  // A new id creates the session owned by `caller` from `spec_json` (parsed by the codec), if the
  // memory quotas allow (checked before anything is allocated); an existing id with an identical
  // spec attaches to it; a different spec is ALREADY_EXISTS naming the difference. The spec is parsed
  // and the session allocated without the registry's lock; a call for an id another call is creating
  // waits for it, then attaches. `create_token` (the request's, at most kMaxCreateTokenBytes; empty:
  // none) is remembered with a session it creates, until it is closed: the same token again is a retry
  // of that request, answered attached = false.
  absl::StatusOr<CreateResult> CreateOrAttach(const std::string& id, const std::string& spec_json,
                                              const std::string& caller = "", const std::string& create_token = "");
  static constexpr size_t kMaxCreateTokenBytes = 64;

  // NOT_FOUND naming the session id when there is none.
  // `field` names the id in errors ("header.session_id" for a step).
  absl::StatusOr<std::shared_ptr<Session>> Find(const std::string& id, const std::string& caller = "",
                                                absl::string_view field = "session_id") const;

  // Drops the session from the map at once (later lookups are NOT_FOUND), then closes it
  // (Session::Close: calls still holding it are refused from then on, its files removed) outside the
  // registry's lock: closing waits for a call that holds the session's own lock, never stopping the
  // other sessions. Until that is done, creating a session of the same id is UNAVAILABLE. Its memory
  // counts against --max-total-bytes for as long as a call still holds the session. Answers the
  // closed session's serial (what the transports bound to it are dropped by).
  absl::StatusOr<uint64_t> Close(const std::string& id, const std::string& caller = "");

  // The sessions `caller` owns, by id.
  std::vector<std::shared_ptr<Session>> ListOwnedBy(const std::string& caller) const;
  // Makes new sessions durable under `options` (a --state-dir) and takes in the sessions restored
  // from it. Call before serving.
  absl::Status EnablePersistence(const durability::StateDirOptions& options);
  // Checkpoints every durable session (at shutdown); returns how many were written.
  int CheckpointAll();
  std::vector<std::shared_ptr<Session>> List() const;
  size_t size() const;

 private:
  // The session of `id`, once no call is creating it (waiting for one that is), or null.
  std::shared_ptr<Session> FindOnceCreatedLocked(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // CreateOrAttach's attaching: the caller's ownership and the same spec; `retried` (the request that
  // created the session, sent again) answers attached = false.
  absl::StatusOr<CreateResult> Attach(std::shared_ptr<Session> session, const std::string& spec_json,
                                      const std::string& caller, bool retried) const;
  // Whether a non-empty `create_token` is that of the request that created session `id`.
  bool CreatedByLocked(const std::string& id, const std::string& create_token) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OK when a session `id` of `bytes` may be added: no session of that id being closed, below
  // --max-sessions (counting those being created) and, for bytes > 0, within the memory quotas
  // (counting those being created and closed ones still held).
  absl::Status CheckRoomLocked(const std::string& id, int64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A session of `config`, with its files under `persistence` when given.
  absl::StatusOr<std::shared_ptr<Session>> NewSession(
      const std::string& id, SessionConfig config, const std::string& caller,
      const std::optional<durability::StateDirOptions>& persistence) const;
  // The open sessions' backend memory.
  int64_t HeldBytesLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // That of closed sessions that calls in flight still hold.
  int64_t ClosedButHeldBytesLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets the closed sessions no call holds any more.
  void PruneClosedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells the metrics what is held now.
  void ReportLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  kernels::Backend* const backend_;
  const SpecCodec* const codec_;
  const SpecLimits limits_;
  const int max_sessions_;
  const MemoryLimits memory_;
  metrics::Metrics* const metrics_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> closing_ ABSL_GUARDED_BY(mu_);            // ids being closed now
  absl::flat_hash_map<std::string, int64_t> creating_ ABSL_GUARDED_BY(mu_);  // ids being created, their bytes
  // The create_token of the request that created each session that had one, by id.
  absl::flat_hash_map<std::string, std::string> create_tokens_ ABSL_GUARDED_BY(mu_);
  // Closed sessions, maybe still held, with their bytes (never taken from a held pointer here, so the
  // registry's lock is never the one a session is destroyed under).
  std::vector<std::pair<std::weak_ptr<Session>, int64_t>> closed_ ABSL_GUARDED_BY(mu_);
  std::optional<durability::StateDirOptions> persistence_ ABSL_GUARDED_BY(mu_);
};

// OK when `id` is a valid session id ([A-Za-z0-9._-]{1,128}); INVALID_ARGUMENT naming `field`. The
// state directory's rule for folder names (durability/session_files.h), so one rule holds everywhere.
using durability::CheckSessionId;

}  // namespace muond::session
