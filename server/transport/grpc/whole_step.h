// A whole step in one call (StepWhole, docs/protocol.md, Steps in one call): the messages a Step
// stream would carry arrive as one StepMessages, and what the stream would answer leaves as one
// StepAnswers. WholeStepStream is a StepStream over those lists, so that the step runs through the
// same GrpcGradientSource and GrpcParameterSink, with every rule of the stream, as a streamed one.
//
// ReadWholeStep splits the request's encoding into its messages (proto/wire/message_list.h: views of
// one copy at most; a chunk's payload is decoded from them as from a stream's message), refusing
// anything but field 1 of length-delimited type. A WholeStepStream is owned by the call's handler and used on its
// thread only.
#pragma once

#include <cstddef>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/support/byte_buffer.h"
#include "server/transport/grpc/grpc_step_stream.h"

namespace muond::transport {

// The messages of a StepMessages encoding, in order; INVALID_ARGUMENT naming `messages` for an
// encoding that is not one.
absl::StatusOr<std::vector<grpc::ByteBuffer>> ReadWholeStep(const grpc::ByteBuffer& request);

class WholeStepStream final : public StepStream {
 public:
  explicit WholeStepStream(std::vector<grpc::ByteBuffer> messages) : messages_(std::move(messages)) {}

  void SendInitialMetadata() override {}
  bool NextMessageSize(uint32_t* size) override;
  bool Read(grpc::ByteBuffer* message) override;
  using StepStream::Write;
  bool Write(const grpc::ByteBuffer& message, grpc::WriteOptions options) override;

  // The StepAnswers encoding of every message written, in order (their slices, not copies).
  grpc::ByteBuffer Answer() const;

 private:
  std::vector<grpc::ByteBuffer> messages_;
  size_t next_ = 0;
  std::vector<grpc::ByteBuffer> written_;
};

}  // namespace muond::transport
