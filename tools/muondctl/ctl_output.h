// How muondctl answers: every command builds one JSON value; --json prints it as is (one document on
// stdout), otherwise the command's text form is printed. Errors go to stderr as "muondctl: <message>"
// (or, with --json, as {"error": {"code": ..., "message": ...}} on stdout) and set the exit code.
//
// Exit codes, for scripts:
//   0  done (health: the daemon is SERVING; state verify: every check passed)
//   1  the command ran and the answer is no: the daemon refused (FAILED_PRECONDITION, ...), health
//      is NOT_SERVING, state verify found a problem
//   2  usage: bad options or arguments (also INVALID_ARGUMENT from the daemon)
//   3  the daemon cannot be reached (UNAVAILABLE, DEADLINE_EXCEEDED)
//   4  not found: no such session, state directory or file
//   5  not allowed: UNAUTHENTICATED or PERMISSION_DENIED
#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"

namespace muond::ctl {

enum ExitCode : int {
  kExitOk = 0,
  kExitNo = 1,
  kExitUsage = 2,
  kExitUnreachable = 3,
  kExitNotFound = 4,
  kExitDenied = 5,
};

// The exit code for a failed status (see above).
int ExitCodeOf(const absl::Status& status);

// What a command returns: its JSON document, its text form, and its exit code.
struct Answer {
  nlohmann::ordered_json json;
  std::string text;  // printed as is without --json; should end with a newline
  int exit_code = kExitOk;
};

// An Answer for a failed status: {"error": {...}} and "muondctl: <message>".
Answer ErrorAnswer(const absl::Status& status);

// Prints `answer` (JSON or text) and returns its exit code.
int Print(const Answer& answer, bool json);

// `text` safe to print on a terminal (EscapeControls, common/echo.h, keeping newlines and tabs), so
// that a name from a daemon or a state file cannot move the cursor, recolour the terminal or reorder
// what follows it. Text output and top go through it.
std::string Printable(std::string_view text);

// "1.50 GiB"-style sizes for text output.
std::string HumanBytes(double bytes);

// A figure of text output that may be absent: `value` in `format`, or "-".
std::string OptionalFigure(bool has, double value, const absl::FormatSpec<double>& format = "%.4g");

}  // namespace muond::ctl
