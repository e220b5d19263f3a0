// The gRPC transport of a step: the bidirectional Step stream of muond.v1. GrpcGradientSource reads
// the chunk messages that follow the header (exactly header.num_chunks of them; a stream gRPC cut
// short is refused, not applied with part of its gradients) through a TensorAssembler into the
// session's IncomingStep. GrpcParameterSink writes the StepResult and then every parameter in
// chunks of the requested dtype.
//
// Both borrow the stream and serve one call on its handler thread.
#pragma once

#include <cstddef>

#include "grpcpp/server_context.h"
#include "grpcpp/support/sync_stream.h"
#include "muond/v1/muond.grpc.pb.h"
#include "server/transport/step_transport.h"

namespace muond::transport {

using StepStream = grpc::ServerReaderWriterInterface<v1::StepResponse, v1::StepRequest>;

class GrpcGradientSource final : public GradientSource {
 public:
  GrpcGradientSource(grpc::ServerContext* context, StepStream* stream, const v1::StepHeader& header,
                     size_t max_chunk_bytes)
      : context_(context), stream_(stream), header_(header), max_chunk_bytes_(max_chunk_bytes) {}

  absl::Status ReadGradients(session::IncomingStep& step) override;

 private:
  grpc::ServerContext* const context_;
  StepStream* const stream_;
  const v1::StepHeader& header_;
  const size_t max_chunk_bytes_;
};

class GrpcParameterSink final : public ParameterSink {
 public:
  // `config` names the parameters and must outlive the sink.
  GrpcParameterSink(StepStream* stream, const session::SessionConfig& config, v1::DType dtype, size_t chunk_bytes)
      : stream_(stream), config_(config), dtype_(dtype), chunk_bytes_(chunk_bytes) {}

  absl::Status Send(const session::StepOutcome& outcome) override;

 private:
  StepStream* const stream_;
  const session::SessionConfig& config_;
  const v1::DType dtype_;
  const size_t chunk_bytes_;
};

}  // namespace muond::transport
