#include "server/transport/shm/shm_socket_server.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log_throttle.h"
#include "common/logging.h"

namespace muond::transport {
namespace {

constexpr int kMaxFdsPerMessage = 4;
// After accept4 fails for want of descriptors (EMFILE, ENFILE) or memory, the listener is left alone
// this long: it stays readable, and polling it at once again would spin.
constexpr absl::Duration kAcceptBackoff = absl::Milliseconds(100);

// sockaddr_un for `address` ("@name": abstract); its length in *length.
absl::StatusOr<sockaddr_un> SocketAddress(const std::string& address, socklen_t* length) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const bool abstract = !address.empty() && address[0] == '@';
  if (address.empty() || address.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shm-socket: '", address, "' must have 1 to ", sizeof(addr.sun_path) - 1, " characters"));
  }
  std::memcpy(addr.sun_path, address.data(), address.size());
  if (abstract) addr.sun_path[0] = '\0';
  *length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + address.size() + (abstract ? 0 : 1));
  return addr;
}

void Reply(int fd, const std::string& line) { ::send(fd, line.data(), line.size(), MSG_NOSIGNAL | MSG_DONTWAIT); }

// Reads one message; false when the connection is finished (closed by the peer or broken).
// `refusals` throttles the log of memfds refused at the daemon's limits.
bool Serve(int fd, uint64_t connection, SharedMemoryRegions& regions, LogThrottle& refusals) {
  char byte = 0;
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t n = ::recvmsg(fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (n < 0) return errno == EAGAIN || errno == EINTR;
  std::vector<int> fds;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int received;
      std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      fds.push_back(received);
    }
  }
  if (n == 0 && fds.empty()) return false;  // closed
  if (byte == 'L' && fds.empty() && (msg.msg_flags & MSG_CTRUNC) == 0) {
    // A liveness ticket: what a client registers with its CUDA IPC memory, which then lives as long
    // as this connection.
    Reply(fd, absl::StrCat("ok ", regions.AddLivenessTicket(connection), "\n"));
    return true;
  }
  if ((msg.msg_flags & MSG_CTRUNC) != 0 || fds.size() != 1 || byte != 'R') {
    for (int received : fds) ::close(received);
    Reply(fd, "error send one byte 'R' with exactly one memfd attached, or 'L' alone for a liveness ticket\n");
    return n > 0;
  }
  // Checked, not mapped: only an authenticated RegisterSharedMemory maps it.
  absl::StatusOr<SealedMemfd> memfd = SealedMemfd::Check(fds[0], regions.limits().max_region_bytes);
  if (!memfd.ok()) {
    Reply(fd, absl::StrCat("error ", memfd.status().message(), "\n"));
    return true;
  }
  const uint64_t size = memfd->size();
  absl::StatusOr<std::string> ticket = regions.AddPending(connection, *std::move(memfd));
  if (!ticket.ok()) {
    if (int64_t held = 0; absl::IsResourceExhausted(ticket.status()) && refusals.Allow(&held)) {
      MUOND_LOG(warn, "shm socket: memfd refused: {} ({} more refusals since the last line)", ticket.status().message(),
                held);
    }
    Reply(fd, absl::StrCat("error ", ticket.status().message(), "\n"));
    return true;
  }
  Reply(fd, absl::StrCat("ok ", *ticket, " ", size, "\n"));
  return true;
}

}  // namespace

std::string DefaultShmSocketAddress() { return absl::StrCat("@muond-", ::getpid(), "-", RandomTicket().substr(0, 8)); }

absl::StatusOr<std::unique_ptr<ShmSocketServer>> ShmSocketServer::Start(const std::string& address,
                                                                        SharedMemoryRegions* regions) {
  socklen_t length = 0;
  absl::StatusOr<sockaddr_un> addr = SocketAddress(address, &length);
  if (!addr.ok()) return addr.status();
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  const bool abstract = address[0] == '@';
  if (!abstract) ::unlink(address.c_str());  // a stale socket of an earlier run
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&*addr), length) != 0 || ::listen(fd, 64) != 0) {
    const std::string error = std::strerror(errno);
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("--shm-socket: cannot listen on '", address, "': ", error));
  }
  if (!abstract) ::chmod(address.c_str(), 0666);  // the socket grants nothing; RPCs authenticate
  int wake[2];
  if (::pipe2(wake, O_CLOEXEC) != 0) {
    ::close(fd);
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  }
  std::unique_ptr<ShmSocketServer> server(new ShmSocketServer(address, fd, wake[0], wake[1], regions));
  server->thread_ = std::thread([s = server.get()] { s->Loop(); });
  return server;
}

ShmSocketServer::~ShmSocketServer() {
  const char stop = 'x';
  (void)!::write(wake_write_, &stop, 1);
  if (thread_.joinable()) thread_.join();
  ::close(listen_fd_);
  ::close(wake_read_);
  ::close(wake_write_);
  if (address_[0] != '@') ::unlink(address_.c_str());
}

void ShmSocketServer::Loop() {
  std::map<int, uint64_t> connections;  // fd -> connection id
  auto drop = [&](int fd) {
    regions_->CloseConnection(connections[fd]);
    connections.erase(fd);
    ::close(fd);
  };
  const size_t max_connections = static_cast<size_t>(regions_->limits().max_connections);
  LogThrottle refused_connections, refused_memfds, accept_failures, expiries;
  int64_t expired = 0;                             // tickets expired since the last line about them
  absl::Time accept_again = absl::InfinitePast();  // backing off after accept4 ran out of descriptors
  for (;;) {
    const absl::Time now = absl::Now();
    const bool accepting = now >= accept_again;
    // Wake for the next ticket to expire, or the end of a back-off, whichever comes first.
    const absl::Time wake = std::min(regions_->NextExpiry(), accepting ? absl::InfiniteFuture() : accept_again);
    const int timeout_ms =
        wake == absl::InfiniteFuture()
            ? -1
            : static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(wake - now) + 1, 0, 60'000));
    std::vector<pollfd> fds = {{wake_read_, POLLIN, 0}, {accepting ? listen_fd_ : -1, POLLIN, 0}};
    for (const auto& [fd, id] : connections) fds.push_back({fd, POLLIN, 0});
    if (::poll(fds.data(), fds.size(), timeout_ms) < 0) {
      if (errno == EINTR) continue;
      MUOND_LOG(error, "shm socket: poll failed: {}", std::strerror(errno));
      break;
    }
    if (fds[0].revents != 0) break;
    expired += regions_->ExpirePending(absl::Now());
    if (int64_t held = 0; expired > 0 && expiries.Allow(&held)) {
      MUOND_LOG(info, "shm socket: {} unclaimed regions expired (not registered within --shm-ticket-timeout)",
                std::exchange(expired, 0));
    }
    if (fds[1].revents & POLLIN) {
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      int64_t held = 0;
      if (fd < 0 && errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) {
        if (accept_failures.Allow(&held)) {
          MUOND_LOG(error, "shm socket: cannot accept a connection: {}; retrying in {} ({} more since)",
                    std::strerror(errno), absl::FormatDuration(kAcceptBackoff), held);
        }
        accept_again = absl::Now() + kAcceptBackoff;
      } else if (fd >= 0 && connections.size() >= max_connections) {
        // Refused at once: the descriptor is held only for this reply.
        Reply(fd, "error the daemon has too many shared-memory connections\n");
        ::close(fd);
        if (refused_connections.Allow(&held)) {
          MUOND_LOG(warn,
                    "shm socket: connection refused: {} open, the limit (--shm-max-connections) ({} more "
                    "refusals since the last line)",
                    connections.size(), held);
        }
      } else if (fd >= 0) {
        connections[fd] = regions_->OpenConnection();
      }
    }
    for (size_t i = 2; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      const int fd = fds[i].fd;
      if ((fds[i].revents & POLLIN) == 0 || !Serve(fd, connections[fd], *regions_, refused_memfds)) drop(fd);
    }
  }
  while (!connections.empty()) drop(connections.begin()->first);
}

}  // namespace muond::transport
