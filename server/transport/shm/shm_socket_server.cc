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
bool ServeOne(int fd, uint64_t connection, SharedMemoryRegions& regions, LogThrottle& refusals) {
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
  std::unique_ptr<ShmSocketServer> server(new ShmSocketServer(address, regions));
  ShmSocketServer* s = server.get();
  absl::StatusOr<std::unique_ptr<ListenerLoop>> loop =
      ListenerLoop::Start("shm socket", fd, /*accept_flags=*/0,
                          {.prepare = [s](absl::Time, std::vector<pollfd>& fds) { return s->Prepare(fds); },
                           .serve = [s](std::span<const pollfd> fds) { s->Serve(fds); },
                           .accept = [s](int connection) { s->Accept(connection); },
                           .stop = [s] { s->CloseAll(); }});
  if (!loop.ok()) {
    if (!abstract) ::unlink(address.c_str());
    return loop.status();
  }
  server->loop_ = *std::move(loop);
  return server;
}

ShmSocketServer::ShmSocketServer(std::string address, SharedMemoryRegions* regions)
    : address_(std::move(address)), regions_(regions) {}

ShmSocketServer::~ShmSocketServer() {
  loop_.reset();  // joins the thread, closes the listener and every connection
  if (address_[0] != '@') ::unlink(address_.c_str());
}

absl::Time ShmSocketServer::Prepare(std::vector<pollfd>& fds) {
  for (const auto& [fd, id] : connections_) fds.push_back({fd, POLLIN, 0});
  return regions_->NextExpiry();  // wake for the next ticket to expire
}

void ShmSocketServer::Serve(std::span<const pollfd> fds) {
  expired_ += regions_->ExpirePending(absl::Now());
  if (int64_t held = 0; expired_ > 0 && expiries_.Allow(&held)) {
    MUOND_LOG(info, "shm socket: {} unclaimed regions expired (not registered within --shm-ticket-timeout)",
              std::exchange(expired_, 0));
  }
  for (const pollfd& p : fds) {
    if (p.revents == 0) continue;
    if ((p.revents & POLLIN) == 0 || !ServeOne(p.fd, connections_[p.fd], *regions_, refused_memfds_)) Drop(p.fd);
  }
}

void ShmSocketServer::Accept(int fd) {
  const size_t max_connections = static_cast<size_t>(regions_->limits().max_connections);
  if (connections_.size() >= max_connections) {
    // Refused at once: the descriptor is held only for this reply.
    Reply(fd, "error the daemon has too many shared-memory connections\n");
    ::close(fd);
    if (int64_t held = 0; refused_connections_.Allow(&held)) {
      MUOND_LOG(warn,
                "shm socket: connection refused: {} open, the limit (--shm-max-connections) ({} more refusals since "
                "the last line)",
                connections_.size(), held);
    }
    return;
  }
  connections_[fd] = regions_->OpenConnection();
}

void ShmSocketServer::Drop(int fd) {
  regions_->CloseConnection(connections_[fd]);
  connections_.erase(fd);
  ::close(fd);
}

void ShmSocketServer::CloseAll() {
  while (!connections_.empty()) Drop(connections_.begin()->first);
}

}  // namespace muond::transport
