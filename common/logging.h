// The daemon's logging: one spdlog logger configured once at start-up. Use MUOND_LOG(level, fmt, ...)
// everywhere in server/ so the sink and format are decided in one place, and MUOND_EVENT for a line
// about one session's event, which --log-format json turns into fields of its own. Thread-safe
// (spdlog's multi-threaded sinks; event fields are per thread).
//
// Formats (--log-format):
//   text  2026-11-25T10:00:00.123 info session run-1 created: ...
//   json  {"time":"2026-11-25T10:00:00.123Z","level":"info","message":"session run-1 created: ...",
//          "event":"session_created","session":"run-1","step":0}
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "spdlog/spdlog.h"

namespace muond {

// Sets the level ("trace", "debug", "info", "warn", "error", "off") and the format ("text", "json");
// INVALID_ARGUMENT naming --log-level or --log-format for anything else.
absl::Status ConfigureLogging(absl::string_view level, absl::string_view format = "text");

// The event fields of the log lines written on this thread while it lives (see MUOND_EVENT).
// `event` and `session` must outlive it; step < 0 leaves the step out.
class ScopedLogEvent {
 public:
  ScopedLogEvent(absl::string_view event, absl::string_view session, int64_t step);
  ~ScopedLogEvent();
  ScopedLogEvent(const ScopedLogEvent&) = delete;
  ScopedLogEvent& operator=(const ScopedLogEvent&) = delete;

  struct Fields {
    absl::string_view event;
    absl::string_view session;
    int64_t step = -1;
  };
  // The innermost scope's fields on this thread, or null.
  static const Fields* Current();

 private:
  Fields fields_;
  const Fields* outer_;
};

}  // namespace muond

// Debian's abseil keeps its own string_view type (not std::string_view); let log lines format it.
template <>
struct fmt::formatter<absl::string_view> : fmt::formatter<fmt::string_view> {
  auto format(absl::string_view s, fmt::format_context& ctx) const {
    return fmt::formatter<fmt::string_view>::format(fmt::string_view(s.data(), s.size()), ctx);
  }
};

#define MUOND_LOG(level, ...) ::spdlog::level(__VA_ARGS__)
// A line about `event` (snake_case, e.g. "session_created") of session `session` at step `step`
// (-1: none): the same text as MUOND_LOG, with the three as JSON fields under --log-format json.
#define MUOND_EVENT(level, event, session, step, ...)                           \
  do {                                                                          \
    const ::muond::ScopedLogEvent muond_log_event_((event), (session), (step)); \
    ::spdlog::level(__VA_ARGS__);                                               \
  } while (0)
