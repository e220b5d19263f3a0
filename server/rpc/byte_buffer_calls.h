// The service's calls over raw byte buffers. MuondService registers every method of muond.v1.Muond
// itself (MuondService::RegisterMethods), each with gRPC's handler for its kind — unary, server
// streaming, client streaming, bidirectional — typed on grpc::ByteBuffer, so that gRPC hands over
// the bytes and every request message is parsed by transport::ParseMessage: a request protobuf
// refuses is answered INVALID_ARGUMENT naming its field within the call's scope, not gRPC's bare
// INTERNAL. Each method keeps its kind, so gRPC reads a unary or server-streaming call's request
// whole before a handler thread takes it, as for a generated service; the messages keep their
// protobuf encoding on the wire, and clients see the same calls.
//
// RequestReader and ResponseWriter give the typed reader and writer interfaces a handler of a
// client- or server-streaming call works with, over the byte-buffer reader or writer they borrow.
// One call, on its handler thread.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/message.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/sync_stream.h"
#include "server/transport/grpc/message_parse.h"

namespace muond::rpc {

using ByteBufferStream = grpc::ServerReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>;

// `message` encoded into `buffer`; INTERNAL when protobuf cannot encode it.
inline absl::Status SerializeMessage(const google::protobuf::Message& message, grpc::ByteBuffer* buffer) {
  bool own = false;
  if (grpc::GenericSerialize<grpc::ProtoBufferWriter, google::protobuf::Message>(message, buffer, &own).ok()) {
    return absl::OkStatus();
  }
  return absl::InternalError(absl::StrCat("the answer (", message.GetTypeName(), ") could not be encoded"));
}

// The request messages of a client-streaming call. A message protobuf refuses ends the reading
// (Read false) and is kept as refusal(), which the handler checks before it uses what it read; so is
// a call cancelled before the client closed its side (by the client, a broken connection or
// --rpc-timeout), which gRPC's reader ends the same way as the last message.
template <class Request>
class RequestReader final : public grpc::ServerReaderInterface<Request> {
 public:
  RequestReader(grpc::ServerReaderInterface<grpc::ByteBuffer>* reader, grpc::ServerContext* context)
      : reader_(reader), context_(context) {}

  void SendInitialMetadata() override { reader_->SendInitialMetadata(); }
  bool NextMessageSize(uint32_t* size) override { return reader_->NextMessageSize(size); }
  bool Read(Request* message) override {
    if (!refusal_.ok()) return false;
    grpc::ByteBuffer buffer;
    if (!reader_->Read(&buffer)) {
      if (context_->IsCancelled()) refusal_ = absl::CancelledError("the call ended before its last message came");
      return false;
    }
    refusal_ = transport::ParseMessage(&buffer, message);
    return refusal_.ok();
  }
  const absl::Status& refusal() const { return refusal_; }

 private:
  grpc::ServerReaderInterface<grpc::ByteBuffer>* reader_;
  grpc::ServerContext* context_;
  absl::Status refusal_;
};

// The response messages of a server-streaming call.
template <class Response>
class ResponseWriter final : public grpc::ServerWriterInterface<Response> {
 public:
  explicit ResponseWriter(grpc::ServerWriterInterface<grpc::ByteBuffer>* writer) : writer_(writer) {}

  void SendInitialMetadata() override { writer_->SendInitialMetadata(); }
  using grpc::internal::WriterInterface<Response>::Write;
  bool Write(const Response& message, grpc::WriteOptions options) override {
    grpc::ByteBuffer buffer;
    return SerializeMessage(message, &buffer).ok() && writer_->Write(buffer, options);
  }

 private:
  grpc::ServerWriterInterface<grpc::ByteBuffer>* writer_;
};

}  // namespace muond::rpc
