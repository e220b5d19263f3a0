// Test-only reads of a daemon's Prometheus endpoint (--metrics-listen), so that a test can wait for
// what the daemon did (a call started, every call ended) instead of sleeping for a guessed time.
// Plain HTTP/1.0 over a loopback socket; stateless functions, safe from any thread.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>

namespace muond::testing {

// The body of GET /metrics at `address` ("127.0.0.1:PORT"); empty when it cannot be read.
inline std::string ScrapeMetrics(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return "";
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  sockaddr_in peer{};
  peer.sin_family = AF_INET;
  peer.sin_port = htons(static_cast<uint16_t>(std::atoi(address.c_str() + colon + 1)));
  peer.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  if (connect(fd, reinterpret_cast<sockaddr*>(&peer), sizeof peer) == 0) {
    const std::string request = "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n";
    if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(request.size())) {
      char buffer[8192];
      for (ssize_t n; (n = recv(fd, buffer, sizeof buffer, 0)) > 0;) response.append(buffer, static_cast<size_t>(n));
    }
  }
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

// The sum of every sample of `name` whose labels contain `label` (e.g. method="Step"); -1 when the
// text holds none.
inline double SumOfSamples(const std::string& text, std::string_view name, std::string_view label) {
  double sum = 0;
  bool found = false;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(name, 0) != 0 || line.size() <= name.size()) continue;
    const char next = line[name.size()];
    if (next != '{' && next != ' ') continue;  // another family whose name starts with `name`
    const size_t value_at = line.rfind(' ');
    if (line.substr(0, value_at).find(label) == std::string::npos) continue;
    sum += std::strtod(line.c_str() + value_at + 1, nullptr);
    found = true;
  }
  return found ? sum : -1;
}

// Polls `condition` until it holds or `limit` passes; returns whether it held.
inline bool Eventually(const std::function<bool()>& condition,
                       std::chrono::milliseconds limit = std::chrono::seconds(30)) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!condition()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

}  // namespace muond::testing
