#include "server/metrics/metrics_endpoint.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <list>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/log_throttle.h"
#include "common/logging.h"
#include "server/metrics/http_responder.h"

namespace muond::metrics {
namespace {

// A listening socket bound to host:port (port 0: any free one); -1 with *bound_port untouched on failure.
int Listen(const std::string& host, int port, int* bound_port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &found) != 0) return -1;
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    // SO_REUSEADDR only, never SO_REUSEPORT: a second daemon on the same port must fail at start-up.
    const int yes = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, 128) != 0) {
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(found);
  if (fd < 0) return -1;
  sockaddr_storage addr{};
  socklen_t length = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length);
  *bound_port = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                                 : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  return fd;
}

}  // namespace

// One connection: reading its request head, then writing the answer, then (a refusal whose peer may
// still be sending) discarding what arrives until the peer closes, so the answer is not lost to a reset.
struct MetricsEndpoint::Connection {
  enum class Phase { kReading, kWriting, kDraining };
  int fd = -1;
  absl::Time deadline;
  Phase phase = Phase::kReading;
  std::string in = {};
  std::string out = {};
  size_t sent = 0;
};

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(const std::string& listen,
                                                                        std::function<std::string()> render,
                                                                        EndpointLimits limits) {
  const size_t colon = listen.rfind(':');
  int port = -1;
  if (colon == std::string::npos || colon == 0 || !absl::SimpleAtoi(listen.substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics-listen: '", listen, "' is not HOST:PORT (e.g. 0.0.0.0:9464, [::]:9464)"));
  }
  std::string host = listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  int bound = 0;
  const int fd = Listen(host, port, &bound);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("--metrics-listen: cannot listen on ", listen, " (address in use or not valid)"));
  }
  std::unique_ptr<MetricsEndpoint> endpoint(new MetricsEndpoint(std::move(render), limits));
  endpoint->address_ = absl::StrCat(listen.substr(0, colon), ":", bound);
  MetricsEndpoint* e = endpoint.get();
  absl::StatusOr<std::unique_ptr<ListenerLoop>> loop =
      ListenerLoop::Start("metrics endpoint", fd, SOCK_NONBLOCK,
                          {.prepare = [e](absl::Time now, std::vector<pollfd>& fds) { return e->Prepare(now, fds); },
                           .serve = [e](std::span<const pollfd> fds) { e->Serve(fds); },
                           .accept = [e](int connection) { e->Accept(connection); },
                           .stop = [e] { e->CloseAll(); }});
  if (!loop.ok()) return loop.status();
  endpoint->loop_ = *std::move(loop);
  return endpoint;
}

MetricsEndpoint::MetricsEndpoint(std::function<std::string()> render, EndpointLimits limits)
    : render_(std::move(render)), limits_(limits) {}

MetricsEndpoint::~MetricsEndpoint() = default;  // loop_ first (the last member): its thread is joined

absl::Time MetricsEndpoint::Prepare(absl::Time now, std::vector<pollfd>& fds) {
  absl::Time wake = absl::InfiniteFuture();
  for (auto it = connections_.begin(); it != connections_.end();) {
    if (it->deadline <= now) {
      ::close(it->fd);
      it = connections_.erase(it);
      continue;
    }
    wake = std::min(wake, it->deadline);
    fds.push_back({it->fd, static_cast<short>(it->phase == Connection::Phase::kWriting ? POLLOUT : POLLIN), 0});
    ++it;
  }
  return wake;
}

void MetricsEndpoint::Serve(std::span<const pollfd> fds) {
  const auto answer = [](Connection& c, std::string response) {
    c.out = std::move(response);
    c.in.clear();
    c.in.shrink_to_fit();
    c.phase = Connection::Phase::kWriting;
  };
  size_t i = 0;  // the pollfds follow the list's order
  for (auto it = connections_.begin(); it != connections_.end() && i < fds.size(); ++i) {
    Connection& c = *it;
    const short revents = fds[i].revents;
    bool done = false;
    if (revents == 0) {
      ++it;
      continue;
    }
    if (c.phase == Connection::Phase::kWriting) {
      const ssize_t n = ::send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0 && errno != EAGAIN && errno != EINTR) {
        done = true;
      } else if (n > 0 && (c.sent += static_cast<size_t>(n)) == c.out.size()) {
        ::shutdown(c.fd, SHUT_WR);
        c.out.clear();
        c.out.shrink_to_fit();
        c.phase = Connection::Phase::kDraining;
      }
    } else {
      char buffer[4096];
      const size_t room =
          c.phase == Connection::Phase::kReading ? limits_.max_request_bytes + 1 - c.in.size() : sizeof(buffer);
      const ssize_t n = ::recv(c.fd, buffer, std::min(room, sizeof(buffer)), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
        done = true;  // the peer closed (or broke) the connection
      } else if (n > 0 && c.phase == Connection::Phase::kReading) {
        c.in.append(buffer, static_cast<size_t>(n));
        if (const size_t end = RequestHeadEnd(c.in); end != std::string::npos) {
          answer(c, AnswerRequest(absl::string_view(c.in).substr(0, end), render_));
        } else if (c.in.size() > limits_.max_request_bytes) {
          answer(c,
                 ErrorResponse("431 Request Header Fields Too Large",
                               absl::StrCat("the request head is limited to ", limits_.max_request_bytes, " bytes")));
        }
      }
    }
    if (done) {
      ::close(c.fd);
      it = connections_.erase(it);
    } else {
      ++it;
    }
  }
}

void MetricsEndpoint::Accept(int fd) {
  if (connections_.size() >= static_cast<size_t>(limits_.max_connections)) {
    // Full: the oldest connection not yet answered makes room; when every one is being answered, the
    // newcomer is turned away.
    auto oldest = std::find_if(connections_.begin(), connections_.end(),
                               [](const Connection& c) { return c.phase != Connection::Phase::kWriting; });
    if (int64_t held = 0; evictions_.Allow(&held)) {
      MUOND_LOG(warn,
                "metrics endpoint: {} connections, the limit (--metrics-max-connections): closing the oldest ({} "
                "more since the last line)",
                connections_.size(), held);
    }
    if (oldest != connections_.end()) {
      ::close(oldest->fd);
      connections_.erase(oldest);
    }
  }
  if (connections_.size() < static_cast<size_t>(limits_.max_connections)) {
    connections_.push_back(Connection{.fd = fd, .deadline = absl::Now() + limits_.request_timeout});
  } else {
    ::close(fd);
  }
}

void MetricsEndpoint::CloseAll() {
  for (const Connection& c : connections_) ::close(c.fd);
  connections_.clear();
}

}  // namespace muond::metrics
