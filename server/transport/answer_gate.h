// AnswerGate and AnswerClaims: which step call may still write its answer into memory a caller
// registered (a shared-memory region, CUDA IPC memory), so that a call its client gave up on never
// writes over what the client did next.
//
// A client that gives up on a step call — its deadline passed, it cancelled, its connection broke —
// sends the next try, and later its next step, through the same memory. The call it gave up on may
// still be waiting in the daemon (for the other ranks of a lock-step step, say) and would write its
// answer there when it wakes: over the next step's gradients, or over the parameters of a later
// answer. So each step call claims the memory it names for its (session, rank) when it begins
// (AnswerClaims), and writes its answer only while every claim is still the latest of that
// (session, rank) and its caller has not given it up, holding the gates' locks while it writes: a
// call that passed the check has finished writing before a later call of the same session and rank
// can write its own answer, and so before that answer reaches the client. The handlers refuse a
// call its caller gave up before it began, so such a call claims nothing.
//
// Each gate (one per registered region, owned by it) keeps the claims of calls in flight only.
// AnswerClaims releases its claims when destroyed and must not outlive the gates it names (a sink
// holds the regions, and the claims after them). Thread-safe; an AnswerClaims serves one call.
#pragma once

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace muond::transport {

class AnswerGate {
 public:
  AnswerGate() = default;
  AnswerGate(const AnswerGate&) = delete;
  AnswerGate& operator=(const AnswerGate&) = delete;

  // How many step calls hold a claim on the memory now (read without the gate's lock, which a call
  // holds while it writes).
  int calls_in_flight() const { return calls_in_flight_.load(std::memory_order_relaxed); }

 private:
  friend class AnswerClaims;
  using Caller = std::pair<std::string, int>;  // session id, rank

  mutable absl::Mutex mu_;
  uint64_t claims_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<int> calls_in_flight_ = 0;
  // The latest claim of each (session, rank) with a call in flight.
  absl::flat_hash_map<Caller, uint64_t> latest_ ABSL_GUARDED_BY(mu_);
};

class AnswerClaims {
 public:
  AnswerClaims() = default;  // claims nothing: Write only checks `given_up`
  // Claims each of `gates` (once each, null ones skipped) for a step call of `session_id`'s `rank`.
  AnswerClaims(std::vector<AnswerGate*> gates, std::string session_id, int rank);
  ~AnswerClaims();
  AnswerClaims(AnswerClaims&& other) noexcept;
  AnswerClaims& operator=(AnswerClaims&&) = delete;
  AnswerClaims(const AnswerClaims&) = delete;
  AnswerClaims& operator=(const AnswerClaims&) = delete;

  // Runs `write` holding every gate's lock when every claim is still the latest of its gate and
  // `given_up()` is false; returns its status. Otherwise writes nothing: CANCELLED when the caller
  // gave the call up, FAILED_PRECONDITION when a later call of the same session and rank named
  // the same memory (`what` names it in the message, e.g. "shared-memory region").
  absl::Status Write(absl::FunctionRef<bool()> given_up, absl::FunctionRef<absl::Status()> write,
                     const std::string& what) const;

 private:
  struct Claim {
    AnswerGate* gate;
    uint64_t number;
  };
  void Release();

  std::vector<Claim> claims_;  // by the gates' addresses: locked in that order
  std::string session_id_;
  int rank_ = 0;
};

// The claims of a step call of `session_id`'s `rank` on the memory every place of `gradients` and
// `parameters` names (`gate_of(place)`: the AnswerGate of the place's region).
template <typename Place, typename GateOf>
AnswerClaims ClaimPlaces(const std::vector<Place>& gradients, const std::vector<Place>& parameters, GateOf gate_of,
                         std::string session_id, int rank) {
  std::vector<AnswerGate*> gates;
  for (const std::vector<Place>* places : {&gradients, &parameters}) {
    for (const Place& place : *places) gates.push_back(gate_of(place));
  }
  return AnswerClaims(std::move(gates), std::move(session_id), rank);
}

}  // namespace muond::transport
