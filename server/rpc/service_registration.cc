// MuondService::RegisterMethods: every method of muond.v1.Muond, each of its own kind, over byte
// buffers (byte_buffer_calls.h). See muond_service.h.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/support/method_handler.h"
#include "server/rpc/grpc_status.h"
#include "server/rpc/muond_service.h"

namespace muond::rpc {
namespace {

using grpc::ByteBuffer;
using grpc::internal::RpcMethod;

const google::protobuf::ServiceDescriptor& ApiService() {
  return *google::protobuf::DescriptorPool::generated_pool()->FindServiceByName("muond.v1.Muond");
}

// Every method the API defines is registered once, with the kind it is defined with: a mistake
// here is the daemon's own, found at its start rather than by a client's UNIMPLEMENTED.
void CheckRegistration(std::string_view name, RpcMethod::RpcType kind) {
  const google::protobuf::MethodDescriptor* method = ApiService().FindMethodByName(std::string(name));
  const RpcMethod::RpcType defined =
      method == nullptr ? kind
      : method->client_streaming()
          ? (method->server_streaming() ? RpcMethod::BIDI_STREAMING : RpcMethod::CLIENT_STREAMING)
      : method->server_streaming() ? RpcMethod::SERVER_STREAMING
                                   : RpcMethod::NORMAL_RPC;
  if (method == nullptr || defined != kind) {
    std::fprintf(stderr, "muond: method %.*s is registered as no method of muond.v1.Muond defines it\n",
                 static_cast<int>(name.size()), name.data());
    std::abort();
  }
}

}  // namespace

const char* MuondService::MethodPath(std::string_view name, RpcMethod::RpcType kind) {
  CheckRegistration(name, kind);
  // gRPC keeps the pointer: the paths live as long as the service.
  return method_paths_.emplace_back(absl::StrCat("/", ApiService().full_name(), "/", std::string(name))).c_str();
}

template <class Request, class Response>
void MuondService::ServeUnary(std::string_view name,
                              grpc::Status (MuondService::*method)(grpc::ServerContext*, const Request*, Response*)) {
  auto handler = [name, method](MuondService* service, grpc::ServerContext* context, const ByteBuffer* bytes,
                                ByteBuffer* answer) -> grpc::Status {
    ByteBuffer buffer(*bytes);  // shares the slices
    Request request;
    if (absl::Status parsed = transport::ParseMessage(&buffer, &request); !parsed.ok()) {
      // Refused within the call's scope: authenticated, counted and logged as any refusal.
      return Serve(service->calls_, context, name, [&](const std::string&) { return parsed; });
    }
    Response response;
    const grpc::Status status = (service->*method)(context, &request, &response);
    if (!status.ok()) return status;
    return ToGrpcStatus(SerializeMessage(response, answer));
  };
  AddMethod(new grpc::internal::RpcServiceMethod(
      MethodPath(name, RpcMethod::NORMAL_RPC), RpcMethod::NORMAL_RPC,
      new grpc::internal::RpcMethodHandler<MuondService, ByteBuffer, ByteBuffer>(handler, this)));
}

void MuondService::ServeServerStream(std::string_view name,
                                     grpc::Status (MuondService::*method)(grpc::ServerContext*, const ByteBuffer*,
                                                                          grpc::ServerWriter<ByteBuffer>*)) {
  AddMethod(new grpc::internal::RpcServiceMethod(
      MethodPath(name, RpcMethod::SERVER_STREAMING), RpcMethod::SERVER_STREAMING,
      new grpc::internal::ServerStreamingHandler<MuondService, ByteBuffer, ByteBuffer>(method, this)));
}

template <class Request, class Response>
void MuondService::ServeClientStream(std::string_view name,
                                     absl::Status (MuondService::*read_all)(const std::string&, RequestReader<Request>*,
                                                                            Response*)) {
  auto handler = [name, read_all](MuondService* service, grpc::ServerContext* context,
                                  grpc::ServerReader<ByteBuffer>* reader, ByteBuffer* answer) {
    return Serve(service->calls_, context, name, [&](const std::string& caller) -> absl::Status {
      RequestReader<Request> requests(reader, context);
      Response response;
      MUOND_RETURN_IF_ERROR((service->*read_all)(caller, &requests, &response));
      return SerializeMessage(response, answer);
    });
  };
  AddMethod(new grpc::internal::RpcServiceMethod(
      MethodPath(name, RpcMethod::CLIENT_STREAMING), RpcMethod::CLIENT_STREAMING,
      new grpc::internal::ClientStreamingHandler<MuondService, ByteBuffer, ByteBuffer>(handler, this)));
}

void MuondService::ServeBidiStream(std::string_view name,
                                   grpc::Status (MuondService::*method)(grpc::ServerContext*, ByteBufferStream*),
                                   RpcMethod::RpcType kind) {
  // StepWhole, unary in the API, is served as a stream of one read and one write (as gRPC serves a
  // "streamed unary" method): its answer is written from the step's own sink.
  AddMethod(new grpc::internal::RpcServiceMethod(
      MethodPath(name, kind), RpcMethod::BIDI_STREAMING,
      new grpc::internal::BidiStreamingHandler<MuondService, ByteBuffer, ByteBuffer>(method, this)));
}

void MuondService::RegisterMethods() {
  ServeUnary("GetServerInfo", &MuondService::GetServerInfo);
  ServeUnary("CreateSession", &MuondService::CreateSession);
  ServeUnary("CloseSession", &MuondService::CloseSession);
  ServeUnary("ListSessions", &MuondService::ListSessions);
  ServeClientStream("UploadParameters", &MuondService::DoUpload);
  ServeBidiStream("Step", &MuondService::StepOverByteBuffers, RpcMethod::BIDI_STREAMING);
  ServeBidiStream("StepWhole", &MuondService::StepWholeOverByteBuffers, RpcMethod::NORMAL_RPC);
  ServeServerStream("GetParameters", &MuondService::GetParametersOverByteBuffers);
  ServeServerStream("GetState", &MuondService::GetStateOverByteBuffers);
  ServeClientStream("SetState", &MuondService::DoSetState);
  ServeUnary("Checkpoint", &MuondService::Checkpoint);
  ServeUnary("GetStateDigest", &MuondService::GetStateDigest);
  ServeUnary("GrantSharedMemory", &MuondService::GrantSharedMemory);
  ServeUnary("RegisterSharedMemory", &MuondService::RegisterSharedMemory);
  ServeUnary("UnregisterSharedMemory", &MuondService::UnregisterSharedMemory);
  ServeUnary("SharedMemoryStatus", &MuondService::SharedMemoryStatus);
  ServeUnary("StepShared", &MuondService::StepShared);
  ServeUnary("RegisterCudaMemory", &MuondService::RegisterCudaMemory);
  ServeUnary("UnregisterCudaMemory", &MuondService::UnregisterCudaMemory);
  ServeUnary("StepCuda", &MuondService::StepCuda);
  ServeUnary("OpenNcclChannel", &MuondService::OpenNcclChannel);
  ServeUnary("CloseNcclChannel", &MuondService::CloseNcclChannel);
  ServeUnary("StepNccl", &MuondService::StepNccl);
  if (method_paths_.size() != static_cast<size_t>(ApiService().method_count())) {
    std::fprintf(stderr, "muond: %zu of muond.v1.Muond's %d methods are registered\n", method_paths_.size(),
                 ApiService().method_count());
    std::abort();
  }
}

}  // namespace muond::rpc
