#include "server/transport/shm/shared_memory_regions.h"

#include <algorithm>
#include <optional>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/echo.h"

namespace muond::transport {

std::string SharedMemoryRegions::Grant(const std::string& caller, absl::Time now) {
  std::string grant = RandomTicket();
  absl::MutexLock lock(&mu_);
  // Grants hold no descriptor, but still a caller's outstanding ones are bounded: the oldest goes.
  int held = 0;
  auto oldest = grants_.end();
  for (auto it = grants_.begin(); it != grants_.end(); ++it) {
    if (it->second.caller != caller) continue;
    ++held;
    if (oldest == grants_.end() || it->second.expires < oldest->second.expires) oldest = it;
  }
  if (held >= SharedMemoryLimits::kMaxGrantsPerCaller) grants_.erase(oldest);
  grants_.emplace(grant, GrantEntry{caller, now + limits_.pending_timeout});
  return grant;
}

uint64_t SharedMemoryRegions::OpenConnection() {
  absl::MutexLock lock(&mu_);
  return next_connection_++;
}

absl::Status SharedMemoryRegions::Bind(uint64_t connection, const std::string& grant, absl::Time now) {
  absl::MutexLock lock(&mu_);
  if (bound_.contains(connection)) return absl::FailedPreconditionError("grant: this connection presented one already");
  auto it = grants_.find(grant);
  if (it == grants_.end() || it->second.expires <= now) {
    if (it != grants_.end()) grants_.erase(it);
    return absl::PermissionDeniedError(
        "grant: unknown, used or expired (ask GrantSharedMemory for one and present it at once)");
  }
  const std::string caller = std::move(it->second.caller);
  grants_.erase(it);
  const int share = std::max(1, limits_.max_connections / 4);
  int held = 0;
  for (const auto& [id, owner] : bound_) held += owner == caller ? 1 : 0;
  if (held >= share) {
    return absl::ResourceExhaustedError(absl::StrCat("grant: this caller holds ", held,
                                                     " shared-memory connections, its share (a quarter of "
                                                     "--shm-max-connections); close some first"));
  }
  bound_.emplace(connection, caller);
  return absl::OkStatus();
}

bool SharedMemoryRegions::IsBound(uint64_t connection) const {
  absl::MutexLock lock(&mu_);
  return bound_.contains(connection);
}

absl::StatusOr<std::string> SharedMemoryRegions::AddPending(uint64_t connection, SealedMemfd memfd, absl::Time now,
                                                            int* evicted) {
  std::optional<SealedMemfd> dropped;  // closed after `lock`
  absl::MutexLock lock(&mu_);
  auto bound = bound_.find(connection);
  if (bound == bound_.end()) {
    return absl::FailedPreconditionError("grant: this connection presented no grant; a memfd needs one");
  }
  const std::string& caller = bound->second;
  int held = 0;
  absl::flat_hash_map<std::string, int> per_caller;
  for (const auto& [ticket, pending] : pending_) {
    held += pending.connection == connection ? 1 : 0;
    ++per_caller[pending.caller];
  }
  if (held >= limits_.max_pending_per_connection) {
    return absl::ResourceExhaustedError(
        absl::StrCat("this connection holds ", held, " unclaimed regions already; register them first"));
  }
  if (!pending_.empty() && pending_.size() >= static_cast<size_t>(limits_.max_pending)) {
    // Full: the caller holding the most gives up its oldest, so no caller can lock another out.
    auto largest = std::max_element(per_caller.begin(), per_caller.end(),
                                    [](const auto& a, const auto& b) { return a.second < b.second; });
    auto oldest = pending_.end();
    for (auto it = pending_.begin(); it != pending_.end(); ++it) {
      if (it->second.caller == largest->first &&
          (oldest == pending_.end() || it->second.expires < oldest->second.expires)) {
        oldest = it;
      }
    }
    dropped.emplace(std::move(oldest->second.memfd));
    pending_.erase(oldest);
    if (evicted != nullptr) ++*evicted;
  }
  std::string ticket = RandomTicket();
  pending_.emplace(ticket, Pending{connection, caller, std::move(memfd), now + limits_.pending_timeout});
  return ticket;
}

int SharedMemoryRegions::ExpirePending(absl::Time now) {
  std::vector<SealedMemfd> expired;  // closed after `lock`
  absl::MutexLock lock(&mu_);
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (it->second.expires <= now) {
      expired.push_back(std::move(it->second.memfd));
      pending_.erase(it++);
    } else {
      ++it;
    }
  }
  absl::erase_if(grants_, [now](const auto& grant) { return grant.second.expires <= now; });
  return static_cast<int>(expired.size());
}

absl::Time SharedMemoryRegions::NextExpiry() const {
  absl::MutexLock lock(&mu_);
  absl::Time next = absl::InfiniteFuture();
  for (const auto& [ticket, pending] : pending_) next = std::min(next, pending.expires);
  return next;
}

int SharedMemoryRegions::PendingCount() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(pending_.size());
}

void SharedMemoryRegions::CloseConnection(uint64_t connection) {
  {
    std::vector<std::shared_ptr<SharedMapping>> dropped;  // destroyed after `lock`: unmapped outside it
    std::vector<SealedMemfd> dropped_pending;
    absl::MutexLock lock(&mu_);
    DropConnectionLocked(connection, dropped, dropped_pending);
  }
  CloseTickets(connection);
}

void SharedMemoryRegions::DropConnectionLocked(uint64_t connection,
                                               std::vector<std::shared_ptr<SharedMapping>>& dropped,
                                               std::vector<SealedMemfd>& dropped_pending) {
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (it->second.connection == connection) {
      dropped_pending.push_back(std::move(it->second.memfd));
      pending_.erase(it++);
    } else {
      ++it;
    }
  }
  for (auto& mapping : regions_.TakeConnection(connection)) dropped.push_back(std::move(mapping));
  bound_.erase(connection);
}

absl::StatusOr<uint64_t> SharedMemoryRegions::Register(const std::string& caller, const std::string& name,
                                                       const std::string& ticket) {
  if (absl::Status ok = CheckRegionName(name); !ok.ok()) return ok;
  absl::MutexLock lock(&mu_);
  auto pending = pending_.find(ticket);
  if (pending == pending_.end() || pending->second.caller != caller) {
    return absl::NotFoundError("ticket: no region was passed under this ticket, or it was claimed already");
  }
  if (regions_.contains(caller, name)) {
    return absl::AlreadyExistsError(absl::StrCat("name: a region '", name, "' is registered already"));
  }
  const int held = regions_.CountOf(caller);
  if (held >= limits_.max_regions_per_caller) {
    return absl::ResourceExhaustedError(
        absl::StrCat("name: this caller holds ", held, " regions already, the daemon's limit"));
  }
  // Mapped now that an authenticated caller claims it; the ticket is used up either way.
  const uint64_t connection = pending->second.connection;
  SealedMemfd memfd = std::move(pending->second.memfd);
  pending_.erase(pending);
  absl::StatusOr<std::shared_ptr<SharedMapping>> mapping = std::move(memfd).Map();
  if (!mapping.ok()) return absl::Status(mapping.status().code(), absl::StrCat("ticket: ", mapping.status().message()));
  const uint64_t size = (*mapping)->size();
  regions_.Insert({.caller = caller, .session = {}, .connection = connection}, name, *std::move(mapping));
  return size;
}

absl::Status SharedMemoryRegions::Unregister(const std::string& caller, const std::string& name) {
  std::shared_ptr<SharedMapping> dropped;  // destroyed after `lock`: unmapped outside it
  absl::MutexLock lock(&mu_);
  dropped = regions_.Take(caller, name);
  if (dropped == nullptr) return absl::NotFoundError(absl::StrCat("name: no region '", Echo(name), "' is registered"));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<RegionStatus>> SharedMemoryRegions::Status(const std::string& caller,
                                                                      const std::string& name) const {
  absl::MutexLock lock(&mu_);
  std::vector<RegionStatus> out;
  regions_.ForEachOf(caller, [&](const std::string& region, const std::shared_ptr<SharedMapping>& mapping) {
    if (!name.empty() && region != name) return;
    out.push_back({region, mapping->size(), mapping->answers().calls_in_flight()});
  });
  if (!name.empty() && out.empty()) {
    return absl::NotFoundError(absl::StrCat("name: no region '", Echo(name), "' is registered"));
  }
  return out;
}

absl::StatusOr<std::shared_ptr<SharedMapping>> SharedMemoryRegions::Find(const std::string& caller,
                                                                         const std::string& name,
                                                                         const std::string& field) const {
  absl::MutexLock lock(&mu_);
  return regions_.Find(caller, name, /*session=*/nullptr, field, " is registered by this caller");
}

}  // namespace muond::transport
