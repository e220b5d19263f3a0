// Decoding a tensor payload in a muond.v1 wire dtype into fp32 host values, with its sum of squares
// taken in the same pass: what every host-side transport does with the gradient bytes it received
// (the gRPC stream's chunks, a shared-memory region, a GPU transport's host fallback).
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "muond/v1/muond.pb.h"

namespace muond::transport {

// Decodes a payload of whole `dtype` elements, out.size() of them, split into `pieces` at any byte
// boundary, into `out` and returns the sum of their squares in fp64 — inf or NaN when a value is not
// finite — in the same pass over the data. The sum does not depend on how the payload was split: it
// is the sum, in order, of the sums of blocks of 4096 elements from the payload's first, each block's
// taken in eight fp64 partial sums (element i into sum i % 8, the tail's into sum 0, each product
// rounded before its add) combined pairwise — the same bits on every CPU.
double DecodeSumSquares(v1::DType dtype, std::span<const absl::string_view> pieces, std::span<float> out);
inline double DecodeSumSquares(v1::DType dtype, absl::string_view bytes, std::span<float> out) {
  return DecodeSumSquares(dtype, std::span<const absl::string_view>(&bytes, 1), out);
}

// A block-quantized chunk (v1::BlockQuantized) of `data_bytes` bytes at element `offset`: OK when its
// fields hold together (bits 8 or 4, block 1 to 65536, count >= 1, offset a multiple of block, the
// data and scales of count elements), else INVALID_ARGUMENT naming `field`.quantized.<field>.
absl::Status CheckBlockQuantized(const v1::BlockQuantized& quantized, uint64_t offset, size_t data_bytes,
                                 absl::string_view field);
// Decodes a checked block-quantized payload, split into `pieces` at any byte boundary, into `out`
// (quantized.count() elements; element i is data[i] · scales[i / block] in fp32) and returns its sum
// of squares as DecodeSumSquares would for those fp32 values.
double DecodeQuantizedSumSquares(const v1::BlockQuantized& quantized, std::span<const absl::string_view> pieces,
                                 std::span<float> out);

// DecodeSumSquares of out.size() fp32 elements at `src` (any alignment), with the same bits, for
// memory another process may write while it is read (shared memory): each element is loaded once, and
// the value stored into `out` is the value summed. `streaming`: store with non-temporal stores (around
// the caches), for copies larger than the caches; the stores are complete (fenced) on return.
double CopySumSquaresFp32(const char* src, std::span<float> out, bool streaming);

// Copies fp32 values to `dst` (any alignment), with non-temporal stores when `streaming`.
void CopyFp32(std::span<const float> values, char* dst, bool streaming);

}  // namespace muond::transport
