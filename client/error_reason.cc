// Reads google.rpc.ErrorInfo out of the gRPC status details; see error_reason.h.
#include "client/error_reason.h"

#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace muond::client {
namespace {

constexpr absl::string_view kDomain = "muond.v1";
constexpr absl::string_view kErrorInfoTypeUrl = "type.googleapis.com/google.rpc.ErrorInfo";
// Where the reason lives on an absl::Status of this library; the value is the reason's name.
constexpr absl::string_view kReasonPayload = "type.googleapis.com/muond.v1.ErrorReason";

// The reason's name in the status details; empty when there is none.
std::string ReasonInDetails(const std::string& details) {
  v1::RpcStatus status;
  if (details.empty() || !status.ParseFromString(details)) return "";
  for (const v1::AnyDetail& any : status.details()) {
    v1::ErrorInfo info;
    if (any.type_url() == kErrorInfoTypeUrl && info.ParseFromString(any.value()) && info.domain() == kDomain) {
      return info.reason();
    }
  }
  return "";
}

}  // namespace

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  absl::Status converted(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  const std::string reason = ReasonInDetails(status.error_details());
  if (!reason.empty()) converted.SetPayload(kReasonPayload, absl::Cord(reason));
  return converted;
}

v1::ErrorReason ReasonOf(const absl::Status& status) {
  auto payload = status.GetPayload(kReasonPayload);
  v1::ErrorReason reason = v1::ERROR_REASON_UNSPECIFIED;
  if (payload.has_value() && !v1::ErrorReason_Parse(std::string(*payload), &reason)) {
    return v1::ERROR_REASON_UNSPECIFIED;
  }
  return reason;
}

absl::Status WithReasonOf(const absl::Status& from, absl::Status status) {
  auto payload = from.GetPayload(kReasonPayload);
  if (payload.has_value() && !status.ok()) status.SetPayload(kReasonPayload, *payload);
  return status;
}

absl::Status AfterTries(const absl::Status& status, int tries) {
  if (status.ok() || tries <= 1) return status;
  return WithReasonOf(
      status, absl::Status(status.code(), absl::StrCat(status.message(), " (gave up after ", tries, " tries)")));
}

absl::Status OnLaterTry(const absl::Status& status, int tries, const absl::Status& before) {
  if (status.ok() || tries <= 1) return status;
  // The first 160 characters (UTF-8 code points, as the Python client counts them).
  constexpr size_t kBeforeChars = 160;
  const absl::string_view whole = before.message();
  size_t cut = 0;
  for (size_t chars = 0; cut < whole.size(); ++cut) {
    if ((static_cast<unsigned char>(whole[cut]) & 0xC0) != 0x80 && chars++ == kBeforeChars) break;
  }
  const absl::string_view met = whole.substr(0, cut);
  return WithReasonOf(
      status, absl::Status(status.code(), absl::StrCat(status.message(), " (on try ", tries, "; the try before met ",
                                                       absl::StatusCodeToString(before.code()), ": ", met,
                                                       met.size() < before.message().size() ? "…" : "", ")")));
}

}  // namespace muond::client
