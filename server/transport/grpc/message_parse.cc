#include "server/transport/grpc/message_parse.h"

#include <string>
#include <vector>

#include "grpcpp/support/proto_buffer_reader.h"
#include "proto/wire/unparsable_message.h"

namespace muond::transport {

absl::Status ParseMessage(grpc::ByteBuffer* buffer, google::protobuf::Message* message, absl::string_view what) {
  message->Clear();
  {
    grpc::ProtoBufferReader reader(buffer);
    if (reader.status().ok() && message->ParseFromZeroCopyStream(&reader)) return absl::OkStatus();
  }
  // Refused: the bytes again, whole, to say why.
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (buffer->Dump(&slices).ok()) {
    for (const grpc::Slice& slice : slices) bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  return wire::ExplainUnparsable(*message->GetDescriptor(), bytes, what);
}

}  // namespace muond::transport
