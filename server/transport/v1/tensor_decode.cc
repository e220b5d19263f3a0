#include "server/transport/v1/tensor_decode.h"

#include <algorithm>

#include "proto/wire/chunk_frame.h"

namespace muond::transport {
namespace {

// Σ x² in fp64 with 8 partial sums (independent additions the CPU overlaps, where one running sum
// waits on each add), combined in a fixed order: the same bits for the same values every time.
double SumSquares(std::span<const float> x) {
  double part[8] = {};
  size_t i = 0;
  for (; i + 8 <= x.size(); i += 8) {
    for (int k = 0; k < 8; ++k) part[k] += static_cast<double>(x[i + k]) * x[i + k];
  }
  for (; i < x.size(); ++i) part[0] += static_cast<double>(x[i]) * x[i];
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

}  // namespace

double DecodeSumSquares(v1::DType dtype, std::span<const absl::string_view> pieces, std::span<float> out) {
  // Blocks of 4096 elements (16 KiB): each block's sum reads what its decode just wrote, from L1.
  // The blocks start at the chunk's first element whatever the pieces, so the sum's bits do not
  // depend on how the payload was split.
  constexpr size_t kBlock = 4096;
  wire::PayloadReader reader(pieces);
  double sum = 0.0;
  for (size_t begin = 0; begin < out.size(); begin += kBlock) {
    std::span<float> block = out.subspan(begin, std::min(kBlock, out.size() - begin));
    reader.Read(dtype, block);  // the caller checked the byte count
    sum += SumSquares(block);
  }
  return sum;
}

}  // namespace muond::transport
