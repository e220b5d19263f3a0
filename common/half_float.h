// The 16-bit floating-point formats muond stores and sends (bf16, IEEE fp16) and their conversions
// to and from fp32, written once for the host and for CUDA kernels (MUOND_HALF_HD expands to
// __host__ __device__ under nvcc) so that the wire codec, the CPU backend and the CUDA backend round
// identically. Rounding to 16 bits is to nearest, ties to even, as torch's .to(torch.bfloat16) and
// .half(); NaN stays a (quiet) NaN; fp16 overflow gives ±inf. Stateless functions; thread-safe.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MUOND_HALF_HD __host__ __device__ __forceinline__
#else
#define MUOND_HALF_HD inline
#endif

namespace muond {

MUOND_HALF_HD uint32_t FloatBits(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
#endif
}

MUOND_HALF_HD float BitsFloat(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
#endif
}

MUOND_HALF_HD uint16_t FloatToBf16(float value) {
  const uint32_t bits = FloatBits(value);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);  // quiet NaN, sign kept
  }
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

MUOND_HALF_HD float Bf16ToFloat(uint16_t bits) { return BitsFloat(static_cast<uint32_t>(bits) << 16); }

MUOND_HALF_HD uint16_t FloatToFp16(float value) {
  const uint32_t bits = FloatBits(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs_bits = bits & 0x7fffffffu;
  if (abs_bits >= 0x7f800000u) {  // inf or NaN
    return sign | (abs_bits > 0x7f800000u ? 0x7e00u : 0x7c00u);
  }
  if (abs_bits >= 0x477ff000u) {  // rounds to a value ≥ 65520: overflow
    return sign | 0x7c00u;
  }
  if (abs_bits < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    // Scale into the subnormal grid (units of 2^-24) and round half to even.
    const float scaled = BitsFloat(abs_bits) * 16777216.0f;  // 2^24, exact
    uint32_t q = static_cast<uint32_t>(scaled);
    const float remainder = scaled - static_cast<float>(q);
    if (remainder > 0.5f || (remainder == 0.5f && (q & 1u))) ++q;
    return sign | static_cast<uint16_t>(q);
  }
  // Normal: rebias the exponent (127 → 15) and round the 13 dropped mantissa bits to even.
  uint32_t h = ((abs_bits >> 13) - (112u << 10));
  const uint32_t dropped = abs_bits & 0x1fffu;
  if (dropped > 0x1000u || (dropped == 0x1000u && (h & 1u))) ++h;
  return sign | static_cast<uint16_t>(h);
}

MUOND_HALF_HD float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) / 16777216.0f;  // mantissa · 2^-24
    return BitsFloat(FloatBits(magnitude) | sign);
  }
  if (exponent == 0x1f) return BitsFloat(sign | 0x7f800000u | (mantissa << 13));
  return BitsFloat(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

}  // namespace muond
