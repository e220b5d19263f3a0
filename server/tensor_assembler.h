// TensorAssembler: collects the chunks of a stream (an upload or a step's gradients) into one fp32
// host buffer per parameter, checking every chunk against the session's config as it arrives.
//
// Checks (each an error naming the field): the parameter exists (NOT_FOUND); the dtype is known;
// the bytes are a whole number of elements and no more than the chunk limit; chunks of a tensor
// arrive in order without gaps or overlap; a tensor never grows past its element count; an optional
// shape matches the spec. Finish() checks that every started tensor is complete (and, when all are
// required, that every parameter arrived).
//
// While decoding it accumulates each tensor's sum of squares in fp64, which gives the gradient norm
// and detects non-finite values without a second pass. With StageInto, every decoded chunk is also
// handed to a StagedGradients, which starts copying it to the backend at once.
//
// One assembler per stream; not thread-safe. Reads the config, which must outlive it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "muond/v1/muond.pb.h"
#include "server/gradient_staging.h"
#include "server/session_config.h"

namespace muond::server {

struct AssembledTensor {
  std::vector<float> values;  // empty until the first chunk
  int64_t received = 0;       // elements so far
  double sum_squares = 0.0;   // inf/NaN when a value was not finite
  bool staged = false;        // `values` are also in the stream's StagedGradients
  bool present() const { return received > 0; }
};

class TensorAssembler {
 public:
  TensorAssembler(const SessionConfig& config, size_t max_chunk_bytes);

  // Also copies every decoded chunk into `staged` (not owned; outlives this assembler's Add calls).
  void StageInto(StagedGradients* staged) { staged_ = staged; }

  // `field` names the chunk in errors, e.g. "chunk".
  absl::Status Add(const v1::TensorChunk& chunk, absl::string_view field = "chunk");

  // require_all: every parameter must have arrived (uploads); otherwise absent tensors are allowed,
  // partial ones are not (steps).
  absl::Status Finish(bool require_all) const;

  // Indexed like config.parameters.
  std::vector<AssembledTensor>& tensors() { return tensors_; }
  const std::vector<AssembledTensor>& tensors() const { return tensors_; }

 private:
  const SessionConfig& config_;
  size_t max_chunk_bytes_;
  std::vector<AssembledTensor> tensors_;
  StagedGradients* staged_ = nullptr;
};

}  // namespace muond::server
