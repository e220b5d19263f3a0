#include "client/shm_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace muond::client {
namespace {

absl::Status Errno(const std::string& what) {
  return absl::UnavailableError(absl::StrCat("shared memory: ", what, ": ", std::strerror(errno)));
}

}  // namespace

absl::StatusOr<int> ConnectShmSocket(const std::string& address, std::chrono::milliseconds answer_timeout) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (address.empty() || address.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("shared memory: bad socket address '", address, "'"));
  }
  const bool abstract = address[0] == '@';
  std::memcpy(addr.sun_path, address.data(), address.size());
  if (abstract) addr.sun_path[0] = '\0';
  const auto length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + address.size() + (abstract ? 0 : 1));
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("socket");
  if (answer_timeout.count() > 0) {
    const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(answer_timeout);
    timeval limit{};
    limit.tv_sec = static_cast<time_t>(seconds.count());
    limit.tv_usec = static_cast<suseconds_t>((answer_timeout - seconds).count() * 1000);
    if (::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit)) != 0 ||
        ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof(limit)) != 0) {
      absl::Status error = Errno("bounding the shared-memory socket's waits");
      ::close(fd);
      return error;
    }
  }
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), length) != 0) {
    absl::Status error = Errno(absl::StrCat("cannot connect to the daemon's socket '", address,
                                            "' (is the daemon on this host, in this network namespace?)"));
    ::close(fd);
    return error;
  }
  return fd;
}

absl::Status PresentGrant(int socket, const std::string& grant) {
  if (grant.empty()) return absl::OkStatus();
  const std::string message = absl::StrCat("G", grant);
  if (::send(socket, message.data(), message.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(message.size())) {
    return Errno("presenting the grant");
  }
  absl::StatusOr<std::string> answer = ReadAnswer(socket);
  if (!answer.ok()) return answer.status();
  if (*answer != "ok") {
    return absl::FailedPreconditionError(absl::StrCat("shared memory: the daemon refused the grant: ", *answer));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> PassDescriptor(int socket, int memfd) {
  char byte = 'R';
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &memfd, sizeof(int));
  if (::sendmsg(socket, &msg, MSG_NOSIGNAL) != 1) return Errno("sending the memfd");
  return ReadAnswer(socket);
}

absl::StatusOr<std::string> RequestLivenessTicket(int socket) {
  const char byte = 'L';
  if (::send(socket, &byte, 1, MSG_NOSIGNAL) != 1) return Errno("asking for a liveness ticket");
  absl::StatusOr<std::string> answer = ReadAnswer(socket);
  if (!answer.ok()) return answer.status();
  std::vector<std::string> words = absl::StrSplit(*answer, ' ');
  if (words.size() != 2 || words[0] != "ok") {
    return absl::UnavailableError(absl::StrCat("the daemon refused a liveness ticket: ", *answer));
  }
  return words[1];
}

absl::StatusOr<std::string> ReadAnswer(int socket) {
  std::string line;
  char ch;
  while (line.size() < 4096) {
    const ssize_t n = ::read(socket, &ch, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {  // ConnectShmSocket's answer_timeout passed
      return absl::UnavailableError("shared memory: the daemon did not answer on its socket within the deadline");
    }
    if (n <= 0) return absl::UnavailableError("shared memory: the daemon closed its socket without an answer");
    if (ch == '\n') break;
    line.push_back(ch);
  }
  return line;
}

absl::StatusOr<std::unique_ptr<ShmRegion>> ShmRegion::Create(const std::string& socket_address, size_t bytes,
                                                             const std::string& grant,
                                                             std::chrono::milliseconds answer_timeout) {
  if (bytes == 0) return absl::InvalidArgumentError("shared memory: a region has at least one byte");
  const int memfd = ::memfd_create("muond-region", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (memfd < 0) return Errno("memfd_create");
  auto fail = [&](absl::Status status, int socket = -1, void* data = nullptr) {
    if (data != nullptr) ::munmap(data, bytes);
    if (socket >= 0) ::close(socket);
    ::close(memfd);
    return status;
  };
  if (::ftruncate(memfd, static_cast<off_t>(bytes)) != 0) return fail(Errno("ftruncate"));
  if (::fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) return fail(Errno("sealing"));
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
  if (data == MAP_FAILED) return fail(Errno("mmap"));
  absl::StatusOr<int> socket = ConnectShmSocket(socket_address, answer_timeout);
  if (!socket.ok()) return fail(socket.status(), -1, data);
  if (absl::Status presented = PresentGrant(*socket, grant); !presented.ok()) return fail(presented, *socket, data);
  absl::StatusOr<std::string> answer = PassDescriptor(*socket, memfd);
  if (!answer.ok()) return fail(answer.status(), *socket, data);
  std::vector<std::string> words = absl::StrSplit(*answer, absl::MaxSplits(' ', 2));
  uint64_t size = 0;
  if (words.size() != 3 || words[0] != "ok" || !absl::SimpleAtoi(words[2], &size) || size != bytes) {
    return fail(absl::FailedPreconditionError(absl::StrCat("shared memory: the daemon refused the region: ", *answer)),
                *socket, data);
  }
  return std::unique_ptr<ShmRegion>(new ShmRegion(memfd, *socket, static_cast<char*>(data), bytes, words[1]));
}

ShmRegion::~ShmRegion() {
  ::munmap(data_, size_);
  ::close(socket_);
  ::close(memfd_);
}

bool ShmSocketReachable(const std::string& socket_address) {
  // A daemon whose backlog is full takes no connection: waited for a few seconds, not forever.
  absl::StatusOr<int> socket = ConnectShmSocket(socket_address, std::chrono::seconds(5));
  if (!socket.ok()) return false;
  ::close(*socket);
  return true;
}

}  // namespace muond::client
