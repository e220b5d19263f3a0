// Conversions between the wire dtypes of the muond API (raw little-endian fp32, bf16, fp16 bytes)
// and fp32 values. Shared by the daemon and the C++ client. Stateless functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "absl/strings/string_view.h"
#include "common/half_float.h"
#include "muond/v1/muond.pb.h"

namespace muond::wire {

// Bytes per element of a concrete dtype; 0 for DTYPE_UNSPECIFIED or a value outside the enum.
size_t ElementSize(v1::DType dtype);
bool IsConcrete(v1::DType dtype);
absl::string_view DTypeName(v1::DType dtype);  // "fp32", "bf16", "fp16", "unspecified"

// The 16-bit conversions (round to nearest even; common/half_float.h), under the wire's names.
using ::muond::Bf16ToFloat;
using ::muond::FloatToBf16;
using ::muond::FloatToFp16;
using ::muond::Fp16ToFloat;

// Decodes `bytes` (a whole number of elements of `dtype`, which must be concrete) into `out`,
// whose size is bytes.size() / ElementSize(dtype).
void Decode(v1::DType dtype, absl::string_view bytes, std::span<float> out);

// Appends values encoded as `dtype` (concrete) to `out`.
void Encode(v1::DType dtype, std::span<const float> values, std::string* out);
// Writes values encoded as `dtype` (concrete) to `dst`, which holds values.size() elements of it.
void EncodeTo(v1::DType dtype, std::span<const float> values, char* dst);

}  // namespace muond::wire
