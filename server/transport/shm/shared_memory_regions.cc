#include "server/transport/shm/shared_memory_regions.h"

#include <sys/random.h>

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/escaping.h"
#include "common/echo.h"

namespace muond::transport {
absl::Status CheckRegionName(const std::string& name) {
  if (name.empty() || name.size() > 128) {
    return absl::InvalidArgumentError(absl::StrCat("name: a region name has 1 to 128 characters, got ", name.size()));
  }
  for (unsigned char c : name) {
    if (c < 0x20 || c == 0x7f) return absl::InvalidArgumentError("name: control characters are not allowed");
  }
  return absl::OkStatus();
}

std::string RandomTicket() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = ::getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

uint64_t SharedMemoryRegions::OpenConnection() {
  absl::MutexLock lock(&mu_);
  return next_connection_++;
}

absl::StatusOr<std::string> SharedMemoryRegions::AddPending(uint64_t connection, SealedMemfd memfd,
                                                            absl::Time now) {
  absl::MutexLock lock(&mu_);
  if (pending_.size() >= static_cast<size_t>(limits_.max_pending)) {
    return absl::ResourceExhaustedError(absl::StrCat("the daemon holds ", pending_.size(),
                                                     " unclaimed regions, its limit (--shm-max-pending-fds); "
                                                     "register them first or try again later"));
  }
  int held = 0;
  for (const auto& [ticket, pending] : pending_) held += pending.connection == connection ? 1 : 0;
  if (held >= limits_.max_pending_per_connection) {
    return absl::ResourceExhaustedError(absl::StrCat("this connection holds ", held,
                                                     " unclaimed regions already; register them first"));
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
  std::vector<std::function<void(uint64_t)>> listeners;
  {
    std::vector<std::shared_ptr<SharedMapping>> dropped;  // destroyed after `lock`: unmapped outside it
    std::vector<SealedMemfd> dropped_pending;
    absl::MutexLock lock(&mu_);
    DropConnectionLocked(connection, dropped, dropped_pending);
    listeners = listeners_;
  }
  for (const auto& listener : listeners) listener(connection);
}

std::string SharedMemoryRegions::AddLivenessTicket(uint64_t connection) {
  std::string ticket = RandomTicket();
  absl::MutexLock lock(&mu_);
  // One per connection: asking again answers the same ticket.
  for (const auto& [existing, owner] : liveness_) {
    if (owner == connection) return existing;
  }
  liveness_.emplace(ticket, connection);
  return ticket;
}

absl::StatusOr<uint64_t> SharedMemoryRegions::LivenessConnection(const std::string& ticket,
                                                                 const std::string& field) const {
  absl::MutexLock lock(&mu_);
  auto it = liveness_.find(ticket);
  if (it == liveness_.end()) {
    return absl::NotFoundError(absl::StrCat(field, ": no open shm_socket connection has this ticket (never issued, or "
                                            "the connection closed)"));
  }
  return it->second;
}

void SharedMemoryRegions::OnConnectionClosed(std::function<void(uint64_t)> listener) {
  absl::MutexLock lock(&mu_);
  listeners_.push_back(std::move(listener));
}

void SharedMemoryRegions::DropConnectionLocked(uint64_t connection,
                                               std::vector<std::shared_ptr<SharedMapping>>& dropped,
                                               std::vector<SealedMemfd>& dropped_pending) {
  for (auto it = liveness_.begin(); it != liveness_.end();) {
    if (it->second == connection) {
      liveness_.erase(it++);
    } else {
      ++it;
    }
  }
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (it->second.connection == connection) {
      dropped_pending.push_back(std::move(it->second.memfd));
      pending_.erase(it++);
    } else {
      ++it;
    }
  }
  for (auto it = regions_.begin(); it != regions_.end();) {
    if (it->second.connection == connection) {
      dropped.push_back(std::move(it->second.mapping));
      it = regions_.erase(it);
    } else {
      ++it;
    }
  }
}

absl::StatusOr<uint64_t> SharedMemoryRegions::Register(const std::string& caller, const std::string& name,
                                                       const std::string& ticket) {
  if (absl::Status ok = CheckRegionName(name); !ok.ok()) return ok;
  absl::MutexLock lock(&mu_);
  auto pending = pending_.find(ticket);
  if (pending == pending_.end()) {
    return absl::NotFoundError("ticket: no region was passed under this ticket, or it was claimed already");
  }
  if (regions_.contains({caller, name})) {
    return absl::AlreadyExistsError(absl::StrCat("name: a region '", name, "' is registered already"));
  }
  int held = 0;
  for (auto it = regions_.lower_bound({caller, ""}); it != regions_.end() && it->first.first == caller; ++it) ++held;
  if (held >= limits_.max_regions_per_caller) {
    return absl::ResourceExhaustedError(absl::StrCat("name: this caller holds ", held,
                                                     " regions already, the daemon's limit"));
  }
  // Mapped now that an authenticated caller claims it; the ticket is used up either way.
  const uint64_t connection = pending->second.connection;
  SealedMemfd memfd = std::move(pending->second.memfd);
  pending_.erase(pending);
  absl::StatusOr<std::shared_ptr<SharedMapping>> mapping = std::move(memfd).Map();
  if (!mapping.ok()) return absl::Status(mapping.status().code(), absl::StrCat("ticket: ", mapping.status().message()));
  const uint64_t size = (*mapping)->size();
  regions_.emplace(Key{caller, name}, Region{connection, *std::move(mapping)});
  return size;
}

absl::Status SharedMemoryRegions::Unregister(const std::string& caller, const std::string& name) {
  std::shared_ptr<SharedMapping> dropped;  // destroyed after `lock`: unmapped outside it
  absl::MutexLock lock(&mu_);
  auto it = regions_.find({caller, name});
  if (it == regions_.end())
    return absl::NotFoundError(absl::StrCat("name: no region '", Echo(name), "' is registered"));
  dropped = std::move(it->second.mapping);
  regions_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<RegionStatus>> SharedMemoryRegions::Status(const std::string& caller,
                                                                       const std::string& name) const {
  absl::MutexLock lock(&mu_);
  std::vector<RegionStatus> out;
  for (auto it = regions_.lower_bound({caller, ""}); it != regions_.end() && it->first.first == caller; ++it) {
    if (!name.empty() && it->first.second != name) continue;
    // The table holds one reference; every other is a step using the region.
    out.push_back({it->first.second, it->second.mapping->size(),
                   static_cast<int>(it->second.mapping.use_count() - 1)});
  }
  if (!name.empty() && out.empty()) {
    return absl::NotFoundError(absl::StrCat("name: no region '", Echo(name), "' is registered"));
  }
  return out;
}

absl::StatusOr<std::shared_ptr<SharedMapping>> SharedMemoryRegions::Find(const std::string& caller,
                                                                         const std::string& name,
                                                                         const std::string& field) const {
  absl::MutexLock lock(&mu_);
  auto it = regions_.find({caller, name});
  if (it == regions_.end()) {
    return absl::NotFoundError(absl::StrCat(field, ": no shared-memory region '", Echo(name),
                                            "' is registered by this caller"));
  }
  return it->second.mapping;
}

}  // namespace muond::transport
