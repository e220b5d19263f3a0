#include "client/transport/grpc_step_transport.h"

#include "client/error_reason.h"
#include "client/transport/parameter_output.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "proto/wire/chunk_frame.h"
#include "proto/wire/dtype_codec.h"

namespace muond::client {

const TransportKind& GrpcTransportKind() {
  static const TransportKind kind{.name = "grpc",
                                  .unviable = nullptr,
                                  .open = [](Client& client, const Session& session) -> std::unique_ptr<StepTransport> {
                                    return std::make_unique<GrpcStepTransport>(client, session);
                                  }};
  return kind;
}

v1::TensorChunk FirstChunk(const TensorView& tensor) {
  v1::TensorChunk first;
  first.set_name(tensor.name);
  for (int64_t d : tensor.shape) first.add_shape(d);
  return first;
}

absl::StatusOr<StepReply> GrpcStepTransport::StepOnce(const v1::StepHeader& header, const StepPayload& payload,
                                                      const StepOptions& options) {
  const size_t chunk_bytes = client_.options().chunk_bytes;
  if (!packs_.has_value()) {
    // Asked once per try at most, and not retried here: a daemon that cannot be reached fails this
    // try like the step itself would, and the session's retries go on.
    v1::ServerInfo info;
    grpc::ClientContext context;
    client_.PrepareContext(context);
    grpc::Status asked = client_.stub().GetServerInfo(&context, v1::GetServerInfoRequest(), &info);
    if (!asked.ok()) return FromGrpcStatus(asked);
    packs_ = info.packed_chunks();
  }
  // Small gradients share PackedChunks messages when the daemon takes them; the others go in chunks
  // of their own. parts: the tensors of each packed message, or one unpacked tensor.
  struct Part {
    bool packed = false;
    std::vector<const TensorView*> tensors;
  };
  std::vector<Part> parts;
  Part packing{.packed = true};
  size_t packed_bytes = 0;
  uint32_t num_chunks = 0;
  for (const TensorView& tensor : payload.gradients) {
    const v1::DType dtype = session_.WireDType(tensor.name);
    const size_t bytes = tensor.values.size() * wire::ElementSize(dtype);
    if (!*packs_ || bytes == 0 || bytes > chunk_bytes / wire::kPackedTensorFraction) {
      parts.push_back(Part{.packed = false, .tensors = {&tensor}});
      num_chunks += static_cast<uint32_t>(wire::ChunkCount(tensor.values.size(), dtype, chunk_bytes));
      continue;
    }
    if (packed_bytes + bytes > chunk_bytes) {
      parts.push_back(std::move(packing));
      packing = Part{.packed = true};
      packed_bytes = 0;
      ++num_chunks;
    }
    packing.tensors.push_back(&tensor);
    packed_bytes += bytes;
  }
  if (!packing.tensors.empty()) {
    parts.push_back(std::move(packing));
    ++num_chunks;
  }

  grpc::ClientContext context;
  client_.PrepareContext(context);
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
          client_.channel(), client_.step_method(), &context));
  v1::StepRequest request;
  v1::StepHeader* sent = request.mutable_header();
  *sent = header;
  sent->set_return_dtype(options.return_dtype);
  sent->set_max_chunk_bytes(static_cast<uint32_t>(chunk_bytes));
  sent->set_num_chunks(num_chunks);
  sent->set_packed_answer(*packs_);
  bool ok = WriteRequest(*stream, request);
  wire::SlicePool& pool = client_.slice_pool();
  for (const Part& part : parts) {
    if (!ok) break;
    if (part.packed) {
      request.Clear();
      for (const TensorView* tensor : part.tensors) {
        v1::TensorChunk* chunk = request.mutable_packed()->add_chunks();
        *chunk = FirstChunk(*tensor);
        chunk->set_dtype(session_.WireDType(tensor->name));
        wire::Encode(chunk->dtype(), tensor->values, chunk->mutable_data());
      }
      ok = WriteRequest(*stream, request);
      continue;
    }
    const TensorView& tensor = *part.tensors.front();
    ok = wire::ForEachChunk(FirstChunk(tensor), tensor.values, session_.WireDType(tensor.name), chunk_bytes,
                            [&](const v1::TensorChunk& meta, std::span<const float> values) {
                              return stream->Write(wire::EncodeChunk(wire::kChunkField, meta, values, pool));
                            });
  }
  stream->WritesDone();
  absl::StatusOr<StepReply> reply = ReadStepAnswer(*stream, session_.element_counts(), options);
  if (!reply.ok() && reply.status().code() == absl::StatusCode::kUnavailable) packs_.reset();  // ask a new daemon
  return reply;
}

bool WriteRequest(grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>& stream,
                  const v1::StepRequest& request) {
  grpc::ByteBuffer buffer;
  bool own = false;
  return grpc::SerializationTraits<v1::StepRequest>::Serialize(request, &buffer, &own).ok() && stream.Write(buffer);
}

absl::StatusOr<StepReply> ReadStepAnswer(grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>& stream,
                                         const std::map<std::string, int64_t>& numel, const StepOptions& options) {
  StepReply reply;
  absl::Status decode = absl::OkStatus();
  bool have_result = false;
  grpc::ByteBuffer buffer;
  wire::FramedChunk framed;
  v1::StepResponse response;
  while (stream.Read(&buffer)) {
    if (!decode.ok()) continue;  // drain the stream; the first error is reported
    if (wire::ParseChunkFrame(buffer, wire::kChunkField, &framed)) {
      decode = ReadChunk(framed.meta, framed.data, framed.data_bytes, numel, options.parameters_out, &reply.parameters);
    } else if (!grpc::SerializationTraits<v1::StepResponse>::Deserialize(&buffer, &response).ok()) {
      decode = absl::InternalError("the daemon's step answer is not a StepResponse");
    } else if (response.has_result()) {
      CopyResult(response.result(), &reply);
      have_result = true;
    } else if (response.has_chunk()) {
      decode = ReadChunk(response.chunk(), numel, options.parameters_out, &reply.parameters);
    } else if (response.has_packed()) {
      for (const v1::TensorChunk& chunk : response.packed().chunks()) {
        if (decode.ok()) decode = ReadChunk(chunk, numel, options.parameters_out, &reply.parameters);
      }
    }
  }
  absl::Status status = FromGrpcStatus(stream.Finish());
  if (!status.ok()) return status;
  if (!decode.ok()) return decode;
  if (!have_result) return absl::InternalError("the daemon's step answer had no result");
  return reply;
}

}  // namespace muond::client
