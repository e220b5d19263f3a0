// Tensor chunks on gRPC byte buffers with their payload kept out of protobuf.
//
// StepRequest and StepResponse are `oneof { <control message> = 1; TensorChunk chunk = 2; }`. Parsed
// the ordinary way, a chunk's `data` is copied from gRPC's receive slices into a protobuf string and
// then decoded once more; serialized the ordinary way, it is encoded into a string and copied into a
// slice. Here the payload stays where it is: a received chunk keeps its `data` as pieces of the
// receive slices (PayloadReader decodes them straight into the destination), and a chunk to send is a
// small protobuf prefix followed by a payload slice the caller encoded into directly (FrameChunk).
// The bytes on the wire are exactly the protobuf encoding, so either side may be an ordinary
// protobuf peer (the Python client, the fuzzer's stubs).
//
// ParseChunkFrame takes the fast path only for the plain encoding of one chunk message; anything else
// (a control message, fields repeated or merged, bytes it does not understand) is left to protobuf,
// which gives those messages their exact protobuf meaning.
//
// SlicePool recycles payload buffers, so a sender allocates nothing per chunk once warm.
//
// FramedChunk and PayloadReader are values used by one thread; SlicePool is thread-safe, and the
// slices it lends may be released on any thread (gRPC's).
#pragma once

#include <algorithm>
#include <cstddef>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "muond/v1/muond.pb.h"

namespace muond::wire {

// The field number of `chunk` in StepRequest and StepResponse.
inline constexpr int kChunkField = 2;

// A received TensorChunk: every field but `data` in `meta`, the payload as pieces of the message's
// slices (held by `slices`, so the pieces stay valid while this lives).
struct FramedChunk {
  v1::TensorChunk meta;
  std::vector<grpc::Slice> slices;
  std::vector<absl::string_view> data;
  size_t data_bytes = 0;
};

// True and `chunk` filled when `buffer` is the plain encoding of a message holding only a
// TensorChunk in field `chunk_field`; false when it is anything else (parse it with protobuf then).
// Never fails: bytes it cannot follow are protobuf's to refuse.
bool ParseChunkFrame(const grpc::ByteBuffer& buffer, int chunk_field, FramedChunk* chunk);

// The message {chunk_field: meta with data = payload}; `meta.data()` must be empty. The payload
// slice is referenced, not copied.
grpc::ByteBuffer FrameChunk(int chunk_field, const v1::TensorChunk& meta, grpc::Slice payload);

// Packed chunks (docs/protocol.md): a whole tensor of at most 1/kPackedTensorFraction of the chunk
// size (64 KiB of the default 1 MiB) shares a PackedChunks message with others, by both clients and
// in the daemon's answers: smaller messages cost more per byte than the copy into a packed one.
inline constexpr size_t kPackedTensorFraction = 4;

// Elements per chunk of at most `max_chunk_bytes` payload bytes of `dtype` (concrete); at least one.
size_t ElementsPerChunk(v1::DType dtype, size_t max_chunk_bytes);
// How many chunks ForEachChunk makes of `numel` elements (at least one, even when it is empty).
size_t ChunkCount(size_t numel, v1::DType dtype, size_t max_chunk_bytes);

// Calls write(const v1::TensorChunk& meta, std::span<const float> values) for each chunk of
// `values` sent as `dtype` (an empty tensor is one empty chunk): `meta` is `first` (name, slot,
// shape as the caller set them) with the chunk's offset and dtype, its shape cleared after the first
// chunk, and no data; `values` are the chunk's elements, for the writer to encode where it sends
// them from. Stops and returns false when write does (the peer went away).
template <typename Write>
bool ForEachChunk(v1::TensorChunk first, std::span<const float> values, v1::DType dtype, size_t max_chunk_bytes,
                  Write&& write) {
  const size_t per_chunk = ElementsPerChunk(dtype, max_chunk_bytes);
  first.set_dtype(dtype);
  size_t offset = 0;
  do {
    const size_t count = std::min(per_chunk, values.size() - offset);
    first.set_offset(offset);
    if (!write(static_cast<const v1::TensorChunk&>(first), values.subspan(offset, count))) return false;
    first.clear_shape();
    offset += count;
  } while (offset < values.size());
  return true;
}

// Decodes a payload split into pieces at arbitrary byte boundaries (an element may straddle two).
class PayloadReader {
 public:
  explicit PayloadReader(std::span<const absl::string_view> pieces) : pieces_(pieces) {}
  // Decodes the next out.size() elements of `dtype` (concrete) into `out`; false, with `out`
  // unspecified, when fewer bytes remain.
  bool Read(v1::DType dtype, std::span<float> out);
  // Bytes not read yet.
  size_t remaining() const;

 private:
  std::span<const absl::string_view> pieces_;
  size_t piece_ = 0;   // current piece
  size_t offset_ = 0;  // bytes of it already read
};

// Payload buffers, recycled: Take() returns a slice of `bytes` over an idle buffer at least that
// large, or a new one of max(bytes, buffer_bytes); the buffer goes back to the pool when gRPC
// releases the slice. At most `keep` idle buffers are kept (the rest are freed), so a pool holds
// at most keep × the largest chunk while idle.
class SlicePool;

// The message {chunk_field: meta with `values` encoded as meta.dtype()}, the payload encoded
// straight into a slice of `pool`.
grpc::ByteBuffer EncodeChunk(int chunk_field, const v1::TensorChunk& meta, std::span<const float> values,
                             SlicePool& pool);

class SlicePool {
 public:
  static std::shared_ptr<SlicePool> Create(size_t buffer_bytes, size_t keep = 4);

  // The slice's bytes are writable until it is handed to gRPC: `data` points at them.
  grpc::Slice Take(size_t bytes, char** data);

  size_t buffer_bytes() const { return buffer_bytes_; }
  size_t idle() const;

 private:
  struct Lent;
  struct Idle {
    std::unique_ptr<char[]> storage;
    size_t capacity;
  };
  SlicePool(size_t buffer_bytes, size_t keep) : buffer_bytes_(buffer_bytes), keep_(keep) {}
  static void Release(void* lent);

  const size_t buffer_bytes_;
  const size_t keep_;
  mutable std::mutex mu_;
  std::vector<Idle> idle_;
  std::weak_ptr<SlicePool> self_;
};

}  // namespace muond::wire
