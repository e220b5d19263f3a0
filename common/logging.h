// The daemon's logging: one spdlog logger configured once at start-up. Use MUOND_LOG(level, fmt, ...)
// everywhere in server/ so the sink and format are decided in one place. Thread-safe (spdlog's
// multi-threaded sinks).
#pragma once

#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "spdlog/spdlog.h"

namespace muond {

// Sets the level ("trace", "debug", "info", "warn", "error", "off"); INVALID_ARGUMENT naming
// --log-level for anything else.
absl::Status ConfigureLogging(absl::string_view level);

}  // namespace muond

// Debian's abseil keeps its own string_view type (not std::string_view); let log lines format it.
template <>
struct fmt::formatter<absl::string_view> : fmt::formatter<fmt::string_view> {
  auto format(absl::string_view s, fmt::format_context& ctx) const {
    return fmt::formatter<fmt::string_view>::format(fmt::string_view(s.data(), s.size()), ctx);
  }
};

#define MUOND_LOG(level, ...) ::spdlog::level(__VA_ARGS__)
