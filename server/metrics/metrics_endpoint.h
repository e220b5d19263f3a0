// MetricsEndpoint: the HTTP listener of --metrics-listen. It serves GET /metrics with whatever the
// render function returns (PrometheusMetrics::Render), in Prometheus's text exposition format, on a
// thread of its own, apart from the gRPC server, so a scrape never waits behind steps.
//
// A minimal GET-only responder (http_responder.h) on one poll loop, bounded in everything a peer can
// make it hold: at most `max_connections` connections (at the limit, a new one takes the place of
// the oldest still sending its request, so idle or slow peers cannot shut a scraper out), each with
// one deadline from accept to its answer sent (`request_timeout`: a peer sending a byte a second is
// cut off), a request head of at most `max_request_bytes` (431 beyond), no request bodies (413), one
// request per connection. Nothing a connection sent is kept after it closes.
//
// Owned by main(); Start() binds before returning (a taken port is an error at start-up, not later),
// the destructor stops the loop and joins its thread. `render` must be thread-safe and outlive it.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace muond::metrics {

struct EndpointLimits {
  int max_connections = 16;
  absl::Duration request_timeout = absl::Seconds(10);
  size_t max_request_bytes = 8192;
};

class MetricsEndpoint {
 public:
  // Listens on `listen` ("HOST:PORT"; "[v6]:PORT"; port 0 picks a free one). INVALID_ARGUMENT naming
  // --metrics-listen for a malformed address, UNAVAILABLE when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(const std::string& listen,
                                                                std::function<std::string()> render,
                                                                EndpointLimits limits = {});
  ~MetricsEndpoint();
  MetricsEndpoint(const MetricsEndpoint&) = delete;
  MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;

  // The bound address, "HOST:PORT" with the port it got.
  const std::string& address() const { return address_; }

 private:
  MetricsEndpoint(int listen_fd, int wake_read, int wake_write, std::function<std::string()> render,
                  EndpointLimits limits)
      : listen_fd_(listen_fd),
        wake_read_(wake_read),
        wake_write_(wake_write),
        render_(std::move(render)),
        limits_(limits) {}
  void Loop();

  const int listen_fd_;
  const int wake_read_, wake_write_;  // a pipe that ends the loop
  const std::function<std::string()> render_;
  const EndpointLimits limits_;
  std::string address_;
  std::thread thread_;
};

}  // namespace muond::metrics
