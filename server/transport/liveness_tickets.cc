#include "server/transport/liveness_tickets.h"

#include <sys/random.h>

#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace muond::transport {

std::string RandomTicket() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = ::getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

std::string LivenessTickets::AddLivenessTicket(uint64_t connection) {
  std::string ticket = RandomTicket();
  absl::MutexLock lock(&mu_);
  // One per connection: asking again answers the same ticket.
  for (const auto& [existing, owner] : tickets_) {
    if (owner == connection) return existing;
  }
  tickets_.emplace(ticket, connection);
  return ticket;
}

absl::StatusOr<uint64_t> LivenessTickets::LivenessConnection(const std::string& ticket,
                                                             const std::string& field) const {
  absl::MutexLock lock(&mu_);
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) {
    return absl::NotFoundError(absl::StrCat(field,
                                            ": no open shm_socket connection has this ticket (never issued, or "
                                            "the connection closed)"));
  }
  return it->second;
}

void LivenessTickets::OnConnectionClosed(std::function<void(uint64_t)> listener) {
  absl::MutexLock lock(&mu_);
  listeners_.push_back(std::move(listener));
}

void LivenessTickets::CloseTickets(uint64_t connection) {
  std::vector<std::function<void(uint64_t)>> listeners;
  {
    absl::MutexLock lock(&mu_);
    absl::erase_if(tickets_, [&](const auto& entry) { return entry.second == connection; });
    listeners = listeners_;
  }
  for (const auto& listener : listeners) listener(connection);
}

}  // namespace muond::transport
