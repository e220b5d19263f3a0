#include "server/transport/api_codec/tensor_decode.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "absl/strings/str_cat.h"
#include "proto/wire/chunk_frame.h"

namespace muond::transport {
namespace {

// Blocks of 4096 elements (16 KiB): the unit of the sum of squares. Each block's sum starts afresh
// and the blocks' sums are added in order.
constexpr size_t kBlock = 4096;

double Combine(const double part[8]) {
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

// Σ x² of one block in fp64 with 8 partial sums (independent additions the CPU overlaps, where one
// running sum waits on each add), combined in a fixed order: the same bits for the same values every
// time. Partial sum k takes the elements i with i % 8 == k (the tail's go to sum 0), each product
// rounded before its add (no fused multiply-add): the plain loop is the definition, and the
// fallback where there is no SSE2. The SSE2 and AVX2 forms below keep exactly those sums in their
// lanes (two or four to a register), so they give the plain loop's bits at about the speed of a copy.
[[maybe_unused]] double SumSquaresPlain(const float* x, size_t n) {
  double part[8] = {};
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) part[k] += static_cast<double>(x[i + k]) * x[i + k];
  }
  for (; i < n; ++i) part[0] += static_cast<double>(x[i]) * x[i];
  return Combine(part);
}

// The copy of a block out of memory another process may write (shared memory) into `dst`, with the
// block's sum of squares, in one pass: each element is loaded once, and the value stored is the
// value summed. How the values are stored: plainly, or with streaming (non-temporal) stores, which
// write around the caches — for copies larger than them, whose destination the next pass reads from
// memory anyway — on a destination aligned to 16 or 32 bytes.
enum class Store { kPlain, kStream16, kStream32 };

double CopySumSquaresPlain(const char* src, float* dst, size_t n) {
  double part[8] = {};
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    float v[8];
    std::memcpy(v, src + 4 * i, sizeof(v));
    std::memcpy(dst + i, v, sizeof(v));
    for (int k = 0; k < 8; ++k) part[k] += static_cast<double>(v[k]) * v[k];
  }
  for (; i < n; ++i) {
    float v;
    std::memcpy(&v, src + 4 * i, 4);
    dst[i] = v;
    part[0] += static_cast<double>(v) * v;
  }
  return Combine(part);
}

#if defined(__SSE2__)

// The tail of a block (fewer than 8 elements), into partial sum 0.
inline void CopyTail(const char* src, float* dst, size_t i, size_t n, double& part0) {
  for (; i < n; ++i) {
    float v;
    std::memcpy(&v, src + 4 * i, 4);
    dst[i] = v;
    part0 += static_cast<double>(v) * v;
  }
}

// SumSquaresPlain's eight partial sums in four SSE2 registers, two lanes each.
struct Sse2Squares {
  __m128d s01 = _mm_setzero_pd(), s23 = _mm_setzero_pd(), s45 = _mm_setzero_pd(), s67 = _mm_setzero_pd();

  // Elements i..i+7 (lo: the first four): each into its own partial sum.
  void Add(__m128 lo, __m128 hi) {
    const __m128d x01 = _mm_cvtps_pd(lo), x23 = _mm_cvtps_pd(_mm_movehl_ps(lo, lo));
    const __m128d x45 = _mm_cvtps_pd(hi), x67 = _mm_cvtps_pd(_mm_movehl_ps(hi, hi));
    s01 = _mm_add_pd(s01, _mm_mul_pd(x01, x01));
    s23 = _mm_add_pd(s23, _mm_mul_pd(x23, x23));
    s45 = _mm_add_pd(s45, _mm_mul_pd(x45, x45));
    s67 = _mm_add_pd(s67, _mm_mul_pd(x67, x67));
  }
  void StoreTo(double part[8]) const {
    _mm_storeu_pd(part, s01);
    _mm_storeu_pd(part + 2, s23);
    _mm_storeu_pd(part + 4, s45);
    _mm_storeu_pd(part + 6, s67);
  }
};

double SumSquaresSse2(const float* x, size_t n) {
  double part[8] = {};
  size_t i = 0;
  Sse2Squares sums;
  for (; i + 8 <= n; i += 8) sums.Add(_mm_loadu_ps(x + i), _mm_loadu_ps(x + i + 4));
  sums.StoreTo(part);
  for (; i < n; ++i) part[0] += static_cast<double>(x[i]) * x[i];
  return Combine(part);
}

template <Store kStore>
double CopySumSquaresSse2(const char* src, float* dst, size_t n) {
  double part[8] = {};
  size_t i = 0;
  Sse2Squares sums;
  for (; i + 8 <= n; i += 8) {
    __m128 lo = _mm_loadu_ps(reinterpret_cast<const float*>(src + 4 * i));
    __m128 hi = _mm_loadu_ps(reinterpret_cast<const float*>(src + 4 * i + 16));
    // Opaque to the compiler: the store and the sum use these registers, never a second load.
    asm("" : "+x"(lo), "+x"(hi));
    if constexpr (kStore == Store::kPlain) {
      _mm_storeu_ps(dst + i, lo);
      _mm_storeu_ps(dst + i + 4, hi);
    } else {
      _mm_stream_ps(dst + i, lo);
      _mm_stream_ps(dst + i + 4, hi);
    }
    sums.Add(lo, hi);
  }
  sums.StoreTo(part);
  CopyTail(src, dst, i, n, part[0]);
  return Combine(part);
}

// AVX2 where the CPU has it (chosen at run time; the build targets the baseline instruction set).
// AVX2 alone enables no fused multiply-add, so each product is rounded before its add, as defined.
// Elements i..i+7 (lo: the first four) into the eight partial sums, four lanes to a register.
__attribute__((target("avx2"))) inline void AddSquaresAvx2(__m128 lo, __m128 hi, __m256d& s0123, __m256d& s4567) {
  const __m256d x0123 = _mm256_cvtps_pd(lo), x4567 = _mm256_cvtps_pd(hi);
  s0123 = _mm256_add_pd(s0123, _mm256_mul_pd(x0123, x0123));
  s4567 = _mm256_add_pd(s4567, _mm256_mul_pd(x4567, x4567));
}

__attribute__((target("avx2"))) double SumSquaresAvx2(const float* x, size_t n) {
  double part[8] = {};
  size_t i = 0;
  __m256d s0123 = _mm256_setzero_pd(), s4567 = _mm256_setzero_pd();
  for (; i + 8 <= n; i += 8) AddSquaresAvx2(_mm_loadu_ps(x + i), _mm_loadu_ps(x + i + 4), s0123, s4567);
  _mm256_storeu_pd(part, s0123);
  _mm256_storeu_pd(part + 4, s4567);
  for (; i < n; ++i) part[0] += static_cast<double>(x[i]) * x[i];
  return Combine(part);
}

template <Store kStore>
__attribute__((target("avx2"))) double CopySumSquaresAvx2(const char* src, float* dst, size_t n) {
  double part[8] = {};
  size_t i = 0;
  __m256d s0123 = _mm256_setzero_pd(), s4567 = _mm256_setzero_pd();
  __m128 pending = _mm_setzero_ps();  // kStream16: the last 4 elements loaded, not yet stored
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(reinterpret_cast<const float*>(src + 4 * i));
    asm("" : "+x"(v));  // opaque: the store and the sum use this register, never a second load
    if constexpr (kStore == Store::kPlain) {
      _mm256_storeu_ps(dst + i, v);
    } else if constexpr (kStore == Store::kStream16) {
      // dst + i lies 16 bytes past a 32-byte boundary: whole 32-byte streams, each the upper half of
      // the previous 8 elements and the lower half of these (measured faster than 16-byte streams).
      if (i == 0) {
        _mm_stream_ps(dst, _mm256_castps256_ps128(v));
      } else {
        _mm256_stream_ps(dst + i - 4, _mm256_set_m128(_mm256_castps256_ps128(v), pending));
      }
      pending = _mm256_extractf128_ps(v, 1);
    } else {
      _mm256_stream_ps(dst + i, v);
    }
    AddSquaresAvx2(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1), s0123, s4567);
  }
  if constexpr (kStore == Store::kStream16) {
    if (i > 0) _mm_stream_ps(dst + i - 4, pending);
  }
  _mm256_storeu_pd(part, s0123);
  _mm256_storeu_pd(part + 4, s4567);
  CopyTail(src, dst, i, n, part[0]);
  return Combine(part);
}

bool HasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}

// A copy of fp32 values into `dst` (no sum), streamed where `dst` allows.
__attribute__((target("avx2"))) void StreamCopyAvx2(const float* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i < n && reinterpret_cast<uintptr_t>(dst + i) % 32 != 0; ++i) dst[i] = src[i];
  for (; i + 8 <= n; i += 8) _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
  for (; i < n; ++i) dst[i] = src[i];
}

void StreamCopySse2(const float* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i < n && reinterpret_cast<uintptr_t>(dst + i) % 16 != 0; ++i) dst[i] = src[i];
  for (; i + 4 <= n; i += 4) _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
  for (; i < n; ++i) dst[i] = src[i];
}

#endif  // __SSE2__

double SumSquares(const float* x, size_t n) {
#if defined(__SSE2__)
  return HasAvx2() ? SumSquaresAvx2(x, n) : SumSquaresSse2(x, n);
#else
  return SumSquaresPlain(x, n);
#endif
}

}  // namespace

double DecodeSumSquares(v1::DType dtype, std::span<const absl::string_view> pieces, std::span<float> out) {
  // Each block's sum reads what its decode just wrote, from L1. The blocks start at the chunk's
  // first element whatever the pieces, so the sum's bits do not depend on how the payload was split.
  wire::PayloadReader reader(pieces);
  double sum = 0.0;
  for (size_t begin = 0; begin < out.size(); begin += kBlock) {
    std::span<float> block = out.subspan(begin, std::min(kBlock, out.size() - begin));
    reader.Read(dtype, block);  // the caller checked the byte count
    sum += SumSquares(block.data(), block.size());
  }
  return sum;
}

absl::Status CheckBlockQuantized(const v1::BlockQuantized& quantized, uint64_t offset, size_t data_bytes,
                                 absl::string_view field) {
  const std::string at = absl::StrCat(field, ".quantized.");
  if (quantized.bits() != 8 && quantized.bits() != 4) {
    return absl::InvalidArgumentError(absl::StrCat(at, "bits: ", quantized.bits(), " is not 8 or 4"));
  }
  if (quantized.block() < 1 || quantized.block() > 65536) {
    return absl::InvalidArgumentError(absl::StrCat(at, "block: ", quantized.block(), " is not in [1, 65536]"));
  }
  if (quantized.count() < 1)
    return absl::InvalidArgumentError(absl::StrCat(at, "count: a chunk has at least 1 element"));
  if (offset % quantized.block() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".offset: ", offset, " is not a multiple of the block (",
                                                   quantized.block(), "): blocks start at the tensor's first element"));
  }
  // count is bounded by the data's size before anything is multiplied by it.
  const uint64_t count = quantized.count();
  if (count / (8 / quantized.bits()) > data_bytes || (count * quantized.bits() + 7) / 8 != data_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".data: ", data_bytes, " bytes do not hold ", count,
                                                   " elements of ", quantized.bits(), " bits"));
  }
  const uint64_t blocks = (count + quantized.block() - 1) / quantized.block();
  if (quantized.scales().size() != blocks * 4) {
    return absl::InvalidArgumentError(
        absl::StrCat(at, "scales: ", quantized.scales().size(), " bytes for ", blocks, " blocks; one fp32 per block"));
  }
  return absl::OkStatus();
}

double DecodeQuantizedSumSquares(const v1::BlockQuantized& quantized, std::span<const absl::string_view> pieces,
                                 std::span<float> out) {
  std::string joined;  // a chunk split over several receive slices, in one piece
  absl::string_view data = pieces.empty() ? absl::string_view() : pieces[0];
  if (pieces.size() > 1) {
    for (absl::string_view piece : pieces) joined.append(piece.data(), piece.size());
    data = joined;
  }
  const absl::string_view scales = quantized.scales();
  const size_t block = quantized.block();
  const bool nibbles = quantized.bits() == 4;
  for (size_t begin = 0; begin < out.size(); begin += block) {
    float scale;  // one load per block
    std::memcpy(&scale, scales.data() + 4 * (begin / block), 4);
    const size_t end = std::min(out.size(), begin + block);
    for (size_t i = begin; i < end; ++i) {
      int value;
      if (nibbles) {
        const int nibble = (static_cast<uint8_t>(data[i / 2]) >> (4 * (i % 2))) & 0xF;
        value = nibble >= 8 ? nibble - 16 : nibble;
      } else {
        value = static_cast<int8_t>(data[i]);
      }
      out[i] = static_cast<float>(value) * scale;
    }
  }
  double sum = 0.0;
  for (size_t begin = 0; begin < out.size(); begin += kBlock) {
    sum += SumSquares(out.data() + begin, std::min(kBlock, out.size() - begin));
  }
  return sum;
}

double CopySumSquaresFp32(const char* src, std::span<float> out, bool streaming) {
  using Kernel = double (*)(const char*, float*, size_t);
  Kernel kernel = CopySumSquaresPlain;
#if defined(__SSE2__)
  const uintptr_t address = reinterpret_cast<uintptr_t>(out.data());
  const Store store = !streaming          ? Store::kPlain
                      : address % 32 == 0 ? Store::kStream32
                      : address % 16 == 0 ? Store::kStream16
                                          : Store::kPlain;
  if (HasAvx2()) {
    kernel = store == Store::kStream32   ? CopySumSquaresAvx2<Store::kStream32>
             : store == Store::kStream16 ? CopySumSquaresAvx2<Store::kStream16>
                                         : CopySumSquaresAvx2<Store::kPlain>;
  } else {
    kernel = store == Store::kPlain ? CopySumSquaresSse2<Store::kPlain> : CopySumSquaresSse2<Store::kStream16>;
  }
#else
  (void)streaming;
#endif
  // The blocks start at multiples of 4096 elements: every block keeps the destination's alignment.
  double sum = 0.0;
  for (size_t begin = 0; begin < out.size(); begin += kBlock) {
    sum += kernel(src + 4 * begin, out.data() + begin, std::min(kBlock, out.size() - begin));
  }
#if defined(__SSE2__)
  if (streaming) _mm_sfence();  // streaming stores are weakly ordered: visible before whatever follows
#endif
  return sum;
}

void CopyFp32(std::span<const float> values, char* dst, bool streaming) {
  if (values.empty()) return;
#if defined(__SSE2__)
  // A destination that is not aligned to an element stays with memcpy.
  if (streaming && reinterpret_cast<uintptr_t>(dst) % 4 == 0) {
    float* out = reinterpret_cast<float*>(dst);
    if (HasAvx2()) {
      StreamCopyAvx2(values.data(), out, values.size());
    } else {
      StreamCopySse2(values.data(), out, values.size());
    }
    _mm_sfence();
    return;
  }
#else
  (void)streaming;
#endif
  std::memcpy(dst, values.data(), values.size() * sizeof(float));
}

}  // namespace muond::transport
