#include "tools/muondctl/ctl_output.h"

#include <cstdio>
#include <iostream>

#include "absl/strings/str_format.h"

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
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    const auto byte = static_cast<unsigned char>(text[i]);
    const auto next = [&](size_t k) { return i + k < text.size() ? static_cast<unsigned char>(text[i + k]) : 0; };
    if ((byte < 0x20 && byte != '\n' && byte != '\t') || byte == 0x7f) {
      absl::StrAppendFormat(&out, "\\x%02x", byte);
    } else if (byte == 0xc2 && next(1) >= 0x80 && next(1) <= 0x9f) {  // C1: U+0080–U+009F
      absl::StrAppendFormat(&out, "\\u{%04x}", next(1));
      i += 1;
    } else if (byte == 0xe2 && ((next(1) == 0x80 && next(2) >= 0xaa && next(2) <= 0xae) ||
                                (next(1) == 0x81 && next(2) >= 0xa6 && next(2) <= 0xa9))) {
      absl::StrAppendFormat(&out, "\\u{%04x}", 0x2000 + ((next(1) & 0x3f) << 6) + (next(2) & 0x3f));
      i += 2;
    } else {
      out.push_back(static_cast<char>(byte));
    }
  }
  return out;
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
