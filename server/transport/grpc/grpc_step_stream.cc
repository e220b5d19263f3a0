#include "server/transport/grpc/grpc_step_stream.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "proto/wire/dtype_codec.h"
#include "server/transport/grpc/tensor_assembler.h"
#include "server/transport/v1/api_conversion.h"

namespace muond::transport {
namespace {

// Parses a whole message the ordinary protobuf way (control messages and unusual encodings).
absl::Status ParseRequest(grpc::ByteBuffer* buffer, v1::StepRequest* request) {
  if (!grpc::SerializationTraits<v1::StepRequest>::Deserialize(buffer, request).ok()) {
    return absl::InvalidArgumentError("chunk: a message of the step stream is not a valid StepRequest");
  }
  return absl::OkStatus();
}

// Writes `buffer`, adding its size to `*bytes`; false when the client went away.
bool WriteCounted(StepStream* stream, const grpc::ByteBuffer& buffer, int64_t* bytes) {
  *bytes += static_cast<int64_t>(buffer.Length());
  return stream->Write(buffer);
}

bool WriteMessage(StepStream* stream, const v1::StepResponse& response, int64_t* bytes) {
  grpc::ByteBuffer buffer;
  bool own = false;
  return grpc::SerializationTraits<v1::StepResponse>::Serialize(response, &buffer, &own).ok() &&
         WriteCounted(stream, buffer, bytes);
}

}  // namespace

absl::StatusOr<v1::StepHeader> ReadStepHeader(StepStream* stream) {
  grpc::ByteBuffer buffer;
  v1::StepRequest request;
  if (!stream->Read(&buffer) || !ParseRequest(&buffer, &request).ok() ||
      request.kind_case() != v1::StepRequest::kHeader) {
    return absl::InvalidArgumentError("header: the first message of a step must be its header");
  }
  return std::move(*request.mutable_header());
}

absl::Status GrpcGradientSource::ReadGradients(session::IncomingStep& step) {
  if (!header_.has_num_chunks()) {
    return absl::InvalidArgumentError("header.num_chunks: required (the number of chunk messages that follow)");
  }
  TensorAssembler assembler(&step, max_chunk_bytes_);
  grpc::ByteBuffer buffer;
  wire::FramedChunk framed;
  v1::StepRequest request;  // for messages framed otherwise
  uint64_t chunks = 0;
  while (stream_->Read(&buffer)) {
    bytes_received_ += static_cast<int64_t>(buffer.Length());
    if (++chunks > header_.num_chunks()) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk: more chunks than the ", header_.num_chunks(), " announced in header.num_chunks"));
    }
    if (wire::ParseChunkFrame(buffer, wire::kChunkField, &framed)) {
      if (!step.replay()) MUOND_RETURN_IF_ERROR(assembler.Add(framed.meta, framed.data, framed.data_bytes));
      continue;
    }
    MUOND_RETURN_IF_ERROR(ParseRequest(&buffer, &request));
    if (request.kind_case() != v1::StepRequest::kChunk) {
      return absl::InvalidArgumentError("chunk: every message after the header must carry a chunk");
    }
    // A replay's gradients are not needed again; they are read only to consume the stream.
    if (!step.replay()) MUOND_RETURN_IF_ERROR(assembler.Add(request.chunk()));
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
  if (!WriteMessage(stream_, response, &bytes_sent_)) return absl::CancelledError("the client went away");
  if (outcome.parameters == nullptr) return absl::OkStatus();  // a prepare: the result alone
  for (size_t i = 0; i < config_.parameters.size(); ++i) {
    v1::TensorChunk first;
    first.set_name(config_.parameters[i].name);
    const bool sent = wire::ForEachChunk(
        first, outcome.parameters->values[i], dtype_, chunk_bytes_,
        [&](const v1::TensorChunk& meta, std::span<const float> values) {
          return WriteCounted(stream_, wire::EncodeChunk(wire::kChunkField, meta, values, *pool_), &bytes_sent_);
        });
    if (!sent) return absl::CancelledError("the client went away");
  }
  return absl::OkStatus();
}

}  // namespace muond::transport
