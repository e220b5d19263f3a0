#include "tools/muondctl/ctl_output.h"

#include <cstdio>
#include <iostream>

#include "absl/strings/str_format.h"
#include "common/echo.h"

namespace muond::ctl {

int ExitCodeOf(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return kExitOk;
    case absl::StatusCode::kInvalidArgument:
      return kExitUsage;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
      return kExitUnreachable;
    case absl::StatusCode::kNotFound:
      return kExitNotFound;
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kPermissionDenied:
      return kExitDenied;
    default:
      return kExitNo;
  }
}

Answer ErrorAnswer(const absl::Status& status) {
  Answer answer;
  const std::string message(status.message());
  answer.json["error"] = {{"code", absl::StatusCodeToString(status.code())}, {"message", message}};
  answer.exit_code = ExitCodeOf(status);
  if (answer.exit_code == kExitOk) answer.exit_code = kExitNo;
  answer.text = message;
  return answer;
}

std::string Printable(std::string_view text) {
  return EscapeControls(absl::string_view(text.data(), text.size()), /*keep_line_breaks=*/true);
}

int Print(const Answer& answer, bool json) {
  const bool failed = answer.json.contains("error");
  if (json) {
    std::cout << answer.json.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  } else if (failed) {
    std::cerr << "muondctl: " << Printable(answer.text) << "\n";
  } else {
    std::cout << Printable(answer.text);
  }
  std::cout.flush();
  return answer.exit_code;
}

std::string OptionalFigure(bool has, double value, const absl::FormatSpec<double>& format) {
  return has ? absl::StrFormat(format, value) : std::string("-");
}

std::string HumanBytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (bytes >= 1024 && unit < 4) {
    bytes /= 1024;
    ++unit;
  }
  return unit == 0 ? absl::StrFormat("%.0f B", bytes) : absl::StrFormat("%.2f %s", bytes, units[unit]);
}

}  // namespace muond::ctl
