#include "common/logging.h"

#include <chrono>
#include <ctime>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"
#include "spdlog/pattern_formatter.h"
#include "spdlog/sinks/stdout_color_sinks.h"

namespace muond {
namespace {

thread_local const ScopedLogEvent::Fields* g_current_event = nullptr;

// One JSON object per line: time (UTC, milliseconds), level, message, and the event fields of the
// writing thread's ScopedLogEvent when there is one.
class JsonFormatter final : public spdlog::formatter {
 public:
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    const auto since_epoch = msg.time.time_since_epoch();
    const std::time_t seconds = std::chrono::duration_cast<std::chrono::seconds>(since_epoch).count();
    const auto millis = std::chrono::duration_cast<std::chrono::milliseconds>(since_epoch).count() % 1000;
    std::tm utc = {};
    gmtime_r(&seconds, &utc);
    char time[40];
    const size_t length = std::strftime(time, sizeof(time), "%Y-%m-%dT%H:%M:%S", &utc);
    nlohmann::ordered_json line;
    line["time"] = absl::StrCat(std::string(time, length), ".", absl::StrFormat("%03d", static_cast<int>(millis)), "Z");
    const auto level = spdlog::level::to_string_view(msg.level);
    line["level"] = std::string(level.data(), level.size());
    line["message"] = std::string(msg.payload.data(), msg.payload.size());
    if (const ScopedLogEvent::Fields* event = ScopedLogEvent::Current()) {
      line["event"] = std::string(event->event);
      if (!event->session.empty()) line["session"] = std::string(event->session);
      if (event->step >= 0) line["step"] = event->step;
    }
    // Replace invalid UTF-8 rather than throw: a log line must never take the daemon down.
    const std::string text = line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    dest.append(text.data(), text.data() + text.size());
    dest.push_back('\n');
  }
  std::unique_ptr<spdlog::formatter> clone() const override { return std::make_unique<JsonFormatter>(); }
};

}  // namespace

ScopedLogEvent::ScopedLogEvent(absl::string_view event, absl::string_view session, int64_t step)
    : fields_{event, session, step}, outer_(g_current_event) {
  g_current_event = &fields_;
}

ScopedLogEvent::~ScopedLogEvent() { g_current_event = outer_; }

const ScopedLogEvent::Fields* ScopedLogEvent::Current() { return g_current_event; }

absl::Status ConfigureLogging(absl::string_view level, absl::string_view format) {
  const spdlog::level::level_enum parsed = spdlog::level::from_str(std::string(level));
  // from_str maps unknown names to "off"; only accept "off" when it was asked for.
  if (parsed == spdlog::level::off && level != "off") {
    return absl::InvalidArgumentError(
        absl::StrCat("--log-level must be one of trace, debug, info, warn, error, off; got '", level, "'"));
  }
  if (format != "text" && format != "json") {
    return absl::InvalidArgumentError(absl::StrCat("--log-format must be text or json; got '", format, "'"));
  }
  std::shared_ptr<spdlog::logger> logger = spdlog::get("muond");
  if (logger == nullptr) logger = spdlog::stderr_color_mt("muond");
  if (format == "json") {
    logger->set_formatter(std::make_unique<JsonFormatter>());
  } else {
    logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %v");
  }
  logger->set_level(parsed);
  spdlog::set_default_logger(logger);
  return absl::OkStatus();
}

}  // namespace muond
