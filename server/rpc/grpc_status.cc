#include "server/rpc/grpc_status.h"

#include <string>

#include "common/echo.h"
#include "common/error_reason.h"
#include "muond/v1/muond.pb.h"

namespace muond::rpc {
namespace {

constexpr size_t kMaxStatusMessageBytes = 4096;

// The status details of a refusal with a reason: google.rpc.Status holding one google.rpc.ErrorInfo.
std::string ErrorDetails(grpc::StatusCode code, const std::string& message, const std::string& reason) {
  v1::ErrorInfo info;
  info.set_reason(reason);
  info.set_domain(std::string(kErrorDomain));
  v1::RpcStatus details;
  details.set_code(static_cast<int32_t>(code));
  details.set_message(message);
  v1::AnyDetail* any = details.add_details();
  any->set_type_url(std::string(kErrorInfoTypeUrl));
  any->set_value(info.SerializeAsString());
  return details.SerializeAsString();
}

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl::StatusCode and grpc::StatusCode share the canonical numbering 0..16.
  // Bounded whatever a handler put in it: a message past the client's metadata limit would reach it as
  // RESOURCE_EXHAUSTED instead of the refusal (client strings are echoed bounded already; Echo).
  const auto code = static_cast<grpc::StatusCode>(status.code());
  std::string message = Echo(status.message(), kMaxStatusMessageBytes);
  const std::string reason = ReasonOf(status);
  if (reason.empty()) return grpc::Status(code, std::move(message));
  std::string details = ErrorDetails(code, message, reason);
  return grpc::Status(code, std::move(message), std::move(details));
}

}  // namespace muond::rpc
