#include "client/transport/transport_choice.h"

#include <array>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/transport/grpc_step_transport.h"
#include "client/transport/shm_step_transport.h"
#include "common/host_id.h"

namespace muond::client {

std::span<const TransportKind> HostTransports() {
  static const std::array<TransportKind, 2> kinds = {ShmTransportKind(), GrpcTransportKind()};
  return kinds;
}

absl::Status CheckTransportName(std::string_view wanted) {
  if (wanted == "auto") return absl::OkStatus();
  std::vector<std::string> names = {"auto"};
  for (const TransportKind& kind : HostTransports()) {
    if (kind.name == wanted) return absl::OkStatus();
    names.push_back(kind.name);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("transport: '", std::string(wanted), "' is not one of ", absl::StrJoin(names, ", ")));
}

absl::Status CheckViable(const TransportKind& kind, const v1::ServerInfo& info) {
  const std::string why = kind.unviable == nullptr ? std::string() : kind.unviable(info);
  if (why.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("transport: '", kind.name, "' is not possible: ", why));
}

absl::StatusOr<const TransportKind*> ChooseTransport(std::string_view wanted,
                                                     absl::FunctionRef<absl::StatusOr<v1::ServerInfo>()> server_info) {
  if (absl::Status named = CheckTransportName(wanted); !named.ok()) return named;
  std::optional<v1::ServerInfo> info;
  for (const TransportKind& kind : HostTransports()) {
    if (wanted != "auto" && wanted != kind.name) continue;
    if (kind.unviable == nullptr) return &kind;
    if (!info.has_value()) {
      absl::StatusOr<v1::ServerInfo> asked = server_info();
      if (!asked.ok()) return asked.status();
      info = *std::move(asked);
    }
    absl::Status viable = CheckViable(kind, *info);
    if (viable.ok()) return &kind;
    if (wanted != "auto") return viable;
  }
  return absl::InternalError("no step transport is viable");  // gRPC always is
}

std::string NotOnThisHost(const v1::ServerInfo& info) {
  if (info.host_id().empty() || info.host_id() != HostId()) return "the daemon runs on another host";
  return "";
}

}  // namespace muond::client
