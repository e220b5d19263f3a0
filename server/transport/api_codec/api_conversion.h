// Conversions between the muond.v1 wire messages and the session layer's own types: a step header
// becomes a StepRequest, a StepResult becomes its message, dtypes map one to one (the session's
// TensorDType uses the API's numbering). The only place the two vocabularies meet, besides the spec
// codec (server/rpc/session_spec_codec.h). Pure functions; thread-safe.
#pragma once

#include "muond/v1/muond.pb.h"
#include "server/session/session_config.h"
#include "server/session/step_types.h"

namespace muond::transport {

session::StepRequest ToStepRequest(const v1::StepHeader& header);
// A streamed step's options (its StepEnd) as the fields of a StepRequest; the rest left unset.
session::StepRequest StepOptionsOf(const v1::StepEnd& end);
// Whether `header` sets one of the options a streamed step gives in its StepEnd; its name if so.
const char* StreamedOptionInHeader(const v1::StepHeader& header);
v1::StepResult ToProto(const session::StepResult& result);
// One group's clipping and telemetry (StepResult.group_clips, group_telemetry).
v1::GroupClip ToProto(const session::StepResult::GroupClip& clip);
v1::GroupTelemetry ToProto(const session::StepResult::GroupTelemetry& telemetry);
// One group's overrides (StepHeader.overrides, CreateSessionResponse.last_overrides).
v1::GroupOverride ToProto(const session::GroupOverride& o);

inline v1::DType ToProto(session::TensorDType dtype) { return static_cast<v1::DType>(dtype); }
inline session::TensorDType FromProto(v1::DType dtype) { return static_cast<session::TensorDType>(dtype); }

}  // namespace muond::transport
