// MuondService::ServeOverByteBuffers: every method of muond.v1.Muond served over byte buffers
// (byte_buffer_calls.h). See muond_service.h.
#include <string>

#include "common/status_macros.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/impl/codegen/method_handler.h"
#include "server/rpc/muond_service.h"

namespace muond::rpc {
namespace {

using StreamHandler = grpc::internal::BidiStreamingHandler<MuondService, grpc::ByteBuffer, grpc::ByteBuffer>;

// The index of method `name` in the generated service, which registers its methods in the order of
// the proto's service definition.
int MethodIndex(std::string_view name) {
  const google::protobuf::ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName("muond.v1.Muond");
  return service->FindMethodByName(std::string(name))->index();
}

}  // namespace

template <class Request, class Response>
void MuondService::ServeUnary(std::string_view name,
                              grpc::Status (MuondService::*method)(grpc::ServerContext*, const Request*, Response*)) {
  // A unary method marked streamed is served as a stream of one read and one write.
  MarkMethodStreamed(MethodIndex(name),
                     new StreamHandler(
                         [name, method](MuondService* service, grpc::ServerContext* context, ByteBufferStream* stream) {
                           Request request;
                           const absl::Status read = ReadOneRequest(stream, &request);
                           if (!read.ok()) {
                             // Refused within the call's scope: authenticated, counted and logged as any.
                             return Serve(service->calls_, context, name,
                                          [&](const std::string&) -> absl::Status { return read; });
                           }
                           Response response;
                           const grpc::Status status = (service->*method)(context, &request, &response);
                           if (status.ok()) WriteLastResponse(stream, response);  // nobody to tell if it fails
                           return status;
                         },
                         this));
}

template <class Request, class Response>
void MuondService::ServeClientStream(std::string_view name,
                                     absl::Status (MuondService::*read_all)(const std::string&, RequestReader<Request>*,
                                                                            Response*)) {
  MarkMethodStreamed(
      MethodIndex(name),
      new StreamHandler(
          [name, read_all](MuondService* service, grpc::ServerContext* context, ByteBufferStream* stream) {
            return Serve(service->calls_, context, name, [&](const std::string& caller) -> absl::Status {
              RequestReader<Request> reader(stream);
              Response response;
              MUOND_RETURN_IF_ERROR((service->*read_all)(caller, &reader, &response));
              if (!WriteLastResponse(stream, response)) return absl::CancelledError("the client went away");
              return absl::OkStatus();
            });
          },
          this));
}

void MuondService::ServeStreamed(std::string_view name,
                                 grpc::Status (MuondService::*method)(grpc::ServerContext*, ByteBufferStream*)) {
  MarkMethodStreamed(
      MethodIndex(name),
      new StreamHandler([method](MuondService* service, grpc::ServerContext* context,
                                 ByteBufferStream* stream) { return (service->*method)(context, stream); },
                        this));
}

void MuondService::ServeOverByteBuffers() {
  ServeUnary("GetServerInfo", &MuondService::GetServerInfo);
  ServeUnary("CreateSession", &MuondService::CreateSession);
  ServeUnary("CloseSession", &MuondService::CloseSession);
  ServeUnary("ListSessions", &MuondService::ListSessions);
  ServeClientStream("UploadParameters", &MuondService::DoUpload);
  ServeStreamed("Step", &MuondService::StepOverByteBuffers);
  ServeStreamed("StepWhole", &MuondService::StepWholeOverByteBuffers);
  ServeStreamed("GetParameters", &MuondService::GetParametersOverByteBuffers);
  ServeStreamed("GetState", &MuondService::GetStateOverByteBuffers);
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
}

}  // namespace muond::rpc
