// Splits host fp32 tensors into TensorChunk messages of at most `max_chunk_bytes` payload bytes,
// encoded in the requested dtype, for the daemon's server-streaming answers. Stateless; thread-safe.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>

#include "muond/v1/muond.pb.h"
#include "proto/wire/dtype_codec.h"

namespace muond::transport {

// Calls emit(v1::TensorChunk&&) for each chunk of `values`; stops early and returns false when
// emit returns false (the client went away).
template <typename Emit>
bool EmitChunks(const std::string& name, absl::string_view slot, std::span<const float> values,
                v1::DType dtype, size_t max_chunk_bytes, Emit&& emit) {
  const size_t per_chunk = std::max<size_t>(1, max_chunk_bytes / wire::ElementSize(dtype));
  size_t offset = 0;
  do {
    const size_t count = std::min(per_chunk, values.size() - offset);
    v1::TensorChunk chunk;
    chunk.set_name(name);
    chunk.set_offset(offset);
    chunk.set_dtype(dtype);
    if (!slot.empty()) chunk.set_slot(std::string(slot));
    wire::Encode(dtype, values.subspan(offset, count), chunk.mutable_data());
    if (!emit(std::move(chunk))) return false;
    offset += count;
  } while (offset < values.size());
  return true;
}

}  // namespace muond::transport
