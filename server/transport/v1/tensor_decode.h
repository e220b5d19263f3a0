// Decoding a tensor payload in a muond.v1 wire dtype into fp32 host values, with its sum of squares
// taken in the same pass: what every host-side transport does with the gradient bytes it received
// (the gRPC stream's chunks, a shared-memory region, a GPU transport's host fallback).
// Pure functions; thread-safe.
#pragma once

#include <span>

#include "absl/strings/string_view.h"
#include "muond/v1/muond.pb.h"

namespace muond::transport {

// Decodes a payload of whole `dtype` elements, out.size() of them, split into `pieces` at any byte
// boundary, into `out` and returns the sum of their squares in fp64 — inf or NaN when a value is not
// finite — in the same pass over the data. The sum does not depend on how the payload was split.
double DecodeSumSquares(v1::DType dtype, std::span<const absl::string_view> pieces, std::span<float> out);
inline double DecodeSumSquares(v1::DType dtype, absl::string_view bytes, std::span<float> out) {
  return DecodeSumSquares(dtype, std::span<const absl::string_view>(&bytes, 1), out);
}

}  // namespace muond::transport
