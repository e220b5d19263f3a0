#include "server/transport/shm/shared_memory_regions.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/echo.h"

namespace muond::transport {

uint64_t SharedMemoryRegions::OpenConnection() {
  absl::MutexLock lock(&mu_);
  return next_connection_++;
}

absl::StatusOr<std::string> SharedMemoryRegions::AddPending(uint64_t connection, SealedMemfd memfd, absl::Time now) {
  absl::MutexLock lock(&mu_);
  if (pending_.size() >= static_cast<size_t>(limits_.max_pending)) {
    return absl::ResourceExhaustedError(absl::StrCat("the daemon holds ", pending_.size(),
                                                     " unclaimed regions, its limit (--shm-max-pending-fds); "
                                                     "register them first or try again later"));
  }
  int held = 0;
  for (const auto& [ticket, pending] : pending_) held += pending.connection == connection ? 1 : 0;
  if (held >= limits_.max_pending_per_connection) {
    return absl::ResourceExhaustedError(
        absl::StrCat("this connection holds ", held, " unclaimed regions already; register them first"));
  }
  std::string ticket = RandomTicket();
  pending_.emplace(ticket, Pending{connection, std::move(memfd), now + limits_.pending_timeout});
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
}

absl::StatusOr<uint64_t> SharedMemoryRegions::Register(const std::string& caller, const std::string& name,
                                                       const std::string& ticket) {
  if (absl::Status ok = CheckRegionName(name); !ok.ok()) return ok;
  absl::MutexLock lock(&mu_);
  auto pending = pending_.find(ticket);
  if (pending == pending_.end()) {
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
  regions_.Insert({caller, "", connection}, name, *std::move(mapping));
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
    // The table holds one reference; every other is a step using the region.
    out.push_back({region, mapping->size(), static_cast<int>(mapping.use_count() - 1)});
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
  return regions_.Find(caller, name, /*session_id=*/nullptr, field, " is registered by this caller");
}

}  // namespace muond::transport
