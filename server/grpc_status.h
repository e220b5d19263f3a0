// The one place where absl::Status becomes grpc::Status (and back, for code shared with the client).
// The codes map one to one (both follow google.rpc.Code); the message is kept as is.
#pragma once

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace muond::server {

grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace muond::server
