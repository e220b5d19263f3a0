#include "server/metrics/http_responder.h"

#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace muond::metrics {
namespace {

constexpr char kExposition[] = "text/plain; version=0.0.4; charset=utf-8";
constexpr char kPlain[] = "text/plain; charset=utf-8";

std::string Response(absl::string_view status, absl::string_view content_type, absl::string_view body, bool with_body,
                     absl::string_view extra_headers = "") {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", content_type, "\r\nContent-Length: ", body.size(),
                      "\r\n", extra_headers, "Connection: close\r\n\r\n", with_body ? body : "");
}

}  // namespace

size_t RequestHeadEnd(absl::string_view buffer) {
  for (size_t at = buffer.find('\n'); at != absl::string_view::npos; at = buffer.find('\n', at + 1)) {
    const absl::string_view rest = buffer.substr(at + 1);
    if (absl::StartsWith(rest, "\n")) return at + 2;
    if (absl::StartsWith(rest, "\r\n")) return at + 3;
  }
  return absl::string_view::npos;
}

std::string ErrorResponse(absl::string_view status, absl::string_view reason) {
  return Response(status, kPlain, absl::StrCat(reason, "\n"), true);
}

std::string AnswerRequest(absl::string_view head, const std::function<std::string()>& render) {
  std::vector<absl::string_view> lines = absl::StrSplit(head, '\n');
  const std::vector<absl::string_view> request_line =
      absl::StrSplit(absl::StripTrailingAsciiWhitespace(lines[0]), ' ', absl::SkipEmpty());
  if (request_line.size() != 3 || !absl::StartsWith(request_line[2], "HTTP/1.")) {
    return ErrorResponse("400 Bad Request", "a request line is METHOD TARGET HTTP/1.x");
  }
  const absl::string_view method = request_line[0];
  const bool head_only = method == "HEAD";
  if (method != "GET" && !head_only) {
    return Response("405 Method Not Allowed", kPlain, "only GET and HEAD are served\n", true, "Allow: GET, HEAD\r\n");
  }
  for (size_t i = 1; i < lines.size(); ++i) {
    const absl::string_view line = absl::StripAsciiWhitespace(lines[i]);
    const size_t colon = line.find(':');
    if (colon == absl::string_view::npos) continue;
    const absl::string_view name = line.substr(0, colon);
    const absl::string_view value = absl::StripAsciiWhitespace(line.substr(colon + 1));
    uint64_t length = 0;
    if (absl::EqualsIgnoreCase(name, "transfer-encoding") ||
        (absl::EqualsIgnoreCase(name, "content-length") && !(absl::SimpleAtoi(value, &length) && length == 0))) {
      return ErrorResponse("413 Content Too Large", "requests to the metrics endpoint have no body");
    }
  }
  absl::string_view target = request_line[1];
  target = target.substr(0, target.find('?'));
  if (target == "/metrics") return Response("200 OK", kExposition, render(), !head_only);
  if (target == "/") return Response("200 OK", kPlain, "muond: metrics are at /metrics\n", !head_only);
  return Response("404 Not Found", kPlain, "not found; metrics are at /metrics\n", !head_only);
}

}  // namespace muond::metrics
