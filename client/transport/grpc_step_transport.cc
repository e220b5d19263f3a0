#include "client/transport/grpc_step_transport.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "client/error_reason.h"
#include "client/transport/parameter_output.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/codegen/client_unary_call.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "proto/wire/chunk_frame.h"
#include "proto/wire/dtype_codec.h"
#include "proto/wire/message_list.h"

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

namespace {

// Reads a step's answer one message at a time, as a Step stream or a StepWhole call returns them:
// the StepResult, then the parameters into options.parameters_out or the reply. The first message it
// cannot decode is the answer's error; later ones are ignored.
class AnswerReader {
 public:
  AnswerReader(const std::map<std::string, int64_t>& numel, const StepOptions& options)
      : numel_(numel), options_(options) {}

  void Add(grpc::ByteBuffer& message) {
    if (!decode_.ok()) return;  // the first error is reported
    if (wire::ParseChunkFrame(message, wire::kChunkField, &framed_)) {
      decode_ = ReadChunk(framed_.meta, framed_.data, framed_.data_bytes, numel_, options_.parameters_out,
                          &reply_.parameters);
    } else if (!grpc::SerializationTraits<v1::StepResponse>::Deserialize(&message, &response_).ok()) {
      decode_ = absl::InternalError("the daemon's step answer is not a StepResponse");
    } else if (response_.has_result()) {
      CopyResult(response_.result(), &reply_);
      have_result_ = true;
    } else if (response_.has_chunk()) {
      decode_ = ReadChunk(response_.chunk(), numel_, options_.parameters_out, &reply_.parameters);
    } else if (response_.has_packed()) {
      for (const v1::TensorChunk& chunk : response_.packed().chunks()) {
        if (decode_.ok()) decode_ = ReadChunk(chunk, numel_, options_.parameters_out, &reply_.parameters);
      }
    }
  }

  // The reply, once the call ended with `status`.
  absl::StatusOr<StepReply> Finish(const absl::Status& status) {
    if (!status.ok()) return status;
    if (!decode_.ok()) return decode_;
    if (!have_result_) return absl::InternalError("the daemon's step answer had no result");
    return std::move(reply_);
  }

 private:
  const std::map<std::string, int64_t>& numel_;
  const StepOptions& options_;
  StepReply reply_;
  absl::Status decode_ = absl::OkStatus();
  bool have_result_ = false;
  wire::FramedChunk framed_;
  v1::StepResponse response_;
};

std::optional<grpc::ByteBuffer> Serialized(const v1::StepRequest& request) {
  grpc::ByteBuffer buffer;
  bool own = false;
  if (!grpc::SerializationTraits<v1::StepRequest>::Serialize(request, &buffer, &own).ok()) return std::nullopt;
  return buffer;
}

}  // namespace

bool GrpcStepTransport::Whole(const StepPayload& payload, const StepOptions& options) const {
  const size_t limit = client_.options().whole_step_bytes;
  if (limit == 0 || !offer_->whole_steps()) return false;
  // Each direction's payload, and its size against the daemon's message limit (a daemon with a small
  // --max-chunk-bytes has a limit of little more than 1 MiB, which a stream keeps message by message):
  // per chunk its fields and framing but the name, per parameter an answer_order entry or a sum of
  // squares, and the header or the StepResult with its groups' telemetry.
  constexpr size_t kChunkOverhead = 96, kParameterOverhead = 16, kFixedOverhead = 64 << 10;
  const size_t chunk_bytes = client_.chunk_bytes();
  size_t sent = 0, sent_size = kFixedOverhead;
  for (const TensorView& tensor : payload.gradients) {
    const v1::DType dtype = session_.WireDType(tensor.name);
    const size_t bytes = tensor.values.size() * wire::ElementSize(dtype);
    sent += bytes;
    sent_size += bytes + kParameterOverhead +
                 wire::ChunkCount(tensor.values.size(), dtype, chunk_bytes) * (tensor.name.size() + kChunkOverhead);
  }
  const v1::DType returned = wire::IsConcrete(options.return_dtype) ? options.return_dtype : v1::DTYPE_FP32;
  size_t answered = 0, answer_size = kFixedOverhead;
  for (const auto& [name, numel] : session_.element_counts()) {
    const size_t bytes = static_cast<size_t>(numel) * wire::ElementSize(returned);
    answered += bytes;
    answer_size += bytes + kParameterOverhead +
                   wire::ChunkCount(static_cast<size_t>(numel), returned, chunk_bytes) * (name.size() + kChunkOverhead);
  }
  return std::max(sent, answered) <= limit && std::max(sent_size, answer_size) <= offer_->max_message_bytes();
}

absl::StatusOr<StepReply> GrpcStepTransport::StepOnce(const v1::StepHeader& header, const StepPayload& payload,
                                                      const StepOptions& options) {
  const size_t chunk_bytes = client_.chunk_bytes();
  if (!offer_.has_value()) {
    // Asked once per try at most, and not retried here: a daemon that cannot be reached fails this
    // try like the step itself would, and the session's retries go on.
    v1::ServerInfo info;
    grpc::ClientContext context;
    client_.PrepareContext(context);
    grpc::Status asked = client_.stub().GetServerInfo(&context, v1::GetServerInfoRequest(), &info);
    if (!asked.ok()) return FromGrpcStatus(asked);
    offer_ = std::move(info);
  }
  const bool packs = offer_->packed_chunks();
  // Small gradients share PackedChunks messages when the daemon takes them; the others go in chunks
  // of their own. parts: the tensors of each packed message, or one unpacked tensor.
  struct Part {
    bool packed = false;
    std::vector<const TensorView*> tensors;
  };
  std::vector<Part> parts;
  Part packing{.packed = true, .tensors = {}};
  size_t packed_bytes = 0;
  uint32_t num_chunks = 0;
  for (const TensorView& tensor : payload.gradients) {
    const v1::DType dtype = session_.WireDType(tensor.name);
    const size_t bytes = tensor.values.size() * wire::ElementSize(dtype);
    if (!packs || bytes == 0 || bytes > chunk_bytes / wire::kPackedTensorFraction) {
      parts.push_back(Part{.packed = false, .tensors = {&tensor}});
      num_chunks += static_cast<uint32_t>(wire::ChunkCount(tensor.values.size(), dtype, chunk_bytes));
      continue;
    }
    if (packed_bytes + bytes > chunk_bytes) {
      parts.push_back(std::move(packing));
      packing = Part{.packed = true, .tensors = {}};
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

  // The messages go on a Step stream as they are made, or are gathered for one StepWhole call.
  grpc::ClientContext context;
  client_.PrepareContext(context);
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream;
  std::vector<grpc::ByteBuffer> gathered;
  if (!Whole(payload, options)) {
    stream.reset(grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
        client_.channel(), client_.step_method(), &context));
  }
  const auto send = [&](std::optional<grpc::ByteBuffer> message) {
    if (!message.has_value()) return false;
    if (stream != nullptr) return stream->Write(*message);
    gathered.push_back(*std::move(message));
    return true;
  };
  v1::StepRequest request;
  v1::StepHeader* sent = request.mutable_header();
  *sent = header;
  sent->set_return_dtype(options.return_dtype);
  sent->set_max_chunk_bytes(static_cast<uint32_t>(chunk_bytes));
  sent->set_num_chunks(num_chunks);
  sent->set_packed_answer(packs);
  bool ok = send(Serialized(request));
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
      ok = send(Serialized(request));
      continue;
    }
    const TensorView& tensor = *part.tensors.front();
    ok = wire::ForEachChunk(FirstChunk(tensor), tensor.values, session_.WireDType(tensor.name), chunk_bytes,
                            [&](const v1::TensorChunk& meta, std::span<const float> values) {
                              return send(wire::EncodeChunk(wire::kChunkField, meta, values, pool));
                            });
  }
  absl::StatusOr<StepReply> reply;
  if (stream != nullptr) {
    stream->WritesDone();
    reply = ReadStepAnswer(*stream, session_.element_counts(), options);
  } else {
    reply = CallWhole(context, gathered, options);
  }
  if (!reply.ok() && reply.status().code() == absl::StatusCode::kUnavailable) offer_.reset();  // ask a new daemon
  return reply;
}

absl::StatusOr<StepReply> GrpcStepTransport::CallWhole(grpc::ClientContext& context,
                                                       const std::vector<grpc::ByteBuffer>& messages,
                                                       const StepOptions& options) {
  grpc::ByteBuffer answer;
  const grpc::Status called = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      client_.channel(), client_.whole_step_method(), &context, wire::JoinMessageList(messages), &answer);
  AnswerReader reader(session_.element_counts(), options);
  if (!called.ok()) return reader.Finish(FromGrpcStatus(called));
  absl::StatusOr<std::vector<grpc::ByteBuffer>> answers = wire::SplitMessageList(answer, "StepAnswers", "messages");
  if (!answers.ok()) {
    return absl::InternalError(absl::StrCat("the daemon's StepWhole answer: ", answers.status().message()));
  }
  for (grpc::ByteBuffer& message : *answers) reader.Add(message);
  return reader.Finish(absl::OkStatus());
}

bool WriteRequest(grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>& stream,
                  const v1::StepRequest& request) {
  std::optional<grpc::ByteBuffer> buffer = Serialized(request);
  return buffer.has_value() && stream.Write(*buffer);
}

absl::StatusOr<StepReply> ReadStepAnswer(grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>& stream,
                                         const std::map<std::string, int64_t>& numel, const StepOptions& options) {
  AnswerReader reader(numel, options);
  grpc::ByteBuffer buffer;
  while (stream.Read(&buffer)) reader.Add(buffer);  // read to the end; the first error is reported
  return reader.Finish(FromGrpcStatus(stream.Finish()));
}

}  // namespace muond::client
