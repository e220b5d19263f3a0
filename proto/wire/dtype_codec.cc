#include "proto/wire/dtype_codec.h"

#include <bit>
#include <cstring>

#include "common/half_float.h"

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

void Decode(v1::DType dtype, absl::string_view bytes, std::span<float> out) {
  switch (dtype) {
    case v1::DTYPE_FP32:
      // An empty span may carry a null pointer, which memcpy must not be given even for 0 bytes.
      if (!out.empty()) std::memcpy(out.data(), bytes.data(), out.size() * sizeof(float));
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
      if (!values.empty()) std::memcpy(dst, values.data(), values.size() * sizeof(float));
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
