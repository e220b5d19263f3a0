#include "proto/wire/dtype_codec.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include "common/half_ranges.h"

namespace muond::wire {
namespace {

// 16-bit values convert in blocks of this many (4 KiB of them, on the stack).
constexpr size_t kBlockElements = 2048;

}  // namespace

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
      // The bytes may sit at any address: each block is copied to an aligned one first.
      const auto widen = dtype == v1::DTYPE_BF16 ? WidenBf16 : WidenFp16;
      alignas(64) uint16_t block[kBlockElements];
      for (size_t at = 0; at < out.size(); at += kBlockElements) {
        const size_t n = std::min(kBlockElements, out.size() - at);
        std::memcpy(block, bytes.data() + 2 * at, 2 * n);
        widen(block, out.data() + at, n);
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
      const auto narrow = dtype == v1::DTYPE_BF16 ? NarrowToBf16 : NarrowToFp16;
      alignas(64) uint16_t block[kBlockElements];
      for (size_t at = 0; at < values.size(); at += kBlockElements) {
        const size_t n = std::min(kBlockElements, values.size() - at);
        narrow(values.data() + at, block, n);
        std::memcpy(dst + 2 * at, block, 2 * n);
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
