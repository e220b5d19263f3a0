// The one place where absl::Status becomes grpc::Status: every handler's answer passes through
// CallScope::Finish, which calls this. The codes map one to one (both follow google.rpc.Code); the
// message is kept as is. A status with a reason (common/error_reason.h) also carries it as status
// details (grpc-status-details-bin): a google.rpc.Status with one google.rpc.ErrorInfo whose domain
// is "muond.v1" (muond.v1.RpcStatus and ErrorInfo, the same messages on the wire).
#pragma once

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/status.h"

namespace muond::rpc {

inline constexpr absl::string_view kErrorDomain = "muond.v1";
inline constexpr absl::string_view kErrorInfoTypeUrl = "type.googleapis.com/google.rpc.ErrorInfo";

grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace muond::rpc
