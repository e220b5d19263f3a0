// What the out-of-band step RPCs (StepShared, StepCuda, StepNccl: tensors named in the request,
// carried elsewhere) share around their transport: finding the stepping session from the header,
// refusing a return dtype (their answers go in parameters[].dtype), and running the step into the
// response. Stateless; called on the handler's thread.
#pragma once

#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "muond/v1/muond.pb.h"
#include "server/metrics/metrics.h"
#include "server/session/session.h"
#include "server/session/session_registry.h"
#include "server/transport/api_codec/api_conversion.h"
#include "server/transport/step_transport.h"

namespace muond::rpc {

// The caller's session that `header` names; errors name header.session_id.
inline absl::StatusOr<std::shared_ptr<session::Session>> FindStepSession(session::SessionRegistry& registry,
                                                                         const v1::StepHeader& header,
                                                                         const std::string& caller) {
  MUOND_RETURN_IF_ERROR(session::CheckSessionId(header.session_id(), "header.session_id"));
  return registry.Find(header.session_id(), caller, "header.session_id");
}

// INVALID_ARGUMENT naming a header option of the Step stream's answer when it is set: `a_step` ("a
// CUDA IPC step") answers in parameters[].dtype (not header.return_dtype), every parameter at once
// (not in header.answer_order).
inline absl::Status CheckNoStreamAnswerOptions(const v1::StepHeader& header, absl::string_view a_step) {
  if (header.return_dtype() != v1::DTYPE_UNSPECIFIED) {
    return absl::InvalidArgumentError(absl::StrCat("header.return_dtype: ", a_step, " answers in parameters[].dtype"));
  }
  if (header.answer_order_size() > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.answer_order: ", a_step, " answers every parameter at once (Step only)"));
  }
  return absl::OkStatus();
}

// Runs the step `header` asks for on `source` and `sink` and puts its result into `response`.
// `device_answer`: see StepRequest::device_answer.
template <typename Sink>
absl::Status RunOutOfBandStep(session::Session& session, const v1::StepHeader& header, bool device_answer,
                              transport::GradientSource& source, Sink& sink, metrics::Metrics& metrics,
                              v1::StepSharedResponse* response) {
  if (header.streamed()) {
    return absl::InvalidArgumentError(
        "header.streamed: only the Step stream takes streamed steps; this call carries every gradient at once");
  }
  session::StepRequest step = transport::ToStepRequest(header);
  if (device_answer) step.device_answer = true;
  MUOND_RETURN_IF_ERROR(transport::RunStep(session, std::move(step), source, sink, metrics));
  *response->mutable_result() = sink.result();
  return absl::OkStatus();
}

}  // namespace muond::rpc
