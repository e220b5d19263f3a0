// The gRPC transport of a step: the bidirectional Step stream of muond.v1, served over raw byte
// buffers so that tensor payloads are never copied into protobuf strings. StepRequest and
// StepResponse keep their protobuf encoding on the wire (wire/chunk_frame.h frames the chunks).
//
// GrpcGradientSource reads the chunk messages that follow the header (exactly header.num_chunks of
// them, or for a streamed step as many as the closing StepEnd counts; a stream gRPC cut short is
// refused, not applied with part of its gradients) through a TensorAssembler into the session's
// IncomingStep, decoding each payload from gRPC's receive slices as it arrives: while a streamed
// step's client is still in its backward pass, its earlier tensors are already decoded, summed and
// staged.
// GrpcParameterSink writes the StepResult and then every parameter in chunks of the requested
// dtype, each encoded straight from the masters into a pooled payload slice; when the client asked
// for it, whole small parameters share PackedChunks messages instead. Either side may pack: a
// PackedChunks request message is taken as its chunks, counted as one message.
//
// Both borrow the stream and serve one call on its handler thread.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/sync_stream.h"
#include "muond/v1/muond.pb.h"
#include "proto/wire/chunk_frame.h"
#include "server/transport/step_transport.h"

namespace muond::transport {

using StepStream = grpc::ServerReaderWriterInterface<grpc::ByteBuffer, grpc::ByteBuffer>;

// Reads the step's first message, which must be its header.
absl::StatusOr<v1::StepHeader> ReadStepHeader(StepStream* stream);

// The order in which the answer sends the session's `count` parameters: header.answer_order's
// indices first, then the others in the session's order; empty when the header gives none (the
// session's order). An index out of range or given twice is refused naming it (INVALID_ARGUMENT).
absl::StatusOr<std::vector<size_t>> AnswerOrder(const v1::StepHeader& header, size_t count);

class GrpcGradientSource final : public GradientSource {
 public:
  GrpcGradientSource(grpc::ServerContext* context, StepStream* stream, const v1::StepHeader& header,
                     size_t max_chunk_bytes)
      : context_(context), stream_(stream), header_(header), max_chunk_bytes_(max_chunk_bytes) {}

  absl::Status ReadGradients(session::IncomingStep& step) override;
  std::string_view transport() const override { return "grpc"; }

 private:
  grpc::ServerContext* const context_;
  StepStream* const stream_;
  const v1::StepHeader& header_;
  const size_t max_chunk_bytes_;
};

class GrpcParameterSink final : public ParameterSink {
 public:
  // `config` names the parameters and must outlive the sink; payload buffers come from `pool`.
  // `pack`: the client asked for packed answers (StepHeader.packed_answer). `order`: the parameters'
  // indices in the order to send them (AnswerOrder); empty: the session's order.
  GrpcParameterSink(StepStream* stream, const session::SessionConfig& config, v1::DType dtype, size_t chunk_bytes,
                    wire::SlicePool* pool, bool pack = false, std::vector<size_t> order = {})
      : stream_(stream),
        config_(config),
        dtype_(dtype),
        chunk_bytes_(chunk_bytes),
        pool_(pool),
        pack_(pack),
        order_(std::move(order)) {}

  absl::Status Send(const session::StepOutcome& outcome, session::ParameterReader& parameters) override;

 private:
  StepStream* const stream_;
  const session::SessionConfig& config_;
  const v1::DType dtype_;
  const size_t chunk_bytes_;
  wire::SlicePool* const pool_;
  const bool pack_;
  const std::vector<size_t> order_;
};

}  // namespace muond::transport
