// MuondService: session management and server information. The tensor-streaming handlers live in
// service_step.cc and service_state.cc.
#include "server/muond_service.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/optim/options.h"
#include "kernels/status_macros.h"
#include "server/grpc_status.h"
#include "server/logging.h"

#ifndef MUOND_VERSION
#define MUOND_VERSION "unknown"
#endif

namespace muond::server {
namespace {
constexpr size_t kMinAnswerChunkBytes = 64u << 10;
}  // namespace

size_t MuondService::AnswerChunkBytes(uint32_t requested) const {
  if (requested == 0) return options_.default_chunk_bytes;
  // A floor, so a tiny request cannot make the daemon send one element per message.
  const size_t floor = std::min<size_t>(kMinAnswerChunkBytes, options_.max_chunk_bytes);
  return std::clamp<size_t>(requested, floor, options_.max_chunk_bytes);
}

grpc::Status MuondService::GetServerInfo(grpc::ServerContext* context, const v1::GetServerInfoRequest*,
                                         v1::ServerInfo* info) {
  RpcDeadlines::Scope deadline = deadlines_.Watch(context);  // counted as in flight by the drain, too
  if (absl::StatusOr<std::string> caller = Caller(*context); !caller.ok()) return ToGrpcStatus(caller.status());
  info->set_version(MUOND_VERSION);
  info->set_backend(backend_->Name());
  info->set_backend_detail(backend_->Detail());
  info->set_max_chunk_bytes(options_.max_chunk_bytes);
  info->set_max_message_bytes(options_.max_message_bytes);
  for (const char* name : {"muon", "adamw", "lion", "sgd"}) info->add_optimizers(name);
  for (const std::string& name : optim::NamedScheduleNames()) info->add_ns_coefficient_sets(name);
  info->set_num_sessions(static_cast<int32_t>(registry_->size()));
  return grpc::Status::OK;
}

grpc::Status MuondService::CreateSession(grpc::ServerContext* context, const v1::CreateSessionRequest* request,
                                         v1::CreateSessionResponse* response) {
  RpcDeadlines::Scope deadline = deadlines_.Watch(context);
  absl::StatusOr<std::string> caller = Caller(*context);
  if (!caller.ok()) return ToGrpcStatus(caller.status());
  absl::StatusOr<CreateResult> created =
      registry_->CreateOrAttach(request->session_id(), request->spec(), *caller);
  if (!created.ok()) {
    MUOND_LOG(info, "create session '{}' refused: {}", request->session_id().substr(0, 140),
              created.status().ToString());
    return ToGrpcStatus(created.status());
  }
  const Session& session = *created->session;
  response->set_session_id(session.id());
  response->set_attached(created->attached);
  response->set_last_step(session.last_step());
  response->set_initialized(session.initialized());
  response->set_num_parameters(session.config().total_elements);
  return grpc::Status::OK;
}

grpc::Status MuondService::CloseSession(grpc::ServerContext* context, const v1::CloseSessionRequest* request,
                                        v1::CloseSessionResponse*) {
  RpcDeadlines::Scope deadline = deadlines_.Watch(context);
  absl::StatusOr<std::string> caller = Caller(*context);
  if (!caller.ok()) return ToGrpcStatus(caller.status());
  return ToGrpcStatus(registry_->Close(request->session_id(), *caller));
}

grpc::Status MuondService::ListSessions(grpc::ServerContext* context, const v1::ListSessionsRequest*,
                                        v1::ListSessionsResponse* response) {
  absl::StatusOr<std::string> caller = Caller(*context);
  if (!caller.ok()) return ToGrpcStatus(caller.status());
  for (const auto& session : registry_->ListOwnedBy(*caller)) {
    v1::SessionSummary* summary = response->add_sessions();
    summary->set_session_id(session->id());
    summary->set_last_step(session->last_step());
    summary->set_num_tensors(static_cast<int32_t>(session->config().parameters.size()));
    summary->set_num_parameters(session->config().total_elements);
    summary->set_initialized(session->initialized());
    summary->set_world_size(session->config().world_size);
  }
  return grpc::Status::OK;
}

grpc::Status MuondService::Checkpoint(grpc::ServerContext* context, const v1::CheckpointRequest* request,
                                      v1::CheckpointResponse* response) {
  RpcDeadlines::Scope deadline = deadlines_.Watch(context);
  absl::StatusOr<std::string> caller = Caller(*context);
  if (!caller.ok()) return ToGrpcStatus(caller.status());
  absl::StatusOr<std::shared_ptr<Session>> session = registry_->Find(request->session_id(), *caller);
  if (!session.ok()) return ToGrpcStatus(session.status());
  absl::StatusOr<int64_t> step = (*session)->Checkpoint();
  if (!step.ok()) return ToGrpcStatus(step.status());
  response->set_step(*step);
  MUOND_LOG(info, "session {} checkpointed at step {}", request->session_id(), *step);
  return grpc::Status::OK;
}

}  // namespace muond::server
