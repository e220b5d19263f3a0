#include "tests/integration/call_cutting_proxy.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>

namespace muond::testing {
namespace {

// The client connection preface every HTTP/2 client sends before its first frame (RFC 9113 §3.4).
constexpr std::string_view kPreface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
constexpr size_t kFrameHeaderBytes = 9;
constexpr uint8_t kHeadersFrame = 0x1;

bool WriteAll(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = ::send(fd, data, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "CallCuttingProxy: %s: %s\n", what, std::strerror(errno));
  std::abort();
}

}  // namespace

struct CallCuttingProxy::Connection {
  int client_fd = -1;
  int server_fd = -1;
  std::thread thread;
};

CallCuttingProxy::CallCuttingProxy(int target_port) : target_port_(target_port) {
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC);
  listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (wake_fd_ < 0 || listen_fd_ < 0) Fail("socket");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      ::listen(listen_fd_, 16) != 0 || ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    Fail("listen");
  }
  port_ = ntohs(address.sin_port);
  acceptor_ = std::thread([this] { AcceptLoop(); });
}

CallCuttingProxy::~CallCuttingProxy() {
  const uint64_t one = 1;
  if (::write(wake_fd_, &one, sizeof(one)) != sizeof(one)) Fail("eventfd write");
  acceptor_.join();
  std::vector<std::unique_ptr<Connection>> connections;
  {
    std::lock_guard<std::mutex> lock(mu_);
    connections.swap(connections_);
  }
  for (const std::unique_ptr<Connection>& c : connections) c->thread.join();
  ::close(listen_fd_);
  ::close(wake_fd_);
}

void CallCuttingProxy::CutAfterCalls(int calls) {
  std::lock_guard<std::mutex> lock(mu_);
  calls_left_ = calls;
}

void CallCuttingProxy::Heal() {
  std::lock_guard<std::mutex> lock(mu_);
  calls_left_ = -1;
}

bool CallCuttingProxy::Cutting() {
  std::lock_guard<std::mutex> lock(mu_);
  return calls_left_ == 0;
}

bool CallCuttingProxy::AdmitCall() {
  std::lock_guard<std::mutex> lock(mu_);
  if (calls_left_ < 0) return true;
  if (calls_left_ == 0) {
    ++cut_calls_;
    return false;
  }
  --calls_left_;
  return true;
}

void CallCuttingProxy::AcceptLoop() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      Fail("poll");
    }
    if (fds[1].revents != 0) return;
    const int client = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) continue;
    if (Cutting()) {  // the daemon is unreachable until Heal()
      ::close(client);
      continue;
    }
    auto connection = std::make_unique<Connection>();
    connection->client_fd = client;
    Connection* raw = connection.get();
    std::lock_guard<std::mutex> lock(mu_);
    connection->thread = std::thread([this, raw] { Serve(raw); });
    connections_.push_back(std::move(connection));
  }
}

void CallCuttingProxy::Serve(Connection* connection) {
  const int client = connection->client_fd;
  const int server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in target{};
  target.sin_family = AF_INET;
  target.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  target.sin_port = htons(static_cast<uint16_t>(target_port_));
  if (server < 0 || ::connect(server, reinterpret_cast<sockaddr*>(&target), sizeof(target)) != 0) {
    if (server >= 0) ::close(server);
    ::close(client);
    return;
  }
  std::string pending;  // bytes from the client not yet forwarded: at most one incomplete frame
  bool preface_seen = false;
  uint32_t last_stream = 0;
  char buffer[1 << 16];
  for (bool open = true; open;) {
    pollfd fds[3] = {{client, POLLIN, 0}, {server, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (::poll(fds, 3, -1) < 0) {
      if (errno == EINTR) continue;
      Fail("poll");
    }
    if (fds[2].revents != 0) break;
    if (fds[1].revents != 0) {
      const ssize_t n = ::recv(server, buffer, sizeof(buffer), 0);
      if (n <= 0 || !WriteAll(client, buffer, static_cast<size_t>(n))) break;
    }
    if (fds[0].revents == 0) continue;
    const ssize_t n = ::recv(client, buffer, sizeof(buffer), 0);
    if (n <= 0) break;
    pending.append(buffer, static_cast<size_t>(n));
    size_t sent = 0;
    if (!preface_seen) {
      if (pending.size() < kPreface.size()) continue;
      preface_seen = true;
      sent = kPreface.size();
    }
    // Whole frames only: a call's first frame is read whole before any of it goes on.
    for (size_t at = sent; pending.size() - at >= kFrameHeaderBytes;) {
      const auto byte = [&](size_t i) { return static_cast<uint8_t>(pending[at + i]); };
      const size_t length = (size_t{byte(0)} << 16) | (size_t{byte(1)} << 8) | byte(2);
      if (pending.size() - at < kFrameHeaderBytes + length) break;
      const uint32_t stream =
          ((uint32_t{byte(5)} << 24) | (uint32_t{byte(6)} << 16) | (uint32_t{byte(7)} << 8) | byte(8)) & 0x7fffffffu;
      if (byte(3) == kHeadersFrame && stream > last_stream) {
        last_stream = stream;
        if (!AdmitCall()) {
          open = false;
          break;
        }
      }
      at += kFrameHeaderBytes + length;
      sent = at;
    }
    if (sent > 0 && !WriteAll(server, pending.data(), sent)) break;
    pending.erase(0, sent);
  }
  ::shutdown(client, SHUT_RDWR);
  ::shutdown(server, SHUT_RDWR);
  ::close(client);
  ::close(server);
}

}  // namespace muond::testing
