// Whole tensors decoded from, and encoded into, memory the daemon addresses directly (a client's
// shared-memory region), split over the threads of a ComputePool (common/compute_pool.h).
//
// The sum of squares of a tensor decoded this way is the sum, in order, of the sums of its
// segments — kSegmentBytes of payload from its first element, each summed as DecodeSumSquares sums
// a payload (tensor_decode.h) — whichever threads decoded them: one thread decodes each segment, and
// the calling thread adds the segments' sums in order, so the bits do not depend on the pool's
// thread count. A segment is the clients' default gRPC chunk (1 MiB of payload), so a tensor's sum
// has the bits of a gRPC step sent in chunks of that size.
//
// Large copies (16 MiB and more in one call) are written with streaming stores, around the caches
// they would only flush. Thread-safety: functions of their arguments; the pool serializes its calls.
#pragma once

#include <cstddef>
#include <span>

#include "muond/v1/muond.pb.h"

namespace muond {
class ComputePool;
}

namespace muond::transport {

inline constexpr size_t kSegmentBytes = size_t{1} << 20;

// One tensor, or a piece of one beginning at a whole segment from its first element.
struct DecodeItem {
  v1::DType dtype = v1::DTYPE_FP32;  // concrete
  const char* src = nullptr;         // out.size() elements of `dtype`
  std::span<float> out;
  // In: the sum of squares of the tensor's elements before this piece (0 at its first); out: that
  // plus this piece's segments' sums, in order — a tensor decoded in pieces sums as when whole.
  double sum_squares = 0;
};

// Decodes every item into its `out` and sums its squares, over `pool`'s threads (null: the calling
// thread alone). Each element of `src` is read once: what is stored is what is summed.
void DecodeAll(std::span<DecodeItem> items, ComputePool* pool);

struct EncodeItem {
  v1::DType dtype = v1::DTYPE_FP32;  // concrete
  std::span<const float> values;
  char* dst = nullptr;  // room for values.size() elements of `dtype`
};

// Encodes every item's values into its `dst`, over `pool`'s threads (null: the calling thread alone).
void EncodeAll(std::span<const EncodeItem> items, ComputePool* pool);

}  // namespace muond::transport
