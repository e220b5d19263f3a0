#include "server/metrics/metrics_endpoint.h"

#include <sys/socket.h>

#include <chrono>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "httplib.h"

namespace muond::metrics {
namespace {

constexpr char kContentType[] = "text/plain; version=0.0.4; charset=utf-8";

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(const std::string& listen,
                                                                        std::function<std::string()> render) {
  const size_t colon = listen.rfind(':');
  int port = -1;
  if (colon == std::string::npos || colon == 0 || !absl::SimpleAtoi(listen.substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics-listen: '", listen, "' is not HOST:PORT (e.g. 0.0.0.0:9464, [::]:9464)"));
  }
  std::string host = listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);

  std::unique_ptr<MetricsEndpoint> endpoint(new MetricsEndpoint());
  endpoint->server_ = std::make_unique<httplib::Server>();
  httplib::Server& server = *endpoint->server_;
  // SO_REUSEADDR only: cpp-httplib's default also sets SO_REUSEPORT, which lets a second daemon bind
  // the same port and share its scrapes instead of failing at start-up.
  server.set_socket_options([](int sock) {
    const int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  server.Get("/metrics", [render](const httplib::Request&, httplib::Response& response) {
    response.set_content(render(), kContentType);
  });
  server.Get("/", [](const httplib::Request&, httplib::Response& response) {
    response.set_content("muond: metrics are at /metrics\n", "text/plain; charset=utf-8");
  });
  const int bound = port == 0 ? server.bind_to_any_port(host) : (server.bind_to_port(host, port) ? port : -1);
  if (bound <= 0) {
    return absl::UnavailableError(
        absl::StrCat("--metrics-listen: cannot listen on ", listen, " (address in use or not valid)"));
  }
  endpoint->address_ = absl::StrCat(listen.substr(0, colon), ":", bound);
  endpoint->thread_ = std::thread([&server, &ended = endpoint->ended_] {
    server.listen_after_bind();
    ended = true;
  });
  // Return once the listener runs: cpp-httplib's stop() does nothing before then, so a destructor
  // racing the thread's start would wait for a listener nobody stops.
  while (!server.is_running() && !endpoint->ended_) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (endpoint->ended_) {
    return absl::UnavailableError(absl::StrCat("--metrics-listen: the listener on ", listen, " stopped at once"));
  }
  return endpoint;
}

MetricsEndpoint::~MetricsEndpoint() {
  server_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace muond::metrics
