// MetricsEndpoint: the HTTP listener of --metrics-listen. It serves GET /metrics with whatever the
// render function returns (PrometheusMetrics::Render), in Prometheus's text exposition format, on a
// thread of its own (cpp-httplib), apart from the gRPC server, so a scrape never waits behind steps.
//
// Owned by main(); Start() binds before returning (a taken port is an error at start-up, not later),
// the destructor stops the listener and joins its thread. `render` must be thread-safe and outlive it.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace httplib {
class Server;
}

namespace muond::metrics {

class MetricsEndpoint {
 public:
  // Listens on `listen` ("HOST:PORT"; "[v6]:PORT"; port 0 picks a free one). INVALID_ARGUMENT naming
  // --metrics-listen for a malformed address, UNAVAILABLE when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(const std::string& listen,
                                                                std::function<std::string()> render);
  ~MetricsEndpoint();
  MetricsEndpoint(const MetricsEndpoint&) = delete;
  MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;

  // The bound address, "HOST:PORT" with the port it got.
  const std::string& address() const { return address_; }

 private:
  MetricsEndpoint() = default;

  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  std::atomic<bool> ended_{false};  // the listener's loop returned
  std::string address_;
};

}  // namespace muond::metrics
