// Splits host fp32 tensors into TensorChunk messages of at most `max_chunk_bytes` payload bytes,
// encoded in the requested dtype, for the daemon's server-streaming answers. Stateless; thread-safe
// (EmitParameterChunks: as its reader).
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "muond/v1/muond.pb.h"
#include "proto/wire/chunk_frame.h"
#include "proto/wire/dtype_codec.h"
#include "server/session/parameter_reader.h"

namespace muond::transport {

// Calls emit(v1::TensorChunk&&) for each chunk of `values`; stops early and returns false when
// emit returns false (the client went away).
template <typename Emit>
bool EmitChunks(const std::string& name, absl::string_view slot, std::span<const float> values, v1::DType dtype,
                size_t max_chunk_bytes, Emit&& emit, std::span<const int64_t> shape = {}) {
  v1::TensorChunk first;
  first.set_name(name);
  if (!slot.empty()) first.set_slot(std::string(slot));
  for (int64_t d : shape) first.add_shape(d);  // the first chunk's only
  return wire::ForEachChunk(first, values, dtype, max_chunk_bytes,
                            [&](const v1::TensorChunk& meta, std::span<const float> chunk_values) {
                              v1::TensorChunk chunk = meta;
                              wire::Encode(dtype, chunk_values, chunk.mutable_data());
                              return emit(std::move(chunk));
                            });
}

// As EmitChunks, for parameter `index` read through `parameters`: held while each chunk is encoded,
// released while it is emitted (a slow client does not hold up the session's steps). CANCELLED when
// emit returns false; the reader's refusal when it was replaced (ParameterReader::Hold).
template <typename Emit>
absl::Status EmitParameterChunks(const std::string& name, session::ParameterReader& parameters, size_t index,
                                 v1::DType dtype, size_t max_chunk_bytes, Emit&& emit) {
  v1::TensorChunk first;
  first.set_name(name);
  absl::Status read;
  const bool sent = wire::ForEachChunk(first, parameters.snapshot()->values[index], dtype, max_chunk_bytes,
                                       [&](const v1::TensorChunk& meta, std::span<const float> piece) {
                                         // `piece` places the chunk; its values are read through the reader.
                                         v1::TensorChunk chunk = meta;
                                         read = parameters.ReadPiece(
                                             index, meta.offset(), piece.size(), [&](std::span<const float> values) {
                                               wire::Encode(dtype, values, chunk.mutable_data());
                                             });
                                         return read.ok() && emit(std::move(chunk));
                                       });
  if (!read.ok()) return read;
  return sent ? absl::OkStatus() : absl::CancelledError("the client went away");
}

}  // namespace muond::transport
