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
// (created mode 0666, removed when the server stops). One thread serves every connection with poll.
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

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
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
  ShmSocketServer(std::string address, int listen_fd, int wake_read, int wake_write, SharedMemoryRegions* regions)
      : address_(std::move(address)),
        listen_fd_(listen_fd),
        wake_read_(wake_read),
        wake_write_(wake_write),
        regions_(regions) {}
  void Loop();

  const std::string address_;
  const int listen_fd_;
  const int wake_read_, wake_write_;  // a pipe that ends the loop
  SharedMemoryRegions* const regions_;
  std::thread thread_;
};

// The default address of a daemon: an abstract name unique to this process.
std::string DefaultShmSocketAddress();

}  // namespace muond::transport
