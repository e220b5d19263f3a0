// LivenessTickets: tickets that name a client's open connection, so that resources the client holds
// elsewhere (CUDA IPC memory) live exactly as long as that connection. The connection's owner (the
// shared-memory socket, SharedMemoryRegions) issues a ticket on request ('L' on the socket) and
// calls CloseTickets when the connection closes; a resource registered with a ticket resolves it to
// its connection (LivenessConnection) and is dropped by the listeners set with OnConnectionClosed.
//
// Also RandomTicket, the unguessable token behind every ticket and channel name.
// Thread-safety: thread-safe; listeners are called without locks held.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace muond::transport {

class LivenessTickets {
 public:
  // A ticket naming `connection` for as long as it is open (one per connection: asked again, the same).
  std::string AddLivenessTicket(uint64_t connection);
  // The connection a liveness ticket names; NOT_FOUND naming `field` when it names none (never
  // issued, or its connection closed).
  absl::StatusOr<uint64_t> LivenessConnection(const std::string& ticket, const std::string& field) const;
  // `listener(connection)` is called (on the closing thread, without locks held) after each
  // connection closes. Set listeners before connections are served.
  void OnConnectionClosed(std::function<void(uint64_t)> listener);

 protected:
  // Forgets the connection's ticket, then tells the listeners.
  void CloseTickets(uint64_t connection);

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, uint64_t> tickets_ ABSL_GUARDED_BY(mu_);  // ticket -> connection
  std::vector<std::function<void(uint64_t)>> listeners_ ABSL_GUARDED_BY(mu_);
};

// 128 random bits from the kernel, as 32 hex digits.
std::string RandomTicket();

}  // namespace muond::transport
