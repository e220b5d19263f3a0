// ShmSocketServer: the Unix-domain socket on which clients on the daemon's host pass memfd regions
// (SCM_RIGHTS), the way tensorpipe and Wayland share memory: nothing has a name that could be
// guessed or leaked in /dev/shm, and the kernel frees the memory once both sides have let go.
//
// Protocol, per connection. First the client presents a grant it got from the authenticated
// GrantSharedMemory RPC: the byte 'G' and the grant's 32 characters, answered "ok\n"; the connection
// is that caller's from then on. Then, any number of times: one byte ('R') with one file descriptor
// attached, answered "ok <ticket> <byte_size>\n" (the ticket is claimed with RegisterSharedMemory,
// by the same caller), or 'L' alone, answered "ok <liveness ticket>\n". Any refusal is
// "error <reason>\n". A descriptor or 'L' on a connection that presented no grant is refused and
// the connection closed, so a peer that has not authenticated holds no descriptor but its
// connection, and that only for kGrantTimeout. The connection stays open while the client wants its
// regions; when it closes (the client exited or crashed) the regions it passed are dropped.
//
// The address is "@name" for Linux's abstract namespace (reachable from the daemon's network
// namespace only, which is what "the same host" means for a container) or a filesystem path
// (created mode 0666, removed when the server stops). One thread serves every connection with poll
// (common/listener_loop.h).
//
// Descriptors are a daemon-wide budget (gRPC needs its share): at most `regions->limits()`'s
// max_connections connections and max_pending unclaimed memfds are held (SharedMemoryRegions says
// how they are shared between callers). At the connection limit a new connection takes the place of
// the oldest one that has presented no grant yet; when every one has, the new one is closed at once,
// with a (throttled) log line. Unclaimed tickets expire after pending_timeout. When accept4 fails for want of
// descriptors the listener is left alone for a moment instead of being polled again at once (a readable listener would
// make the loop spin).
//
// Ownership: the daemon owns the server; `regions` must outlive it. Stopping (the destructor) joins
// the thread and closes every connection. Thread-safe as far as its public methods go.
#pragma once

#include <poll.h>

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/listener_loop.h"
#include "common/log_throttle.h"
#include "server/transport/shm/shared_memory_regions.h"

namespace muond::transport {

class ShmSocketServer {
 public:
  static absl::StatusOr<std::unique_ptr<ShmSocketServer>> Start(const std::string& address,
                                                                SharedMemoryRegions* regions);
  ~ShmSocketServer();
  ShmSocketServer(const ShmSocketServer&) = delete;
  ShmSocketServer& operator=(const ShmSocketServer&) = delete;

  const std::string& address() const { return address_; }

  // How long a connection may stay open without presenting a grant.
  static constexpr absl::Duration kGrantTimeout = absl::Seconds(5);

 private:
  ShmSocketServer(std::string address, SharedMemoryRegions* regions);
  // The loop's Handler (common/listener_loop.h), on its thread.
  absl::Time Prepare(std::vector<pollfd>& fds);
  void Serve(std::span<const pollfd> fds);
  void Accept(int fd);
  void CloseAll();
  void Drop(int fd);

  struct Connection {
    uint64_t id = 0;
    bool bound = false;
    absl::Time grant_deadline;  // when an unbound connection is closed
    std::string grant;          // the part of a grant ('G') read so far
    bool reading_grant = false;
  };
  // Reads and answers one message of `c` on `fd`; false when the connection is finished.
  bool ServeOne(int fd, Connection& c);
  bool ReadGrant(int fd, Connection& c);
  bool RefuseUnbound(int fd, const std::vector<int>& fds);

  const std::string address_;
  SharedMemoryRegions* const regions_;
  std::map<int, Connection> connections_;  // by fd; the loop's thread only
  LogThrottle refused_connections_, refused_memfds_, expiries_, evictions_, unbound_;
  int64_t expired_ = 0;                 // tickets expired since the last line about them
  std::unique_ptr<ListenerLoop> loop_;  // last: stopped before anything it uses goes
};

// The default address of a daemon: an abstract name unique to this process.
std::string DefaultShmSocketAddress();

}  // namespace muond::transport
