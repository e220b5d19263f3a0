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
constexpr size_t kGrantLength = 32;  // RandomTicket()'s

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
  const absl::Time now = absl::Now();
  absl::Time wake = regions_->NextExpiry();  // wake for the next ticket to expire
  std::vector<int> overdue;
  for (const auto& [fd, c] : connections_) {
    if (!c.bound && c.grant_deadline <= now) {
      overdue.push_back(fd);
      continue;
    }
    fds.push_back({fd, POLLIN, 0});
    if (!c.bound) wake = std::min(wake, c.grant_deadline);
  }
  for (int fd : overdue) Drop(fd);  // no grant within kGrantTimeout
  return wake;
}

void ShmSocketServer::Serve(std::span<const pollfd> fds) {
  expired_ += regions_->ExpirePending(absl::Now());
  if (int64_t held = 0; expired_ > 0 && expiries_.Allow(&held)) {
    MUOND_LOG(info, "shm socket: {} unclaimed regions expired (not registered within --shm-ticket-timeout)",
              std::exchange(expired_, 0));
  }
  for (const pollfd& p : fds) {
    if (p.revents == 0) continue;
    if ((p.revents & POLLIN) == 0 || !ServeOne(p.fd, connections_[p.fd])) Drop(p.fd);
  }
}

bool ShmSocketServer::ServeOne(int fd, Connection& c) {
  if (c.reading_grant) return ReadGrant(fd, c);
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
  for (cmsghdr* m = CMSG_FIRSTHDR(&msg); m != nullptr; m = CMSG_NXTHDR(&msg, m)) {
    if (m->cmsg_level != SOL_SOCKET || m->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (m->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int received;
      std::memcpy(&received, CMSG_DATA(m) + i * sizeof(int), sizeof(int));
      fds.push_back(received);
    }
  }
  if (n == 0 && fds.empty()) return false;  // closed
  const bool truncated = (msg.msg_flags & MSG_CTRUNC) != 0;
  if (byte == 'G' && fds.empty() && !truncated) {
    c.reading_grant = true;
    c.grant.clear();
    return ReadGrant(fd, c);
  }
  if (!c.bound && (byte == 'R' || byte == 'L')) return RefuseUnbound(fd, fds);
  if (byte == 'L' && fds.empty() && !truncated) {
    // A liveness ticket: what a client registers with its CUDA IPC memory, which then lives as long
    // as this connection.
    Reply(fd, absl::StrCat("ok ", regions_->AddLivenessTicket(c.id), "\n"));
    return true;
  }
  if (truncated || fds.size() != 1 || byte != 'R') {
    for (int received : fds) ::close(received);
    Reply(fd,
          "error send 'G' with a grant first, then one byte 'R' with exactly one memfd attached, or 'L' alone for "
          "a liveness ticket\n");
    return n > 0;
  }
  // Checked, not mapped: only an authenticated RegisterSharedMemory maps it.
  absl::StatusOr<SealedMemfd> memfd = SealedMemfd::Check(fds[0], regions_->limits().max_region_bytes);
  if (!memfd.ok()) {
    Reply(fd, absl::StrCat("error ", memfd.status().message(), "\n"));
    return true;
  }
  const uint64_t size = memfd->size();
  int evicted = 0;
  absl::StatusOr<std::string> ticket = regions_->AddPending(c.id, *std::move(memfd), absl::Now(), &evicted);
  if (int64_t held = 0; evicted > 0 && evictions_.Allow(&held)) {
    MUOND_LOG(warn,
              "shm socket: the daemon holds --shm-max-pending-fds unclaimed regions; the oldest of the caller holding "
              "the most was dropped to make room ({} more since the last line)",
              held);
  }
  if (!ticket.ok()) {
    if (int64_t held = 0; absl::IsResourceExhausted(ticket.status()) && refused_memfds_.Allow(&held)) {
      MUOND_LOG(warn, "shm socket: memfd refused: {} ({} more refusals since the last line)", ticket.status().message(),
                held);
    }
    Reply(fd, absl::StrCat("error ", ticket.status().message(), "\n"));
    return true;
  }
  Reply(fd, absl::StrCat("ok ", *ticket, " ", size, "\n"));
  return true;
}

bool ShmSocketServer::ReadGrant(int fd, Connection& c) {
  char rest[kGrantLength];
  const ssize_t n = ::recv(fd, rest, kGrantLength - c.grant.size(), MSG_DONTWAIT);
  if (n < 0) return errno == EAGAIN || errno == EINTR;
  if (n == 0) return false;
  c.grant.append(rest, static_cast<size_t>(n));
  if (c.grant.size() < kGrantLength) return true;  // the rest comes later, within kGrantTimeout
  c.reading_grant = false;
  absl::Status bound = regions_->Bind(c.id, std::exchange(c.grant, ""));
  if (!bound.ok()) {
    Reply(fd, absl::StrCat("error ", bound.message(), "\n"));
    return absl::IsFailedPrecondition(bound);  // presented twice: the connection stays as it was
  }
  c.bound = true;
  Reply(fd, "ok\n");
  return true;
}

bool ShmSocketServer::RefuseUnbound(int fd, const std::vector<int>& fds) {
  for (int received : fds) ::close(received);
  Reply(fd,
        "error grant: this daemon takes a memfd or a liveness request only on a connection that presented a grant "
        "from GrantSharedMemory first; upgrade the muond client\n");
  if (int64_t held = 0; unbound_.Allow(&held)) {
    MUOND_LOG(info,
              "shm socket: a connection without a grant passed a memfd or asked for a liveness ticket: refused and "
              "closed (an older client, or a peer that did not authenticate) ({} more since the last line)",
              held);
  }
  return false;
}

void ShmSocketServer::Accept(int fd) {
  const size_t max_connections = static_cast<size_t>(regions_->limits().max_connections);
  if (connections_.size() >= max_connections) {
    // The oldest connection without a grant makes room: peers that never authenticate cannot lock
    // anyone out.
    auto oldest = connections_.end();
    for (auto it = connections_.begin(); it != connections_.end(); ++it) {
      if (!it->second.bound &&
          (oldest == connections_.end() || it->second.grant_deadline < oldest->second.grant_deadline)) {
        oldest = it;
      }
    }
    if (oldest != connections_.end()) Drop(oldest->first);
  }
  if (connections_.size() >= max_connections) {
    // Refused at once: the descriptor is held only for this reply.
    Reply(fd, "error the daemon has too many shared-memory connections\n");
    ::close(fd);
    if (int64_t held = 0; refused_connections_.Allow(&held)) {
      MUOND_LOG(warn,
                "shm socket: connection refused: {} open, each with a grant, the limit (--shm-max-connections) ({} "
                "more refusals since the last line)",
                connections_.size(), held);
    }
    return;
  }
  connections_[fd] = Connection{.id = regions_->OpenConnection(), .grant_deadline = absl::Now() + kGrantTimeout};
}

void ShmSocketServer::Drop(int fd) {
  regions_->CloseConnection(connections_[fd].id);
  connections_.erase(fd);
  ::close(fd);
}

void ShmSocketServer::CloseAll() {
  while (!connections_.empty()) Drop(connections_.begin()->first);
}

}  // namespace muond::transport
