// CallScope: what every handler of the daemon does around its work, in one place — the
// --rpc-timeout watch (and the count of calls in flight that shutdown drains), authentication of the
// caller, the cap on one caller's calls in flight (CallerSlots), the per-method metrics, the log line
// of a refusal and the single conversion of the handler's absl::Status into the call's gRPC status.
//
// A handler is written as
//   return Serve(context, "CloseSession", [&](const std::string& caller) -> absl::Status { ... });
// and never builds a grpc::Status itself. CallServices holds what the scopes share (deadlines,
// tokens, metrics, the callers' slots); it is owned by the service and outlives every scope. A CallScope lives on the
// handler's stack for the whole call; thread-safe as its parts are.
#pragma once

#include <chrono>
#include <new>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/status.h"
#include "server/metrics/metrics.h"
#include "server/rpc/caller_slots.h"
#include "server/rpc/rpc_deadline.h"
#include "server/security/token_table.h"

namespace muond::rpc {

struct CallServices {
  CallServices(absl::Duration rpc_timeout, const security::TokenTable* token_table, metrics::Metrics* sink,
               int max_calls_per_caller = 0)
      : deadlines(rpc_timeout), tokens(token_table), metrics(sink), slots(max_calls_per_caller) {}

  RpcDeadlines deadlines;
  const security::TokenTable* const tokens;  // null: no bearer tokens; not owned
  metrics::Metrics* const metrics;           // not owned
  CallerSlots slots;                         // --max-calls-per-caller
};

// The identity behind `context` (security::IdentifyCaller over what gRPC knows of the call).
absl::StatusOr<std::string> CallerOf(const grpc::ServerContext& context, const security::TokenTable* tokens);

class CallScope {
 public:
  CallScope(CallServices& services, grpc::ServerContext* context, std::string_view method);
  // A scope left without Finish (an exception out of a handler) still ends the call in the metrics,
  // as UNKNOWN, so the in-flight count does not drift.
  ~CallScope();
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;

  // The authenticated caller; UNAUTHENTICATED (as a status) when its credentials do not hold,
  // RESOURCE_EXHAUSTED when it has --max-calls-per-caller calls in flight already.
  const absl::StatusOr<std::string>& caller() const { return caller_; }

  // Ends the call with `status`: reports it, logs a refusal and converts it.
  grpc::Status Finish(const absl::Status& status);

 private:
  CallServices& services_;
  grpc::ServerContext* const context_;
  const std::string_view method_;
  const std::chrono::steady_clock::time_point start_;  // a call's latency, immune to clock steps
  RpcDeadlines::Scope deadline_;
  absl::StatusOr<std::string> caller_;
  CallerSlots::Slot slot_;  // held until the call ends
  bool finished_ = false;
};

// RESOURCE_EXHAUSTED for a call of `method` during which a host allocation failed.
absl::Status OutOfHostMemory(std::string_view method);

// Runs `body(caller)` for an authenticated caller within a CallScope and returns the call's status.
// A host allocation that fails in it (std::bad_alloc: a request too large for the machine's memory
// under an address-space or overcommit limit) ends the call RESOURCE_EXHAUSTED, not UNKNOWN.
template <typename Body>
grpc::Status Serve(CallServices& services, grpc::ServerContext* context, std::string_view method, Body&& body) {
  CallScope scope(services, context, method);
  if (!scope.caller().ok()) return scope.Finish(scope.caller().status());
  absl::Status status;
  try {
    status = body(*scope.caller());
  } catch (const std::bad_alloc&) {
    status = OutOfHostMemory(method);
  }
  return scope.Finish(status);
}

}  // namespace muond::rpc
