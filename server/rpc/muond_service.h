// MuondService: the gRPC face of the daemon (muond.v1.Muond). Every handler runs inside one
// CallScope (Serve: --rpc-timeout watch, authentication, metrics, the refusal's log line and the one
// conversion to a gRPC status), converts its request into the session layer's types and hands the
// work to the SessionRegistry / Session; a step goes through the transport seam
// (transport::RunStep over the gRPC stream's source and sink). The service registers the methods of
// muond.v1.Muond itself, each of the kind the API defines, over raw byte buffers
// (service_registration.cc, byte_buffer_calls.h): a request protobuf refuses is answered naming its
// field, and Step's tensor payloads are never copied into protobuf strings; the messages keep their
// protobuf encoding on the wire.
//
// Handlers: session_handlers.cc (server info, create, close, list, checkpoint), tensor_handlers.cc
// (upload, step, get parameters), state_handlers.cc (get and set state, the state digest),
// shm_handlers.cc (shared-memory regions and the StepShared step). The service holds no
// state of its own beyond what its calls share, so handlers run concurrently on gRPC's threads. It
// borrows the registry, the backend, the tokens and the metrics, which must outlive it.
#pragma once

#include <cstddef>
#include <deque>
#include <memory>
#include <string>
#include <string_view>

#include "absl/time/time.h"
#include "grpcpp/impl/rpc_method.h"
#include "grpcpp/impl/service_type.h"
#include "grpcpp/support/byte_buffer.h"
#include "kernels/backend.h"
#include "muond/v1/muond.grpc.pb.h"
#include "proto/wire/chunk_frame.h"
#include "server/metrics/metrics.h"
#include "server/rpc/byte_buffer_calls.h"
#include "server/rpc/call_scope.h"
#include "server/security/token_table.h"
#include "server/session/session_registry.h"
#include "server/transport/cuda_ipc/cuda_memory_regions.h"
#include "server/transport/grpc/grpc_step_stream.h"
#include "server/transport/nccl/nccl_channels.h"
#include "server/transport/shm/shared_memory_regions.h"

namespace muond::rpc {

// The out-of-band step transports the service offers, besides its gRPC streams: each one's table
// of what callers registered; a null table is not offered. Not owned.
struct OfferedTransports {
  transport::SharedMemoryRegions* shm_regions = nullptr;
  std::string shm_socket;  // the shared-memory socket's address, reported by GetServerInfo
  transport::CudaMemoryRegions* cuda_regions = nullptr;
  transport::NcclChannels* nccl_channels = nullptr;
};

struct ServiceOptions {
  size_t max_chunk_bytes = 4u << 20;      // largest accepted chunk payload
  size_t default_chunk_bytes = 1u << 20;  // chunk size of answers unless the client asks otherwise
  size_t max_message_bytes = 0;           // the gRPC limit the server was built with (reported)
  // Bearer tokens every call must present; null turns token authentication off. Not owned.
  const security::TokenTable* tokens = nullptr;
  absl::Duration rpc_timeout = absl::Seconds(600);   // the daemon's limit on any call; 0: none
  metrics::Metrics* metrics = metrics::NoMetrics();  // not owned
  OfferedTransports transports;
  std::string host_id;  // the kernel's boot id, reported by GetServerInfo
  // Reported by GetServerInfo: the metrics endpoint's address ("" when off), the durability of
  // --state-dir ("" when none) and --max-sessions.
  std::string metrics_address;
  std::string durability;
  int max_sessions = 0;
  int max_calls_per_caller = 0;  // --max-calls-per-caller; 0: no cap
};

class MuondService final : public grpc::Service {
 public:
  MuondService(session::SessionRegistry* registry, kernels::Backend* backend, ServiceOptions options)
      : registry_(registry),
        backend_(backend),
        options_(options),
        calls_(options.rpc_timeout, options.tokens, options.metrics, options.max_calls_per_caller),
        answer_slices_(wire::SlicePool::Create(options.default_chunk_bytes)) {
    RegisterMethods();
  }

  // Waits until no call is in flight, or `limit` passes; true when idle. For shutdown.
  bool AwaitIdle(absl::Duration limit) { return calls_.deadlines.AwaitIdle(limit); }

  grpc::Status GetServerInfo(grpc::ServerContext*, const v1::GetServerInfoRequest*, v1::ServerInfo*);
  grpc::Status CreateSession(grpc::ServerContext*, const v1::CreateSessionRequest*, v1::CreateSessionResponse*);
  grpc::Status CloseSession(grpc::ServerContext*, const v1::CloseSessionRequest*, v1::CloseSessionResponse*);
  grpc::Status ListSessions(grpc::ServerContext*, const v1::ListSessionsRequest*, v1::ListSessionsResponse*);
  // The streaming calls, over byte buffers (UploadParameters and SetState: ServeClientStream over
  // DoUpload and DoSetState). Step: StepRequest in, StepResponse out.
  grpc::Status StepOverByteBuffers(grpc::ServerContext*, ByteBufferStream*);
  // StepWhole: one StepMessages in, one StepAnswers out; the same step as Step's.
  grpc::Status StepWholeOverByteBuffers(grpc::ServerContext*, ByteBufferStream*);
  // GetParameters: one GetParametersRequest in, GetParametersResponse messages out.
  grpc::Status GetParametersOverByteBuffers(grpc::ServerContext*, const grpc::ByteBuffer* request,
                                            grpc::ServerWriter<grpc::ByteBuffer>* writer);
  // GetState: one GetStateRequest in, GetStateResponse messages out.
  grpc::Status GetStateOverByteBuffers(grpc::ServerContext*, const grpc::ByteBuffer* request,
                                       grpc::ServerWriter<grpc::ByteBuffer>* writer);
  grpc::Status Checkpoint(grpc::ServerContext*, const v1::CheckpointRequest*, v1::CheckpointResponse*);
  grpc::Status GetStateDigest(grpc::ServerContext*, const v1::GetStateDigestRequest*, v1::StateDigest*);
  grpc::Status GrantSharedMemory(grpc::ServerContext*, const v1::GrantSharedMemoryRequest*,
                                 v1::GrantSharedMemoryResponse*);
  grpc::Status RegisterSharedMemory(grpc::ServerContext*, const v1::RegisterSharedMemoryRequest*,
                                    v1::RegisterSharedMemoryResponse*);
  grpc::Status UnregisterSharedMemory(grpc::ServerContext*, const v1::UnregisterSharedMemoryRequest*,
                                      v1::UnregisterSharedMemoryResponse*);
  grpc::Status SharedMemoryStatus(grpc::ServerContext*, const v1::SharedMemoryStatusRequest*,
                                  v1::SharedMemoryStatusResponse*);
  grpc::Status StepShared(grpc::ServerContext*, const v1::StepSharedRequest*, v1::StepSharedResponse*);
  grpc::Status RegisterCudaMemory(grpc::ServerContext*, const v1::RegisterCudaMemoryRequest*,
                                  v1::RegisterCudaMemoryResponse*);
  grpc::Status UnregisterCudaMemory(grpc::ServerContext*, const v1::UnregisterCudaMemoryRequest*,
                                    v1::UnregisterCudaMemoryResponse*);
  grpc::Status StepCuda(grpc::ServerContext*, const v1::StepSharedRequest*, v1::StepSharedResponse*);
  grpc::Status OpenNcclChannel(grpc::ServerContext*, const v1::OpenNcclChannelRequest*, v1::OpenNcclChannelResponse*);
  grpc::Status CloseNcclChannel(grpc::ServerContext*, const v1::CloseNcclChannelRequest*,
                                v1::CloseNcclChannelResponse*);
  grpc::Status StepNccl(grpc::ServerContext*, const v1::StepNcclRequest*, v1::StepSharedResponse*);

 private:
  absl::Status DoUpload(const std::string& caller, RequestReader<v1::UploadParametersRequest>* reader,
                        v1::UploadParametersResponse* response);
  // Registers every method of muond.v1.Muond over byte buffers, each of the kind the API defines
  // (service_registration.cc; a method missing or of another kind stops the daemon at its start).
  void RegisterMethods();
  // The method's path ("/muond.v1.Muond/<name>"), kept for as long as the service (gRPC keeps the
  // pointer); `kind` is checked against the API's definition of it.
  const char* MethodPath(std::string_view name, grpc::internal::RpcMethod::RpcType kind);
  // Unary method `name`: its request parsed (ParseMessage; a refusal answered within the call's
  // scope), `method` called, its response encoded.
  template <class Request, class Response>
  void ServeUnary(std::string_view name,
                  grpc::Status (MuondService::*method)(grpc::ServerContext*, const Request*, Response*));
  // Server-streaming method `name`, whose `method` parses its one request itself.
  void ServeServerStream(std::string_view name,
                         grpc::Status (MuondService::*method)(grpc::ServerContext*, const grpc::ByteBuffer*,
                                                              grpc::ServerWriter<grpc::ByteBuffer>*));
  // Client-streaming method `name`: `read_all` reads the request messages (RequestReader) and
  // fills the response, which is encoded once it returns OK; all within the call's scope.
  template <class Request, class Response>
  void ServeClientStream(std::string_view name,
                         absl::Status (MuondService::*read_all)(const std::string& caller, RequestReader<Request>*,
                                                                Response*));
  // Method `name` served as a stream of byte buffers both ways; `kind` is the API's (StepWhole's is
  // unary, served as a stream of one read and one write).
  void ServeBidiStream(std::string_view name,
                       grpc::Status (MuondService::*method)(grpc::ServerContext*, ByteBufferStream*),
                       grpc::internal::RpcMethod::RpcType kind);
  // `answer_limit` (0: none): the most bytes the answer's parameters may take (a StepWhole answers in
  // one message); a step whose parameters alone are more is refused before anything is applied.
  absl::Status DoStep(const std::string& caller, grpc::ServerContext* context, transport::StepStream* stream,
                      size_t answer_limit = 0);
  absl::Status DoGetParameters(const std::string& caller, grpc::ServerContext* context,
                               const v1::GetParametersRequest& request,
                               grpc::ServerWriterInterface<v1::GetParametersResponse>* writer);
  absl::Status DoGetState(const std::string& caller, const v1::GetStateRequest& request,
                          grpc::ServerWriterInterface<v1::GetStateResponse>* writer);
  absl::Status DoSetState(const std::string& caller, RequestReader<v1::SetStateRequest>* reader,
                          v1::SetStateResponse* response);

  // The shared-memory regions, or FAILED_PRECONDITION when the daemon offers none.
  absl::StatusOr<transport::SharedMemoryRegions*> ShmRegions() const;
  // The GPU transports' tables, or FAILED_PRECONDITION when the daemon offers none.
  absl::StatusOr<transport::CudaMemoryRegions*> CudaRegions() const;
  absl::StatusOr<transport::NcclChannels*> NcclChannels() const;
  // Whether the session a GPU transport was bound to is still open to `caller`: neither closed nor
  // closed and created again under its id.
  bool StillOpen(const transport::BoundSession& bound, const std::string& caller) const;
  // When a call that waits on a peer gives up: its deadline, or --rpc-timeout from now.
  absl::Time CallDeadline(const grpc::ServerContext& context) const;
  // Chunk size for an answer: the client's wish bounded by the server's limit.
  size_t AnswerChunkBytes(uint32_t requested) const;

  session::SessionRegistry* const registry_;
  kernels::Backend* const backend_;
  const ServiceOptions options_;
  CallServices calls_;
  std::deque<std::string> method_paths_;            // RegisterMethods's paths, which gRPC points to
  std::shared_ptr<wire::SlicePool> answer_slices_;  // payload buffers of Step answers
};

}  // namespace muond::rpc
