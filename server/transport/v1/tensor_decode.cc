#include "server/transport/v1/tensor_decode.h"

#include <algorithm>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "proto/wire/chunk_frame.h"

namespace muond::transport {
namespace {

// Σ x² in fp64 with 8 partial sums (independent additions the CPU overlaps, where one running sum
// waits on each add), combined in a fixed order: the same bits for the same values every time.
// Partial sum k takes the elements i with i % 8 == k (the tail's go to sum 0): the SSE2 form below
// keeps exactly that, two sums to a register, each product rounded before its add (no fused
// multiply-add on the baseline instruction set), so it gives the bits of the plain loop at about the
// speed of a copy; the plain loop is the definition, and the fallback elsewhere.
double SumSquares(std::span<const float> x) {
  double part[8] = {};
  size_t i = 0;
#if defined(__SSE2__)
  __m128d s01 = _mm_setzero_pd(), s23 = _mm_setzero_pd(), s45 = _mm_setzero_pd(), s67 = _mm_setzero_pd();
  for (; i + 8 <= x.size(); i += 8) {
    const __m128 lo = _mm_loadu_ps(x.data() + i), hi = _mm_loadu_ps(x.data() + i + 4);
    const __m128d x01 = _mm_cvtps_pd(lo), x23 = _mm_cvtps_pd(_mm_movehl_ps(lo, lo));
    const __m128d x45 = _mm_cvtps_pd(hi), x67 = _mm_cvtps_pd(_mm_movehl_ps(hi, hi));
    s01 = _mm_add_pd(s01, _mm_mul_pd(x01, x01));
    s23 = _mm_add_pd(s23, _mm_mul_pd(x23, x23));
    s45 = _mm_add_pd(s45, _mm_mul_pd(x45, x45));
    s67 = _mm_add_pd(s67, _mm_mul_pd(x67, x67));
  }
  _mm_storeu_pd(part, s01);
  _mm_storeu_pd(part + 2, s23);
  _mm_storeu_pd(part + 4, s45);
  _mm_storeu_pd(part + 6, s67);
#else
  for (; i + 8 <= x.size(); i += 8) {
    for (int k = 0; k < 8; ++k) part[k] += static_cast<double>(x[i + k]) * x[i + k];
  }
#endif
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
