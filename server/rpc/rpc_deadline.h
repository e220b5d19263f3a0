// RpcDeadlines: the daemon's own time limit on every call (--rpc-timeout), whatever deadline the
// client set or did not set.
//
// The synchronous gRPC API blocks a handler in Read() while the client sends nothing, so checking a
// clock between messages cannot stop a client that opened a stream and went silent. Instead each
// handler holds a Scope for its lifetime; one watchdog thread cancels the calls whose time is up
// with DEADLINE_EXCEEDED and a message naming --rpc-timeout, which wakes the blocked Read() and
// frees the handler thread. What the client sees is that status.
//
// It also counts the calls in flight, so that shutdown can wait for them (AwaitIdle).
//
// Ownership: the service owns one RpcDeadlines (each CallScope holds a Scope); a Scope refers to it and must not
// outlive it. A Scope unregisters its call before the handler returns, so the watchdog never touches a finished call.
// Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"

namespace muond::rpc {

class RpcDeadlines {
 public:
  // `timeout` <= 0 turns the limit off (Watch then does nothing and no thread is started).
  explicit RpcDeadlines(absl::Duration timeout);
  ~RpcDeadlines();
  RpcDeadlines(const RpcDeadlines&) = delete;
  RpcDeadlines& operator=(const RpcDeadlines&) = delete;

  class Scope {
   public:
    Scope(Scope&& other) noexcept : owner_(other.owner_), key_(other.key_), armed_(other.armed_) {
      other.owner_ = nullptr;
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    Scope& operator=(Scope&&) = delete;
    ~Scope();

   private:
    friend class RpcDeadlines;
    Scope(RpcDeadlines* owner, std::pair<absl::Time, uint64_t> key, bool armed)
        : owner_(owner), key_(key), armed_(armed) {}
    RpcDeadlines* owner_;
    std::pair<absl::Time, uint64_t> key_;
    bool armed_;  // has a deadline in calls_
  };

  // Arms the limit for the call behind `context` until the returned Scope is destroyed.
  Scope Watch(grpc::ServerContext* context);

  absl::Duration timeout() const { return timeout_; }

  // Waits until no watched call is running (true), or `limit` passes (false). Used to drain
  // in-flight calls at shutdown.
  bool AwaitIdle(absl::Duration limit);

 private:
  void Loop();

  const absl::Duration timeout_;
  absl::Mutex mu_;
  // (deadline, sequence number) → the call; the earliest deadline first.
  std::map<std::pair<absl::Time, uint64_t>, grpc::ServerContext*> calls_ ABSL_GUARDED_BY(mu_);
  int active_ ABSL_GUARDED_BY(mu_) = 0;  // watched calls running, armed or not
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// Whether the caller gave up the call behind `context`: it is cancelled (the client cancelled, its
// connection broke, a deadline fired), or the client's deadline has passed though gRPC's timer has
// not fired yet (a call that queued in the daemon past it).
bool CallerGaveUp(const grpc::ServerContext& context);

}  // namespace muond::rpc
