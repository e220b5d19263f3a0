#include "server/transport/grpc/grpc_step_stream.h"

#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "proto/wire/dtype_codec.h"
#include "server/transport/api_codec/api_conversion.h"
#include "server/transport/grpc/message_parse.h"
#include "server/transport/grpc/tensor_assembler.h"

namespace muond::transport {
namespace {

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

// The chunks of a PackedChunks message, each checked as any chunk is (a replay's are dropped).
absl::Status AddPacked(const v1::PackedChunks& packed, size_t max_chunk_bytes, bool replay,
                       TensorAssembler& assembler) {
  size_t bytes = 0;
  for (const v1::TensorChunk& chunk : packed.chunks()) bytes += chunk.data().size();
  if (bytes > max_chunk_bytes) {
    return ChunkTooLarge(absl::StrCat("packed.chunks: ", bytes, " bytes of data in one message"), max_chunk_bytes);
  }
  if (replay) return absl::OkStatus();
  for (int i = 0; i < packed.chunks_size(); ++i) {
    MUOND_RETURN_IF_ERROR(assembler.Add(packed.chunks(i), absl::StrCat("packed.chunks[", i, "]")));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<size_t>> AnswerOrder(const v1::StepHeader& header, size_t count) {
  std::vector<size_t> order;
  if (header.answer_order_size() == 0) return order;  // the session's order, nothing to lay out
  order.reserve(count);
  std::vector<bool> listed(count, false);
  for (int k = 0; k < header.answer_order_size(); ++k) {
    const size_t index = header.answer_order(k);
    if (index >= count) {
      return absl::InvalidArgumentError(absl::StrCat("header.answer_order[", k, "]: ", index,
                                                     " is not a parameter index (the session has ", count, ")"));
    }
    if (listed[index]) {
      return absl::InvalidArgumentError(
          absl::StrCat("header.answer_order[", k, "]: parameter ", index, " is listed already"));
    }
    listed[index] = true;
    order.push_back(index);
  }
  for (size_t i = 0; i < count; ++i) {
    if (!listed[i]) order.push_back(i);
  }
  return order;
}

namespace {

// A streamed step's options, from its StepEnd; a refusal names the end's field.
absl::Status TakeStepOptions(const v1::StepEnd& end, session::IncomingStep& step) {
  absl::Status taken = step.TakeStepOptions(StepOptionsOf(end));
  if (taken.ok() || !absl::StartsWith(taken.message(), "header.")) return taken;
  return absl::Status(taken.code(), absl::StrCat("end.", taken.message().substr(std::string_view("header.").size())));
}

}  // namespace

absl::StatusOr<v1::StepHeader> ReadStepHeader(StepStream* stream) {
  grpc::ByteBuffer buffer;
  v1::StepRequest request;
  const absl::Status not_a_header =
      absl::InvalidArgumentError("header: the first message of a step must be its header");
  if (!stream->Read(&buffer)) return not_a_header;
  MUOND_RETURN_IF_ERROR(ParseMessage(&buffer, &request, "header"));  // a header protobuf refuses, named
  if (request.kind_case() != v1::StepRequest::kHeader) return not_a_header;
  return std::move(*request.mutable_header());
}

absl::Status GrpcGradientSource::ReadGradients(session::IncomingStep& step) {
  const bool streamed = header_.streamed();
  if (streamed && header_.has_num_chunks()) {
    return absl::InvalidArgumentError(
        "header.num_chunks: a streamed step gives its count in the closing StepEnd, not in the header");
  }
  if (const char* option = streamed ? StreamedOptionInHeader(header_) : nullptr; option != nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.", option, ": a streamed step gives its options in its StepEnd, not in the header"));
  }
  if (!streamed && !header_.has_num_chunks()) {
    return absl::InvalidArgumentError(
        "header.num_chunks: required (the number of chunk messages that follow), unless header.streamed is set");
  }
  TensorAssembler assembler(&step, max_chunk_bytes_);
  grpc::ByteBuffer buffer;
  wire::FramedChunk framed;
  v1::StepRequest request;  // for messages framed otherwise
  uint64_t chunks = 0;
  std::optional<uint32_t> ended;  // a streamed step's StepEnd.num_chunks, once it came
  while (stream_->Read(&buffer)) {
    bytes_received_ += static_cast<int64_t>(buffer.Length());
    // A session closed while its gradients arrive stops the stream here, not after its last chunk.
    MUOND_RETURN_IF_ERROR(step.CheckOpen());
    if (ended.has_value()) return absl::InvalidArgumentError("end: a streamed step's StepEnd must be its last message");
    if (!streamed && chunks == header_.num_chunks()) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk: more chunks than the ", header_.num_chunks(), " announced in header.num_chunks"));
    }
    if (wire::ParseChunkFrame(buffer, wire::kChunkField, &framed)) {
      ++chunks;
      if (!step.replay()) MUOND_RETURN_IF_ERROR(assembler.Add(framed.meta, framed.data, framed.data_bytes));
      continue;
    }
    MUOND_RETURN_IF_ERROR(ParseMessage(&buffer, &request, "chunk"));  // control messages, unusual encodings
    if (streamed && request.kind_case() == v1::StepRequest::kEnd) {
      ended = request.end().num_chunks();
      MUOND_RETURN_IF_ERROR(TakeStepOptions(request.end(), step));
      continue;
    }
    if (request.kind_case() == v1::StepRequest::kPacked) {
      ++chunks;
      MUOND_RETURN_IF_ERROR(AddPacked(request.packed(), max_chunk_bytes_, step.replay(), assembler));
      continue;
    }
    if (request.kind_case() != v1::StepRequest::kChunk) {
      return absl::InvalidArgumentError(
          streamed ? "chunk: every message after the header must carry a chunk, packed chunks or the step's end"
                   : "chunk: every message after the header must carry a chunk or packed chunks");
    }
    ++chunks;
    // A replay's gradients are not needed again; they are read only to consume the stream.
    if (!step.replay()) MUOND_RETURN_IF_ERROR(assembler.Add(request.chunk()));
  }
  if (context_->IsCancelled()) return absl::CancelledError("the client cancelled the step");
  // gRPC ends the read loop the same way for a half-close and for a broken stream (a message over
  // its limit, say); only the announced count tells them apart.
  if (streamed) {
    if (!ended.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat("end: the streamed step ended after ", chunks,
                                                     " chunks without its StepEnd; the step was not applied"));
    }
    if (*ended != chunks) {
      return absl::InvalidArgumentError(absl::StrCat("end.num_chunks: ", *ended, " announced but ", chunks,
                                                     " chunks arrived; the step was not applied"));
    }
  } else if (chunks != header_.num_chunks()) {
    return absl::InvalidArgumentError(absl::StrCat("header.num_chunks: the stream ended after ", chunks, " of ",
                                                   header_.num_chunks(),
                                                   " announced chunks; the step was not applied"));
  }
  return assembler.Finish(/*require_all=*/false);
}

absl::Status GrpcParameterSink::Send(const session::StepOutcome& outcome, session::ParameterReader& parameters) {
  v1::StepResponse response;
  *response.mutable_result() = ToProto(outcome.result);
  if (!WriteMessage(stream_, response, &bytes_sent_)) return absl::CancelledError("the client went away");
  if (outcome.parameters == nullptr) return absl::OkStatus();  // a prepare: the result alone
  // The parameters are held while a message is encoded, never while one is written (a client slow to
  // read must not hold up the session's next steps). With packing, whole small parameters
  // (wire::kPackedTensorFraction) are gathered into PackedChunks messages of at most chunk_bytes_ of
  // data; the others go in chunks of their own, in spec order either way.
  v1::StepResponse packed;
  size_t packed_bytes = 0;
  const auto flush = [&] {
    if (packed_bytes == 0 && packed.packed().chunks_size() == 0) return true;
    const bool sent = WriteMessage(stream_, packed, &bytes_sent_);
    packed.Clear();
    packed_bytes = 0;
    return sent;
  };
  const size_t element_bytes = wire::ElementSize(dtype_);
  for (size_t k = 0; k < config_.parameters.size(); ++k) {
    const size_t i = order_.empty() ? k : order_[k];
    const size_t numel = outcome.parameters->values[i].size();  // the same in a copy
    const size_t bytes = numel * element_bytes;
    if (pack_ && numel > 0 && bytes <= chunk_bytes_ / wire::kPackedTensorFraction) {
      if (packed_bytes + bytes > chunk_bytes_ && !flush()) return absl::CancelledError("the client went away");
      v1::TensorChunk* chunk = packed.mutable_packed()->add_chunks();
      chunk->set_name(config_.parameters[i].name);
      chunk->set_dtype(dtype_);
      MUOND_RETURN_IF_ERROR(parameters.ReadPiece(
          i, 0, numel, [&](std::span<const float> values) { wire::Encode(dtype_, values, chunk->mutable_data()); }));
      packed_bytes += bytes;
      continue;
    }
    if (!flush()) return absl::CancelledError("the client went away");
    v1::TensorChunk first;
    first.set_name(config_.parameters[i].name);
    absl::Status read;
    const bool sent = wire::ForEachChunk(first, outcome.parameters->values[i], dtype_, chunk_bytes_,
                                         [&](const v1::TensorChunk& meta, std::span<const float> piece) {
                                           // `piece` places the chunk; its values are read through the reader.
                                           grpc::ByteBuffer encoded;
                                           read = parameters.ReadPiece(
                                               i, meta.offset(), piece.size(), [&](std::span<const float> values) {
                                                 encoded = wire::EncodeChunk(wire::kChunkField, meta, values, *pool_);
                                               });
                                           if (!read.ok()) return false;
                                           return WriteCounted(stream_, encoded, &bytes_sent_);
                                         });
    MUOND_RETURN_IF_ERROR(read);
    if (!sent) return absl::CancelledError("the client went away");
  }
  if (!flush()) return absl::CancelledError("the client went away");
  return absl::OkStatus();
}

}  // namespace muond::transport
