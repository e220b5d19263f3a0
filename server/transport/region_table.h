// RegionTable<T>: the table under every transport whose resources a caller registers and then names
// out of band — shared-memory regions, CUDA IPC memory, NCCL channels. Entries are keyed by (caller,
// name), so a name is private to its caller; each has its owner: the caller, the session it is bound
// to (empty: none) and the liveness connection it lives on (0: none). A session is named by its id and
// its serial, so that an entry of a session closed and then created again under the same id is
// neither the new session's nor taken out with it. The table answers a lookup to the owner only (and,
// for a bound entry, for its session only), counts a caller's entries for the capacity limits, and
// takes entries out by name, by session, by connection or by any predicate.
//
// Entries are shared_ptrs: a step that found one keeps it alive. What the table takes out is handed
// back, not destroyed, so that its owner releases it (unmaps, closes handles, aborts) after dropping
// its lock. Not thread-safe: the owning table (SharedMemoryRegions, CudaMemoryRegions, NcclChannels)
// guards it with its own mutex.
//
// Also CheckRegionName, the rule for the names callers choose.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/echo.h"
#include "common/error_reason.h"

namespace muond::transport {

// A region name: 1 to 128 characters, no control characters (INVALID_ARGUMENT naming `name`).
absl::Status CheckRegionName(const std::string& name);

// The session an entry is bound to: its id (empty: none) and its serial (session::Session::serial,
// which a session created again under the same id does not share).
// Not an aggregate, so that a brace list meant for RegionOwner cannot fill it by brace elision.
struct BoundSession {
  BoundSession() = default;
  BoundSession(std::string session_id, uint64_t session_serial) : id(std::move(session_id)), serial(session_serial) {}
  bool operator==(const BoundSession&) const = default;

  std::string id;
  uint64_t serial = 0;
};

struct RegionOwner {
  std::string caller;
  BoundSession session;     // id empty: not bound to a session
  uint64_t connection = 0;  // the liveness connection; 0: none
};

template <typename T>
class RegionTable {
 public:
  using Ptr = std::shared_ptr<T>;

  // `noun` names an entry in errors ("CUDA memory", "NCCL channel"); `missing` is the reason a lookup
  // of an absent entry carries (common/error_reason.h).
  RegionTable(std::string noun, ErrorReason missing) : noun_(std::move(noun)), missing_(missing) {}

  size_t size() const { return entries_.size(); }
  bool contains(const std::string& caller, const std::string& name) const { return entries_.contains({caller, name}); }
  // How many entries `caller` holds.
  int CountOf(const std::string& caller) const {
    int held = 0;
    for (auto it = entries_.lower_bound({caller, ""}); it != entries_.end() && it->first.first == caller; ++it) ++held;
    return held;
  }

  // Files `value` under (owner.caller, name); false when the name is in use.
  bool Insert(RegionOwner owner, const std::string& name, Ptr value) {
    Key key{owner.caller, name};
    return entries_.emplace(std::move(key), Entry{std::move(owner), std::move(value)}).second;
  }

  // The caller's entry `name`, for a step of `session` (null: any session). NOT_FOUND
  // "<field>: no <noun> '<name>'<missing>", or when it is bound to another session of the same id;
  // FAILED_PRECONDITION when it is bound to another session.
  absl::StatusOr<Ptr> Find(const std::string& caller, const std::string& name, const BoundSession* session,
                           const std::string& field, absl::string_view missing) const {
    auto it = entries_.find({caller, name});
    if (it == entries_.end()) {
      return WithReason(absl::NotFoundError(absl::StrCat(field, ": no ", noun_, " '", Echo(name), "'", missing)),
                        missing_);
    }
    const BoundSession& bound = it->second.owner.session;
    if (session != nullptr && bound.id != session->id) {
      return absl::FailedPreconditionError(absl::StrCat(field, ": ", noun_, " '", Echo(name), "' belongs to session '",
                                                        bound.id, "', not '", Echo(session->id), "'"));
    }
    if (session != nullptr && bound.serial != session->serial) {
      return WithReason(absl::NotFoundError(absl::StrCat(
                            field, ": ", noun_, " '", Echo(name), "' belongs to another session of the id '", bound.id,
                            "' (one was closed and the id created again); register it again")),
                        missing_);
    }
    return it->second.value;
  }

  // Takes out the caller's entry `name`; null when there is none.
  Ptr Take(const std::string& caller, const std::string& name) {
    auto it = entries_.find({caller, name});
    if (it == entries_.end()) return nullptr;
    Ptr taken = std::move(it->second.value);
    entries_.erase(it);
    return taken;
  }

  // Takes out every entry for which `pred(const RegionOwner&, T&)` holds.
  template <typename Pred>
  std::vector<Ptr> TakeIf(Pred&& pred) {
    std::vector<Ptr> taken;
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (pred(std::as_const(it->second.owner), *it->second.value)) {
        taken.push_back(std::move(it->second.value));
        it = entries_.erase(it);
      } else {
        ++it;
      }
    }
    return taken;
  }
  std::vector<Ptr> TakeSession(const BoundSession& session) {
    return TakeIf([&](const RegionOwner& owner, const T&) { return owner.session == session; });
  }
  std::vector<Ptr> TakeConnection(uint64_t connection) {
    return TakeIf([&](const RegionOwner& owner, const T&) { return owner.connection == connection; });
  }
  std::vector<Ptr> TakeAll() {
    return TakeIf([](const RegionOwner&, const T&) { return true; });
  }

  // Calls fn(name, const Ptr&) for each of the caller's entries, in name order.
  template <typename Fn>
  void ForEachOf(const std::string& caller, Fn&& fn) const {
    for (auto it = entries_.lower_bound({caller, ""}); it != entries_.end() && it->first.first == caller; ++it) {
      fn(it->first.second, it->second.value);
    }
  }

 private:
  using Key = std::pair<std::string, std::string>;  // caller, name
  struct Entry {
    RegionOwner owner;
    Ptr value;
  };

  const std::string noun_;
  const ErrorReason missing_;
  std::map<Key, Entry> entries_;
};

}  // namespace muond::transport
