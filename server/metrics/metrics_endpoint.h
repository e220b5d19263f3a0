// MetricsEndpoint: the HTTP listener of --metrics-listen. It serves GET /metrics with whatever the
// render function returns (PrometheusMetrics::Render), in Prometheus's text exposition format, on a
// thread of its own, apart from the gRPC server, so a scrape never waits behind steps.
//
// A minimal GET-only responder (http_responder.h) on one poll loop (common/listener_loop.h), bounded in everything a
// peer can make it hold: at most `max_connections` connections (at the limit, a new one takes the place of the oldest
// still sending its request, so idle or slow peers cannot shut a scraper out), each with one deadline from accept to
// its answer sent (`request_timeout`: a peer sending a byte a second is cut off), a request head of at most
// `max_request_bytes` (431 beyond), no request bodies (413), one request per connection. Nothing a connection sent is
// kept after it closes.
//
// Owned by main(); Start() binds before returning (a taken port is an error at start-up, not later),
// the destructor stops the loop and joins its thread. `render` must be thread-safe and outlive it.
#pragma once

#include <poll.h>

#include <functional>
#include <list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/listener_loop.h"
#include "common/log_throttle.h"

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
  // One connection (metrics_endpoint.cc).
  struct Connection;
  MetricsEndpoint(std::function<std::string()> render, EndpointLimits limits);
  // The loop's Handler (common/listener_loop.h), on its thread.
  absl::Time Prepare(absl::Time now, std::vector<pollfd>& fds);
  void Serve(std::span<const pollfd> fds);
  void Accept(int fd);
  void CloseAll();

  const std::function<std::string()> render_;
  const EndpointLimits limits_;
  std::string address_;
  std::list<Connection> connections_;  // oldest first; the loop's thread only
  LogThrottle evictions_;
  std::unique_ptr<ListenerLoop> loop_;  // last: stopped before anything it uses goes
};

}  // namespace muond::metrics
