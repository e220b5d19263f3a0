// CallerSlots: the daemon's cap on the calls one caller has in flight at once
// (--max-calls-per-caller). The synchronous gRPC server spends a thread on every call for as long as
// it lasts, so without a cap one identity (a token or a client certificate) holding thousands of
// idle streams takes the threads every other caller needs. Only authenticated identities are
// counted: without authentication every caller is the same "" and there is nobody to keep apart.
//
// A Slot is held for the whole call (CallScope) and given back when it is destroyed. Owned by the
// service's CallServices, which outlives every Slot. Thread-safe.
#pragma once

#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace muond::rpc {

class CallerSlots {
 public:
  // `max_per_caller` 0: no cap.
  explicit CallerSlots(int max_per_caller) : max_per_caller_(max_per_caller) {}
  CallerSlots(const CallerSlots&) = delete;
  CallerSlots& operator=(const CallerSlots&) = delete;

  class Slot {
   public:
    Slot() = default;
    Slot(Slot&& other) noexcept;
    Slot& operator=(Slot&& other) noexcept;
    ~Slot();

   private:
    friend class CallerSlots;
    Slot(CallerSlots* owner, std::string caller) : owner_(owner), caller_(std::move(caller)) {}
    CallerSlots* owner_ = nullptr;  // null: nothing held
    std::string caller_;
  };

  // A slot for one more call of `caller`; RESOURCE_EXHAUSTED naming the flag when the caller has
  // `max_per_caller` calls in flight already. The anonymous caller "" always gets one.
  absl::StatusOr<Slot> Take(const std::string& caller);

  // Calls of `caller` in flight (for tests).
  int InFlight(const std::string& caller) const;

 private:
  void Give(const std::string& caller);

  const int max_per_caller_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, int> in_flight_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muond::rpc
