// The metrics endpoint's HTTP: what a request head (request line and header lines, up to the blank
// line) is answered with. GET-only by design: the endpoint serves two fixed documents, so anything
// else is refused — other methods with 405, a request announcing a body with 413 — and every answer
// closes the connection (no keep-alive: an idle connection holds nothing). Pure functions.
#pragma once

#include <cstddef>
#include <functional>
#include <string>

#include "absl/strings/string_view.h"

namespace muond::metrics {

// Where a request head ends: the offset just past its blank line in `buffer`, or npos when the
// blank line has not arrived yet. Accepts CRLF and bare LF line ends.
size_t RequestHeadEnd(absl::string_view buffer);

// The whole response (status line, headers, body) to `head`; `render` makes GET /metrics's body.
std::string AnswerRequest(absl::string_view head, const std::function<std::string()>& render);

// A response with `status` ("431 Request Header Fields Too Large") and a one-line plain-text body.
std::string ErrorResponse(absl::string_view status, absl::string_view reason);

}  // namespace muond::metrics
