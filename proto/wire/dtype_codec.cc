#include "proto/wire/dtype_codec.h"

#include <bit>
#include <cstring>

namespace muond::wire {

static_assert(std::endian::native == std::endian::little,
              "the wire format is little-endian; a big-endian host would need byte swaps");

size_t ElementSize(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FP32:
      return 4;
    case v1::DTYPE_BF16:
    case v1::DTYPE_FP16:
      return 2;
    default:
      return 0;
  }
}

bool IsConcrete(v1::DType dtype) { return ElementSize(dtype) != 0; }

absl::string_view DTypeName(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FP32:
      return "fp32";
    case v1::DTYPE_BF16:
      return "bf16";
    case v1::DTYPE_FP16:
      return "fp16";
    case v1::DTYPE_UNSPECIFIED:
      return "unspecified";
    default:
      return "unknown";
  }
}

uint16_t FloatToBf16(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);  // quiet NaN, sign kept
  }
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

float Bf16ToFloat(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

uint16_t FloatToFp16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
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
    const float magnitude = std::bit_cast<float>(abs_bits);
    const float scaled = magnitude * 16777216.0f;  // 2^24, exact
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

float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) / 16777216.0f;  // mantissa · 2^-24
    return std::bit_cast<float>(std::bit_cast<uint32_t>(magnitude) | sign);
  }
  if (exponent == 0x1f) {
    return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  }
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

void Decode(v1::DType dtype, absl::string_view bytes, std::span<float> out) {
  switch (dtype) {
    case v1::DTYPE_FP32:
      std::memcpy(out.data(), bytes.data(), out.size() * sizeof(float));
      return;
    case v1::DTYPE_BF16:
    case v1::DTYPE_FP16: {
      const bool bf16 = dtype == v1::DTYPE_BF16;
      for (size_t i = 0; i < out.size(); ++i) {
        uint16_t bits;
        std::memcpy(&bits, bytes.data() + 2 * i, 2);
        out[i] = bf16 ? Bf16ToFloat(bits) : Fp16ToFloat(bits);
      }
      return;
    }
    default:
      return;
  }
}

void EncodeTo(v1::DType dtype, std::span<const float> values, char* dst) {
  switch (dtype) {
    case v1::DTYPE_FP32:
      std::memcpy(dst, values.data(), values.size() * sizeof(float));
      return;
    case v1::DTYPE_BF16:
    case v1::DTYPE_FP16: {
      const bool bf16 = dtype == v1::DTYPE_BF16;
      for (size_t i = 0; i < values.size(); ++i) {
        const uint16_t bits = bf16 ? FloatToBf16(values[i]) : FloatToFp16(values[i]);
        std::memcpy(dst + 2 * i, &bits, 2);
      }
      return;
    }
    default:
      return;
  }
}

void Encode(v1::DType dtype, std::span<const float> values, std::string* out) {
  const size_t start = out->size();
  out->resize(start + values.size() * ElementSize(dtype));
  EncodeTo(dtype, values, out->data() + start);
}

}  // namespace muond::wire
