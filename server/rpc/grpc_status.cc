#include "server/rpc/grpc_status.h"

#include <string>

#include "common/echo.h"

namespace muond::rpc {
namespace {

constexpr size_t kMaxStatusMessageBytes = 4096;

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl::StatusCode and grpc::StatusCode share the canonical numbering 0..16.
  // Bounded whatever a handler put in it: a message past the client's metadata limit would reach it as
  // RESOURCE_EXHAUSTED instead of the refusal (client strings are echoed bounded already; Echo).
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), Echo(status.message(), kMaxStatusMessageBytes));
}

}  // namespace muond::rpc
