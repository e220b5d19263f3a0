#include "server/rpc/caller_slots.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/error_reason.h"

namespace muond::rpc {

CallerSlots::Slot::Slot(Slot&& other) noexcept
    : owner_(std::exchange(other.owner_, nullptr)), caller_(std::move(other.caller_)) {}

CallerSlots::Slot& CallerSlots::Slot::operator=(Slot&& other) noexcept {
  if (this != &other) {
    if (owner_ != nullptr) owner_->Give(caller_);
    owner_ = std::exchange(other.owner_, nullptr);
    caller_ = std::move(other.caller_);
  }
  return *this;
}

CallerSlots::Slot::~Slot() {
  if (owner_ != nullptr) owner_->Give(caller_);
}

absl::StatusOr<CallerSlots::Slot> CallerSlots::Take(const std::string& caller) {
  if (max_per_caller_ == 0 || caller.empty()) return Slot();
  absl::MutexLock lock(&mu_);
  int& held = in_flight_[caller];
  if (held >= max_per_caller_) {
    return WithReason(absl::ResourceExhaustedError(absl::StrCat("this caller has ", held,
                                                                " calls in flight, the most the daemon serves at "
                                                                "once (--max-calls-per-caller); let one end first")),
                      ErrorReason::kCallerBusy);
  }
  ++held;
  return Slot(this, caller);
}

void CallerSlots::Give(const std::string& caller) {
  absl::MutexLock lock(&mu_);
  auto it = in_flight_.find(caller);
  if (it == in_flight_.end()) return;
  if (--it->second <= 0) in_flight_.erase(it);
}

int CallerSlots::InFlight(const std::string& caller) const {
  absl::MutexLock lock(&mu_);
  auto it = in_flight_.find(caller);
  return it == in_flight_.end() ? 0 : it->second;
}

}  // namespace muond::rpc
