// The service's calls over raw byte buffers. Every handler of muond.v1.Muond is registered as a
// stream of byte buffers (MuondService::ServeOverByteBuffers; a unary call is a stream of one read and
// one write, as gRPC serves a "streamed unary" method), so that every request message is parsed by
// transport::ParseMessage: a request protobuf refuses is answered INVALID_ARGUMENT naming its field,
// not gRPC's bare INTERNAL. The messages keep their protobuf encoding on the wire; clients see the
// same calls.
//
// RequestReader and ResponseWriter give the typed reader and writer interfaces a handler of a
// client- or server-streaming call works with, over the byte-buffer stream they borrow. One call, on
// its handler thread.
#pragma once

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "google/protobuf/message.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/sync_stream.h"
#include "server/transport/grpc/message_parse.h"

namespace muond::rpc {

using ByteBufferStream = grpc::ServerReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>;

// Reads the one request message of a unary or server-streaming call into `request`.
inline absl::Status ReadOneRequest(ByteBufferStream* stream, google::protobuf::Message* request) {
  grpc::ByteBuffer buffer;
  if (!stream->Read(&buffer)) return absl::CancelledError("the client went away before its request came");
  return transport::ParseMessage(&buffer, request);
}

// Writes `response`, the last message of the call (sent with its status); false when the client went
// away.
inline bool WriteLastResponse(ByteBufferStream* stream, const google::protobuf::Message& response) {
  grpc::ByteBuffer buffer;
  bool own = false;
  return grpc::GenericSerialize<grpc::ProtoBufferWriter, google::protobuf::Message>(response, &buffer, &own).ok() &&
         stream->Write(buffer, grpc::WriteOptions().set_last_message());
}

// The request messages of a client-streaming call. A message protobuf refuses ends the reading
// (Read false) and is kept as refusal(), which the call answers instead of what its handler made of
// the short stream.
template <class Request>
class RequestReader final : public grpc::ServerReaderInterface<Request> {
 public:
  explicit RequestReader(ByteBufferStream* stream) : stream_(stream) {}

  void SendInitialMetadata() override { stream_->SendInitialMetadata(); }
  bool NextMessageSize(uint32_t* size) override { return stream_->NextMessageSize(size); }
  bool Read(Request* message) override {
    if (!refusal_.ok()) return false;
    grpc::ByteBuffer buffer;
    if (!stream_->Read(&buffer)) return false;
    refusal_ = transport::ParseMessage(&buffer, message);
    return refusal_.ok();
  }
  const absl::Status& refusal() const { return refusal_; }

 private:
  ByteBufferStream* stream_;
  absl::Status refusal_;
};

// The response messages of a server-streaming call.
template <class Response>
class ResponseWriter final : public grpc::ServerWriterInterface<Response> {
 public:
  explicit ResponseWriter(ByteBufferStream* stream) : stream_(stream) {}

  void SendInitialMetadata() override { stream_->SendInitialMetadata(); }
  using grpc::internal::WriterInterface<Response>::Write;
  bool Write(const Response& message, grpc::WriteOptions options) override {
    grpc::ByteBuffer buffer;
    bool own = false;
    return grpc::GenericSerialize<grpc::ProtoBufferWriter, Response>(message, &buffer, &own).ok() &&
           stream_->Write(buffer, options);
  }

 private:
  ByteBufferStream* stream_;
};

}  // namespace muond::rpc
