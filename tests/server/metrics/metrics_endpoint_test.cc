// MetricsEndpoint against hostile HTTP peers, over raw loopback sockets: a flood of header lines is
// cut off at the head limit, bodies and other methods are refused, idle and slow connections can
// neither hold the endpoint past its connection limit nor past their deadline, and a scrape is
// answered all the while.
#include "server/metrics/metrics_endpoint.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "gmock/gmock.h"

namespace muond::metrics {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

int PortOf(const MetricsEndpoint& endpoint) {
  int port = 0;
  EXPECT_TRUE(absl::SimpleAtoi(endpoint.address().substr(endpoint.address().rfind(':') + 1), &port));
  return port;
}

// A blocking loopback connection whose reads give up after `timeout_s`.
int Connect(int port, int timeout_s = 30) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const timeval timeout{timeout_s, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
  return fd;
}

bool SendAll(int fd, const std::string& bytes) {
  for (size_t sent = 0; sent < bytes.size();) {
    const ssize_t n = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return true;
}

// Everything the server sends until it closes the connection (or the read times out).
std::string ReadAll(int fd) {
  std::string out;
  char buffer[4096];
  for (ssize_t n; (n = ::recv(fd, buffer, sizeof(buffer), 0)) > 0;) out.append(buffer, static_cast<size_t>(n));
  return out;
}

std::string Exchange(int port, const std::string& request) {
  const int fd = Connect(port);
  SendAll(fd, request);
  std::string answer = ReadAll(fd);
  ::close(fd);
  return answer;
}

std::unique_ptr<MetricsEndpoint> StartEndpoint(EndpointLimits limits = {}) {
  auto endpoint = MetricsEndpoint::Start(
      "127.0.0.1:0", [] { return std::string("muond_sessions 7\n"); }, limits);
  EXPECT_TRUE(endpoint.ok()) << endpoint.status();
  return endpoint.ok() ? *std::move(endpoint) : nullptr;
}

constexpr char kScrape[] = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";

TEST(MetricsEndpointLimitsTest, AFloodOfHeaderLinesIsCutOffAtTheHeadLimit) {
  auto endpoint = StartEndpoint();
  const int fd = Connect(PortOf(*endpoint));
  std::string flood = "GET /metrics HTTP/1.1\r\n";
  const std::string line = "X-Filler: " + std::string(100, 'a') + "\r\n";
  while (flood.size() < (8u << 20)) flood += line;
  SendAll(fd, flood);  // may be cut short: the server stops listening once it has answered
  EXPECT_THAT(ReadAll(fd), StartsWith("HTTP/1.1 431 "));
  ::close(fd);
  EXPECT_THAT(Exchange(PortOf(*endpoint), kScrape), HasSubstr("muond_sessions 7"));
}

TEST(MetricsEndpointLimitsTest, BodiesAndOtherMethodsAreRefused) {
  auto endpoint = StartEndpoint();
  const int port = PortOf(*endpoint);
  EXPECT_THAT(Exchange(port, "POST /metrics HTTP/1.1\r\nContent-Length: 1000000000000\r\n\r\n"),
              StartsWith("HTTP/1.1 405 "));
  EXPECT_THAT(Exchange(port, "PUT / HTTP/1.1\r\n\r\n"), StartsWith("HTTP/1.1 405 "));
  EXPECT_THAT(Exchange(port, "GET /metrics HTTP/1.1\r\nContent-Length: 1000000000000\r\n\r\n"),
              StartsWith("HTTP/1.1 413 "));
  EXPECT_THAT(Exchange(port, "GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"),
              StartsWith("HTTP/1.1 413 "));
  EXPECT_THAT(Exchange(port, "GET /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n"), StartsWith("HTTP/1.1 200 "));
  EXPECT_THAT(Exchange(port, "nonsense\r\n\r\n"), StartsWith("HTTP/1.1 400 "));
  const std::string head = Exchange(port, "HEAD /metrics HTTP/1.0\r\n\r\n");
  EXPECT_THAT(head, StartsWith("HTTP/1.1 200 "));
  EXPECT_THAT(head, Not(HasSubstr("muond_sessions")));
}

TEST(MetricsEndpointLimitsTest, IdleAndSlowConnectionsCannotShutOutAScrape) {
  auto endpoint = StartEndpoint({.max_connections = 4});
  const int port = PortOf(*endpoint);
  std::vector<int> idle;
  for (int i = 0; i < 100; ++i) idle.push_back(Connect(port));
  for (int i = 0; i < 12; ++i) {  // slow: a request begun and never finished
    idle.push_back(Connect(port));
    SendAll(idle.back(), "G");
  }
  const std::string answer = Exchange(port, kScrape);
  EXPECT_THAT(answer, StartsWith("HTTP/1.1 200 "));
  EXPECT_THAT(answer, HasSubstr("muond_sessions 7"));
  for (int fd : idle) ::close(fd);
}

TEST(MetricsEndpointLimitsTest, AConnectionIsCutOffAtItsDeadlineHoweverSlowlyItSends) {
  auto endpoint = StartEndpoint({.request_timeout = absl::Milliseconds(300)});
  const int fd = Connect(PortOf(*endpoint));
  // A byte every 50 ms never lets a per-read timeout fire; the connection's deadline does. Wait for
  // the server to close it (at most 30 s worth of bytes).
  const std::string request = std::string("GET /metrics HTTP/1.1\r\nX: ") + std::string(600, 'a');
  bool closed = false;
  for (size_t i = 0; i < request.size() && !closed; ++i) {
    if (::send(fd, &request[i], 1, MSG_NOSIGNAL) != 1) break;
    pollfd p{fd, POLLIN, 0};
    closed = ::poll(&p, 1, 50) == 1;  // readable: the server closed it (an EOF)
  }
  char byte;
  EXPECT_TRUE(closed || ::recv(fd, &byte, 1, MSG_DONTWAIT) == 0);
  ::close(fd);
}

}  // namespace
}  // namespace muond::metrics
