#include "server/transport/grpc/tensor_assembler.h"

#include <algorithm>
#include <span>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/echo.h"
#include "common/error_reason.h"
#include "common/status_macros.h"
#include "proto/wire/chunk_frame.h"
#include "proto/wire/dtype_codec.h"
#include "server/session/partition.h"
#include "server/transport/api_codec/tensor_decode.h"

namespace muond::transport {

using session::ParameterConfig;

absl::Status ChunkTooLarge(absl::string_view what, size_t max_chunk_bytes) {
  return WithReason(absl::InvalidArgumentError(absl::StrCat(what, " exceed the chunk limit of ", max_chunk_bytes,
                                                            " bytes (--max-chunk-bytes)")),
                    ErrorReason::kChunkTooLarge);
}

absl::Status CheckChunkPayload(size_t bytes, v1::DType dtype, size_t max_chunk_bytes, absl::string_view field,
                               absl::string_view name) {
  if (bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".data: empty chunk for '", name,
                                                   "'; every chunk carries at least one element (a tensor is "
                                                   "sent whole or not at all)"));
  }
  if (bytes > max_chunk_bytes) {
    return ChunkTooLarge(absl::StrCat(field, ".data: ", bytes, " bytes for '", name, "'"), max_chunk_bytes);
  }
  if (bytes % wire::ElementSize(dtype) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".data: ", bytes, " bytes is not a whole number of ",
                                                   wire::DTypeName(dtype), " elements for '", name, "'"));
  }
  return absl::OkStatus();
}

TensorAssembler::TensorAssembler(const session::SessionConfig& config, size_t max_chunk_bytes, int rank)
    : config_(config),
      max_chunk_bytes_(max_chunk_bytes),
      own_(config.parameters.size()),
      tensors_(&own_),
      rank_(rank) {}

TensorAssembler::TensorAssembler(session::IncomingStep* step, size_t max_chunk_bytes)
    : config_(step->config()),
      max_chunk_bytes_(max_chunk_bytes),
      tensors_(&step->gradients()),
      step_(step),
      rank_(step->plan().request.rank) {}

int64_t TensorAssembler::Expected(size_t index) const {
  return rank_ < 0 ? config_.parameters[index].numel : session::PartElements(config_, index, rank_);
}

absl::Status TensorAssembler::Add(const v1::TensorChunk& chunk, absl::string_view field) {
  const absl::string_view data = chunk.data();
  return Add(chunk, std::span<const absl::string_view>(&data, 1), data.size(), field);
}

absl::Status TensorAssembler::Add(const v1::TensorChunk& chunk, std::span<const absl::string_view> pieces, size_t bytes,
                                  absl::string_view field) {
  auto it = config_.parameter_index.find(chunk.name());
  if (it == config_.parameter_index.end()) {
    return absl::NotFoundError(absl::StrCat(field, ".name: unknown parameter '", Echo(chunk.name()), "'"));
  }
  const ParameterConfig& param = config_.parameters[it->second];
  HostTensor& tensor = (*tensors_)[it->second];
  const std::string& name = param.name;
  if (!chunk.slot().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".slot: '", Echo(chunk.slot()), "' given for '", name,
                                                   "'; slots name state tensors (SetState) only"));
  }

  const v1::DType dtype =
      chunk.dtype() == v1::DTYPE_UNSPECIFIED ? static_cast<v1::DType>(param.wire_dtype) : chunk.dtype();
  const bool quantized = chunk.has_quantized();
  const size_t element_size = wire::ElementSize(dtype);
  if (quantized) {
    if (step_ == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".quantized: given for '", name, "'; only a step's gradients may be quantized"));
    }
    if (bytes > max_chunk_bytes_) {
      return ChunkTooLarge(absl::StrCat(field, ".data: ", bytes, " bytes for '", name, "'"), max_chunk_bytes_);
    }
    MUOND_RETURN_IF_ERROR(CheckBlockQuantized(chunk.quantized(), chunk.offset(), bytes, field));
  } else if (element_size == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".dtype: unknown dtype ", static_cast<int>(chunk.dtype()), " for '", name, "'"));
  } else {
    MUOND_RETURN_IF_ERROR(CheckChunkPayload(bytes, dtype, max_chunk_bytes_, field, name));
  }
  const int64_t expected = Expected(it->second);
  const bool part = rank_ >= 0 && session::IsPartitioned(config_, it->second);
  if (chunk.shape_size() > 0 && part) {
    // A part: any shape of its element count (a row block, or a flat range).
    if (session::ShapeElements({chunk.shape().data(), static_cast<size_t>(chunk.shape_size())}) != expected) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".shape: '", name, "' was sent with shape [",
                                                     absl::StrJoin(chunk.shape(), ", "), "]; rank ", rank_,
                                                     "'s part of it has ", expected, " elements"));
    }
  } else if (chunk.shape_size() > 0) {
    const std::vector<int64_t> shape(chunk.shape().begin(), chunk.shape().end());
    if (shape != param.shape) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".shape: '", name, "' was sent with shape [",
                                                     absl::StrJoin(shape, ", "), "], the session has [",
                                                     absl::StrJoin(param.shape, ", "), "]"));
    }
  }
  if (static_cast<int64_t>(chunk.offset()) != tensor.received) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".offset: expected ", tensor.received, " for '", name,
                                                   "', got ", chunk.offset(),
                                                   " (chunks of a tensor must arrive in order, once)"));
  }
  const int64_t count =
      quantized ? static_cast<int64_t>(chunk.quantized().count()) : static_cast<int64_t>(bytes / element_size);
  if (count > expected - tensor.received) {
    const std::string what = part ? absl::StrCat("rank ", rank_, "'s part of '", name, "' has ", expected, " elements")
                                  : absl::StrCat("'", name, "' has ", expected, " elements");
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".data: ", what, "; this chunk would end at element ", tensor.received + count));
  }
  if (step_ != nullptr) {
    if (tensor.values.empty()) tensor.values.resize(expected);
  } else if (static_cast<int64_t>(tensor.values.size()) < tensor.received + count) {
    // A tensor of its own grows with what arrived (as SetState's do): a stream that sent a chunk of
    // each parameter and stopped holds those chunks, not the whole model, until it ends. It doubles
    // while under half the parameter, then takes it whole: at most 1.5 times it while growing.
    const size_t needed = static_cast<size_t>(tensor.received + count);
    if (tensor.values.capacity() < needed) {
      const size_t doubled = std::max(needed, 2 * tensor.values.capacity());
      tensor.values.reserve(2 * doubled >= static_cast<size_t>(expected) ? static_cast<size_t>(expected) : doubled);
    }
    tensor.values.resize(needed);
  }
  std::span<float> out(tensor.values.data() + tensor.received, count);
  tensor.sum_squares +=
      quantized ? DecodeQuantizedSumSquares(chunk.quantized(), pieces, out) : DecodeSumSquares(dtype, pieces, out);
  if (step_ != nullptr) MUOND_RETURN_IF_ERROR(step_->Stage(it->second, tensor.received, out.size()));
  tensor.received += count;
  return absl::OkStatus();
}

absl::Status TensorAssembler::Finish(bool require_all) const {
  for (size_t i = 0; i < tensors_->size(); ++i) {
    const ParameterConfig& param = config_.parameters[i];
    const HostTensor& tensor = (*tensors_)[i];
    const int64_t expected = Expected(i);
    if (tensor.received == expected) continue;
    if (tensor.received == 0 && !require_all) continue;
    if (tensor.received == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk.name: parameter '", param.name, "' is missing; every parameter must be sent"));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("chunk.data: '", param.name, "' is incomplete: ", tensor.received, " of ", expected, " elements"));
  }
  return absl::OkStatus();
}

}  // namespace muond::transport
