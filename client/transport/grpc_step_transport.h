// The gRPC step transport: one bidirectional Step stream per try, over byte buffers, or one StepWhole
// call carrying the same messages when the gradients and the answer are small
// (ClientOptions::whole_step_bytes) and the daemon offers it. Each chunk's payload is encoded from
// the caller's tensor straight into the slice gRPC sends, and each answer chunk is decoded from
// gRPC's receive slices straight into its destination; the messages are StepRequest and
// StepResponse in their protobuf encoding. Small tensors share PackedChunks
// messages both ways when the daemon offers them. Always viable; remembers only the daemon's offer.
//
// Ownership: borrows the Client and the Session (which outlive it). One thread at a time.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "client/transport/transport_choice.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/sync_stream.h"

namespace muond::client {

const TransportKind& GrpcTransportKind();

// Reads a Step stream's answer (the StepResult, then the parameters into options.parameters_out or
// the reply) after the request side is done, and finishes the call.
absl::StatusOr<StepReply> ReadStepAnswer(grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>& stream,
                                         const std::map<std::string, int64_t>& numel, const StepOptions& options);

// Writes one StepRequest message; false once the stream broke.
bool WriteRequest(grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>& stream, const v1::StepRequest& request);

// The first chunk of `tensor`'s: its name and its shape (so the daemon can refuse a transposed one).
v1::TensorChunk FirstChunk(const TensorView& tensor);

class GrpcStepTransport : public StepTransport {
 public:
  GrpcStepTransport(Client& client, const Session& session) : client_(client), session_(session) {}
  std::string_view name() const override { return "grpc"; }
  absl::StatusOr<StepReply> StepOnce(const v1::StepHeader& header, const StepPayload& payload,
                                     const StepOptions& options) override;

 private:
  // Whether this try goes in one StepWhole call.
  bool Whole(const StepPayload& payload, const StepOptions& options) const;
  // The StepWhole call of `messages` (the header's StepRequest first) and its answer.
  absl::StatusOr<StepReply> CallWhole(grpc::ClientContext& context, const std::vector<grpc::ByteBuffer>& messages,
                                      const StepOptions& options);

  Client& client_;
  const Session& session_;
  // The daemon's ServerInfo (packed chunks, whole steps), asked once (again after UNAVAILABLE).
  std::optional<v1::ServerInfo> offer_;
};

}  // namespace muond::client
