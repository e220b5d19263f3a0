// Splits host fp32 tensors into TensorChunk messages of at most `max_chunk_bytes` payload bytes,
// encoded in the requested dtype, for the daemon's server-streaming answers. Stateless; thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "muond/v1/muond.pb.h"
#include "proto/wire/chunk_frame.h"
#include "proto/wire/dtype_codec.h"

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

}  // namespace muond::transport
