// MuondService's tensor streams: UploadParameters, Step (and StepWhole, a step in one call) and
// GetParameters.
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/echo.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "proto/wire/dtype_codec.h"
#include "server/rpc/muond_service.h"
#include "server/session/partition.h"
#include "server/transport/api_codec/api_conversion.h"
#include "server/transport/grpc/chunk_stream.h"
#include "server/transport/grpc/grpc_step_stream.h"
#include "server/transport/grpc/tensor_assembler.h"
#include "server/transport/grpc/whole_step.h"
#include "server/transport/step_transport.h"

namespace muond::rpc {
namespace {

absl::StatusOr<v1::DType> AnswerDType(v1::DType requested, session::TensorDType session_default,
                                      absl::string_view field) {
  if (requested == v1::DTYPE_UNSPECIFIED) return transport::ToProto(session_default);
  if (!wire::IsConcrete(requested)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": unknown dtype ", static_cast<int>(requested)));
  }
  return requested;
}

}  // namespace

absl::Status MuondService::DoUpload(const std::string& caller, RequestReader<v1::UploadParametersRequest>* reader,
                                    v1::UploadParametersResponse* response) {
  v1::UploadParametersRequest request;
  if (!reader->Read(&request) || request.kind_case() != v1::UploadParametersRequest::kSessionId) {
    MUOND_RETURN_IF_ERROR(reader->refusal());
    return absl::InvalidArgumentError("session_id: the first message of an upload must name the session");
  }
  MUOND_RETURN_IF_ERROR(session::CheckSessionId(request.session_id()));
  MUOND_ASSIGN_OR_RETURN(std::shared_ptr<session::Session> session, registry_->Find(request.session_id(), caller));
  const int world_size = session->config().world_size;
  if (request.has_rank() && (request.rank() < 0 || request.rank() >= world_size)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: must be in [0, ", world_size, ") for this session, got ", request.rank()));
  }
  const int rank = request.has_rank() ? request.rank() : -1;
  transport::TensorAssembler assembler(session->config(), options_.max_chunk_bytes, rank);
  while (reader->Read(&request)) {
    if (request.kind_case() != v1::UploadParametersRequest::kChunk) {
      return absl::InvalidArgumentError("chunk: every message after the first must carry a chunk");
    }
    MUOND_RETURN_IF_ERROR(assembler.Add(request.chunk()));
  }
  MUOND_RETURN_IF_ERROR(reader->refusal());  // a message that did not parse, a call cut off: nothing uploaded
  if (rank >= 0) {
    // A rank holding none of a partitioned parameter has nothing of it to send.
    MUOND_RETURN_IF_ERROR(assembler.Finish(/*require_all=*/false));
    MUOND_RETURN_IF_ERROR(session->UploadParts(rank, std::move(assembler.tensors())));
  } else {
    MUOND_RETURN_IF_ERROR(assembler.Finish(/*require_all=*/true));
    MUOND_RETURN_IF_ERROR(session->Upload(std::move(assembler.tensors())));
  }
  response->set_num_tensors(static_cast<int32_t>(session->config().parameters.size()));
  response->set_num_parameters(session->config().total_elements);
  MUOND_EVENT(info, "parameters_uploaded", session->id(), -1, "session {} parameters uploaded ({} elements)",
              session->id(), session->config().total_elements);
  return absl::OkStatus();
}

grpc::Status MuondService::StepOverByteBuffers(grpc::ServerContext* context, ByteBufferStream* stream) {
  return Serve(calls_, context, "Step", [&](const std::string& caller) { return DoStep(caller, context, stream); });
}

grpc::Status MuondService::StepWholeOverByteBuffers(grpc::ServerContext* context, ByteBufferStream* stream) {
  return Serve(calls_, context, "StepWhole", [&](const std::string& caller) -> absl::Status {
    grpc::ByteBuffer request;
    if (!stream->Read(&request)) return absl::CancelledError("the client went away");
    MUOND_ASSIGN_OR_RETURN(std::vector<grpc::ByteBuffer> messages, transport::ReadWholeStep(request));
    transport::WholeStepStream whole(std::move(messages));
    MUOND_RETURN_IF_ERROR(DoStep(caller, context, &whole, options_.max_message_bytes));
    const grpc::ByteBuffer answer = whole.Answer();
    if (options_.max_message_bytes > 0 && answer.Length() > options_.max_message_bytes) {
      // The parameters fit, their fields and the result did not: the step stands, its answer
      // comes again from the record on the stream.
      return absl::ResourceExhaustedError(
          absl::StrCat("StepWhole: the answer takes ", answer.Length(), " bytes, over the daemon's message limit of ",
                       options_.max_message_bytes,
                       " (--max-chunk-bytes + 1 MiB); the step was applied: send it again on the "
                       "Step stream, which answers it from the record"));
    }
    if (!stream->Write(answer)) return absl::CancelledError("the client went away");
    return absl::OkStatus();
  });
}

absl::Status MuondService::DoStep(const std::string& caller, grpc::ServerContext* context,
                                  transport::StepStream* stream, size_t answer_limit) {
  MUOND_ASSIGN_OR_RETURN(const v1::StepHeader header, transport::ReadStepHeader(stream));
  MUOND_RETURN_IF_ERROR(session::CheckSessionId(header.session_id(), "header.session_id"));
  MUOND_ASSIGN_OR_RETURN(std::shared_ptr<session::Session> session,
                         registry_->Find(header.session_id(), caller, "header.session_id"));
  MUOND_ASSIGN_OR_RETURN(v1::DType dtype,
                         AnswerDType(header.return_dtype(), session->config().return_dtype, "header.return_dtype"));
  MUOND_ASSIGN_OR_RETURN(std::vector<size_t> order,
                         transport::AnswerOrder(header, session->config().parameters.size()));
  if (answer_limit > 0 && header.phase() != v1::STEP_PHASE_PREPARE) {  // a prepare answers no parameters
    uint64_t payload = 0;
    for (size_t i = 0; i < session->config().parameters.size(); ++i) {
      payload +=
          static_cast<uint64_t>(session::PartElements(session->config(), i, header.rank())) * wire::ElementSize(dtype);
    }
    if (payload > answer_limit) {
      return absl::InvalidArgumentError(absl::StrCat(
          "messages: the answer's parameters alone take ", payload, " bytes in ", wire::DTypeName(dtype),
          ", over the daemon's message limit of ", answer_limit,
          " (--max-chunk-bytes + 1 MiB) for one StepWhole answer: send this step on the Step stream; nothing was "
          "applied"));
    }
  }
  transport::GrpcGradientSource source(context, stream, header, options_.max_chunk_bytes);
  transport::GrpcParameterSink sink(stream, session->config(), dtype, AnswerChunkBytes(header.max_chunk_bytes()),
                                    answer_slices_.get(), header.packed_answer(), std::move(order));
  return transport::RunStep(*session, transport::ToStepRequest(header), source, sink, *options_.metrics);
}

grpc::Status MuondService::GetParametersOverByteBuffers(grpc::ServerContext* context, const grpc::ByteBuffer* bytes,
                                                        grpc::ServerWriter<grpc::ByteBuffer>* writer) {
  return Serve(calls_, context, "GetParameters", [&](const std::string& caller) -> absl::Status {
    grpc::ByteBuffer buffer(*bytes);
    v1::GetParametersRequest request;
    MUOND_RETURN_IF_ERROR(transport::ParseMessage(&buffer, &request));
    ResponseWriter<v1::GetParametersResponse> responses(writer);
    return DoGetParameters(caller, context, request, &responses);
  });
}

absl::Status MuondService::DoGetParameters(const std::string& caller, grpc::ServerContext* context,
                                           const v1::GetParametersRequest& request,
                                           grpc::ServerWriterInterface<v1::GetParametersResponse>* writer) {
  MUOND_RETURN_IF_ERROR(session::CheckSessionId(request.session_id()));
  MUOND_ASSIGN_OR_RETURN(std::shared_ptr<session::Session> session, registry_->Find(request.session_id(), caller));
  if (!session->initialized()) {
    return absl::FailedPreconditionError(
        absl::StrCat("session '", session->id(), "' has no parameters yet: upload them first"));
  }
  const session::SessionConfig& config = session->config();
  MUOND_ASSIGN_OR_RETURN(v1::DType dtype, AnswerDType(request.dtype(), config.return_dtype, "dtype"));
  std::vector<size_t> wanted;
  std::vector<int> asked_at(config.parameters.size(), -1);  // a parameter's entry in names, once named
  for (int i = 0; i < request.names_size(); ++i) {
    auto it = config.parameter_index.find(request.names(i));
    if (it == config.parameter_index.end()) {
      return absl::NotFoundError(absl::StrCat("names[", i, "]: unknown parameter '", Echo(request.names(i)), "'"));
    }
    // Each at most once: a short request must not have one tensor streamed back over and over.
    if (asked_at[it->second] >= 0) {
      return absl::InvalidArgumentError(absl::StrCat("names[", i, "]: '", Echo(request.names(i)),
                                                     "' is asked for twice (also names[", asked_at[it->second], "])"));
    }
    asked_at[it->second] = i;
    wanted.push_back(it->second);
  }
  if (wanted.empty()) {
    for (size_t i = 0; i < config.parameters.size(); ++i) wanted.push_back(i);
  }
  if (request.has_rank() && (request.rank() < 0 || request.rank() >= config.world_size)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: must be in [0, ", config.world_size, ") for this session, got ", request.rank()));
  }
  std::optional<int> rank;
  if (request.has_rank()) rank = request.rank();
  MUOND_ASSIGN_OR_RETURN(session::Session::LatestParameters latest, session->ReadLatestParameters(rank));
  session::ParameterReader& parameters = latest.reader;
  for (size_t i = 0; i < config.parameters.size(); ++i) {
    if (asked_at[i] < 0 && request.names_size() > 0) parameters.Finished(i);  // not read: never copied
  }
  parameters.Release();  // held by EmitParameterChunks while it encodes, not while the client reads
  if (parameters.snapshot()->on_device) {
    return absl::UnavailableError(
        "the parameters could not be read back from the backend (see the daemon's log); "
        "try again");
  }
  const size_t chunk_bytes = AnswerChunkBytes(request.max_chunk_bytes());
  bool first = true;
  for (size_t index : wanted) {
    MUOND_RETURN_IF_ERROR(transport::EmitParameterChunks(config.parameters[index].name, parameters, index, dtype,
                                                         chunk_bytes, [&](v1::TensorChunk&& chunk) {
                                                           v1::GetParametersResponse response;
                                                           if (first) response.set_last_step(latest.last_step);
                                                           first = false;
                                                           *response.mutable_chunk() = std::move(chunk);
                                                           return writer->Write(response);
                                                         }));
    if (context->IsCancelled()) return absl::CancelledError("the client went away");
  }
  return absl::OkStatus();
}

}  // namespace muond::rpc
