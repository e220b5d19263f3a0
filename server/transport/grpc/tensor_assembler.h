// TensorAssembler: collects the chunks of a gRPC stream (an upload or a step's gradients) into one
// fp32 host tensor per parameter, checking every chunk against the session's config as it arrives.
//
// Checks (each an error naming the field): the parameter exists (NOT_FOUND); the chunk names no
// slot; the dtype is known; the bytes are at least one whole element, a whole number of elements
// and no more than the chunk limit; chunks of a tensor
// arrive in order without gaps or overlap; a tensor never grows past its element count; an optional
// shape matches the spec. A step's tensor of a partitioned parameter is the sending rank's part
// (session/partition.h): its element count and shape are the part's. Finish() checks that every started tensor is
// complete (and, when all are required, that every parameter arrived).
//
// While decoding it accumulates each tensor's sum of squares in fp64, which gives the gradient norm
// and detects non-finite values without a second pass. Given a step (IncomingStep), it decodes into
// the step's gradients and hands every decoded chunk to IncomingStep::Stage, which starts copying it
// to the backend at once. A chunk's payload may be its `data` field or, for a chunk framed by
// wire::ParseChunkFrame, pieces of the received gRPC slices, decoded from there without a copy.
//
// One assembler per stream; not thread-safe. Reads the config (and the step), which must outlive it.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/host_tensor.h"
#include "muond/v1/muond.pb.h"
#include "server/session/incoming_step.h"
#include "server/session/session_config.h"
#include "server/transport/api_codec/tensor_decode.h"

namespace muond::transport {

// The payload rules every tensor chunk follows (uploads, steps and SetState alike): at least one
// element, a whole number of `dtype` elements, at most `max_chunk_bytes` bytes. `dtype` must be
// concrete; errors name `field`.data and the tensor `name`.
absl::Status CheckChunkPayload(size_t bytes, v1::DType dtype, size_t max_chunk_bytes, absl::string_view field,
                               absl::string_view name);
inline absl::Status CheckChunkPayload(const v1::TensorChunk& chunk, v1::DType dtype, size_t max_chunk_bytes,
                                      absl::string_view field, absl::string_view name) {
  return CheckChunkPayload(chunk.data().size(), dtype, max_chunk_bytes, field, name);
}

// INVALID_ARGUMENT with the reason CHUNK_TOO_LARGE: `what` (a field and the data it holds) carries
// more bytes than the daemon's limit. A client that sized its chunks for a daemon that took
// larger ones asks ServerInfo.max_chunk_bytes again and sends smaller ones (docs/protocol.md).
absl::Status ChunkTooLarge(absl::string_view what, size_t max_chunk_bytes);

class TensorAssembler {
 public:
  // Assembles into tensors of its own (uploads, state); `rank` >= 0: that rank's parts of the
  // partitioned parameters (an upload of parts).
  TensorAssembler(const session::SessionConfig& config, size_t max_chunk_bytes, int rank = -1);
  // Assembles into `step`'s gradients and stages each chunk (not owned; outlives this assembler).
  TensorAssembler(session::IncomingStep* step, size_t max_chunk_bytes);

  // `field` names the chunk in errors, e.g. "chunk".
  absl::Status Add(const v1::TensorChunk& chunk, absl::string_view field = "chunk");
  // The same for a chunk whose `data` is left out of `meta` and given as `pieces` (`bytes` in all).
  absl::Status Add(const v1::TensorChunk& meta, std::span<const absl::string_view> pieces, size_t bytes,
                   absl::string_view field = "chunk");

  // require_all: every parameter must have arrived (uploads); otherwise absent tensors are allowed,
  // partial ones are not (steps).
  absl::Status Finish(bool require_all) const;

  // Indexed like config.parameters.
  std::vector<HostTensor>& tensors() { return *tensors_; }
  const std::vector<HostTensor>& tensors() const { return *tensors_; }

 private:
  const session::SessionConfig& config_;
  size_t max_chunk_bytes_;
  std::vector<HostTensor> own_;       // used without a step
  std::vector<HostTensor>* tensors_;  // own_ or the step's gradients
  session::IncomingStep* step_ = nullptr;
  int rank_ = -1;  // the step's rank: its parts of partitioned parameters; -1 (no step): whole tensors

  // The elements parameter `index` arrives with: the rank's part, or the whole parameter.
  int64_t Expected(size_t index) const;
};

}  // namespace muond::transport
