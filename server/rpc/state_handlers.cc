// MuondService's state transfer: GetState streams every master and optimizer slot of a session;
// SetState receives them (fp32 only) and replaces the session's state in one go; GetStateDigest
// answers the digest of the state (server/session/state_digest.h).
#include <algorithm>
#include <cstring>
#include <map>
#include <span>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/echo.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "proto/wire/dtype_codec.h"
#include "server/rpc/muond_service.h"
#include "server/session/partition.h"
#include "server/session/state_digest.h"
#include "server/transport/grpc/chunk_stream.h"
#include "server/transport/grpc/tensor_assembler.h"

namespace muond::rpc {

using session::ParameterConfig;
using session::SessionConfig;
using session::SessionState;
using session::StateTensor;

grpc::Status MuondService::GetStateOverByteBuffers(grpc::ServerContext* context, const grpc::ByteBuffer* bytes,
                                                   grpc::ServerWriter<grpc::ByteBuffer>* writer) {
  return Serve(calls_, context, "GetState", [&](const std::string& caller) -> absl::Status {
    grpc::ByteBuffer buffer(*bytes);
    v1::GetStateRequest request;
    MUOND_RETURN_IF_ERROR(transport::ParseMessage(&buffer, &request));
    ResponseWriter<v1::GetStateResponse> responses(writer);
    return DoGetState(caller, request, &responses);
  });
}

namespace {

// The wire dtype of a storage format.
v1::DType WireDtypeOf(kernels::StorageDtype dtype) {
  switch (dtype) {
    case kernels::StorageDtype::kBf16:
      return v1::DTYPE_BF16;
    case kernels::StorageDtype::kFp16:
      return v1::DTYPE_FP16;
    case kernels::StorageDtype::kFp32:
      return v1::DTYPE_FP32;
  }
  return v1::DTYPE_FP32;
}

}  // namespace

absl::Status MuondService::DoGetState(const std::string& caller, const v1::GetStateRequest& request,
                                      grpc::ServerWriterInterface<v1::GetStateResponse>* writer) {
  MUOND_RETURN_IF_ERROR(session::CheckSessionId(request.session_id()));
  MUOND_ASSIGN_OR_RETURN(std::shared_ptr<session::Session> session, registry_->Find(request.session_id(), caller));
  MUOND_ASSIGN_OR_RETURN(SessionState state, session->ExportState());
  const SessionConfig& config = session->config();
  if (request.has_rank() && (request.rank() < 0 || request.rank() >= config.world_size)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: must be in [0, ", config.world_size, ") for this session, got ", request.rank()));
  }
  v1::GetStateResponse response;
  v1::StateHeader* header = response.mutable_header();
  header->set_last_step(state.last_step);
  for (size_t i = 0; i < config.parameters.size(); ++i) {
    v1::ParameterStepCount* count = header->add_step_counts();
    count->set_name(config.parameters[i].name);
    count->set_count(state.step_counts[i]);
  }
  if (state.loss_scaler.has_value()) {
    v1::LossScalerState* scaler = header->mutable_loss_scaler();
    scaler->set_scale(state.loss_scaler->scale);
    scaler->set_growth_tracker(state.loss_scaler->growth_tracker);
    scaler->set_hysteresis_tracker(state.loss_scaler->hysteresis_tracker);
  }
  if (!writer->Write(response)) return absl::CancelledError("the client went away");
  const size_t chunk_bytes = AnswerChunkBytes(request.max_chunk_bytes());
  for (const StateTensor& tensor : state.tensors) {
    // The first chunk of each tensor carries its shape (a slot's own, e.g. NorMuon's (rows, 1));
    // a rank's part of one, flat.
    const session::ElementRange part =
        session::StatePartOf(config, tensor.parameter, tensor.values.size(), request.has_rank() ? request.rank() : -1);
    std::vector<int64_t> shape = session->TensorShape(tensor.parameter, tensor.slot);
    if (part.size() != static_cast<int64_t>(tensor.values.size())) shape = {part.size()};
    const std::span<const float> values =
        std::span<const float>(tensor.values)
            .subspan(static_cast<size_t>(part.begin), static_cast<size_t>(part.size()));
    const v1::DType dtype = request.stored_dtypes() ? WireDtypeOf(tensor.dtype) : v1::DTYPE_FP32;
    const bool sent = transport::EmitChunks(
        config.parameters[tensor.parameter].name, tensor.slot, values, dtype, chunk_bytes,
        [&](v1::TensorChunk&& chunk) {
          response.Clear();
          *response.mutable_chunk() = std::move(chunk);
          return writer->Write(response);
        },
        shape);
    if (!sent) return absl::CancelledError("the client went away");
  }
  return absl::OkStatus();
}

absl::Status MuondService::DoSetState(const std::string& caller, RequestReader<v1::SetStateRequest>* reader,
                                      v1::SetStateResponse* response) {
  v1::SetStateRequest request;
  if (!reader->Read(&request) || request.kind_case() != v1::SetStateRequest::kSessionId) {
    MUOND_RETURN_IF_ERROR(reader->refusal());
    return absl::InvalidArgumentError("session_id: the first message of a state upload must name the session");
  }
  MUOND_RETURN_IF_ERROR(session::CheckSessionId(request.session_id()));
  MUOND_ASSIGN_OR_RETURN(std::shared_ptr<session::Session> session, registry_->Find(request.session_id(), caller));
  const SessionConfig& config = session->config();
  if (request.has_rank() && (request.rank() < 0 || request.rank() >= config.world_size)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: must be in [0, ", config.world_size, ") for this session, got ", request.rank()));
  }
  const int rank = request.has_rank() ? request.rank() : -1;
  if (!reader->Read(&request) || request.kind_case() != v1::SetStateRequest::kHeader) {
    MUOND_RETURN_IF_ERROR(reader->refusal());
    return absl::InvalidArgumentError("header: the second message of a state upload must be its header");
  }
  SessionState state;
  state.last_step = request.header().last_step();
  if (request.header().has_loss_scaler()) {
    const v1::LossScalerState& scaler = request.header().loss_scaler();
    state.loss_scaler = optim::LossScalerState{.scale = scaler.scale(),
                                               .growth_tracker = scaler.growth_tracker(),
                                               .hysteresis_tracker = scaler.hysteresis_tracker()};
  }
  state.step_counts.assign(config.parameters.size(), -1);
  for (int i = 0; i < request.header().step_counts_size(); ++i) {
    const v1::ParameterStepCount& count = request.header().step_counts(i);
    auto it = config.parameter_index.find(count.name());
    const std::string field = absl::StrCat("header.step_counts[", i, "]");
    if (it == config.parameter_index.end()) {
      return absl::NotFoundError(absl::StrCat(field, ".name: unknown parameter '", Echo(count.name()), "'"));
    }
    if (count.count() < 0 || state.step_counts[it->second] != -1) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": negative or repeated count for '", Echo(count.name()), "'"));
    }
    state.step_counts[it->second] = count.count();
  }
  for (size_t i = 0; i < config.parameters.size(); ++i) {
    if (state.step_counts[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("header.step_counts: no count for '", config.parameters[i].name, "'"));
    }
  }

  // (parameter, slot) → index into state.tensors, filled in order.
  std::map<std::pair<size_t, std::string>, size_t> index;
  while (reader->Read(&request)) {
    if (request.kind_case() != v1::SetStateRequest::kChunk) {
      return absl::InvalidArgumentError("chunk: every message after the header must carry a chunk");
    }
    const v1::TensorChunk& chunk = request.chunk();
    auto it = config.parameter_index.find(chunk.name());
    if (it == config.parameter_index.end()) {
      return absl::NotFoundError(absl::StrCat("chunk.name: unknown parameter '", Echo(chunk.name()), "'"));
    }
    if (chunk.has_quantized()) {
      return absl::InvalidArgumentError("chunk.quantized: only a step's gradients may be quantized");
    }
    // fp32, or a 16-bit dtype (for a tensor stored in 16 bits, exact; for another, rounded).
    const v1::DType dtype = chunk.dtype() == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_FP32 : chunk.dtype();
    if (!wire::IsConcrete(dtype)) {
      return absl::InvalidArgumentError(absl::StrCat("chunk.dtype: unknown dtype ", static_cast<int>(chunk.dtype())));
    }
    const ParameterConfig& param = config.parameters[it->second];
    MUOND_RETURN_IF_ERROR(transport::CheckChunkPayload(chunk, dtype, options_.max_chunk_bytes, "chunk",
                                                       absl::StrCat(param.name, "/", chunk.slot())));
    if (chunk.shape_size() > 0) {  // optional: the tensor's shape, or any of a rank's part's element count
      const std::vector<int64_t> expected = session->TensorShape(it->second, chunk.slot());
      const int64_t whole = session::ShapeElements(expected);
      // A rank's part of a partitioned parameter's master or element-wise slot (StatePartOf's rule)
      // travels in the rank's own layout, flat or in rows, even when the part is the whole tensor.
      const bool part = rank >= 0 && session::IsPartitioned(config, it->second) && whole == param.numel;
      const int64_t elements = session::StatePartOf(config, it->second, static_cast<size_t>(whole), rank).size();
      const bool fits =
          part ? session::ShapeElements({chunk.shape().data(), static_cast<size_t>(chunk.shape_size())}) == elements
               : std::equal(expected.begin(), expected.end(), chunk.shape().begin(), chunk.shape().end());
      if (!fits) {
        return absl::InvalidArgumentError(
            absl::StrCat("chunk.shape: ", param.name, "/", chunk.slot(), " is [", absl::StrJoin(expected, ", "), "]",
                         part ? absl::StrCat(", rank ", rank, "'s part of it ", elements, " elements") : std::string(),
                         " here, got [", absl::StrJoin(chunk.shape(), ", "), "]"));
      }
    }
    auto [slot, inserted] = index.try_emplace({it->second, chunk.slot()}, state.tensors.size());
    if (inserted) state.tensors.push_back({it->second, chunk.slot(), {}});
    std::vector<float>& values = state.tensors[slot->second].values;
    const size_t count = chunk.data().size() / wire::ElementSize(dtype);
    if (chunk.offset() != values.size()) {
      return absl::InvalidArgumentError(absl::StrCat("chunk.offset: ", param.name, "/", chunk.slot(),
                                                     " expected offset ", values.size(), ", got ", chunk.offset()));
    }
    if (values.size() + count > static_cast<size_t>(param.numel)) {
      return absl::InvalidArgumentError(absl::StrCat("chunk.data: ", param.name, "/", chunk.slot(), " has at most ",
                                                     param.numel, " elements; this chunk brings it to ",
                                                     values.size() + count));
    }
    values.resize(values.size() + count);
    wire::Decode(dtype, chunk.data(), std::span<float>(values.data() + values.size() - count, count));
  }
  MUOND_RETURN_IF_ERROR(reader->refusal());  // a message that did not parse, a call cut off: nothing loaded
  MUOND_RETURN_IF_ERROR(session->ImportState(std::move(state), rank));
  response->set_last_step(session->last_step());
  MUOND_EVENT(info, "state_replaced", session->id(), response->last_step(), "session {} state replaced at step {}",
              session->id(), response->last_step());
  return absl::OkStatus();
}

grpc::Status MuondService::GetStateDigest(grpc::ServerContext* context, const v1::GetStateDigestRequest* request,
                                          v1::StateDigest* response) {
  return Serve(calls_, context, "GetStateDigest", [&](const std::string& caller) -> absl::Status {
    MUOND_RETURN_IF_ERROR(session::CheckSessionId(request->session_id()));
    MUOND_ASSIGN_OR_RETURN(std::shared_ptr<session::Session> session, registry_->Find(request->session_id(), caller));
    MUOND_ASSIGN_OR_RETURN(session::StateDigest digest, session::DigestSession(*session));
    response->set_step(digest.step);
    response->set_algorithm(session::kStateDigestAlgorithm);
    response->set_digest(digest.hex);
    response->set_num_tensors(digest.num_tensors);
    response->set_num_bytes(digest.num_bytes);
    response->set_format(session::kStateDigestFormat);
    return absl::OkStatus();
  });
}

}  // namespace muond::rpc
