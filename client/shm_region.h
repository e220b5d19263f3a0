// ShmRegion: the client's side of muond's shared-memory transport — a memfd the client maps and
// passes to the daemon over the daemon's Unix-domain socket (ServerInfo.shm_socket), on a connection
// that first presented a grant (Client::SharedMemoryGrant); the daemon answers with a one-time ticket
// to claim through RegisterSharedMemory.
//
// The memfd is sized once and sealed against shrinking and growing (the daemon refuses anything it
// could be made to fault on). The socket connection stays open as long as the region: the daemon
// drops every region a connection passed once it closes, so a client that exits or crashes leaves
// nothing behind. Neither side names the memory anywhere a third process could find it.
//
// Ownership: the region owns its mapping, its memfd and its socket. Not thread-safe.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace muond::client {

class ShmRegion {
 public:
  // Creates a region of `bytes` bytes and passes it to the daemon listening on `socket_address`
  // ("@name": Linux's abstract namespace) after presenting `grant` (none when empty: a daemon
  // without ServerInfo.shm_grants); each wait on the socket is bounded by `answer_timeout`
  // (ConnectShmSocket).
  static absl::StatusOr<std::unique_ptr<ShmRegion>> Create(const std::string& socket_address, size_t bytes,
                                                           const std::string& grant,
                                                           std::chrono::milliseconds answer_timeout = {});
  ~ShmRegion();
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;

  char* data() const { return data_; }
  size_t size() const { return size_; }
  // The daemon's one-time ticket for this region.
  const std::string& ticket() const { return ticket_; }

 private:
  ShmRegion(int memfd, int socket, char* data, size_t size, std::string ticket)
      : memfd_(memfd), socket_(socket), data_(data), size_(size), ticket_(std::move(ticket)) {}

  const int memfd_;
  const int socket_;
  char* const data_;
  const size_t size_;
  const std::string ticket_;
};

// The protocol's parts, for callers that pass descriptors themselves: a connection to the daemon's
// socket (owned by the caller; closing it drops what it passed), the grant presented on it ('G';
// nothing when `grant` is empty; FAILED_PRECONDITION with the daemon's reason when refused), and one
// descriptor passed on it with the daemon's one-line answer ("ok <ticket> <bytes>" or
// "error <reason>"). `answer_timeout` above zero bounds every wait on the connection (connecting,
// sending, each answer): a daemon that accepts and never answers is UNAVAILABLE after it, as one
// that is away; zero waits without a limit.
absl::StatusOr<int> ConnectShmSocket(const std::string& socket_address, std::chrono::milliseconds answer_timeout = {});
absl::Status PresentGrant(int socket, const std::string& grant);
absl::StatusOr<std::string> PassDescriptor(int socket, int fd);
// A liveness ticket naming the connection `socket` ('L'): what registered with it lives as long as the
// connection (CUDA IPC memory).
absl::StatusOr<std::string> RequestLivenessTicket(int socket);
// The daemon's one-line answer on `socket`, without its newline.
absl::StatusOr<std::string> ReadAnswer(int socket);

// Whether the daemon's socket accepts a connection from here (same host and network namespace), waiting
// at most a few seconds for it to be taken.
bool ShmSocketReachable(const std::string& socket_address);

}  // namespace muond::client
