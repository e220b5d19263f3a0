// MuondService: the gRPC face of the daemon (muond.v1.Muond). Each handler runs under the daemon's
// --rpc-timeout, authenticates its caller (when tokens are configured), checks its request,
// hands the work to the SessionRegistry / Session, and converts the resulting absl::Status to a gRPC
// status in exactly one place (ToGrpcStatus). It holds no state of its own beyond the registry and
// the options, so handlers run concurrently on gRPC's threads.
#pragma once

#include <cstddef>
#include <string>

#include "absl/time/time.h"
#include "kernels/backend.h"
#include "muond/v1/muond.grpc.pb.h"
#include "server/auth.h"
#include "server/rpc_deadline.h"
#include "server/session_registry.h"

namespace muond::server {

struct ServiceOptions {
  size_t max_chunk_bytes = 4u << 20;      // largest accepted chunk payload
  size_t default_chunk_bytes = 1u << 20;  // chunk size of answers unless the client asks otherwise
  size_t max_message_bytes = 0;           // the gRPC limit the server was built with (reported)
  // Bearer tokens every call must present; null turns authentication off. Not owned; must outlive
  // the service.
  const TokenTable* tokens = nullptr;
  absl::Duration rpc_timeout = absl::Seconds(600);  // the daemon's limit on any call; 0: none
};

class MuondService final : public v1::Muond::Service {
 public:
  MuondService(SessionRegistry* registry, kernels::Backend* backend, ServiceOptions options)
      : registry_(registry), backend_(backend), options_(options), deadlines_(options.rpc_timeout) {}

  // Waits until no session call is in flight, or `limit` passes; true when idle. For shutdown.
  bool AwaitIdle(absl::Duration limit) { return deadlines_.AwaitIdle(limit); }

  grpc::Status GetServerInfo(grpc::ServerContext*, const v1::GetServerInfoRequest*, v1::ServerInfo*) override;
  grpc::Status CreateSession(grpc::ServerContext*, const v1::CreateSessionRequest*,
                             v1::CreateSessionResponse*) override;
  grpc::Status CloseSession(grpc::ServerContext*, const v1::CloseSessionRequest*,
                            v1::CloseSessionResponse*) override;
  grpc::Status ListSessions(grpc::ServerContext*, const v1::ListSessionsRequest*,
                            v1::ListSessionsResponse*) override;
  grpc::Status UploadParameters(grpc::ServerContext*, grpc::ServerReader<v1::UploadParametersRequest>*,
                                v1::UploadParametersResponse*) override;
  grpc::Status Step(grpc::ServerContext*, grpc::ServerReaderWriter<v1::StepResponse, v1::StepRequest>*) override;
  grpc::Status GetParameters(grpc::ServerContext*, const v1::GetParametersRequest*,
                             grpc::ServerWriter<v1::GetParametersResponse>*) override;
  grpc::Status GetState(grpc::ServerContext*, const v1::GetStateRequest*,
                        grpc::ServerWriter<v1::GetStateResponse>*) override;
  grpc::Status SetState(grpc::ServerContext*, grpc::ServerReader<v1::SetStateRequest>*,
                        v1::SetStateResponse*) override;
  grpc::Status Checkpoint(grpc::ServerContext*, const v1::CheckpointRequest*, v1::CheckpointResponse*) override;

 private:
  // The authenticated identity of the call ("" when authentication is off); UNAUTHENTICATED when
  // its bearer token is missing or wrong. Every handler asks before touching a session.
  absl::StatusOr<std::string> Caller(const grpc::ServerContext& context) const {
    return CallerOf(context, options_.tokens);
  }

  absl::Status DoUpload(const std::string& caller, grpc::ServerReader<v1::UploadParametersRequest>* reader,
                        v1::UploadParametersResponse* response);
  absl::Status DoStep(const std::string& caller, grpc::ServerContext* context,
                      grpc::ServerReaderWriter<v1::StepResponse, v1::StepRequest>* stream);
  absl::Status DoGetParameters(const std::string& caller, grpc::ServerContext* context,
                               const v1::GetParametersRequest& request,
                               grpc::ServerWriter<v1::GetParametersResponse>* writer);
  absl::Status DoGetState(const std::string& caller, const v1::GetStateRequest& request,
                          grpc::ServerWriter<v1::GetStateResponse>* writer);
  absl::Status DoSetState(const std::string& caller, grpc::ServerReader<v1::SetStateRequest>* reader,
                          v1::SetStateResponse* response);

  // Chunk size for an answer: the client's wish bounded by the server's limit.
  size_t AnswerChunkBytes(uint32_t requested) const;

  SessionRegistry* const registry_;
  kernels::Backend* const backend_;
  const ServiceOptions options_;
  RpcDeadlines deadlines_;  // --rpc-timeout: every handler holds a Watch scope
};

}  // namespace muond::server
