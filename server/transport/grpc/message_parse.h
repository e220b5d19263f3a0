// Parsing a request message from gRPC's byte buffer, with a refusal a client can act on: where gRPC's
// own parse of a request answers a bare INTERNAL, this one answers INVALID_ARGUMENT naming the field
// protobuf stopped at (wire/unparsable_message.h). The daemon serves its calls over byte buffers and
// parses every request message through here. Stateless; thread-safe.
#pragma once

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message.h"
#include "grpcpp/support/byte_buffer.h"

namespace muond::transport {

// Parses `buffer` into `message` (cleared first). A message protobuf refuses is INVALID_ARGUMENT:
// "<field path>: is not UTF-8 ...", or "<what>: not a valid <type> ..." for a malformed encoding.
absl::Status ParseMessage(grpc::ByteBuffer* buffer, google::protobuf::Message* message,
                          absl::string_view what = "request");

}  // namespace muond::transport
