#include "common/half_ranges.h"

#include <algorithm>
#include <cstring>

#include "common/half_float.h"
#include "common/simd_clones.h"

// On x86-64 under GCC, narrowing to fp16 takes F16C's instruction where the CPU has it (chosen once,
// at the first call).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MUOND_HAVE_F16C_PATH 1
#include <immintrin.h>
#else
#define MUOND_HAVE_F16C_PATH 0
#endif

namespace muond {
namespace {

// Each case of the scalar conversion is computed for every element and the element's own is
// selected with masks, which GCC vectorizes (a conditional expression or a comparison used as a
// number it does not, here). Every intermediate is defined for every input.

inline uint32_t Select(bool condition, uint32_t if_true, uint32_t if_false) {
  const uint32_t mask = 0u - static_cast<uint32_t>(condition);
  return (if_true & mask) | (if_false & ~mask);
}

// `value` shifted right by `shift` (1 to 31), rounded to nearest, ties to even: adding half less
// one, and one more when the kept part is odd, carries into the kept part exactly then. Needs
// value + 2^(shift - 1) < 2^32.
inline uint32_t ShiftRoundingToEven(uint32_t value, uint32_t shift) {
  return (value + ((1u << (shift - 1u)) - 1u) + ((value >> shift) & 1u)) >> shift;
}

inline uint32_t Bf16Bits(uint32_t bits) {
  const uint32_t quiet_nan = (bits >> 16) | 0x0040u;
  return Select((bits & 0x7fffffffu) > 0x7f800000u, quiet_nan, ShiftRoundingToEven(bits, 16));
}

inline uint32_t Fp16Bits(uint32_t bits) {
  const uint32_t abs_bits = bits & 0x7fffffffu;
  // Normal: the 13 dropped mantissa bits rounded (a carry moves into the exponent, as it should),
  // the exponent rebiased (127 → 15). Wraps, harmlessly, for the inputs another case takes.
  const uint32_t normal = ShiftRoundingToEven(abs_bits, 13) - (112u << 10);
  // Below the smallest normal half (2^-14): the significand (with its implicit bit) in units of
  // 2^-24, i.e. shifted right by 126 - exponent (125 for an fp32 subnormal, which has no implicit
  // bit and rounds to 0 as any shift of 25 or more does; capped at 31).
  const uint32_t exponent = abs_bits >> 23;
  const uint32_t significand = (abs_bits & 0x7fffffu) | Select(exponent != 0, 0x800000u, 0u);
  const uint32_t shift = std::min(126u - std::min(exponent, 112u), 31u);
  const uint32_t subnormal = ShiftRoundingToEven(significand, shift);
  uint32_t h = Select(abs_bits < 0x38800000u, subnormal, normal);
  h = Select(abs_bits >= 0x477ff000u, 0x7c00u, h);  // rounds to a value ≥ 65520, or inf: ±inf
  h = Select(abs_bits > 0x7f800000u, 0x7e00u, h);   // NaN: the quiet one
  return h | ((bits >> 16) & 0x8000u);
}

inline uint32_t Fp32BitsOfFp16(uint32_t half) {
  const uint32_t sign = (half & 0x8000u) << 16;
  const uint32_t exponent = (half >> 10) & 0x1fu;
  const uint32_t mantissa = half & 0x3ffu;
  // mantissa · 2^-24, exact (as the scalar division by 2^24)
  const float magnitude = static_cast<float>(static_cast<int32_t>(mantissa)) * (1.0f / 16777216.0f);
  const uint32_t subnormal = FloatBits(magnitude) | sign;
  const uint32_t special = sign | 0x7f800000u | (mantissa << 13);
  const uint32_t normal = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  return Select(exponent == 0, subnormal, Select(exponent == 0x1fu, special, normal));
}

}  // namespace

MUOND_ELEMENTWISE_CLONES void WidenBf16(const uint16_t* __restrict in, float* __restrict out, size_t count) {
  for (size_t i = 0; i < count; ++i) out[i] = BitsFloat(static_cast<uint32_t>(in[i]) << 16);
}

MUOND_ELEMENTWISE_CLONES void WidenFp16(const uint16_t* __restrict in, float* __restrict out, size_t count) {
  for (size_t i = 0; i < count; ++i) out[i] = BitsFloat(Fp32BitsOfFp16(in[i]));
}

MUOND_ELEMENTWISE_CLONES void NarrowToBf16(const float* __restrict in, uint16_t* __restrict out, size_t count) {
  for (size_t i = 0; i < count; ++i) out[i] = static_cast<uint16_t>(Bf16Bits(FloatBits(in[i])));
}

namespace {

MUOND_ELEMENTWISE_CLONES void NarrowToFp16Portable(const float* __restrict in, uint16_t* __restrict out, size_t count) {
  for (size_t i = 0; i < count; ++i) out[i] = static_cast<uint16_t>(Fp16Bits(FloatBits(in[i])));
}

#if MUOND_HAVE_F16C_PATH
// The CPU's own conversion (F16C's vcvtps2ph, rounding to nearest even whatever MXCSR says) is IEEE's,
// as Fp16Bits is, but for a NaN, where it keeps the payload's top bits: those are cleared, leaving
// the sign and 0x7e00 as the scalar conversion does.
__attribute__((target("avx2,f16c"))) void NarrowToFp16F16c(const float* __restrict in, uint16_t* __restrict out,
                                                           size_t count) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i infinity = _mm256_set1_epi32(0x7f800000);
  const __m128i payload = _mm_set1_epi16(0x01ff);
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 x = _mm256_loadu_ps(in + i);
    const __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(x), abs_mask), infinity);
    const __m128i nan16 = _mm_packs_epi32(_mm256_castsi256_si128(nan), _mm256_extracti128_si256(nan, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm_andnot_si128(_mm_and_si128(nan16, payload), h));
  }
  for (; i < count; ++i) out[i] = static_cast<uint16_t>(Fp16Bits(FloatBits(in[i])));
}
#endif

}  // namespace

void NarrowToFp16(const float* in, uint16_t* out, size_t count) {
#if MUOND_HAVE_F16C_PATH
  static const bool f16c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  if (f16c) return NarrowToFp16F16c(in, out, count);
#endif
  NarrowToFp16Portable(in, out, count);
}

namespace {
constexpr size_t kWordBlock = 4096;  // 8 KiB of words on the stack
}  // namespace

void WidenHalfBytes(HalfFormat format, const void* in, float* out, size_t count) {
  uint16_t words[kWordBlock];
  const char* bytes = static_cast<const char*>(in);
  for (size_t begin = 0; begin < count; begin += kWordBlock) {
    const size_t n = std::min(kWordBlock, count - begin);
    std::memcpy(words, bytes + 2 * begin, 2 * n);
    (format == HalfFormat::kBf16 ? WidenBf16 : WidenFp16)(words, out + begin, n);
  }
}

void NarrowToHalfBytes(HalfFormat format, const float* in, void* out, size_t count) {
  uint16_t words[kWordBlock];
  char* bytes = static_cast<char*>(out);
  for (size_t begin = 0; begin < count; begin += kWordBlock) {
    const size_t n = std::min(kWordBlock, count - begin);
    (format == HalfFormat::kBf16 ? NarrowToBf16 : NarrowToFp16)(in + begin, words, n);
    std::memcpy(bytes + 2 * begin, words, 2 * n);
  }
}

}  // namespace muond
