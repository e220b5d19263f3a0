// Reasons as absl payloads; see error_reason.h.
#include "common/error_reason.h"

#include "absl/strings/cord.h"

namespace muond {
namespace {

// The payload's type URL; the value is the reason's wire name.
constexpr absl::string_view kReasonPayload = "type.googleapis.com/muond.v1.ErrorReason";

}  // namespace

absl::string_view ReasonName(ErrorReason reason) {
  switch (reason) {
    case ErrorReason::kRegionNotFound:
      return "REGION_NOT_FOUND";
    case ErrorReason::kChannelNotFound:
      return "CHANNEL_NOT_FOUND";
    case ErrorReason::kStepNotPrepared:
      return "STEP_NOT_PREPARED";
    case ErrorReason::kSessionNotFound:
      return "SESSION_NOT_FOUND";
    case ErrorReason::kPushTooStale:
      return "PUSH_TOO_STALE";
    case ErrorReason::kChunkTooLarge:
      return "CHUNK_TOO_LARGE";
    case ErrorReason::kCallerBusy:
      return "CALLER_BUSY";
  }
  return "";
}

absl::Status WithReason(absl::Status status, ErrorReason reason) {
  if (!status.ok()) status.SetPayload(kReasonPayload, absl::Cord(ReasonName(reason)));
  return status;
}

std::string ReasonOf(const absl::Status& status) {
  auto payload = status.GetPayload(kReasonPayload);
  return payload.has_value() ? std::string(*payload) : std::string();
}

}  // namespace muond
