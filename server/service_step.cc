// MuondService's tensor streams: UploadParameters, Step and GetParameters.
#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "proto/wire/dtype_codec.h"
#include "server/chunk_stream.h"
#include "server/grpc_status.h"
#include "server/logging.h"
#include "server/muond_service.h"
#include "server/tensor_assembler.h"

namespace muond::server {
namespace {

absl::StatusOr<v1::DType> AnswerDType(v1::DType requested, v1::DType session_default, absl::string_view field) {
  if (requested == v1::DTYPE_UNSPECIFIED) return session_default;
  if (!wire::IsConcrete(requested)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": unknown dtype ", static_cast<int>(requested)));
  }
  return requested;
}

}  // namespace

grpc::Status MuondService::UploadParameters(grpc::ServerContext* context,
                                            grpc::ServerReader<v1::UploadParametersRequest>* reader,
                                            v1::UploadParametersResponse* response) {
  RpcDeadlines::Scope deadline = deadlines_.Watch(context);
  absl::StatusOr<std::string> caller = Caller(*context);
  if (!caller.ok()) return ToGrpcStatus(caller.status());
  absl::Status status = DoUpload(*caller, reader, response);
  if (!status.ok()) MUOND_LOG(info, "upload refused: {}", status.ToString());
  return ToGrpcStatus(status);
}

absl::Status MuondService::DoUpload(const std::string& caller,
                                    grpc::ServerReader<v1::UploadParametersRequest>* reader,
                                    v1::UploadParametersResponse* response) {
  v1::UploadParametersRequest request;
  if (!reader->Read(&request) || request.kind_case() != v1::UploadParametersRequest::kSessionId) {
    return absl::InvalidArgumentError("session_id: the first message of an upload must name the session");
  }
  MUOND_RETURN_IF_ERROR(CheckSessionId(request.session_id()));
  MUOND_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, registry_->Find(request.session_id(), caller));
  TensorAssembler assembler(session->config(), options_.max_chunk_bytes);
  while (reader->Read(&request)) {
    if (request.kind_case() != v1::UploadParametersRequest::kChunk) {
      return absl::InvalidArgumentError("chunk: every message after the first must carry a chunk");
    }
    MUOND_RETURN_IF_ERROR(assembler.Add(request.chunk()));
  }
  MUOND_RETURN_IF_ERROR(assembler.Finish(/*require_all=*/true));
  MUOND_RETURN_IF_ERROR(session->Upload(std::move(assembler.tensors())));
  response->set_num_tensors(static_cast<int32_t>(session->config().parameters.size()));
  response->set_num_parameters(session->config().total_elements);
  MUOND_LOG(info, "session {} parameters uploaded ({} elements)", session->id(), session->config().total_elements);
  return absl::OkStatus();
}

grpc::Status MuondService::Step(grpc::ServerContext* context,
                                grpc::ServerReaderWriter<v1::StepResponse, v1::StepRequest>* stream) {
  RpcDeadlines::Scope deadline = deadlines_.Watch(context);
  absl::StatusOr<std::string> caller = Caller(*context);
  if (!caller.ok()) return ToGrpcStatus(caller.status());
  absl::Status status = DoStep(*caller, context, stream);
  if (!status.ok()) MUOND_LOG(debug, "step refused: {}", status.ToString());
  return ToGrpcStatus(status);
}

absl::Status MuondService::DoStep(const std::string& caller, grpc::ServerContext* context,
                                  grpc::ServerReaderWriter<v1::StepResponse, v1::StepRequest>* stream) {
  v1::StepRequest request;
  if (!stream->Read(&request) || request.kind_case() != v1::StepRequest::kHeader) {
    return absl::InvalidArgumentError("header: the first message of a step must be its header");
  }
  const v1::StepHeader header = request.header();
  MUOND_RETURN_IF_ERROR(CheckSessionId(header.session_id(), "header.session_id"));
  MUOND_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, registry_->Find(header.session_id(), caller));
  MUOND_ASSIGN_OR_RETURN(v1::DType dtype,
                         AnswerDType(header.return_dtype(), session->config().return_dtype, "header.return_dtype"));
  // Refuse a step out of order before reading its gradients.
  MUOND_RETURN_IF_ERROR(session->CheckStepNumber(header.step()));

  if (!header.has_num_chunks()) {
    return absl::InvalidArgumentError("header.num_chunks: required (the number of chunk messages that follow)");
  }

  TensorAssembler assembler(session->config(), options_.max_chunk_bytes);
  const bool replay = header.step() == session->last_step();
  // One rank's gradients go straight to the backend while the rest of the stream arrives (unless
  // another stream of the session is doing so); the ranks of a multi-rank session are averaged on
  // the host first.
  std::unique_ptr<StagedGradients> staged;
  if (!replay && session->config().world_size == 1) {
    MUOND_ASSIGN_OR_RETURN(staged, session->StageGradients());
    if (staged != nullptr) assembler.StageInto(staged.get());
  }
  uint64_t chunks = 0;
  while (stream->Read(&request)) {
    if (request.kind_case() != v1::StepRequest::kChunk) {
      return absl::InvalidArgumentError("chunk: every message after the header must carry a chunk");
    }
    if (++chunks > header.num_chunks()) {
      return absl::InvalidArgumentError(absl::StrCat("chunk: more chunks than the ", header.num_chunks(),
                                                     " announced in header.num_chunks"));
    }
    if (replay) continue;  // the step was applied already: its gradients are not needed again
    MUOND_RETURN_IF_ERROR(assembler.Add(request.chunk()));
  }
  if (context->IsCancelled()) return absl::CancelledError("the client cancelled the step");
  // gRPC ends the read loop the same way for a half-close and for a broken stream (a message over
  // its limit, say); only the announced count tells them apart.
  if (chunks != header.num_chunks()) {
    return absl::InvalidArgumentError(absl::StrCat("header.num_chunks: the stream ended after ", chunks, " of ",
                                                   header.num_chunks(),
                                                   " announced chunks; the step was not applied"));
  }
  MUOND_RETURN_IF_ERROR(assembler.Finish(/*require_all=*/false));
  if (staged != nullptr) MUOND_RETURN_IF_ERROR(staged->Finish());
  MUOND_ASSIGN_OR_RETURN(StepOutcome outcome,
                         session->Step(header, std::move(assembler.tensors()), std::move(staged)));
  if (!outcome.result.applied()) {
    MUOND_LOG(warn, "session {} step {} skipped: {}", session->id(), header.step(), outcome.result.skip_reason());
  }

  v1::StepResponse response;
  *response.mutable_result() = outcome.result;
  if (!stream->Write(response)) return absl::CancelledError("the client went away");
  const size_t chunk_bytes = AnswerChunkBytes(header.max_chunk_bytes());
  const SessionConfig& config = session->config();
  for (size_t i = 0; i < config.parameters.size(); ++i) {
    const bool sent = EmitChunks(config.parameters[i].name, "", outcome.parameters->values[i], dtype, chunk_bytes,
                                 [&](v1::TensorChunk&& chunk) {
                                   response.Clear();
                                   *response.mutable_chunk() = std::move(chunk);
                                   return stream->Write(response);
                                 });
    if (!sent) return absl::CancelledError("the client went away");
  }
  return absl::OkStatus();
}

grpc::Status MuondService::GetParameters(grpc::ServerContext* context, const v1::GetParametersRequest* request,
                                         grpc::ServerWriter<v1::GetParametersResponse>* writer) {
  RpcDeadlines::Scope deadline = deadlines_.Watch(context);
  absl::StatusOr<std::string> caller = Caller(*context);
  if (!caller.ok()) return ToGrpcStatus(caller.status());
  return ToGrpcStatus(DoGetParameters(*caller, context, *request, writer));
}

absl::Status MuondService::DoGetParameters(const std::string& caller, grpc::ServerContext* context,
                                           const v1::GetParametersRequest& request,
                                           grpc::ServerWriter<v1::GetParametersResponse>* writer) {
  MUOND_RETURN_IF_ERROR(CheckSessionId(request.session_id()));
  MUOND_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, registry_->Find(request.session_id(), caller));
  if (!session->initialized()) {
    return absl::FailedPreconditionError(
        absl::StrCat("session '", session->id(), "' has no parameters yet: upload them first"));
  }
  const SessionConfig& config = session->config();
  MUOND_ASSIGN_OR_RETURN(v1::DType dtype, AnswerDType(request.dtype(), config.return_dtype, "dtype"));
  std::vector<size_t> wanted;
  for (int i = 0; i < request.names_size(); ++i) {
    auto it = config.parameter_index.find(request.names(i));
    if (it == config.parameter_index.end()) {
      return absl::NotFoundError(absl::StrCat("names[", i, "]: unknown parameter '", request.names(i), "'"));
    }
    wanted.push_back(it->second);
  }
  if (wanted.empty()) {
    for (size_t i = 0; i < config.parameters.size(); ++i) wanted.push_back(i);
  }
  int64_t last_step = 0;
  std::shared_ptr<const ParameterSnapshot> snapshot = session->Parameters(&last_step);
  const size_t chunk_bytes = AnswerChunkBytes(request.max_chunk_bytes());
  bool first = true;
  for (size_t index : wanted) {
    const bool sent = EmitChunks(config.parameters[index].name, "", snapshot->values[index], dtype, chunk_bytes,
                                 [&](v1::TensorChunk&& chunk) {
                                   v1::GetParametersResponse response;
                                   if (first) response.set_last_step(last_step);
                                   first = false;
                                   *response.mutable_chunk() = std::move(chunk);
                                   return writer->Write(response);
                                 });
    if (!sent || context->IsCancelled()) return absl::CancelledError("the client went away");
  }
  return absl::OkStatus();
}

}  // namespace muond::server
