// ShmSocketServer: the Unix-domain socket on which clients on the daemon's host pass memfd regions
// (SCM_RIGHTS), the way tensorpipe and Wayland share memory: nothing has a name that could be
// guessed or leaked in /dev/shm, and the kernel frees the memory once both sides have let go.
//
// Protocol, per connection, any number of times: the client sends one byte ('R') with one file
// descriptor attached; the daemon answers one line, "ok <ticket> <byte_size>\n" or "error <reason>\n".
// The ticket is then claimed with the RegisterSharedMemory RPC, which is where the caller is
// authenticated: the socket itself grants nothing. The connection stays open while the client wants
// its regions; when it closes (the client exited or crashed) the regions it passed are dropped.
//
// The address is "@name" for Linux's abstract namespace (reachable from the daemon's network
// namespace only, which is what "the same host" means for a container) or a filesystem path
// (created mode 0666, removed when the server stops). One thread serves every connection with poll
// (common/listener_loop.h).
//
// Descriptors are a daemon-wide budget (gRPC needs its share): at most `regions->limits()`'s
// max_connections connections and max_pending unclaimed memfds are held; beyond, a connection is
// closed at once and a memfd refused, each with a (throttled) log line. Unclaimed tickets expire
// after pending_timeout. When accept4 fails for want of descriptors the listener is left alone for a
// moment instead of being polled again at once (a readable listener would make the loop spin).
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

 private:
  ShmSocketServer(std::string address, SharedMemoryRegions* regions);
  // The loop's Handler (common/listener_loop.h), on its thread.
  absl::Time Prepare(std::vector<pollfd>& fds);
  void Serve(std::span<const pollfd> fds);
  void Accept(int fd);
  void CloseAll();
  void Drop(int fd);

  const std::string address_;
  SharedMemoryRegions* const regions_;
  std::map<int, uint64_t> connections_;  // fd → connection id; the loop's thread only
  LogThrottle refused_connections_, refused_memfds_, expiries_;
  int64_t expired_ = 0;                 // tickets expired since the last line about them
  std::unique_ptr<ListenerLoop> loop_;  // last: stopped before anything it uses goes
};

// The default address of a daemon: an abstract name unique to this process.
std::string DefaultShmSocketAddress();

}  // namespace muond::transport
