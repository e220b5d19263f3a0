// LogThrottle: lets a repeated log line through at most once per interval and counts the ones held
// back, so that a peer provoking a refusal over and over cannot flood the log (or the disk under it).
//
// Usage: `if (int64_t held; throttle.Allow(&held)) MUOND_LOG(warn, "... ({} more since)", held);`
// Not thread-safe: one per thread or under the caller's lock.
#pragma once

#include <cstdint>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace muond {

class LogThrottle {
 public:
  explicit LogThrottle(absl::Duration interval = absl::Seconds(10)) : interval_(interval) {}

  // True when the line may be logged now; *held_back is then the count suppressed since the last one.
  bool Allow(int64_t* held_back, absl::Time now = absl::Now()) {
    if (now < next_) {
      ++held_back_;
      return false;
    }
    *held_back = held_back_;
    held_back_ = 0;
    next_ = now + interval_;
    return true;
  }

 private:
  const absl::Duration interval_;
  absl::Time next_ = absl::InfinitePast();
  int64_t held_back_ = 0;
};

}  // namespace muond
