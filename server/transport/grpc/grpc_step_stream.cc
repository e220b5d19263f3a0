#include "server/transport/grpc/grpc_step_stream.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/transport/grpc/api_conversion.h"
#include "server/transport/grpc/chunk_stream.h"
#include "server/transport/grpc/tensor_assembler.h"

namespace muond::transport {

absl::Status GrpcGradientSource::ReadGradients(session::IncomingStep& step) {
  if (!header_.has_num_chunks()) {
    return absl::InvalidArgumentError("header.num_chunks: required (the number of chunk messages that follow)");
  }
  TensorAssembler assembler(&step, max_chunk_bytes_);
  v1::StepRequest request;
  uint64_t chunks = 0;
  while (stream_->Read(&request)) {
    if (request.kind_case() != v1::StepRequest::kChunk) {
      return absl::InvalidArgumentError("chunk: every message after the header must carry a chunk");
    }
    if (++chunks > header_.num_chunks()) {
      return absl::InvalidArgumentError(absl::StrCat("chunk: more chunks than the ", header_.num_chunks(),
                                                     " announced in header.num_chunks"));
    }
    if (step.replay()) continue;  // the step was applied already: its gradients are not needed again
    MUOND_RETURN_IF_ERROR(assembler.Add(request.chunk()));
  }
  if (context_->IsCancelled()) return absl::CancelledError("the client cancelled the step");
  // gRPC ends the read loop the same way for a half-close and for a broken stream (a message over
  // its limit, say); only the announced count tells them apart.
  if (chunks != header_.num_chunks()) {
    return absl::InvalidArgumentError(absl::StrCat("header.num_chunks: the stream ended after ", chunks, " of ",
                                                   header_.num_chunks(),
                                                   " announced chunks; the step was not applied"));
  }
  return assembler.Finish(/*require_all=*/false);
}

absl::Status GrpcParameterSink::Send(const session::StepOutcome& outcome) {
  v1::StepResponse response;
  *response.mutable_result() = ToProto(outcome.result);
  if (!stream_->Write(response)) return absl::CancelledError("the client went away");
  for (size_t i = 0; i < config_.parameters.size(); ++i) {
    const bool sent = EmitChunks(config_.parameters[i].name, "", outcome.parameters->values[i], dtype_, chunk_bytes_,
                                 [&](v1::TensorChunk&& chunk) {
                                   response.Clear();
                                   *response.mutable_chunk() = std::move(chunk);
                                   return stream_->Write(response);
                                 });
    if (!sent) return absl::CancelledError("the client went away");
  }
  return absl::OkStatus();
}

}  // namespace muond::transport
