// The one place where absl::Status becomes grpc::Status: every handler's answer passes through
// CallScope::Finish, which calls this. The codes map one to one (both follow google.rpc.Code); the
// message is kept as is.
#pragma once

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace muond::rpc {

grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace muond::rpc
