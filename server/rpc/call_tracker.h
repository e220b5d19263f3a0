// CallTracker: counts the daemon's muond.v1 calls from their arrival until gRPC has finished with
// them — the last answer and the status handed to the transport and the call's context destroyed —
// so that shutdown waits for the answers of drained calls to leave, not only for their handlers to
// return (a handler returns before gRPC sends its status; stopping the server in between cancels
// the call and the client never sees an answer the daemon has already applied).
//
// It is a gRPC server interceptor factory: each call gets an interceptor that lives exactly as long
// as the call. Calls of other services (health checking) are not counted: a client's long-lived
// health watch must not hold shutdown up.
//
// Ownership: the daemon owns the tracker and must keep it alive until the server is destroyed; the
// factories it hands to grpc::ServerBuilder refer to it. Thread-safe.
#pragma once

#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/support/server_interceptor.h"

namespace muond::rpc {

class CallTracker {
 public:
  // A factory for grpc::ServerBuilder::experimental().SetInterceptorCreators.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> NewFactory();

  // Waits until no muond.v1 call is alive, or `limit` passes; true when none is.
  bool AwaitIdle(absl::Duration limit);

 private:
  class Counted;
  class Factory;

  absl::Mutex mu_;
  int alive_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace muond::rpc
