#include "server/rpc/call_scope.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/echo.h"
#include "common/logging.h"
#include "grpcpp/security/auth_context.h"
#include "server/rpc/grpc_status.h"
#include "server/security/caller_identity.h"

namespace muond::rpc {

absl::Status OutOfHostMemory(std::string_view method) {
  return absl::ResourceExhaustedError(
      absl::StrCat(std::string(method),
                   ": a host allocation failed (the daemon is out of memory under its address-space or overcommit "
                   "limit); a smaller request, or --max-session-bytes to refuse such sessions before they are made"));
}

absl::StatusOr<std::string> CallerOf(const grpc::ServerContext& context, const security::TokenTable* tokens) {
  security::CallCredentials credentials;
  const auto& metadata = context.client_metadata();
  if (auto it = metadata.find("authorization"); it != metadata.end()) {
    credentials.authorization = std::string(it->second.data(), it->second.size());
  }
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth != nullptr && auth->IsPeerAuthenticated()) {
    credentials.peer_verified = true;
    for (const grpc::string_ref& name : auth->GetPeerIdentity())
      credentials.peer_names.emplace_back(name.data(), name.size());
  }
  return security::IdentifyCaller(credentials, tokens);
}

CallScope::CallScope(CallServices& services, grpc::ServerContext* context, std::string_view method)
    : services_(services),
      context_(context),
      method_(method),
      start_(std::chrono::steady_clock::now()),
      deadline_(services.deadlines.Watch(context)),
      caller_(CallerOf(*context, services.tokens)) {
  if (caller_.ok()) {
    absl::StatusOr<CallerSlots::Slot> slot = services_.slots.Take(*caller_);
    if (slot.ok()) {
      slot_ = *std::move(slot);
    } else {
      caller_ = slot.status();
    }
  }
  services_.metrics->CallStarted(method_);  // after the slot: a started call holds its slot
}

CallScope::~CallScope() {
  if (!finished_) {
    services_.metrics->CallEnded(method_, absl::StatusCode::kUnknown,
                                 absl::FromChrono(std::chrono::steady_clock::now() - start_));
  }
}

grpc::Status CallScope::Finish(const absl::Status& status) {
  finished_ = true;
  services_.metrics->CallEnded(method_, status.code(), absl::FromChrono(std::chrono::steady_clock::now() - start_));
  if (!status.ok()) {
    // Every refusal is logged once, here. Steps are the daemon's bulk traffic, so theirs are debug
    // lines; errors of the daemon itself are logged where they happen.
    const spdlog::level::level_enum level =
        method_ == "Step" || method_ == "StepWhole" ? spdlog::level::debug : spdlog::level::info;
    spdlog::log(level, "{} from {} refused: {}", method_, context_->peer(), Echo(status.ToString(), 4096));
  }
  return ToGrpcStatus(status);
}

}  // namespace muond::rpc
